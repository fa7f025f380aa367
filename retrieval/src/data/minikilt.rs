//! The mini-KILT layout: `corpus.jsonl` and `tasks/<task>/{queries.<split>.jsonl,
//! qrels.<split>.tsv}` under one root (see `data/minikilt/README.md`).

use super::{beir, Corpus, Qrels, Query};
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

/// A mini-KILT directory.
#[derive(Debug, Clone)]
pub struct MiniKilt {
    root: PathBuf,
}

/// The files of one task split.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskSplit {
    pub task: String,
    pub split: String,
    pub queries: PathBuf,
    pub qrels: PathBuf,
}

impl TaskSplit {
    /// Read the queries and the qrels.
    pub fn load(&self) -> Result<(Vec<Query>, Qrels)> {
        Ok((beir::load_queries(&self.queries)?, beir::read_qrels(&self.qrels)?))
    }
}

impl MiniKilt {
    /// Open a root that has `corpus.jsonl` and `tasks/`.
    pub fn open(root: impl AsRef<Path>) -> Result<Self> {
        let root = root.as_ref().to_path_buf();
        for need in ["corpus.jsonl", "tasks"] {
            if !root.join(need).exists() {
                bail!("{}: not a mini-KILT directory (no {need})", root.display());
            }
        }
        Ok(Self { root })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn corpus_path(&self) -> PathBuf {
        self.root.join("corpus.jsonl")
    }

    pub fn load_corpus(&self) -> Result<Corpus> {
        beir::load_corpus(&self.corpus_path())
    }

    /// Task names (folders under `tasks/`), sorted.
    pub fn tasks(&self) -> Result<Vec<String>> {
        let dir = self.root.join("tasks");
        let mut tasks = Vec::new();
        for e in std::fs::read_dir(&dir).with_context(|| format!("{}: cannot list", dir.display()))? {
            let e = e?;
            if e.file_type()?.is_dir() {
                tasks.push(e.file_name().to_string_lossy().into_owned());
            }
        }
        tasks.sort();
        Ok(tasks)
    }

    /// Splits of a task that have both a queries and a qrels file, sorted.
    pub fn splits(&self, task: &str) -> Result<Vec<String>> {
        let dir = self.root.join("tasks").join(task);
        let mut splits = Vec::new();
        for e in std::fs::read_dir(&dir).with_context(|| format!("{}: no such task", dir.display()))? {
            let name = e?.file_name().to_string_lossy().into_owned();
            if let Some(split) = name.strip_prefix("queries.").and_then(|s| s.strip_suffix(".jsonl")) {
                if dir.join(format!("qrels.{split}.tsv")).exists() {
                    splits.push(split.to_string());
                }
            }
        }
        splits.sort();
        Ok(splits)
    }

    /// The files of `task`/`split`; both must exist.
    pub fn split(&self, task: &str, split: &str) -> Result<TaskSplit> {
        let dir = self.root.join("tasks").join(task);
        let s = TaskSplit {
            task: task.into(),
            split: split.into(),
            queries: dir.join(format!("queries.{split}.jsonl")),
            qrels: dir.join(format!("qrels.{split}.tsv")),
        };
        for p in [&s.queries, &s.qrels] {
            if !p.is_file() {
                bail!("{}: missing (task {task:?}, split {split:?})", p.display());
            }
        }
        Ok(s)
    }

    /// Every task that has `split`, in task order.
    pub fn all(&self, split: &str) -> Result<Vec<TaskSplit>> {
        let mut out = Vec::new();
        for t in self.tasks()? {
            if self.splits(&t)?.iter().any(|s| s == split) {
                out.push(self.split(&t, split)?);
            }
        }
        Ok(out)
    }
}
