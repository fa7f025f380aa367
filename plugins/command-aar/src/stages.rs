//! The run's stages on disk (`OUT/stages/`): each stage `NAME` has a key (`NAME.key.json`,
//! everything its output depends on, earlier stages' keys included), its work folder
//! (`NAME/`) and, once finished, `NAME.done.json` (what it reports). Every mark is written
//! under a temporary name and renamed, so a kill leaves either no mark or a whole one.
//!
//! A rerun skips finished stages whose key is unchanged and resumes the first unfinished one
//! from its folder; the stages after a resumed or redone one are cleared and redone. A stage whose key changed is refused, naming what changed, unless
//! `--overwrite` is given: then it and every later stage are redone, and the earlier ones kept.
//!
//! The output folder holds only what the run wrote: before any work, [`check_output_dir`]
//! refuses a folder that is not empty and was not made by `aar-train` (`stages/aar-train.json`
//! marks one), and one that is, holds or lies inside the starting retriever or the source. The
//! final stage's model is saved under `stages/final/model/`, then moved into `OUT` entry by
//! entry; `stages/model_files.json` records the entries it moved, and a later final stage
//! replaces or removes only those (never a file someone else put in `OUT`; a record naming
//! anything but one entry of `OUT` is refused). A run folder made before that record has what
//! it holds beside `stages/` and the analysis adopted: replaced by a model entry of the same
//! name, never removed (it may hold the user's files). Clearing the final
//! stage leaves the model in place: the last complete model stays until a new one replaces it.

use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// Marks an output folder as an `aar-train` run's (under `OUT/stages/`).
pub const MARKER: &str = "aar-train.json";

/// The entries of `OUT` the final stage moved there (under `OUT/stages/`).
const MODEL_FILES: &str = "model_files.json";

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

/// `stages/model_files.json`: the entries of `OUT` that are the run's model.
#[derive(Clone, Default, Debug, PartialEq)]
struct ModelFiles {
    /// Moved there by a final stage: replaced or removed by the next.
    entries: Vec<String>,
    /// Found beside an older run's records (its model, or files added since): replaced by a
    /// model entry of the same name, never removed.
    adopted: Vec<String>,
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

/// A file, link or folder, gone (absent already is fine).
fn remove_entry(path: &Path) -> Result<()> {
    match path.symlink_metadata() {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(path).with_context(|| format!("{}: cannot remove", path.display())),
        Ok(_) => remove_file(path),
        Err(_) => Ok(()),
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
    /// The stages of the run folder `dir`'s parent, marked as an `aar-train` run's (call
    /// [`check_output_dir`] first, and hold the run's lock: see `lib.rs`).
    pub fn new(dir: PathBuf, overwrite: bool) -> Result<Self> {
        std::fs::create_dir_all(&dir).with_context(|| format!("{}: cannot create", dir.display()))?;
        let stages = Stages { dir, overwrite };
        let marker = stages.dir.join(MARKER);
        let marked = marker.exists();
        stages.adopt_earlier_model(marked)?;
        if !marked {
            write_json(&marker, &serde_json::json!({"made_by": "host aar-train", "help": "this folder is an aar-train run's output; aar-train reruns only into folders it made"}))?;
        }
        Ok(stages)
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
    /// goes, the model it moved into `OUT` stays until a new final stage replaces it.
    fn clear_from(&self, name: &str) -> Result<()> {
        self.clear(ORDER.iter().position(|s| *s == name).expect("a known stage"), name)
    }

    /// Remove the stages from position `from` on, because stage `name` is redone (the score
    /// stage only when it is `name`: see [`Stages::clear_from`]).
    fn clear(&self, from: usize, name: &str) -> Result<()> {
        for s in &ORDER[from..] {
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

    fn out(&self) -> &Path {
        self.dir.parent().unwrap_or(Path::new("."))
    }

    /// The entries of `OUT` the final stage moved there, and those adopted from a run made
    /// before the record (see [`Stages::adopt_earlier_model`]). Every entry must be the name of
    /// one entry of `OUT`, and not the run's own records: the names are joined to `OUT` and
    /// what they name may be removed, so a hand-edited `../sibling` or `/abs` is refused.
    fn model_files(&self) -> Result<ModelFiles> {
        let path = self.dir.join(MODEL_FILES);
        let Some(v) = read_json(&path)? else { return Ok(ModelFiles::default()) };
        let list = |field: &str| -> Result<Vec<String>> {
            let names: Vec<String> = match v.get(field) {
                None | Some(Value::Null) => Vec::new(),
                Some(l) => serde_json::from_value(l.clone()).with_context(|| format!("{}: {field} is not a list of names", path.display()))?,
            };
            for n in &names {
                let mut parts = Path::new(n).components();
                let single = matches!((parts.next(), parts.next()), (Some(std::path::Component::Normal(_)), None));
                if !single || n == "stages" || n == "analysis.json" {
                    bail!(
                        "{}: {field} holds {n:?}, which is not the name of one model entry in the output folder (a path, or the run's own records); \
                         refusing to replace or remove anything by it. Fix or remove that file (the model's entries in {} then count as files the run did not write)",
                        path.display(),
                        self.out().display()
                    );
                }
            }
            Ok(names)
        };
        Ok(ModelFiles { entries: list("entries")?, adopted: list("adopted")? })
    }

    fn record_model_files(&self, files: &ModelFiles) -> Result<()> {
        write_json(
            &self.dir.join(MODEL_FILES),
            &serde_json::json!({
                "entries": files.entries,
                "adopted": files.adopted,
                "help": "entries: the entries of the output folder the final stage wrote (its model); only these are ever replaced or removed by a later final stage. \
                         adopted: those an older run's folder held beside its records, the model of that run or files added since: a later final stage may replace them by name, never removes them"
            }),
        )
    }

    /// A run folder made before the marker and the record of the model's entries: what `OUT`
    /// holds but `stages/` and the analysis is the model of that version's final stage (which
    /// kept the folder to itself), or files the user put there since; which is which cannot be
    /// told. They are recorded as adopted: a new model may replace one of the same name (it
    /// would have been the earlier model's), but one the new model lacks is never removed.
    fn adopt_earlier_model(&self, marked: bool) -> Result<()> {
        let done_before = self.key_path("final").exists() || self.done_path("final").exists();
        if marked || self.dir.join(MODEL_FILES).exists() || !done_before {
            return Ok(());
        }
        let mut names = Vec::new();
        for e in std::fs::read_dir(self.out()).with_context(|| format!("{}: cannot list", self.out().display()))? {
            let e = e.with_context(|| format!("{}: cannot list", self.out().display()))?;
            // A name that is not UTF-8 is no model file of ours (install_model refuses them).
            let Ok(name) = e.file_name().into_string() else { continue };
            if e.path() != self.dir && name != "analysis.json" {
                names.push(name);
            }
        }
        names.sort();
        self.record_model_files(&ModelFiles { entries: Vec::new(), adopted: names })
    }

    /// Move the model saved in `saved` into `OUT`, replacing the entries the last final stage
    /// moved there and removing those of them this model has not; an adopted entry is replaced
    /// when the model has one of its name, else left. An entry of `OUT` that no final stage
    /// wrote is never replaced: refused, naming it. The record is written before anything
    /// moves (every entry that may be the run's is in it if a kill comes in between) and
    /// narrowed after.
    pub fn install_model(&self, saved: &Path) -> Result<()> {
        let out = self.out().to_path_buf();
        let recorded = self.model_files()?;
        let mut names: Vec<String> = Vec::new();
        for e in std::fs::read_dir(saved).with_context(|| format!("{}: cannot list", saved.display()))? {
            let e = e.with_context(|| format!("{}: cannot list", saved.display()))?;
            names.push(e.file_name().into_string().map_err(|n| anyhow::anyhow!("{}: a file name that is not UTF-8: {n:?}", saved.display()))?);
        }
        names.sort();
        for n in &names {
            if n == "stages" || n == "analysis.json" {
                bail!("{}: the encoder saved an entry {n:?}, the name the run keeps its own records under", saved.display());
            }
            let dest = out.join(n);
            if dest.symlink_metadata().is_ok() && !recorded.entries.contains(n) && !recorded.adopted.contains(n) {
                bail!(
                    "{}: exists and was not written by this run's final stage; the trained model would replace it. Move it out of {} and rerun (the trained model is kept in {})",
                    dest.display(),
                    out.display(),
                    saved.display()
                );
            }
        }
        let mut union = recorded.clone();
        union.entries.extend(names.iter().filter(|n| !recorded.entries.contains(n)).cloned());
        self.record_model_files(&union)?;
        for n in &names {
            let (src, dest) = (saved.join(n), out.join(n));
            // rename replaces a file by a file, but not a folder, nor a file by a folder (an
            // entry that changed kind between models): the old entry goes first then.
            let is_dir = |p: &Path| p.symlink_metadata().is_ok_and(|m| m.is_dir());
            if dest.symlink_metadata().is_ok() && (is_dir(&dest) || is_dir(&src)) {
                remove_entry(&dest).with_context(|| format!("{}: cannot remove the earlier model's entry", dest.display()))?;
            }
            std::fs::rename(&src, &dest).with_context(|| format!("{}: cannot move the trained model's entry into {}", src.display(), out.display()))?;
        }
        // An adopted entry is never removed (it may be a file the user added to an older run).
        for old in recorded.entries.iter().filter(|n| !names.contains(n) && !recorded.adopted.contains(n)) {
            remove_entry(&out.join(old))?;
        }
        rak_core::fsutil::sync_dir(&out)?;
        let adopted = recorded.adopted.into_iter().filter(|n| !names.contains(n)).collect();
        self.record_model_files(&ModelFiles { entries: names, adopted })
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

    /// The key recorded for stage `name` replaced by `key` when it is an older shape of it
    /// (`upgrade` turns it into `key`), so the stage is not taken as run with other inputs.
    pub fn upgrade_key(&self, name: &str, key: &Value, upgrade: impl Fn(&Value) -> Option<Value>) -> Result<()> {
        let path = self.key_path(name);
        if let Some(then) = read_json(&path)? {
            if then != *key && upgrade(&then).as_ref() == Some(key) {
                write_json(&path, key)?;
            }
        }
        Ok(())
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

/// `path` made absolute with its links resolved as far as it exists, `.` and `..` taken
/// lexically past that (the output folder may not exist yet).
fn resolved(path: &Path) -> Result<PathBuf> {
    let cwd = std::env::current_dir().context("cannot read the current folder")?;
    let mut abs = PathBuf::new();
    for c in cwd.join(path).components() {
        match c {
            std::path::Component::ParentDir => {
                abs.pop();
            }
            std::path::Component::CurDir => {}
            other => abs.push(other),
        }
    }
    // The longest existing prefix, canonical; the rest as it is.
    let mut existing = abs.clone();
    let mut rest = Vec::new();
    loop {
        if let Ok(c) = existing.canonicalize() {
            let mut out = c;
            out.extend(rest.iter().rev());
            return Ok(out);
        }
        match (existing.file_name().map(|n| n.to_os_string()), existing.parent().map(Path::to_path_buf)) {
            (Some(name), Some(parent)) => {
                rest.push(name);
                existing = parent;
            }
            _ => return Ok(abs),
        }
    }
}

/// Whether `dir` is an `aar-train` run's folder: marked, or (a run made before the marker)
/// holding the lock every run has taken first.
pub fn made_by_aar_train(dir: &Path) -> bool {
    dir.join("stages").join(MARKER).is_file() || dir.join("stages/lock").is_file()
}

/// The checks on `--output-dir` made before any work, so a run never writes into (and a redone
/// final stage never replaces files of) a folder it does not own: `out` must not be, hold or
/// lie inside any of `inputs` (the starting retriever, a white-box source: named by their
/// flags), and must be absent, empty, or an `aar-train` run's folder.
pub fn check_output_dir(out: &Path, inputs: &[(&str, &Path)]) -> Result<()> {
    let at = resolved(out)?;
    for (flag, input) in inputs {
        let input_at = resolved(input)?;
        if at == input_at {
            bail!("--output-dir {} is {flag} {}: the run would write its model over it; give another folder", out.display(), input.display());
        }
        if at.starts_with(&input_at) {
            bail!("--output-dir {} is inside {flag} {}: the run's files would change that model's folder; give a folder outside it", out.display(), input.display());
        }
        if input_at.starts_with(&at) {
            bail!("{flag} {} is inside --output-dir {}: the run's final stage would write beside it; give an output folder that does not hold it", input.display(), out.display());
        }
    }
    match std::fs::read_dir(out) {
        Ok(mut entries) => {
            if entries.next().is_some() && !made_by_aar_train(out) {
                bail!(
                    "--output-dir {}: not empty, and not an aar-train run's folder (no stages/{MARKER}); give a new or empty folder (aar-train writes only there, and may replace its own files on a rerun)",
                    out.display()
                );
            }
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotADirectory => bail!("--output-dir {}: a file, not a folder", out.display()),
        Err(e) => Err(e).with_context(|| format!("--output-dir {}: cannot list", out.display())),
    }
}

/// An exclusive lock on the run's folder for as long as it is held (one run per output folder:
/// two would append to the same record files). Released when the process ends, however.
pub struct RunLock(std::fs::File);

impl Drop for RunLock {
    /// Unlocked explicitly, not only closed: the lock belongs to the open file, which a child
    /// being spawned holds a copy of from fork to exec (see `OutputLock` in `host augment`).
    fn drop(&mut self) {
        let _ = self.0.unlock();
    }
}

impl RunLock {
    pub fn take(path: &Path) -> Result<RunLock> {
        use std::io::{Read, Seek, Write};
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .with_context(|| format!("{}: cannot open", path.display()))?;
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                bail!(
                    "{}: another aar-train (pid {}) is running on this output folder; wait for it or stop it",
                    path.display(),
                    holder.split_whitespace().next().unwrap_or("unknown")
                );
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(e).with_context(|| format!("{}: cannot lock", path.display())),
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

    /// One run per folder: a second is refused naming the first's process; the folder is free
    /// again once the first is done.
    #[test]
    fn a_second_run_on_a_folder_is_refused_while_the_first_holds_it() {
        let dir = std::env::temp_dir().join(format!("aar-stages-lock-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(".aar.lock");
        let first = RunLock::take(&path).unwrap();
        let e = RunLock::take(&path).err().unwrap().to_string();
        assert!(e.contains(&format!("another aar-train (pid {})", std::process::id())), "{e}");
        drop(first);
        assert!(RunLock::take(&path).is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A resumed or redone stage clears the later ones, but for the score stage, whose key is
    /// what it scores: a retrieval killed after a redo keeps the scores; a cleared final stage
    /// leaves OUT's model until a new one replaces it.
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
        assert!(out.join("model.safetensors").exists(), "the last complete model went before a new one was made");
        assert!(out.join("analysis.json").exists() && out.join("stages").exists());
        // The score stage resumed: the later stages go again.
        for name in ["select", "train"] {
            assert!(matches!(stages.begin(name, &json!({"stage": name})).unwrap(), Start::Fresh));
            stages.finish(name, &json!({})).unwrap();
        }
        // A key of an older shape, upgraded: the stage is done, not run with other inputs.
        write_json(&stages.key_path("select"), &json!({"old": "select"})).unwrap();
        stages.upgrade_key("select", &json!({"stage": "select"}), |then| (then["old"] == "select").then(|| json!({"stage": "select"}))).unwrap();
        assert!(matches!(stages.begin("select", &json!({"stage": "select"})).unwrap(), Start::Done(_)));
        stages.upgrade_key("select", &json!({"stage": "other"}), |_| None).unwrap();
        assert_eq!(read_json(&stages.key_path("select")).unwrap(), Some(json!({"stage": "select"})));
        stages.reopen("score").unwrap();
        assert!(matches!(stages.begin("score", &json!({"stage": "score"})).unwrap(), Start::Resume));
        assert!(stages.folder("score").join("work").exists());
        assert!(!stages.done_path("select").exists() && !stages.done_path("train").exists());
        let _ = std::fs::remove_dir_all(&out);
    }

    fn temp(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("aar-stages-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn saved(dir: &Path, files: &[&str]) -> PathBuf {
        let _ = std::fs::remove_dir_all(dir);
        for f in files {
            let p = dir.join(f);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, f.as_bytes()).unwrap();
        }
        dir.to_path_buf()
    }

    /// The final stage's model replaces only what an earlier final stage wrote: a file someone
    /// put in OUT stays, one of the same name as the model's is refused, not overwritten.
    #[test]
    fn the_model_replaces_only_what_the_run_wrote() {
        let out = temp("install");
        let stages = Stages::new(out.join("stages"), false).unwrap();
        std::fs::write(out.join("notes.txt"), b"mine").unwrap();
        stages.install_model(&saved(&out.join("stages/final/model"), &["model.safetensors", "config.json", "1_Pooling/config.json"])).unwrap();
        assert!(out.join("model.safetensors").exists() && out.join("1_Pooling/config.json").exists());
        // A second model without config.json: the first's is removed, the user's file kept.
        stages.install_model(&saved(&out.join("stages/final/model"), &["model.safetensors", "1_Pooling/config.json"])).unwrap();
        assert!(!out.join("config.json").exists(), "a file of the earlier model is left");
        assert_eq!(std::fs::read(out.join("notes.txt")).unwrap(), b"mine");
        assert_eq!(stages.model_files().unwrap().entries, vec!["1_Pooling".to_string(), "model.safetensors".into()]);
        // A file of the model's name that no final stage wrote: refused, left as it is.
        std::fs::write(out.join("vocab.txt"), b"mine").unwrap();
        let e = stages.install_model(&saved(&out.join("stages/final/model"), &["model.safetensors", "vocab.txt"])).unwrap_err().to_string();
        assert!(e.contains("vocab.txt") && e.contains("not written by this run"), "{e}");
        assert_eq!(std::fs::read(out.join("vocab.txt")).unwrap(), b"mine");
        assert_eq!(std::fs::read(out.join("notes.txt")).unwrap(), b"mine");
        let _ = std::fs::remove_dir_all(&out);
    }

    /// A run folder made before the marker: what its final stage left is adopted, and a later
    /// model replaces adopted entries of its names but never removes the others: one of them
    /// may be a file the user added after that run (notes.txt here).
    #[test]
    fn an_earlier_run_s_model_is_adopted_and_never_removed() {
        let out = temp("adopt");
        std::fs::create_dir_all(out.join("stages")).unwrap();
        for f in ["stages/lock", "stages/final.key.json", "stages/final.done.json", "analysis.json", "model.safetensors", "config.json", "notes.txt"] {
            std::fs::write(out.join(f), b"{}").unwrap();
        }
        assert!(made_by_aar_train(&out));
        let stages = Stages::new(out.join("stages"), false).unwrap();
        let files = stages.model_files().unwrap();
        assert_eq!(files.adopted, vec!["config.json".to_string(), "model.safetensors".into(), "notes.txt".into()]);
        assert!(files.entries.is_empty());
        assert!(out.join("stages").join(MARKER).exists());
        // A redone final stage: model.safetensors replaced, the adopted entries it lacks kept.
        stages.install_model(&saved(&out.join("stages/final/model"), &["model.safetensors", "tokenizer.json"])).unwrap();
        assert_eq!(std::fs::read(out.join("model.safetensors")).unwrap(), b"model.safetensors");
        assert_eq!(std::fs::read(out.join("notes.txt")).unwrap(), b"{}", "a file the user added was removed");
        assert!(out.join("config.json").exists());
        let files = stages.model_files().unwrap();
        assert_eq!(files.entries, vec!["model.safetensors".to_string(), "tokenizer.json".into()]);
        assert_eq!(files.adopted, vec!["config.json".to_string(), "notes.txt".into()]);
        // And the next one too: only what a final stage wrote goes.
        stages.install_model(&saved(&out.join("stages/final/model"), &["model.safetensors"])).unwrap();
        assert!(!out.join("tokenizer.json").exists() && out.join("notes.txt").exists() && out.join("config.json").exists());
        let _ = std::fs::remove_dir_all(&out);
    }

    /// The record's names are joined to OUT and what they name may be removed: a path, or the
    /// run's own records, is refused naming the file, and nothing outside OUT is touched.
    #[test]
    fn a_model_record_naming_a_path_is_refused() {
        let root = temp("record");
        let out = root.join("run");
        let stages = Stages::new(out.join("stages"), false).unwrap();
        std::fs::create_dir_all(root.join("sibling")).unwrap();
        std::fs::write(root.join("sibling/keep"), b"x").unwrap();
        let sibling = root.join("sibling").to_string_lossy().into_owned();
        for (field, bad) in [("entries", "../sibling"), ("entries", sibling.as_str()), ("adopted", "a/b"), ("entries", "stages"), ("entries", "analysis.json"), ("entries", "."), ("entries", "")] {
            std::fs::write(out.join("stages").join(MODEL_FILES), json!({field: [bad]}).to_string()).unwrap();
            let e = stages.install_model(&saved(&out.join("stages/final/model"), &["model.safetensors"])).unwrap_err().to_string();
            assert!(e.contains(MODEL_FILES) && e.contains(&format!("{bad:?}")) && e.contains(field), "{bad}: {e}");
            assert!(root.join("sibling/keep").exists() && out.join("stages").join(MARKER).exists(), "{bad}: removed");
        }
        let _ = std::fs::remove_dir_all(&root);
    }

    /// An entry that is a file in one model and a folder in the next (or the reverse).
    #[test]
    fn a_model_entry_may_change_kind() {
        let out = temp("kind");
        let stages = Stages::new(out.join("stages"), false).unwrap();
        stages.install_model(&saved(&out.join("stages/final/model"), &["x"])).unwrap();
        stages.install_model(&saved(&out.join("stages/final/model"), &["x/inner"])).unwrap();
        assert_eq!(std::fs::read(out.join("x/inner")).unwrap(), b"x/inner");
        stages.install_model(&saved(&out.join("stages/final/model"), &["x"])).unwrap();
        assert_eq!(std::fs::read(out.join("x")).unwrap(), b"x");
        let _ = std::fs::remove_dir_all(&out);
    }

    /// The output folder is checked before any work: never a folder the run did not make, nor
    /// the starting retriever's or the source's, inside them, or holding them.
    #[test]
    fn output_folders_the_run_does_not_own_are_refused() {
        let root = temp("check");
        let model = root.join("model");
        std::fs::create_dir_all(&model).unwrap();
        std::fs::write(model.join("model.safetensors"), b"w").unwrap();
        let inputs = [("--model", model.as_path())];
        // New, or empty: fine.
        check_output_dir(&root.join("new"), &inputs).unwrap();
        std::fs::create_dir_all(root.join("empty")).unwrap();
        check_output_dir(&root.join("empty"), &inputs).unwrap();
        // Not empty and not a run's (a folder of runs, say): refused.
        std::fs::create_dir_all(root.join("runs/other")).unwrap();
        let e = check_output_dir(&root.join("runs"), &inputs).unwrap_err().to_string();
        assert!(e.contains("not empty") && e.contains("runs"), "{e}");
        // The model itself, under another spelling; inside it; holding it.
        for (out, needle) in [(model.join("."), "is --model"), (model.join("aar"), "inside --model"), (root.clone(), "is inside --output-dir")] {
            let e = check_output_dir(&out, &inputs).unwrap_err().to_string();
            assert!(e.contains(needle), "{}: {e}", out.display());
        }
        // A run's own folder (marked) is fine to rerun into.
        std::fs::create_dir_all(root.join("run/stages")).unwrap();
        std::fs::write(root.join("run/stages").join(MARKER), b"{}").unwrap();
        std::fs::write(root.join("run/model.safetensors"), b"w").unwrap();
        check_output_dir(&root.join("run"), &inputs).unwrap();
        // ...but not with a starting retriever inside it.
        let e = check_output_dir(&root.join("run"), &[("--model", &root.join("run/stages/train/checkpoint-4"))]).unwrap_err().to_string();
        assert!(e.contains("inside --output-dir"), "{e}");
        let _ = std::fs::remove_dir_all(&root);
    }
}
