//! Files that are not loadable plugins: each is refused with one line naming the file and the
//! reason, a non-zero exit, and no panic or backtrace; through `plugins inspect` and `--plugin`.

use rak_e2e::*;
use std::path::{Path, PathBuf};

/// Run both entry points on `file` and check the refusal; returns the message.
fn refused(file: &Path, reason: &str) -> String {
    let path = file.to_str().unwrap();
    let mut last = String::new();
    for args in [vec!["plugins", "inspect", path], vec!["--plugin", path, "plugins", "list"]] {
        let out = host(&args);
        let err = stderr(&out);
        assert!(!out.status.success(), "{args:?} should fail");
        assert_eq!(out.status.code(), Some(1), "{args:?}: exit code, not a signal or panic (101)");
        let lines: Vec<&str> = err.lines().collect();
        assert_eq!(lines.len(), 1, "{args:?}: one line, got:\n{err}");
        assert!(lines[0].starts_with("error: ") && lines[0].contains(path), "{args:?}: names the file: {err}");
        assert!(lines[0].contains(reason), "{args:?}: expected {reason:?} in: {err}");
        assert!(!err.contains("panicked") && !err.contains("backtrace"), "{err}");
        last = lines[0].to_string();
    }
    last
}

fn copy_of(src: &Path, dir: &TempDir, name: &str) -> PathBuf {
    let dst = dir.path().join(name);
    std::fs::copy(src, &dst).unwrap();
    dst
}

#[test]
fn a_text_file() {
    let dir = TempDir::new("bad-text");
    let file = dir.path().join("notes.so");
    std::fs::write(&file, "this is not a plugin\n").unwrap();
    refused(&file, "not a shared library");
}

#[test]
fn a_shared_object_that_is_not_a_plugin() {
    // libc10 ships with every libtorch: a real ELF shared object without a plugin header.
    let torch_lib = std::env::var("RAK_TEST_LIBC10").map(PathBuf::from).unwrap_or_else(|_| {
        let out = std::process::Command::new("ldd").arg(host_bin()).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let line = text.lines().find(|l| l.contains("libc10.so")).expect("host links libc10").to_string();
        PathBuf::from(line.split("=>").nth(1).unwrap().split('(').next().unwrap().trim())
    });
    refused(&torch_lib, "not a rak plugin");
}

#[test]
fn a_truncated_plugin() {
    let dir = TempDir::new("bad-trunc");
    let good = plugin_file("rak_optim_adamw");
    let len = std::fs::metadata(&good).unwrap().len();
    // Cut in the middle (section table gone) and just past the program headers (ELF header and
    // program headers intact: dlopen of this one would die of SIGBUS).
    for (name, keep) in [("half.so", len / 2), ("headers-only.so", 4096)] {
        let f = copy_of(&good, &dir, name);
        std::fs::OpenOptions::new().write(true).open(&f).unwrap().set_len(keep).unwrap();
        refused(&f, "truncated");
    }
}

/// Rewrite one text field of a copied plugin's header, as a plugin built elsewhere would have it.
fn patch_header_field(file: &Path, old: &str, new: &str) {
    assert_eq!(old.len(), new.len());
    let mut bytes = std::fs::read(file).unwrap();
    let magic = rak_core::abi::header::MAGIC;
    let start = bytes.windows(8).position(|w| w == magic).expect("header magic");
    let header = &mut bytes[start..start + rak_core::abi::header::HEADER_SIZE];
    let at = header.windows(old.len()).position(|w| w == old.as_bytes()).expect("field in header");
    header[at..at + old.len()].copy_from_slice(new.as_bytes());
    std::fs::write(file, bytes).unwrap();
}

#[test]
fn a_plugin_built_against_another_libtorch() {
    let dir = TempDir::new("bad-libtorch");
    let f = copy_of(&plugin_file("rak_optim_adamw"), &dir, "old-torch.so");
    let ours = rak_core::LIBTORCH_VERSION;
    let theirs = format!("2.10{}", &ours[4..]);
    patch_header_field(&f, ours, &theirs);
    let msg = refused(&f, "libtorch");
    assert!(msg.contains(&theirs) && msg.contains(ours), "names both versions: {msg}");
}

/// Build the out-of-tree `hashbow` plugin against a copy of rak-core in `target/NAME`, after
/// `edit(copy root)` changed the copy; returns the `.so`. Only rak-core and rak-abi are
/// copied: the copy takes rak-torch-shim (rak-core's C++) and rak-build from this checkout,
/// so the C++ compiled for the real plugins is reused rather than compiled again per copy.
fn hashbow_built_from_a_copy(name: &str, edit: impl Fn(&Path)) -> PathBuf {
    let copy = root().join("target").join(name);
    let _ = std::fs::remove_dir_all(&copy);
    for sub in ["abi", "core", "tests/third-party"] {
        copy_tree(&root().join(sub), &copy.join(sub));
    }
    std::fs::remove_dir_all(copy.join("core/shim")).unwrap();
    let here = |sub: &str| toml::Value::String(root().join(sub).display().to_string()).to_string();
    // The copied crates inherit settings from a workspace root: give them one of their own.
    let manifest = std::fs::read_to_string(root().join("Cargo.toml")).unwrap();
    let (head, tail) = manifest.split_once("members = [").unwrap();
    let tail = &tail[tail.find(']').unwrap() + 1..];
    let tail = tail
        .replace("rak-torch-shim = { path = \"core/shim\" }", &format!("rak-torch-shim = {{ path = {} }}", here("core/shim")))
        .replace("rak-build = { path = \"build-support\" }", &format!("rak-build = {{ path = {} }}", here("build-support")));
    assert!(tail.contains(&here("core/shim")) && tail.contains(&here("build-support")), "the workspace's path dependencies moved");
    std::fs::write(copy.join("Cargo.toml"), format!("{head}members = [\"abi\", \"core\"]{tail}")).unwrap();
    let plugins = copy.join("tests/third-party/Cargo.toml");
    let text = std::fs::read_to_string(&plugins).unwrap();
    let line = "rak-build = { path = \"../../build-support\" }";
    assert!(text.contains(line), "{}: {line}", plugins.display());
    std::fs::write(&plugins, text.replace(line, &format!("rak-build = {{ path = {} }}", here("build-support")))).unwrap();
    edit(&copy);
    // A library name of its own, so that building in the shared plugin target folder (which
    // reuses the compiled dependencies) cannot overwrite the real hashbow other tests load.
    let lib = format!("hashbow_{}", name.replace('-', "_"));
    let cargo_toml = copy.join("tests/third-party/hashbow/Cargo.toml");
    let text = std::fs::read_to_string(&cargo_toml).unwrap();
    std::fs::write(&cargo_toml, text.replace("[lib]\n", &format!("[lib]\nname = \"{lib}\"\n"))).unwrap();
    let status = plugin_build(&copy.join("tests/third-party/Cargo.toml")).args(["-p", "hashbow-encoder"]).status().expect("run cargo");
    assert!(status.success(), "building hashbow from {} failed", copy.display());
    plugin_target_dir().join("release").join(format!("lib{lib}.so"))
}

/// A plugin really built with a different ABI number: the out-of-tree plugin compiled against a
/// copy of rak-core whose `ABI_VERSION` is bumped.
#[test]
fn a_plugin_built_with_another_abi_version() {
    let ours = rak_core::abi::ABI_VERSION;
    let so = hashbow_built_from_a_copy("abi-bump", |copy| {
        let abi = copy.join("abi/src/lib.rs");
        let src = std::fs::read_to_string(&abi).unwrap();
        let line = format!("pub const ABI_VERSION: u32 = {ours};");
        let text = format!("pub const ABI_VERSION_STRING: &str = \"{ours}.0.0\";");
        assert!(src.contains(&line) && src.contains(&text));
        let src = src.replace(&line, &format!("pub const ABI_VERSION: u32 = {};", ours + 1));
        std::fs::write(&abi, src.replace(&text, &format!("pub const ABI_VERSION_STRING: &str = \"{}.0.0\";", ours + 1))).unwrap();
        // The crate's version moves with the ABI's.
        let manifest = copy.join("abi/Cargo.toml");
        let m = std::fs::read_to_string(&manifest).unwrap();
        std::fs::write(&manifest, m.replace(&format!("version = \"{ours}.0.0\""), &format!("version = \"{}.0.0\"", ours + 1))).unwrap();
    });
    let dir = TempDir::new("bad-abi");
    let f = copy_of(&so, &dir, "abi-next.so");
    let msg = refused(&f, "ABI version");
    assert!(msg.contains(&format!("version {}", ours + 1)) && msg.contains(&format!("version {ours}")), "{msg}");
}

/// A plugin built against another release of rak-core with the same ABI loads and works:
/// compatibility follows the ABI version, not the crate's (abi_stable would otherwise refuse
/// a 0.1 plugin in a 0.2 host, after dlopen).
#[test]
fn a_plugin_built_against_another_crate_version_with_the_same_abi_loads() {
    let so = hashbow_built_from_a_copy("crate-bump", |copy| {
        let manifest = copy.join("Cargo.toml");
        let text = std::fs::read_to_string(&manifest).unwrap();
        let ours = format!("version = \"{}\"", env!("CARGO_PKG_VERSION"));
        assert!(text.contains(&ours), "workspace version line");
        std::fs::write(&manifest, text.replace(&ours, "version = \"9.7.0\"")).unwrap();
    });
    let out = host(&["--plugin", so.to_str().unwrap(), "plugins", "inspect", so.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(v["compatible"], true);
    assert_eq!(v["settings"]["dim"]["default"], 32, "its code ran after loading");
}

fn copy_tree(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for entry in std::fs::read_dir(src).unwrap().flatten() {
        let p = entry.path();
        let name = entry.file_name();
        if name == "target" {
            continue;
        }
        if p.is_dir() {
            copy_tree(&p, &dst.join(&name));
        } else {
            std::fs::copy(&p, dst.join(&name)).unwrap();
        }
    }
}

#[test]
fn two_plugins_with_one_name() {
    let dir = TempDir::new("dup");
    let a = copy_of(&plugin_file("rak_optim_adamw"), &dir, "a.so");
    let out = host(&["--plugin", a.to_str().unwrap(), "plugins", "list"]);
    let err = stderr(&out);
    assert!(!out.status.success());
    assert!(err.contains("two plugins are named \"adamw\"") && err.contains("a.so") && err.contains("librak_optim_adamw.so"), "{err}");
}

#[test]
fn a_missing_file() {
    refused(Path::new("/nonexistent/plugin.so"), "cannot read it");
}
