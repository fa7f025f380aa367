//! Retrieval data sets and runs: passages, queries, relevance judgements (qrels) and ranked
//! runs, read from and written to the formats the field uses.
//!
//! - [`beir`]: the native layout (`corpus.jsonl`, `queries.jsonl`, `qrels/*.tsv`); also reads
//!   mini-KILT's queries, which add `answers` and `pages`.
//! - [`kilt`]: KILT jsonl queries, and KILT prediction files for KILT's own evaluation.
//! - [`dpr`]: DPR retriever json (questions with positive contexts) and DPR passage tsv.
//! - [`msmarco`]: MS MARCO collection, queries and qrels tsv.
//! - [`trec`]: 6-column TREC runs.
//! - [`minikilt`]: finds the tasks and split files of a mini-KILT directory.
//!
//! Readers stream: records come one line at a time as `Result`s, and every parse error names
//! the file and the 1-based line (`corpus.jsonl:17: ...`). A corpus, query or qrels file with no
//! records is an error naming the file. Every writer is atomic ([`rak_core::fsutil`]).

pub mod beir;
pub mod dpr;
pub mod kilt;
mod lines;
pub mod minikilt;
pub mod msmarco;
pub mod probes;
pub mod trec;

pub use lines::Records;

use serde::{Deserialize, Serialize};
use std::cmp::Ordering;
use std::collections::{BTreeMap, HashMap};

/// One retrieval unit. `title` is the Wikipedia page title where there is one (KILT, DPR,
/// mini-KILT: passages with the same title are one page), else empty.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Passage {
    pub id: String,
    pub title: String,
    pub text: String,
}

/// One query. `answers` are gold answer strings (empty when the source has none); `pages` are
/// gold page titles, all of them, de-duplicated in order.
///
/// `page_sets` holds the gold provenance sets where a source has several alternative ones (KILT:
/// one per output that carries provenance); page-level R-precision takes the best set. Empty
/// means `pages` is the query's one gold set (mini-KILT, BEIR, DPR).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Query {
    pub id: String,
    pub text: String,
    pub answers: Vec<String>,
    pub pages: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub page_sets: Vec<Vec<String>>,
}

impl Query {
    /// The query's gold page sets: `page_sets`, or `pages` as the one set, or none.
    pub fn gold_page_sets(&self) -> Vec<&[String]> {
        if !self.page_sets.is_empty() {
            self.page_sets.iter().map(|s| s.as_slice()).collect()
        } else if !self.pages.is_empty() {
            vec![self.pages.as_slice()]
        } else {
            Vec::new()
        }
    }
}

/// Relevance judgements: query id -> passage id -> grade. As in trec_eval, a grade >= 1 is
/// relevant; 0 and negative grades are judged non-relevant.
pub type Qrels = BTreeMap<String, BTreeMap<String, i32>>;

/// A passage collection held in memory, by id.
#[derive(Debug, Clone, Default)]
pub struct Corpus {
    passages: HashMap<String, Passage>,
}

impl Corpus {
    /// Build from passages; a repeated id is an error.
    pub fn from_passages(passages: impl IntoIterator<Item = Passage>) -> anyhow::Result<Self> {
        let mut map = HashMap::new();
        for p in passages {
            if map.contains_key(&p.id) {
                anyhow::bail!("passage id {:?} occurs twice", p.id);
            }
            map.insert(p.id.clone(), p);
        }
        Ok(Self { passages: map })
    }
    pub(crate) fn from_map(passages: HashMap<String, Passage>) -> Self {
        Self { passages }
    }
    pub fn get(&self, id: &str) -> Option<&Passage> {
        self.passages.get(id)
    }
    pub fn contains(&self, id: &str) -> bool {
        self.passages.contains_key(id)
    }
    /// The page title of a passage (`None` for an unknown id).
    pub fn title(&self, id: &str) -> Option<&str> {
        self.passages.get(id).map(|p| p.title.as_str())
    }
    pub fn len(&self) -> usize {
        self.passages.len()
    }
    pub fn is_empty(&self) -> bool {
        self.passages.is_empty()
    }
    pub fn iter(&self) -> impl Iterator<Item = &Passage> {
        self.passages.values()
    }
}

/// trec_eval's ranking order: score descending, compared as `f32` (trec_eval keeps scores in a
/// C `float`, so scores equal in single precision tie), ties broken by passage id in
/// *descending* byte order (`comp_sim_docno`: `strcmp(ptr2->docno, ptr1->docno)`). The rank
/// column of a TREC file is ignored, as trec_eval ignores it.
pub fn trec_order(a: &(String, f64), b: &(String, f64)) -> Ordering {
    (b.1 as f32).total_cmp(&(a.1 as f32)).then_with(|| b.0.cmp(&a.0))
}

/// A ranked run: query id -> passages with scores, always kept in [`trec_order`], so that the
/// metrics here and trec_eval / pytrec_eval see the same list.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Run {
    queries: BTreeMap<String, Vec<(String, f64)>>,
}

impl Run {
    pub fn new() -> Self {
        Self::default()
    }

    /// Set the ranking of one query (replacing any earlier one). The list is sorted into
    /// [`trec_order`]; a passage listed twice keeps its best-ranked entry.
    pub fn insert(&mut self, qid: impl Into<String>, mut docs: Vec<(String, f64)>) {
        docs.sort_by(trec_order);
        let mut seen = std::collections::HashSet::new();
        docs.retain(|(d, _)| seen.insert(d.clone()));
        self.queries.insert(qid.into(), docs);
    }

    /// The ranking of a query, best first.
    pub fn get(&self, qid: &str) -> Option<&[(String, f64)]> {
        self.queries.get(qid).map(|v| v.as_slice())
    }
    pub fn contains(&self, qid: &str) -> bool {
        self.queries.contains_key(qid)
    }
    /// Queries in id order with their rankings.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &[(String, f64)])> {
        self.queries.iter().map(|(q, d)| (q.as_str(), d.as_slice()))
    }
    pub fn len(&self) -> usize {
        self.queries.len()
    }
    pub fn is_empty(&self) -> bool {
        self.queries.is_empty()
    }
    /// The same run with every ranking cut to its first `k` passages.
    pub fn truncated(&self, k: usize) -> Run {
        let queries = self.queries.iter().map(|(q, d)| (q.clone(), d.iter().take(k).cloned().collect())).collect();
        Run { queries }
    }
}

/// Qrels entries naming ids that the corpus or the query file lacks (counted, not an error:
/// trec_eval simply never retrieves such passages, but many of them point at a wrong corpus).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct UnknownIds {
    /// Distinct judged query ids absent from the queries.
    pub queries: usize,
    /// Distinct judged passage ids absent from the corpus.
    pub passages: usize,
    /// Judgements (query, passage) where either id is unknown.
    pub judgements: usize,
}

impl UnknownIds {
    pub fn is_empty(&self) -> bool {
        self.judgements == 0
    }
}

/// Count qrels entries whose query or passage id is unknown, and warn on stderr (one line,
/// naming `label`, e.g. the qrels file) when there are any.
pub fn check_qrels_ids(
    label: &str,
    qrels: &Qrels,
    is_query: impl Fn(&str) -> bool,
    is_passage: impl Fn(&str) -> bool,
) -> UnknownIds {
    let mut out = UnknownIds::default();
    let mut bad_passages = std::collections::HashSet::new();
    for (q, docs) in qrels {
        let q_ok = is_query(q);
        if !q_ok {
            out.queries += 1;
        }
        for d in docs.keys() {
            let d_ok = is_passage(d);
            if !d_ok {
                bad_passages.insert(d.as_str());
            }
            if !(q_ok && d_ok) {
                out.judgements += 1;
            }
        }
    }
    out.passages = bad_passages.len();
    if !out.is_empty() {
        eprintln!(
            "warning: {label}: {} judgement(s) name unknown ids ({} unknown query id(s), {} unknown passage id(s))",
            out.judgements, out.queries, out.passages
        );
    }
    out
}

/// Deserialize an id given as a JSON string or number (BEIR and KILT files use both).
pub(crate) fn id_string<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    match serde_json::Value::deserialize(d)? {
        serde_json::Value::String(s) => Ok(s),
        serde_json::Value::Number(n) => Ok(n.to_string()),
        other => Err(serde::de::Error::custom(format!("expected a string or number id, found {other}"))),
    }
}

/// Push `s` unless already present (keeps first-seen order).
pub(crate) fn push_unique(v: &mut Vec<String>, s: &str) {
    if !v.iter().any(|x| x == s) {
        v.push(s.to_string());
    }
}
