//! Build-script helper shared by `host`, every built-in plugin and third-party plugins.
//!
//! It finds the libtorch that `torch-sys` links (the same search: `LIBTORCH`, else the
//! Python `torch` package when `LIBTORCH_USE_PYTORCH` is set), then:
//! - embeds an rpath to its `lib/` folder so users need no `LD_LIBRARY_PATH`;
//! - links `libtorch_cuda` with `--no-as-needed` when the install has it, because nothing
//!   references its symbols directly and the linker would otherwise drop it (and with it CUDA);
//! - exports the libtorch version as `RAK_LIBTORCH_VERSION` for `rak-core` to record.
//!
//! It is not a general libtorch finder: it supports exactly the two layouts torch-sys supports.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Where libtorch lives and which version it is.
pub struct Libtorch {
    pub lib_dir: PathBuf,
    pub version: String,
}

/// Locate libtorch the way torch-sys does. Panics (the build-script way of failing) with a
/// message that says what to do.
pub fn find_libtorch() -> Libtorch {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-env-changed=LIBTORCH_USE_PYTORCH");
    println!("cargo:rerun-if-env-changed=PYTHON_SYS_EXECUTABLE");
    if let Ok(root) = std::env::var("LIBTORCH") {
        let root = PathBuf::from(root);
        let version = std::fs::read_to_string(root.join("build-version"))
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| "unknown".to_string());
        return Libtorch { lib_dir: root.join("lib"), version };
    }
    let python = std::env::var("PYTHON_SYS_EXECUTABLE").unwrap_or_else(|_| "python3".to_string());
    let out = Command::new(&python)
        .args([
            "-c",
            "import torch, os; print(os.path.dirname(torch.__file__)); print(torch.__version__)",
        ])
        .output()
        .unwrap_or_else(|e| panic!("rak-build: cannot run {python}: {e}; run ./setup.sh first"));
    if !out.status.success() {
        panic!(
            "rak-build: `{python} -c 'import torch'` failed; run ./setup.sh (it installs torch==2.11.0 into .venv)\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let mut lines = text.lines();
    let torch_dir = PathBuf::from(lines.next().unwrap_or_default().trim());
    let version = lines.next().unwrap_or("unknown").trim().to_string();
    Libtorch { lib_dir: torch_dir.join("lib"), version }
}

/// Call from the `build.rs` of every crate that produces a binary or a cdylib.
pub fn link_libtorch() -> Libtorch {
    let lt = find_libtorch();
    let dir = lt.lib_dir.display();
    println!("cargo:rustc-link-search=native={dir}");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    if has_cuda(&lt.lib_dir) {
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
        println!("cargo:rustc-link-arg=-ltorch_cuda");
        println!("cargo:rustc-link-arg=-Wl,--as-needed");
    }
    println!("cargo:rustc-env=RAK_LIBTORCH_VERSION={}", lt.version);
    lt
}

/// Only record the libtorch version (for library crates, which do not link).
pub fn record_libtorch_version() -> Libtorch {
    let lt = find_libtorch();
    println!("cargo:rustc-env=RAK_LIBTORCH_VERSION={}", lt.version);
    lt
}

fn has_cuda(lib_dir: &Path) -> bool {
    lib_dir.join("libtorch_cuda.so").exists()
}
