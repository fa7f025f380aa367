//! Training data: per task, queries with their gold passages (from BEIR qrels) and hard
//! negatives; and the texts of the passages they name.
//!
//! Problems a run cannot train through are errors naming the file: a task without examples,
//! a passage text that is empty, a query or passage id that occurs twice (with its line).
//! Problems that only shrink the data are counted and reported: queries without gold passages
//! are dropped, judgements naming passages the corpus lacks are ignored.

use anyhow::{bail, Context, Result};
use rak_core::encoders::passage_string;
use rak_retrieval::data::beir;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

/// One training query.
#[derive(Debug, Clone, PartialEq)]
pub struct Example {
    pub query_id: String,
    pub query: String,
    /// Gold passage ids (at least one).
    pub positives: Vec<String>,
    /// Hard-negative passage ids (may be empty: in-batch negatives only).
    pub negatives: Vec<String>,
    /// Gold answer strings (empty where the task has none): `exclude_answer_negatives` keeps
    /// passages holding one out of the negatives.
    pub answers: Vec<String>,
    /// Passages a language model scored for this query, with their scores (the log-likelihood
    /// of the answer given the passage): what the `lm_supervised` loss trains the retriever's
    /// distribution toward. Empty for every other loss.
    pub lm_scores: Vec<(String, f64)>,
}

/// Where a task's training data is.
#[derive(Debug, Clone)]
pub struct TaskSource {
    pub name: String,
    pub queries: PathBuf,
    pub qrels: PathBuf,
}

/// One task's examples.
#[derive(Debug, Clone, PartialEq)]
pub struct TaskData {
    pub name: String,
    pub examples: Vec<Example>,
}

/// What loading dropped, for the user.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct LoadReport {
    pub queries_without_gold: usize,
    pub judgements_naming_unknown_passages: usize,
}

/// Load a task's queries and their relevant passages (grade >= 1) that exist in `known`.
pub fn load_task(src: &TaskSource, known: &dyn Fn(&str) -> bool, report: &mut LoadReport) -> Result<TaskData> {
    let qrels = beir::read_qrels(&src.qrels)?;
    let mut examples = Vec::new();
    let mut seen = HashSet::new();
    for q in beir::read_queries(&src.queries)?.numbered() {
        let (line, q) = q?;
        // A repeated id would train twice on one query under one key (its dropout masks, its
        // mined negatives) and is most likely two files joined: refuse it by line.
        if !seen.insert(q.id.clone()) {
            bail!("{}:{line}: query id {:?} occurs twice; give each query its own id", src.queries.display(), q.id);
        }
        let mut positives = Vec::new();
        for (pid, &grade) in qrels.get(&q.id).into_iter().flatten() {
            if grade < 1 {
                continue;
            }
            if known(pid) {
                positives.push(pid.clone());
            } else {
                report.judgements_naming_unknown_passages += 1;
            }
        }
        if positives.is_empty() {
            report.queries_without_gold += 1;
            continue;
        }
        examples.push(Example { query_id: q.id, query: q.text, positives, negatives: Vec::new(), answers: q.answers, lm_scores: Vec::new() });
    }
    if examples.is_empty() {
        bail!(
            "task {:?} has no training examples: no query in {} has a relevant passage of the corpus in {}",
            src.name,
            src.queries.display(),
            src.qrels.display()
        );
    }
    Ok(TaskData { name: src.name.clone(), examples })
}

/// The ids of every passage in a corpus file (streamed); a repeated id is an error naming its
/// line (the texts the trainer reads for it would depend on which copy came last).
pub fn corpus_ids(corpus: &Path) -> Result<HashSet<String>> {
    let mut ids = HashSet::new();
    for p in beir::read_corpus(corpus)?.numbered() {
        let (line, p) = p?;
        // One lookup a passage: `replace` hands back the copy already there.
        if let Some(id) = ids.replace(p.id) {
            bail!("{}:{line}: passage id {:?} occurs twice; give each passage its own id", corpus.display(), id);
        }
    }
    Ok(ids)
}

/// Every passage's page, by id: pages are numbered in order of first appearance and a
/// passage's page is its title (KILT judges pages: every passage of a gold page counts).
pub fn corpus_pages(corpus: &Path) -> Result<HashMap<String, u32>> {
    let mut by_title: HashMap<String, u32> = HashMap::new();
    let mut pages = HashMap::new();
    for p in beir::read_corpus(corpus)? {
        let p = p?;
        let next = by_title.len() as u32;
        let page = *by_title.entry(p.title).or_insert(next);
        pages.insert(p.id, page);
    }
    Ok(pages)
}

/// The texts (without titles) of the passages in `wanted` that the corpus holds, streamed.
pub fn corpus_texts(corpus: &Path, wanted: &HashSet<&str>) -> Result<HashMap<String, String>> {
    let mut out = HashMap::with_capacity(wanted.len());
    for p in beir::read_corpus(corpus)? {
        let p = p?;
        if wanted.contains(p.id.as_str()) {
            out.insert(p.id, p.text);
        }
    }
    Ok(out)
}

/// The encoder strings (`title \u{1f} text`) of the passages in `wanted`, streamed from the
/// corpus. An empty passage text is an error naming it: it would train on nothing.
pub fn passage_texts(corpus: &Path, wanted: &HashSet<&str>) -> Result<HashMap<String, String>> {
    let mut out = HashMap::with_capacity(wanted.len());
    for p in beir::read_corpus(corpus)?.numbered() {
        let (line, p) = p?;
        if wanted.contains(p.id.as_str()) {
            if p.text.trim().is_empty() {
                bail!("{}:{line}: passage {:?} has an empty text; remove it or give it one", corpus.display(), p.id);
            }
            out.insert(p.id.clone(), passage_string(&p.title, &p.text));
        }
    }
    let missing: Vec<&&str> = wanted.iter().filter(|id| !out.contains_key(**id)).take(3).collect();
    if !missing.is_empty() {
        bail!("{}: passages {missing:?} are named by the training data but not in the corpus", corpus.display());
    }
    Ok(out)
}

/// The mini-KILT layout: `DIR/<task>/queries.train.jsonl` and `qrels.train.tsv`.
pub fn task_sources(task_dir: &Path, tasks: &[String], split: &str) -> Result<Vec<TaskSource>> {
    tasks
        .iter()
        .map(|t| {
            let dir = task_dir.join(t);
            let src = TaskSource {
                name: t.clone(),
                queries: dir.join(format!("queries.{split}.jsonl")),
                qrels: dir.join(format!("qrels.{split}.tsv")),
            };
            for f in [&src.queries, &src.qrels] {
                std::fs::metadata(f).with_context(|| format!("task {t:?}: {} is missing", f.display()))?;
            }
            Ok(src)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A folder of its own under the system's temporary one, removed first.
    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("rak-data-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn repeated_ids_and_empty_texts_name_their_lines() {
        let dir = scratch("repeated");
        let corpus = dir.join("corpus.jsonl");
        std::fs::write(&corpus, "{\"_id\": \"a\", \"text\": \"one\"}\n{\"_id\": \"b\", \"text\": \" \"}\n{\"_id\": \"a\", \"text\": \"two\"}\n").unwrap();
        let err = format!("{:#}", corpus_ids(&corpus).unwrap_err());
        assert!(err.contains("corpus.jsonl:3: passage id \"a\" occurs twice"), "{err}");
        let err = format!("{:#}", passage_texts(&corpus, &HashSet::from(["b"])).unwrap_err());
        assert!(err.contains("corpus.jsonl:2: passage \"b\" has an empty text"), "{err}");

        let src = TaskSource { name: "t".into(), queries: dir.join("queries.train.jsonl"), qrels: dir.join("qrels.train.tsv") };
        std::fs::write(&src.qrels, "query-id\tcorpus-id\tscore\nq1\ta\t1\nq2\ta\t1\n").unwrap();
        std::fs::write(&src.queries, "{\"_id\": \"q1\", \"text\": \"x\"}\n{\"_id\": \"q2\", \"text\": \"y\"}\n").unwrap();
        let mut report = LoadReport::default();
        assert_eq!(load_task(&src, &|_| true, &mut report).unwrap().examples.len(), 2);
        std::fs::write(&src.queries, "{\"_id\": \"q1\", \"text\": \"x\"}\n{\"_id\": \"q2\", \"text\": \"y\"}\n\n{\"_id\": \"q1\", \"text\": \"z\"}\n").unwrap();
        let err = format!("{:#}", load_task(&src, &|_| true, &mut report).unwrap_err());
        assert!(err.contains("queries.train.jsonl:4: query id \"q1\" occurs twice"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
