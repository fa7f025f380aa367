//! The run's stages on disk (`OUT/stages/`): each stage `NAME` has a key (`NAME.key.json`,
//! everything its output depends on, earlier stages' keys included), its work folder
//! (`NAME/`) and, once finished, `NAME.done.json` (what it reports). Every mark is written
//! under a temporary name and renamed, so a kill leaves either no mark or a whole one.
//!
//! A rerun skips finished stages whose key is unchanged and resumes the first unfinished one
//! from its folder; the stages after a resumed or redone one are cleared and redone. A stage whose key changed is refused, naming what changed, unless
//! `--overwrite` is given: then it and every later stage are redone, and the earlier ones kept.

use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// The stages in order.
pub const ORDER: [&str; 5] = ["retrieve", "score", "select", "train", "final"];

/// For tests only: names a stage at whose end the process kills itself (SIGKILL) before marking
/// it done (the kill for stages too quick to kill from outside).
pub const DIE_BEFORE_DONE: &str = "RAK_AAR_DIE_BEFORE_DONE";

/// How a stage starts.
pub enum Start {
    /// Finished earlier with the same key: its report.
    Done(Value),
    /// Begun earlier with the same key: continue from its folder.
    Resume,
    /// Nothing of it (or of any later stage) is left.
    Fresh,
}

pub struct Stages {
    dir: PathBuf,
    overwrite: bool,
}

fn read_json(path: &Path) -> Result<Option<Value>> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(Some(serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", path.display()))?)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("{}: cannot read", path.display())),
    }
}

fn remove_file(f: &Path) -> Result<()> {
    match std::fs::remove_file(f) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).with_context(|| format!("{}: cannot remove", f.display())),
    }
}

fn write_json(path: &Path, v: &Value) -> Result<()> {
    rak_core::fsutil::write_bytes(path, serde_json::to_string_pretty(v)?.as_bytes())
}

/// The top-level keys whose values differ, for the user.
fn differences(then: &Value, now: &Value) -> Vec<String> {
    let empty = serde_json::Map::new();
    let (a, b) = (then.as_object().unwrap_or(&empty), now.as_object().unwrap_or(&empty));
    let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
    keys.sort();
    keys.dedup();
    keys.into_iter()
        .filter(|k| a.get(k.as_str()) != b.get(k.as_str()))
        .map(|k| {
            let show = |v: Option<&Value>| {
                let s = v.map(Value::to_string).unwrap_or_else(|| "absent".into());
                if s.len() > 160 { format!("{}...", &s[..s.char_indices().nth(157).map(|(i, _)| i).unwrap_or(s.len())]) } else { s }
            };
            format!("  {k}: {} then, {} now", show(a.get(k.as_str())), show(b.get(k.as_str())))
        })
        .collect()
}

impl Stages {
    pub fn new(dir: PathBuf, overwrite: bool) -> Result<Self> {
        std::fs::create_dir_all(&dir).with_context(|| format!("{}: cannot create", dir.display()))?;
        Ok(Stages { dir, overwrite })
    }

    /// The work folder of a stage.
    pub fn folder(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// A file of the run beside the stages (the summary, the lock).
    pub fn file(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    fn key_path(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.key.json"))
    }

    fn done_path(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.done.json"))
    }

    /// Remove stage `name` and every later one. The score stage is left alone when an earlier
    /// stage is redone: its key is the content of what it scores (each query's top N and
    /// answers, the corpus, the source), not the earlier stage's key, so when that content is
    /// unchanged its scores stand (hours of a real source), and when it changed its begin
    /// finds another key (refused, or with --overwrite cleared then). When the final stage
    /// goes, so does the model it saved into `OUT`.
    fn clear_from(&self, name: &str) -> Result<()> {
        self.clear(ORDER.iter().position(|s| *s == name).expect("a known stage"), name)
    }

    /// Remove the stages from position `from` on, because stage `name` is redone (the score
    /// stage only when it is `name`: see [`Stages::clear_from`]).
    fn clear(&self, from: usize, name: &str) -> Result<()> {
        for s in &ORDER[from..] {
            if *s == "final" && (self.key_path(s).exists() || self.done_path(s).exists()) {
                self.remove_model()?;
            }
            if *s == "score" && *s != name {
                continue;
            }
            for f in [self.done_path(s), self.key_path(s)] {
                remove_file(&f)?;
            }
            let folder = self.folder(s);
            if folder.exists() {
                std::fs::remove_dir_all(&folder).with_context(|| format!("{}: cannot remove", folder.display()))?;
            }
        }
        Ok(())
    }

    /// The stages after `name`, which is resumed or redone.
    fn clear_after(&self, name: &str) -> Result<()> {
        self.clear(ORDER.iter().position(|s| *s == name).expect("a known stage") + 1, name)
    }

    /// The model the final stage saved into `OUT` (everything there but `stages/` and the
    /// analysis): a cleared final stage leaves no stale model behind.
    fn remove_model(&self) -> Result<()> {
        let Some(out) = self.dir.parent() else { return Ok(()) };
        let Ok(entries) = std::fs::read_dir(out) else { return Ok(()) };
        for e in entries.flatten() {
            let path = e.path();
            if path == self.dir || e.file_name() == "analysis.json" {
                continue;
            }
            if path.is_dir() {
                std::fs::remove_dir_all(&path).with_context(|| format!("{}: cannot remove", path.display()))?;
            } else {
                remove_file(&path)?;
            }
        }
        Ok(())
    }

    /// Where stage `name` with inputs `key` starts (see the module docs). A stage that is not
    /// done (resumed or fresh) clears every later stage: they are redone from its new output.
    pub fn begin(&self, name: &str, key: &Value) -> Result<Start> {
        let key_path = self.key_path(name);
        match read_json(&key_path)? {
            Some(then) if then == *key => match read_json(&self.done_path(name))? {
                Some(done) => Ok(Start::Done(done)),
                None => {
                    self.clear_after(name)?;
                    Ok(Start::Resume)
                }
            },
            Some(then) => {
                if !self.overwrite {
                    bail!(
                        "{}: the {name} stage was run with other inputs; rerun with the same ones, or with --overwrite to redo it and the stages after it:\n{}",
                        self.dir.display(),
                        differences(&then, key).join("\n")
                    );
                }
                self.clear_from(name)?;
                write_json(&key_path, key)?;
                Ok(Start::Fresh)
            }
            None => {
                // Anything of this stage or a later one without this stage's key is a leftover.
                self.clear_from(name)?;
                write_json(&key_path, key)?;
                Ok(Start::Fresh)
            }
        }
    }

    /// A finished stage `name` made unfinished again (its key and folder kept, so it resumes),
    /// and every later stage cleared.
    pub fn reopen(&self, name: &str) -> Result<()> {
        remove_file(&self.done_path(name))?;
        self.clear_after(name)
    }

    /// Mark stage `name` finished with its report.
    pub fn finish(&self, name: &str, report: &Value) -> Result<()> {
        // Fault injection for the tests: die at once, as a SIGKILL would, with the stage's
        // output written and its done marker not (a stage too quick to kill from outside).
        if std::env::var_os(DIE_BEFORE_DONE).is_some_and(|v| v == name) {
            // Safety: a signal to this process; it does not return.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
            // Should the signal not have stopped this thread yet, nothing more is written.
            std::process::abort();
        }
        write_json(&self.done_path(name), report)
    }
}

/// An exclusive lock on the run's folder for as long as it is held (one run per output folder:
/// two would append to the same record files). Released when the process ends, however.
pub struct RunLock(#[allow(dead_code)] std::fs::File);

impl RunLock {
    pub fn take(path: &Path) -> Result<RunLock> {
        use std::io::{Read, Seek, Write};
        use std::os::unix::io::AsRawFd;
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .with_context(|| format!("{}: cannot open", path.display()))?;
        // Safety: flock on a descriptor this function owns.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            bail!(
                "{}: another aar-train (pid {}) is running on this output folder; wait for it or stop it",
                path.display(),
                holder.split_whitespace().next().unwrap_or("unknown")
            );
        }
        file.set_len(0)?;
        file.rewind()?;
        writeln!(file, "{}", std::process::id())?;
        Ok(RunLock(file))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A resumed or redone stage clears the later ones, but for the score stage, whose key is
    /// what it scores: a retrieval killed after a redo keeps the scores; a cleared final stage
    /// takes OUT's model with it.
    #[test]
    fn a_resumed_stage_clears_the_later_ones_but_the_scores() {
        let out = std::env::temp_dir().join(format!("aar-stages-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&out);
        let stages = Stages::new(out.join("stages"), false).unwrap();
        for name in ORDER {
            assert!(matches!(stages.begin(name, &json!({"stage": name})).unwrap(), Start::Fresh));
            std::fs::create_dir_all(stages.folder(name)).unwrap();
            std::fs::write(stages.folder(name).join("work"), b"x").unwrap();
            stages.finish(name, &json!({})).unwrap();
        }
        std::fs::write(out.join("model.safetensors"), b"weights").unwrap();
        std::fs::write(out.join("analysis.json"), b"{}").unwrap();
        // The retrieval killed after being begun again.
        std::fs::remove_file(stages.done_path("retrieve")).unwrap();
        assert!(matches!(stages.begin("retrieve", &json!({"stage": "retrieve"})).unwrap(), Start::Resume));
        assert!(stages.done_path("score").exists() && stages.folder("score").join("work").exists(), "the scores were cleared");
        assert!(matches!(stages.begin("score", &json!({"stage": "score"})).unwrap(), Start::Done(_)));
        for name in ["select", "train", "final"] {
            assert!(!stages.key_path(name).exists() && !stages.done_path(name).exists() && !stages.folder(name).exists(), "{name} left");
        }
        assert!(!out.join("model.safetensors").exists(), "a stale model is left in OUT");
        assert!(out.join("analysis.json").exists() && out.join("stages").exists());
        // The score stage resumed: the later stages go again.
        for name in ["select", "train"] {
            assert!(matches!(stages.begin(name, &json!({"stage": name})).unwrap(), Start::Fresh));
            stages.finish(name, &json!({})).unwrap();
        }
        stages.reopen("score").unwrap();
        assert!(matches!(stages.begin("score", &json!({"stage": "score"})).unwrap(), Start::Resume));
        assert!(stages.folder("score").join("work").exists());
        assert!(!stages.done_path("select").exists() && !stages.done_path("train").exists());
        let _ = std::fs::remove_dir_all(&out);
    }
}
