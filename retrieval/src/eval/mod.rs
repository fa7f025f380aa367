//! Retrieval evaluation: a [`Run`] against [`Qrels`] (and, where given, the queries' gold pages
//! and answers and the corpus), per query and averaged, as JSON.
//!
//! Measures (keys of the JSON maps):
//! - `rprec_passage`, `recall@5`, `recall@20`, `recall@100`, `mrr@10`, `ndcg@10`: as trec_eval
//!   (`Rprec`, `recall_k`, `recip_rank` on the run cut to 10, `ndcg_cut_10`), checked against
//!   pytrec_eval; see [`trec`].
//! - `rprec_page` (needs the corpus): KILT's page-level R-precision, see [`kilt`]. Gold pages are
//!   the query's `pages` (or its `page_sets`), else the titles of its relevant passages.
//! - `answer_acc@1`, `@5`, `@20` (needs the corpus; only for queries with answers): DPR's top-k
//!   accuracy, 1 when a top-k passage's text contains an answer (see [`answer`]).
//!
//! Which queries count: those in the qrels. A judged query absent from the run scores 0 on
//! every measure ([`MissingQueries::Zero`], the default; trec_eval `-c`), or is left out
//! ([`MissingQueries::Skip`]: trec_eval's default, and what pytrec_eval does). Run queries with
//! no judgements are ignored (as trec_eval does) and counted.

pub mod answer;
pub mod kilt;
pub mod trec;

use crate::data::{Corpus, Qrels, Query, Run};
use rak_core::fsutil;
use anyhow::Result;
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// Cutoffs of the measures.
pub const RECALL_KS: [usize; 3] = [5, 20, 100];
pub const ANSWER_KS: [usize; 3] = [1, 5, 20];
pub const MRR_K: usize = 10;
pub const NDCG_K: usize = 10;

/// What to do with judged queries that the run lacks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MissingQueries {
    /// Score them 0 and average over all judged queries (trec_eval `-c`).
    #[default]
    Zero,
    /// Leave them out (trec_eval without `-c`; pytrec_eval).
    Skip,
}

impl std::str::FromStr for MissingQueries {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "zero" => Ok(MissingQueries::Zero),
            "skip" => Ok(MissingQueries::Skip),
            other => anyhow::bail!("missing queries {other:?}: expected zero or skip"),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct EvalOptions {
    pub missing: MissingQueries,
    /// Compute `answer_acc@k` for queries with answers (turn off for labels that are not
    /// answer strings, e.g. fact verification's `SUPPORTS`).
    pub answer_accuracy: bool,
}

impl Default for EvalOptions {
    fn default() -> Self {
        Self { missing: MissingQueries::Zero, answer_accuracy: true }
    }
}

/// The result for one run.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Evaluation {
    /// Queries averaged over (answer measures: see `answer_queries`).
    pub queries: usize,
    /// Judged queries absent from the run (scored 0, or left out, per `missing`).
    pub missing_queries: usize,
    /// Run queries without judgements (ignored).
    pub unjudged_queries: usize,
    /// Queries averaged over for `answer_acc@k`.
    pub answer_queries: usize,
    pub missing: MissingQueries,
    /// Mean of each measure over the queries that have it.
    pub mean: BTreeMap<String, f64>,
    pub per_query: BTreeMap<String, BTreeMap<String, f64>>,
}

impl Evaluation {
    /// Write as pretty JSON, atomically.
    pub fn write_json(&self, path: &Path) -> Result<()> {
        fsutil::write_bytes(path, &serde_json::to_vec_pretty(self)?)
    }
}

/// The mean of each measure over the entries that have it (per-query means, or the macro
/// average over tasks).
pub fn mean_of(per_query: &BTreeMap<String, BTreeMap<String, f64>>) -> BTreeMap<String, f64> {
    let mut sums: BTreeMap<String, (f64, usize)> = BTreeMap::new();
    for m in per_query.values() {
        for (k, v) in m {
            let e = sums.entry(k.clone()).or_default();
            e.0 += v;
            e.1 += 1;
        }
    }
    sums.into_iter().map(|(k, (s, n))| (k, s / n as f64)).collect()
}

/// Evaluate one run. `queries` may be empty (no gold pages or answers then); `corpus` is needed
/// for `rprec_page` and `answer_acc@k`.
pub fn evaluate(run: &Run, qrels: &Qrels, queries: &[Query], corpus: Option<&Corpus>, opts: &EvalOptions) -> Evaluation {
    let by_id: HashMap<&str, &Query> = queries.iter().map(|q| (q.id.as_str(), q)).collect();
    let mut ev = Evaluation { missing: opts.missing, ..Evaluation::default() };
    ev.unjudged_queries = run.iter().filter(|(q, _)| !qrels.contains_key(*q)).count();
    for (qid, rels) in qrels {
        let ranking = match run.get(qid) {
            Some(r) => r,
            None => {
                ev.missing_queries += 1;
                if opts.missing == MissingQueries::Skip {
                    continue;
                }
                &[]
            }
        };
        let query = by_id.get(qid.as_str()).copied();
        let mut m = BTreeMap::new();
        m.insert("rprec_passage".to_string(), trec::rprec(ranking, rels));
        for k in RECALL_KS {
            m.insert(format!("recall@{k}"), trec::recall_at(ranking, rels, k));
        }
        m.insert(format!("mrr@{MRR_K}"), trec::recip_rank_at(ranking, rels, MRR_K));
        m.insert(format!("ndcg@{NDCG_K}"), trec::ndcg_cut(ranking, rels, NDCG_K));
        if let Some(corpus) = corpus {
            m.insert("rprec_page".to_string(), page_rprec(ranking, rels, query, corpus));
            if let Some(q) = query.filter(|q| opts.answer_accuracy && !q.answers.is_empty()) {
                let matcher = answer::AnswerMatcher::new(&q.answers);
                let max_k = ANSWER_KS.iter().copied().max().unwrap_or(0);
                let first_hit = ranking
                    .iter()
                    .take(max_k)
                    .position(|(d, _)| corpus.get(d).is_some_and(|p| matcher.matches(&p.text)));
                for k in ANSWER_KS {
                    m.insert(format!("answer_acc@{k}"), if first_hit.is_some_and(|i| i < k) { 1.0 } else { 0.0 });
                }
                ev.answer_queries += 1;
            }
        }
        ev.per_query.insert(qid.clone(), m);
    }
    ev.queries = ev.per_query.len();
    ev.mean = mean_of(&ev.per_query);
    ev
}

fn page_rprec(ranking: &[(String, f64)], rels: &BTreeMap<String, i32>, query: Option<&Query>, corpus: &Corpus) -> f64 {
    // A passage unknown to the corpus still takes a rank: it stands for a page of its own, as
    // does an untitled one (BEIR and MS MARCO passages): under one empty title every passage
    // would be the same page, and any ranking would find it.
    let page = |d: &str| -> Option<String> {
        match corpus.title(d) {
            Some("") => Some(format!("\u{0}untitled:{d}")),
            Some(title) => Some(title.to_string()),
            None => None,
        }
    };
    let titles: Vec<String> = ranking.iter().map(|(d, _)| page(d).unwrap_or_else(|| format!("\u{0}unknown:{d}"))).collect();
    let ranked = kilt::ranked_pages(titles.iter().map(String::as_str));
    let from_query: Vec<Vec<&str>> = query
        .map(|q| q.gold_page_sets().into_iter().map(|s| s.iter().map(String::as_str).collect()).collect())
        .unwrap_or_default();
    let from_qrels: Vec<String> = rels.iter().filter(|(_, &g)| g >= 1).filter_map(|(d, _)| page(d)).collect();
    let gold_sets = if from_query.is_empty() { vec![from_qrels.iter().map(String::as_str).collect()] } else { from_query };
    kilt::rprec_page(&ranked, &gold_sets)
}

/// Several tasks evaluated alike, with the macro average (unweighted mean over the tasks that
/// have each measure).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct TaskEvaluation {
    pub tasks: BTreeMap<String, Evaluation>,
    #[serde(rename = "macro")]
    pub macro_avg: BTreeMap<String, f64>,
}

impl TaskEvaluation {
    /// Write as pretty JSON, atomically.
    pub fn write_json(&self, path: &Path) -> Result<()> {
        fsutil::write_bytes(path, &serde_json::to_vec_pretty(self)?)
    }
}

/// Evaluate `(task name, run, qrels, queries)` tuples against one corpus.
pub fn evaluate_tasks(tasks: &[(&str, &Run, &Qrels, &[Query])], corpus: Option<&Corpus>, opts: &EvalOptions) -> TaskEvaluation {
    let mut out = TaskEvaluation::default();
    for (name, run, qrels, queries) in tasks {
        out.tasks.insert(name.to_string(), evaluate(run, qrels, queries, corpus, opts));
    }
    let means: BTreeMap<String, BTreeMap<String, f64>> = out.tasks.iter().map(|(t, e)| (t.clone(), e.mean.clone())).collect();
    out.macro_avg = mean_of(&means);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::Passage;

    fn corpus(titles: &[(&str, &str)]) -> Corpus {
        Corpus::from_passages(titles.iter().map(|(id, title)| Passage { id: id.to_string(), title: title.to_string(), text: String::new() })).unwrap()
    }

    /// An untitled passage is a page of its own: on a corpus without titles, a query that
    /// retrieved only a wrong passage scores 0, not 1 (one empty title made every passage the
    /// same page). Titled passages still share their page.
    #[test]
    fn untitled_passages_are_pages_of_their_own() {
        let qrels: Qrels = [("q1".to_string(), [("d1".to_string(), 1)].into_iter().collect())].into_iter().collect();
        let mut run = Run::new();
        run.insert("q1", vec![("d2".to_string(), 1.0), ("d1".to_string(), 0.5)]);
        let rprec = |run: &Run, c: &Corpus| evaluate(run, &qrels, &[], Some(c), &EvalOptions::default()).per_query["q1"]["rprec_page"];
        assert_eq!(rprec(&run, &corpus(&[("d1", ""), ("d2", ""), ("d3", "")])), 0.0);
        assert_eq!(rprec(&run, &corpus(&[("d1", "Paris"), ("d2", "Paris"), ("d3", "Rome")])), 1.0, "the same page");
        assert_eq!(rprec(&run, &corpus(&[("d1", "Paris"), ("d2", "Rome"), ("d3", "")])), 0.0);
        run.insert("q1", vec![("d1".to_string(), 1.0), ("d2".to_string(), 0.5)]);
        assert_eq!(rprec(&run, &corpus(&[("d1", ""), ("d2", ""), ("d3", "")])), 1.0);
    }
}
