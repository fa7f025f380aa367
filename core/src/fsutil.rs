//! File-system helpers: every output is written under a temporary name and renamed into
//! place, so a killed run never leaves a half-written file that looks whole.

use anyhow::{Context, Result};
use std::path::{Path, PathBuf};

/// The temporary sibling of `path` used while writing it.
pub fn temp_path(path: &Path) -> PathBuf {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    path.with_file_name(format!(".{name}.tmp-{}", std::process::id()))
}

/// Call `write` on a temporary path, then rename it to `path`. On error the temporary file is
/// removed and `path` is untouched.
pub fn write_atomically(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("{}: cannot create directory", dir.display()))?;
    }
    let tmp = temp_path(path);
    match write(&tmp) {
        Ok(()) => std::fs::rename(&tmp, path).with_context(|| format!("{}: cannot move into place", path.display())),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// Write bytes atomically.
pub fn write_bytes(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomically(path, |tmp| std::fs::write(tmp, bytes).with_context(|| format!("{}: cannot write", tmp.display())))
}
