//! File-system helpers: every output is written under a temporary name and renamed into
//! place, so a killed run never leaves a half-written file that looks whole.
//!
//! Durability: the file is fsynced before the rename and its directory after it. Without the
//! first, a crash soon after the rename can leave the new name pointing at an empty or partial
//! file (the rename reached the disk before the data); without the second, the rename itself
//! can be lost.
//!
//! Leftovers: a killed run leaves its temporary `.NAME.tmp-PID` (and, for directories,
//! `.NAME.old-PID`) behind. The next write of the same target removes those of processes that
//! no longer run ([`remove_stale_temps`]); a live process's are left alone, since it may still
//! be writing them.

use anyhow::{Context, Result};
use std::fs::File;
use std::path::{Path, PathBuf};

/// The temporary sibling of `path` used while writing it.
pub fn temp_path(path: &Path) -> PathBuf {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    path.with_file_name(format!(".{name}.tmp-{}", std::process::id()))
}

/// The directory holding `path` (`.` for a bare file name).
fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    }
}

/// Call `write` on a temporary path, then fsync it, rename it to `path` and fsync the
/// directory. On error the temporary file is removed and `path` is untouched.
pub fn write_atomically(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let dir = parent_dir(path);
    std::fs::create_dir_all(dir).with_context(|| format!("{}: cannot create directory", dir.display()))?;
    remove_stale_temps(path);
    let tmp = temp_path(path);
    let res = write(&tmp).and_then(|()| sync_file(&tmp));
    if let Err(e) = res {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    if let Err(e) = std::fs::rename(&tmp, path) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e).with_context(|| format!("{}: cannot move into place", path.display()));
    }
    sync_dir(dir)
}

/// Write bytes atomically.
pub fn write_bytes(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomically(path, |tmp| std::fs::write(tmp, bytes).with_context(|| format!("{}: cannot write", tmp.display())))
}

/// Flush a written file's data to the disk.
pub fn sync_file(path: &Path) -> Result<()> {
    // fsync through a read-only descriptor is enough on Linux: it flushes the file, not the fd.
    File::open(path).and_then(|f| f.sync_all()).with_context(|| format!("{}: cannot sync to disk", path.display()))
}

/// Flush a directory's entries (a rename or a new file in it) to the disk.
pub fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir).and_then(|f| f.sync_all()).with_context(|| format!("{}: cannot sync the directory to disk", dir.display()))
}

/// Whether a process with this id runs (or is a zombie not yet reaped). `kill(pid, 0)` sends
/// nothing; it fails with ESRCH only when there is no such process (EPERM: it exists but
/// belongs to another user). A reused id reads as alive, which only keeps a stale file.
pub fn pid_alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else { return false };
    if pid <= 0 {
        return false;
    }
    // Safety: signal 0 only checks for the process; nothing is delivered.
    if unsafe { libc::kill(pid, 0) } == 0 {
        return true;
    }
    std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// The process id in a leftover name `.NAME.tmp-PID` or `.NAME.old-PID` for target `name`.
fn leftover_pid(entry: &str, name: &str) -> Option<u32> {
    let rest = entry.strip_prefix('.')?.strip_prefix(name)?.strip_prefix('.')?;
    let digits = rest.strip_prefix("tmp-").or_else(|| rest.strip_prefix("old-"))?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Remove the temporary files and directories that killed runs left beside `path`
/// (`.NAME.tmp-PID`, `.NAME.old-PID`), but only those whose process is gone: another process
/// writing the same target at the same time keeps its own, and so does this process (another
/// of its threads may be writing). Best effort: a leftover that cannot be removed stays.
pub fn remove_stale_temps(path: &Path) {
    let Some(name) = path.file_name().and_then(|n| n.to_str()) else { return };
    let Ok(entries) = std::fs::read_dir(parent_dir(path)) else { return };
    let me = std::process::id();
    for entry in entries.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|e| leftover_pid(e, name)) else { continue };
        if pid == me || pid_alive(pid) {
            continue;
        }
        let p = entry.path();
        // symlink_metadata: a link is removed as a link, never followed.
        let _ = match std::fs::symlink_metadata(&p) {
            Ok(m) if m.is_dir() => std::fs::remove_dir_all(&p),
            Ok(_) => std::fs::remove_file(&p),
            Err(_) => continue,
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leftover_names() {
        assert_eq!(leftover_pid(".x.tmp-123", "x"), Some(123));
        assert_eq!(leftover_pid(".idx.old-7", "idx"), Some(7));
        assert_eq!(leftover_pid(".x.tmp-", "x"), None);
        assert_eq!(leftover_pid(".x.tmp-12a", "x"), None);
        assert_eq!(leftover_pid(".xy.tmp-12", "x"), None);
        assert_eq!(leftover_pid(".x.partial", "x"), None);
        assert_eq!(leftover_pid("x.tmp-12", "x"), None);
    }

    #[test]
    fn pid_alive_tells_live_from_dead() {
        assert!(pid_alive(std::process::id()));
        assert!(!pid_alive(0));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        assert!(!pid_alive(pid), "a reaped child's id is free (unless reused at once)");
    }
}
