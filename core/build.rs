fn main() {
    // Linking (rpath, libtorch_cuda) only reaches this crate's own test binaries: a library's
    // link args are not passed on to its dependents. (The versions a plugin's header records
    // come from rak-abi's build script.)
    rak_build::link_libtorch();
    // The C++ is rak-torch-shim's; it says whether its c10d part was built.
    println!("cargo:rustc-check-cfg=cfg(rak_c10d)");
    // (No rerun-if for it: this script reruns whenever the shim's does.)
    if std::env::var_os("DEP_RAK_TORCH_SHIM_C10D").is_some() {
        println!("cargo:rustc-cfg=rak_c10d");
    }
}
