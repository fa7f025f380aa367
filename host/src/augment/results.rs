//! `results.jsonl`: one line per answered item, appended as each finishes, so a killed run
//! loses at most the items in flight.
//!
//! On a rerun the file is read back: answered lines whose prompt matches the one the item
//! would get now, asked of the same setup (target, model, answering settings), are kept and
//! their items skipped; error records are dropped (those items are asked again, whatever setup
//! they were made under); a torn last line (a kill mid-write) is dropped. An answered line with
//! another setup, or any line with another prompt, means the file was made with another recipe: that is refused unless `--overwrite`, so two settings never mix
//! in one file. Records of questions this run does not ask (a smaller `--limit`, a sample)
//! are kept in the file untouched. The kept lines are rewritten atomically before appending.
//!
//! One run at a time per file: `OUTPUT.lock` beside it is held (an exclusive `flock`) for the
//! run's life, so a second run on the same output is refused rather than replace the file
//! while the first appends to the one it unlinked.

use anyhow::{bail, Context, Result};
use rak_core::fsutil;
use serde_json::Value;
use std::collections::HashMap;
use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

pub struct Results {
    path: PathBuf,
    file: File,
    _lock: OutputLock,
}

/// The exclusive right to write one output, held until dropped. The kernel releases it when
/// the process ends however it ends, so a killed run leaves no stale lock to clear.
pub struct OutputLock {
    file: File,
}

impl Drop for OutputLock {
    /// Unlocked explicitly, not only closed: the lock belongs to the open file, and a child this
    /// process is spawning holds a copy of its descriptor from fork to exec, so a close alone
    /// would leave it held until then (CI failed so, beside a test spawning `sh`).
    fn drop(&mut self) {
        let _ = self.file.unlock();
    }
}

impl OutputLock {
    /// Lock `OUTPUT.lock` beside `output` (created if missing), or refuse naming the process
    /// that holds it.
    pub fn take(output: &Path) -> Result<Self> {
        let mut name = output.file_name().with_context(|| format!("{}: not a file name", output.display()))?.to_os_string();
        name.push(".lock");
        let path = output.with_file_name(name);
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).with_context(|| format!("{}: cannot create", dir.display()))?;
        }
        // Never removed: a process that opened the file before a removal would lock the old
        // one while the next locks a new file under the same name, and both would write.
        let mut file = OpenOptions::new().create(true).truncate(false).read(true).write(true).open(&path).with_context(|| format!("{}: cannot open", path.display()))?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                let holder = holder.trim();
                let who = if holder.is_empty() { String::new() } else { format!(" (pid {holder})") };
                bail!(
                    "{}: another host augment{who} is writing this output (it holds {}); wait for it to finish or use another --output",
                    output.display(),
                    path.display()
                );
            }
            Err(TryLockError::Error(e)) => return Err(e).with_context(|| format!("{}: cannot lock", path.display())),
        }
        // Who holds it, for the message a second run prints.
        let _ = file.set_len(0).and_then(|_| file.rewind()).and_then(|_| write!(file, "{}", std::process::id()));
        Ok(OutputLock { file })
    }
}

/// Finished records of an earlier run, by item id.
pub type Done = HashMap<String, Value>;

impl Results {
    /// Open `path` for appending, under its `lock`. `expected` maps each item id to the SHA-256
    /// of its prompt, `setup` is the SHA-256 of the rest that decides an answer; returns the
    /// records already answered with both, each judged again by `rejudge` (which returns
    /// whether its verdict changed) before the file is rewritten: the prompt and the setup do
    /// not hold the gold answers, which may have been corrected since.
    pub fn open(
        path: &Path,
        lock: OutputLock,
        expected: &HashMap<String, String>,
        setup: &str,
        overwrite: bool,
        rejudge: &dyn Fn(&str, &mut Value) -> bool,
    ) -> Result<(Self, Done)> {
        let mut done = Done::new();
        let mut others: Vec<Value> = Vec::new();
        let mut dropped_errors = 0;
        if path.exists() && !overwrite {
            let text = std::fs::read_to_string(path).with_context(|| format!("{}: cannot read", path.display()))?;
            let lines: Vec<&str> = text.lines().collect();
            for (n, line) in lines.iter().enumerate() {
                if line.trim().is_empty() {
                    continue;
                }
                let Ok(rec) = serde_json::from_str::<Value>(line) else {
                    if n + 1 == lines.len() {
                        continue; // torn by a kill mid-write
                    }
                    bail!("{}:{}: not a JSON record; use --overwrite to start this file afresh", path.display(), n + 1);
                };
                let id = rec["_id"].as_str().with_context(|| format!("{}:{}: a record without \"_id\"", path.display(), n + 1))?;
                let Some(want) = expected.get(id) else {
                    // Another selection of the same file's questions (--limit, a sample):
                    // kept as it is, not part of this run.
                    others.push(rec);
                    continue;
                };
                if rec["prompt_sha256"].as_str() != Some(want.as_str()) {
                    bail!(
                        "{}:{}: item {id:?} was asked with another prompt (different recipe, retriever or k); use another --output, or --overwrite",
                        path.display(),
                        n + 1
                    );
                }
                // An error record holds no answer: it is asked again whatever setup it was made
                // under. (A first run against a server that was not up yet knew less of the
                // target, such as the model it serves, and its failed items must not bar the
                // rerun.)
                if !rec["error"].is_null() {
                    dropped_errors += 1;
                    done.remove(id);
                    continue;
                }
                if rec["setup_sha256"].as_str() != Some(setup) {
                    bail!(
                        "{}:{}: item {id:?} was asked of another target, model, prompt settings or answering settings; use another --output, or --overwrite",
                        path.display(),
                        n + 1
                    );
                }
                done.insert(id.to_string(), rec);
            }
        }
        let rejudged = done.iter_mut().map(|(id, rec)| rejudge(id, rec)).filter(|&changed| changed).count();
        if rejudged > 0 {
            eprintln!("augment: {rejudged} answers kept from the last run are judged otherwise against the gold answers as they are now");
        }
        let mut kept: Vec<&Value> = done.values().chain(&others).collect();
        kept.sort_by_key(|r| r["_id"].as_str().unwrap_or("").to_string());
        let mut body = String::new();
        for r in kept {
            body.push_str(&r.to_string());
            body.push('\n');
        }
        fsutil::write_bytes(path, body.as_bytes())?;
        if dropped_errors > 0 {
            eprintln!("augment: asking again {dropped_errors} items that failed last time");
        }
        let file = OpenOptions::new().append(true).open(path).with_context(|| format!("{}: cannot open for appending", path.display()))?;
        Ok((Results { path: path.to_path_buf(), file, _lock: lock }, done))
    }

    /// Append one record as a single write, flushed to the OS at once.
    pub fn append(&mut self, record: &Value) -> Result<()> {
        let mut line = record.to_string();
        line.push('\n');
        self.file.write_all(line.as_bytes()).with_context(|| format!("{}: cannot append", self.path.display()))
    }

    pub fn sync(&self) -> Result<()> {
        self.file.sync_all().with_context(|| format!("{}: cannot sync", self.path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn open(path: &Path, expected: &HashMap<String, String>, setup: &str, overwrite: bool) -> Result<(Results, Done)> {
        Results::open(path, OutputLock::take(path)?, expected, setup, overwrite, &|_, _| false)
    }

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("rak-results-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d.join("results.jsonl")
    }

    #[test]
    fn resumes_keeping_answers_and_dropping_errors_and_torn_lines() {
        let p = tmp("resume");
        let expected: HashMap<String, String> = [("a", "h1"), ("b", "h2"), ("c", "h3")].iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        std::fs::write(
            &p,
            format!(
                "{}\n{}\n{{\"_id\": \"c\", \"prompt_sh",
                json!({"_id": "a", "prompt_sha256": "h1", "setup_sha256": "s", "error": null}),
                json!({"_id": "b", "prompt_sha256": "h2", "setup_sha256": "s", "error": "HTTP 500"})
            ),
        )
        .unwrap();
        let (mut r, done) = open(&p, &expected, "s", false).unwrap();
        assert_eq!(done.keys().collect::<Vec<_>>(), vec!["a"]);
        r.append(&json!({"_id": "b", "prompt_sha256": "h2", "setup_sha256": "s", "error": null})).unwrap();
        drop(r);
        let e = open(&p, &expected, "other", false).err().unwrap().to_string();
        assert!(e.contains("another target, model, prompt settings or answering settings"), "{e}");
        let (_, done) = open(&p, &expected, "s", false).unwrap();
        assert_eq!(done.len(), 2);
        let lines = std::fs::read_to_string(&p).unwrap();
        assert_eq!(lines.lines().count(), 2);
    }

    /// Kept answers go through `rejudge` before the file is rewritten, so the file and the
    /// run's summary hold the verdicts against the gold of now.
    #[test]
    fn kept_answers_are_rejudged_before_the_file_is_rewritten() {
        let p = tmp("rejudge");
        let expected: HashMap<String, String> = [("a", "h1"), ("b", "h2")].iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let rec = |id: &str, h: &str| json!({"_id": id, "prompt_sha256": h, "setup_sha256": "s", "error": null, "correct": true});
        std::fs::write(&p, format!("{}\n{}\n", rec("a", "h1"), rec("b", "h2"))).unwrap();
        let flip_a = |id: &str, r: &mut Value| {
            if id != "a" {
                return false;
            }
            r["correct"] = json!(false);
            true
        };
        let (_, done) = Results::open(&p, OutputLock::take(&p).unwrap(), &expected, "s", false, &flip_a).unwrap();
        assert_eq!((done["a"]["correct"].clone(), done["b"]["correct"].clone()), (json!(false), json!(true)));
        let text = std::fs::read_to_string(&p).unwrap();
        let file: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(file.iter().map(|r| r["correct"].clone()).collect::<Vec<_>>(), vec![json!(false), json!(true)]);
    }

    /// Failed items of a run that knew the target otherwise (its server was down at start)
    /// are asked again by a run with another setup, not refused; answers still are.
    #[test]
    fn error_records_never_bind_the_file_to_their_setup() {
        let p = tmp("error-setup");
        let expected: HashMap<String, String> = [("a", "h1"), ("b", "h2")].iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let failed = |id: &str, h: &str| json!({"_id": id, "prompt_sha256": h, "setup_sha256": "down", "error": "unreachable: no server"});
        std::fs::write(&p, format!("{}\n{}\n", failed("a", "h1"), failed("b", "h2"))).unwrap();
        let (mut r, done) = open(&p, &expected, "up", false).unwrap();
        assert!(done.is_empty(), "both are asked again");
        r.append(&json!({"_id": "a", "prompt_sha256": "h1", "setup_sha256": "up", "error": null})).unwrap();
        drop(r);
        let e = open(&p, &expected, "down", false).err().unwrap().to_string();
        assert!(e.contains("another target, model"), "an answer of another setup is still refused: {e}");
    }

    #[test]
    fn records_of_questions_not_asked_now_are_kept() {
        let p = tmp("others");
        let expected: HashMap<String, String> = [("a".to_string(), "h1".to_string())].into();
        std::fs::write(
            &p,
            format!("{}\n{}\n", json!({"_id": "a", "prompt_sha256": "h1", "setup_sha256": "s", "error": null}), json!({"_id": "z", "prompt_sha256": "hz", "setup_sha256": "s", "error": null})),
        )
        .unwrap();
        let (_, done) = open(&p, &expected, "s", false).unwrap();
        assert_eq!(done.keys().collect::<Vec<_>>(), vec!["a"]);
        assert!(std::fs::read_to_string(&p).unwrap().contains("\"z\""));
    }

    #[test]
    fn a_second_writer_is_refused_while_the_first_holds_the_file() {
        let p = tmp("lock");
        let expected = HashMap::new();
        let (first, _) = open(&p, &expected, "s", false).unwrap();
        let e = OutputLock::take(&p).err().unwrap().to_string();
        assert!(e.contains("another host augment") && e.contains(&format!("pid {}", std::process::id())), "{e}");
        drop(first);
        assert!(open(&p, &expected, "s", false).is_ok(), "free again once the first is done");
    }

    /// A child this process spawns holds a copy of every open descriptor between its fork
    /// and its exec, the lock's too: a lock only closed would briefly stay held (CI failed so,
    /// beside a test spawning `sh`). One dropped is free at once, children or not.
    #[test]
    fn a_lock_just_dropped_is_free_while_children_are_being_spawned() {
        let p = tmp("spawning");
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let spawner = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let _ = std::process::Command::new("true").status();
                }
            })
        };
        let mut refused = None;
        for _ in 0..1000 {
            match OutputLock::take(&p) {
                Ok(lock) => drop(lock),
                Err(e) => {
                    refused = Some(e.to_string());
                    break;
                }
            }
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        spawner.join().unwrap();
        assert!(refused.is_none(), "{refused:?}");
    }

    #[test]
    fn another_prompt_is_refused_unless_overwriting() {
        let p = tmp("mismatch");
        let expected: HashMap<String, String> = [("a".to_string(), "new".to_string())].into();
        std::fs::write(&p, format!("{}\n", json!({"_id": "a", "prompt_sha256": "old", "setup_sha256": "s", "error": null}))).unwrap();
        let e = open(&p, &expected, "s", false).err().unwrap().to_string();
        assert!(e.contains("another prompt"), "{e}");
        let (_, done) = open(&p, &expected, "s", true).unwrap();
        assert!(done.is_empty());
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "");
    }
}
