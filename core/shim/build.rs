//! Compiles rak-core's C++ against libtorch's headers (see `src/lib.rs` for why it is a crate
//! of its own). Tells rak-core's build script, through the `links` metadata, whether the c10d
//! shim was built (`DEP_RAK_TORCH_SHIM_C10D`).

fn main() {
    let libtorch = rak_build::find_libtorch();
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    compile_onednn_shim(&libtorch.lib_dir);
    compile_dist_shim(&libtorch.lib_dir);
}

/// A C++ build against libtorch's headers with the same C++ ABI as torch-sys builds its own.
fn torch_cpp(lib_dir: &std::path::Path) -> cc::Build {
    let include = lib_dir.parent().expect("libtorch lib dir has a parent").join("include");
    let abi = std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".into());
    let mut b = cc::Build::new();
    b.cpp(true)
        .pic(true)
        .warnings(false)
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .flag("-std=c++17")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={abi}"))
        .flag("-DGLOG_USE_GLOG_EXPORT");
    b
}

/// The small C++ files: libtorch's oneDNN linear operators called by name, the autograd
/// controls tch lacks, libtorch's multi-tensor operators, the keyed dropout kernel's host
/// side (NVRTC and the CUDA driver opened at run time: no CUDA headers needed) and libtorch's
/// profiler (see their headers).
fn compile_onednn_shim(lib_dir: &std::path::Path) {
    let files = ["onednn.cpp", "autograd.cpp", "multi_tensor.cpp", "cuda_kernels.cpp", "profiler.cpp"];
    for file in files.iter().chain(&["guarded.h", "keyed_mask.cuh"]) {
        println!("cargo:rerun-if-changed=csrc/{file}");
    }
    let mut build = torch_cpp(lib_dir);
    for file in files {
        build.file(format!("csrc/{file}"));
    }
    build.compile("rak_onednn");
}

/// The c10d shim (`csrc/dist.cpp`): multi-process training over libtorch's own TCPStore and
/// Gloo. The torch wheel ships c10d's headers and Gloo's code (inside libtorch_cpu) but not
/// Gloo's own headers, which `ProcessGroupGloo.hpp` includes; Debian's `libgloo-dev` has them
/// (scripts/install.sh installs it). Without them the shim is left out and rak-core's
/// `cfg(rak_c10d)` is unset: multi-process training then says what to install instead of
/// failing to build.
fn compile_dist_shim(lib_dir: &std::path::Path) {
    println!("cargo:rerun-if-changed=csrc/dist.cpp");
    println!("cargo:rerun-if-env-changed=RAK_GLOO_INCLUDE");
    let gloo = std::env::var_os("RAK_GLOO_INCLUDE").map(std::path::PathBuf::from).unwrap_or_else(|| "/usr/include".into());
    if !gloo.join("gloo/config.h").exists() {
        // Not watched while missing: cargo would rerun this script (and rebuild rak-core) on
        // every build.
        println!("cargo:warning=Gloo's headers not found (apt install libgloo-dev, then cargo clean -p rak-torch-shim; or RAK_GLOO_INCLUDE=DIR): multi-process training is left out of this build");
        return;
    }
    println!("cargo:rerun-if-changed={}", gloo.join("gloo/config.h").display());
    // After torch's own headers, so that only Gloo's come from here.
    let mut build = torch_cpp(lib_dir);
    build.include(&gloo).flag("-DUSE_C10D_GLOO").file("csrc/dist.cpp");
    let mut with_nccl = build.clone();
    let nccl = cuda_includes(lib_dir).is_some_and(|includes| {
        with_nccl.flag("-DUSE_C10D_NCCL").flag("-DUSE_CUDA");
        for dir in includes {
            with_nccl.include(dir);
        }
        // The CUDA headers c10d's NCCL group pulls in are many (crt/, nv/target, cuBLAS, ...)
        // and a wheel's packages may lack some: without them, Gloo alone.
        match with_nccl.try_compile("rak_dist") {
            Ok(()) => true,
            Err(e) => {
                println!("cargo:warning=c10d's NCCL group did not compile ({e}): multi-process training on CUDA goes over Gloo (scripts/install.sh installs the CUDA headers it needs)");
                false
            }
        }
    });
    if !nccl {
        build.compile("rak_dist");
    }
    // Read by rak-core's build script as DEP_RAK_TORCH_SHIM_C10D.
    println!("cargo:c10d=1");
}

/// The CUDA runtime's and NCCL's header directories, when this libtorch has CUDA
/// (`libtorch_cuda`, which holds c10d's NCCL process group): from `RAK_CUDA_INCLUDE` and
/// `RAK_NCCL_INCLUDE`, else the pip layout the torch wheel brings (`nvidia/cu*/include`,
/// `nvidia/nccl/include` beside `torch/`), else `CUDA_HOME`'s. `None` leaves NCCL out.
fn cuda_includes(lib_dir: &std::path::Path) -> Option<Vec<std::path::PathBuf>> {
    use std::path::PathBuf;
    println!("cargo:rerun-if-env-changed=RAK_CUDA_INCLUDE");
    println!("cargo:rerun-if-env-changed=RAK_NCCL_INCLUDE");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    if !lib_dir.join("libtorch_cuda.so").exists() {
        return None;
    }
    let nvidia = lib_dir.parent()?.parent()?.join("nvidia");
    let pip_cuda = std::fs::read_dir(&nvidia).ok().and_then(|entries| {
        let mut dirs: Vec<PathBuf> = entries.flatten().map(|e| e.path().join("include")).filter(|d| d.join("cuda_runtime_api.h").exists()).collect();
        dirs.sort();
        dirs.pop()
    });
    let cuda = std::env::var_os("RAK_CUDA_INCLUDE")
        .map(PathBuf::from)
        .or(pip_cuda)
        .or_else(|| std::env::var_os("CUDA_HOME").map(|h| PathBuf::from(h).join("include")))
        .filter(|d| d.join("cuda_runtime_api.h").exists())?;
    let nccl = std::env::var_os("RAK_NCCL_INCLUDE")
        .map(PathBuf::from)
        .unwrap_or_else(|| nvidia.join("nccl/include"));
    let nccl = [nccl, cuda.clone()].into_iter().find(|d| d.join("nccl.h").exists())?;
    // The folders, not the headers: installing a missing header (crt/, nv/) changes them.
    println!("cargo:rerun-if-changed={}", cuda.display());
    println!("cargo:rerun-if-changed={}", nccl.display());
    Some(vec![cuda, nccl])
}
