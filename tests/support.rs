//! Helpers shared by the end-to-end tests: where things are, how to run `host`, and how to
//! build the out-of-tree plugin.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

/// The workspace root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// `target/release`, where `cargo build --release --workspace` puts `host` and the plugins.
pub fn release_dir() -> PathBuf {
    let dir = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| root().join("target"));
    dir.join("release")
}

/// The `host` binary; the tests need the workspace built first.
pub fn host_bin() -> PathBuf {
    let bin = release_dir().join("host");
    assert!(bin.exists(), "{} missing: run `cargo build --release --workspace` before the tests", bin.display());
    bin
}

/// A built-in plugin's file, e.g. `plugin_file("rak_optim_adamw")`.
pub fn plugin_file(lib: &str) -> PathBuf {
    let f = release_dir().join(format!("lib{lib}.so"));
    assert!(f.exists(), "{} missing: run `cargo build --release --workspace` before the tests", f.display());
    f
}

/// Run `host` with `args`, with no plugin path from the environment.
pub fn host(args: &[&str]) -> Output {
    Command::new(host_bin()).args(args).env_remove("RAK_PLUGIN_PATH").output().expect("run host")
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The target dir for plugins the tests build out of tree (kept between runs).
pub fn plugin_target_dir() -> PathBuf {
    root().join("target").join("plugin-tests")
}

/// Build the cdylib crate at `manifest_dir` in release mode; returns the `.so`.
pub fn cargo_build_plugin(manifest_dir: &Path, lib_name: &str) -> PathBuf {
    let status = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(["build", "--release", "--quiet", "--manifest-path"])
        .arg(manifest_dir.join("Cargo.toml"))
        .env("CARGO_TARGET_DIR", plugin_target_dir())
        .status()
        .expect("run cargo");
    assert!(status.success(), "building {} failed", manifest_dir.display());
    plugin_target_dir().join("release").join(format!("lib{lib_name}.so"))
}

/// The out-of-tree `hashbow` encoder plugin, built once per test process.
pub fn hashbow_plugin() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| cargo_build_plugin(&root().join("tests/third-party-plugin"), "hashbow_encoder")).clone()
}

/// A fresh temporary directory under `target/`, removed at drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let dir = root().join("target").join("e2e-tmp").join(format!("{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
