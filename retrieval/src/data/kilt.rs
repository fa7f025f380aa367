//! KILT: query files (`{"id", "input", "output": [{"answer", "provenance": [{"wikipedia_id",
//! "title", ...}]}]}`) and prediction files for KILT's `eval_retrieval.py`.

use super::lines::Records;
use super::{id_string, push_unique, Corpus, Query, Run};
use rak_core::fsutil;
use anyhow::{Context, Result};
use serde::Deserialize;
use serde_json::json;
use std::collections::HashMap;
use std::io::Write;
use std::path::Path;

#[derive(Deserialize)]
struct KiltLine {
    #[serde(deserialize_with = "id_string")]
    id: String,
    input: String,
    #[serde(default)]
    output: Vec<KiltOutput>,
}

#[derive(Deserialize)]
struct KiltOutput {
    #[serde(default)]
    answer: Option<String>,
    #[serde(default)]
    provenance: Option<Vec<KiltProvenance>>,
}

#[derive(Deserialize)]
struct KiltProvenance {
    #[serde(default)]
    title: Option<String>,
}

fn parse_query(_: usize, line: &str) -> Result<Option<Query>, String> {
    let k: KiltLine = serde_json::from_str(line).map_err(|e| {
        format!("expected a KILT JSON object with \"id\", \"input\" and optional \"output\": [{{\"answer\", \"provenance\": [{{\"title\", ...}}]}}]: {e}")
    })?;
    let mut q = Query { id: k.id, text: k.input, ..Query::default() };
    for out in k.output {
        if let Some(a) = out.answer {
            push_unique(&mut q.answers, &a);
        }
        let mut set = Vec::new();
        for p in out.provenance.unwrap_or_default() {
            if let Some(t) = p.title {
                push_unique(&mut set, t.trim());
                push_unique(&mut q.pages, t.trim());
            }
        }
        if !set.is_empty() && !q.page_sets.contains(&set) {
            q.page_sets.push(set);
        }
    }
    // One gold set is just `pages`; keep `page_sets` for the case it exists for.
    if q.page_sets.len() == 1 {
        q.page_sets.clear();
    }
    Ok(Some(q))
}

/// Stream the queries of a KILT jsonl file. `answers` are the outputs' answers, `pages` the
/// provenance titles of all outputs, `page_sets` one set per output with provenance (when
/// there is more than one distinct set).
pub fn read_queries(path: &Path) -> Result<Records<Query>> {
    Records::open(path, "queries", parse_query)
}

/// Write a KILT prediction file: one line per id of `query_ids`, in that order (KILT wants the
/// gold file's order), each `{"id", "output": [{"provenance": [...]}]}` with the run's passages
/// mapped to their pages, de-duplicated in rank order, at most `k` pages.
///
/// Each provenance item has `"title"` and `"wikipedia_title"` (the page title) and, when
/// `page_ids` maps the title, `"wikipedia_id"`. KILT's evaluation matches provenance on its
/// `--rank_keys`: `wikipedia_id` (its default, needs `page_ids`) or `title` (mini-KILT has no
/// page ids). A query absent from the run gets an empty provenance list; a passage missing
/// from the corpus is an error.
pub fn write_predictions<'a>(
    path: &Path,
    run: &Run,
    corpus: &Corpus,
    page_ids: Option<&HashMap<String, String>>,
    query_ids: impl IntoIterator<Item = &'a str>,
    k: usize,
) -> Result<()> {
    let mut out = Vec::new();
    for qid in query_ids {
        let mut provenance = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for (docid, _) in run.get(qid).unwrap_or(&[]) {
            if provenance.len() == k {
                break;
            }
            let title = corpus
                .title(docid)
                .with_context(|| format!("{}: run passage {docid:?} (query {qid:?}) is not in the corpus", path.display()))?;
            if !seen.insert(title) {
                continue;
            }
            let mut item = json!({"wikipedia_title": title, "title": title});
            if let Some(id) = page_ids.and_then(|m| m.get(title)) {
                item["wikipedia_id"] = json!(id);
            }
            provenance.push(item);
        }
        serde_json::to_writer(&mut out, &json!({"id": qid, "output": [{"provenance": provenance}]}))?;
        out.write_all(b"\n")?;
    }
    fsutil::write_bytes(path, &out)
}
