fn main() {
    // Linking (rpath, libtorch_cuda) only reaches this crate's own test binaries: a library's
    // link args are not passed on to its dependents. (The versions a plugin's header records
    // come from rak-abi's build script.)
    let libtorch = rak_build::link_libtorch();
    compile_onednn_shim(&libtorch.lib_dir);
}

/// The small C++ files: libtorch's oneDNN linear operators called by name, and the autograd
/// controls tch lacks (see their headers).
/// Built against the same headers and C++ ABI as torch-sys builds its own C++.
fn compile_onednn_shim(lib_dir: &std::path::Path) {
    println!("cargo:rerun-if-changed=csrc/onednn.cpp");
    println!("cargo:rerun-if-changed=csrc/autograd.cpp");
    println!("cargo:rerun-if-changed=csrc/guarded.h");
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    let include = lib_dir.parent().expect("libtorch lib dir has a parent").join("include");
    let abi = std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".into());
    cc::Build::new()
        .cpp(true)
        .pic(true)
        .warnings(false)
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .flag("-std=c++17")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={abi}"))
        .flag("-DGLOG_USE_GLOG_EXPORT")
        .file("csrc/onednn.cpp")
        .file("csrc/autograd.cpp")
        .compile("rak_onednn");
}
