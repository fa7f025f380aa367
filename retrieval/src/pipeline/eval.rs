//! Evaluate TREC runs against qrels (and queries with answers and gold pages): metrics per
//! task and their macro average, as JSON.

use super::Progress;
use crate::data::{beir, check_qrels_ids, trec, Corpus, Passage, Qrels, Query, Run};
use crate::eval::{evaluate_tasks, mean_of, EvalOptions, MissingQueries, ANSWER_KS};
use anyhow::{bail, Result};
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

/// One task to evaluate.
#[derive(Debug, Clone)]
pub struct EvalInput {
    /// The task's name in the output; `None`: derived from the run's file name.
    pub name: Option<String>,
    pub run: PathBuf,
    pub qrels: PathBuf,
    /// Queries JSONL with answers and gold pages, for `answer_acc@k` and page R-precision.
    pub queries: Option<PathBuf>,
}

/// Fact verification labels are not answer strings: answer accuracy is meaningless there.
fn has_answer_strings(queries: &[Query]) -> bool {
    queries.iter().flat_map(|q| &q.answers).any(|a| !matches!(a.as_str(), "SUPPORTS" | "REFUTES" | "NOT ENOUGH INFO"))
}

/// A name per input: the given one, else the run's file stem, else (when two stems collide,
/// as `nq/dev.trec` and `tqa/dev.trec` do) `parent/stem`. Two inputs may never share a name:
/// the macro average would silently cover one of them.
pub fn task_names(inputs: &[EvalInput]) -> Result<Vec<String>> {
    let stem = |p: &Path| p.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let with_parent = |p: &Path| match p.parent().and_then(|d| d.file_name()) {
        Some(d) => format!("{}/{}", d.to_string_lossy(), stem(p)),
        None => stem(p),
    };
    let mut stems: HashMap<String, usize> = HashMap::new();
    for i in inputs.iter().filter(|i| i.name.is_none()) {
        *stems.entry(stem(&i.run)).or_default() += 1;
    }
    let names: Vec<String> = inputs
        .iter()
        .map(|i| match &i.name {
            Some(n) => n.clone(),
            None if stems[&stem(&i.run)] > 1 => with_parent(&i.run),
            None => stem(&i.run),
        })
        .collect();
    let mut seen: HashMap<&str, &Path> = HashMap::new();
    for (name, input) in names.iter().zip(inputs) {
        if let Some(first) = seen.insert(name, &input.run) {
            bail!(
                "two runs would both be reported as task {name:?} ({} and {}); name each with --task",
                first.display(),
                input.run.display()
            );
        }
    }
    Ok(names)
}

/// The passages an evaluation needs, streamed from `corpus`: every passage a run or the qrels
/// name (for page titles), with its text only where answer accuracy reads it. The rest of the
/// corpus is never held in memory.
fn needed_passages(corpus: &Path, needed: &HashSet<&str>, with_text: &HashSet<&str>) -> Result<Corpus> {
    let mut kept = Vec::with_capacity(needed.len());
    for p in beir::read_corpus(corpus)? {
        let p = p?;
        if needed.contains(p.id.as_str()) {
            let text = if with_text.contains(p.id.as_str()) { p.text } else { String::new() };
            kept.push(Passage { id: p.id, title: p.title, text });
        }
    }
    Corpus::from_passages(kept).map_err(|e| anyhow::anyhow!("{}: {e}", corpus.display()))
}

/// Evaluate every input against `corpus`. Unknown ids in qrels are reported through
/// `progress.log`; with `per_query`, per-query values are included.
pub fn evaluate_files(
    inputs: &[EvalInput],
    corpus: &Path,
    missing: MissingQueries,
    per_query: bool,
    progress: &dyn Progress,
) -> Result<Value> {
    let names = task_names(inputs)?;
    struct Loaded {
        name: String,
        run: Run,
        qrels: Qrels,
        queries: Vec<Query>,
        answers: bool,
    }
    let mut loaded = Vec::new();
    for (name, input) in names.into_iter().zip(inputs) {
        let run = trec::read_run(&input.run)?;
        let qrels = beir::read_qrels(&input.qrels)?;
        let queries = match &input.queries {
            Some(p) => beir::load_queries(p)?,
            None => Vec::new(),
        };
        let answers = has_answer_strings(&queries);
        loaded.push(Loaded { name, run, qrels, queries, answers });
    }
    let answer_depth = ANSWER_KS.iter().copied().max().unwrap_or(0);
    let mut needed: HashSet<&str> = HashSet::new();
    let mut with_text: HashSet<&str> = HashSet::new();
    for l in &loaded {
        for (_, docs) in l.run.iter() {
            needed.extend(docs.iter().map(|(d, _)| d.as_str()));
            if l.answers {
                with_text.extend(docs.iter().take(answer_depth).map(|(d, _)| d.as_str()));
            }
        }
        needed.extend(l.qrels.values().flat_map(|r| r.keys().map(String::as_str)));
    }
    let corpus_path = corpus;
    let corpus = needed_passages(corpus, &needed, &with_text)?;

    let mut out = json!({"tasks": {}, "macro": {}});
    let mut means = BTreeMap::new();
    for (l, input) in loaded.iter().zip(inputs) {
        let query_ids: HashSet<&str> = l.queries.iter().map(|q| q.id.as_str()).collect();
        let unknown = check_qrels_ids(
            &input.qrels.display().to_string(),
            &l.qrels,
            |q| l.queries.is_empty() || query_ids.contains(q),
            |p| corpus.contains(p),
        );
        if !unknown.is_empty() {
            progress.log(&format!(
                "warning: {}: {} judgements name unknown ids ({} queries, {} passages; corpus {}); they count as relevant but cannot be retrieved",
                input.qrels.display(),
                unknown.judgements,
                unknown.queries,
                unknown.passages,
                corpus_path.display()
            ));
        }
        let opts = EvalOptions { missing, answer_accuracy: l.answers };
        let ev = evaluate_tasks(&[(l.name.as_str(), &l.run, &l.qrels, l.queries.as_slice())], Some(&corpus), &opts);
        let e = &ev.tasks[&l.name];
        let mut entry = json!({
            "queries": e.queries, "missing_queries": e.missing_queries, "unjudged_queries": e.unjudged_queries,
            "answer_queries": e.answer_queries, "metrics": e.mean,
        });
        if per_query {
            entry["per_query"] = json!(e.per_query);
        }
        out["tasks"][&l.name] = entry;
        means.insert(l.name.clone(), e.mean.clone());
    }
    out["macro"] = json!(mean_of(&means));
    Ok(out)
}
