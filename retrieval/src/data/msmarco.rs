//! MS MARCO passage ranking: `collection.tsv` (`pid\ttext`), `queries.*.tsv` (`qid\ttext`), and
//! TREC-style qrels (`qid 0 pid rel`, tab- or space-separated). No header lines.

use super::beir::collect_qrels;
use super::lines::Records;
use super::{Passage, Qrels, Query};
use anyhow::Result;
use std::path::Path;

fn two_columns(line: &str, what: &str) -> Result<(String, String), String> {
    match line.split_once('\t') {
        Some((id, text)) if !id.is_empty() && !text.contains('\t') => Ok((id.to_string(), text.to_string())),
        _ => Err(format!("expected 2 tab-separated columns ({what} id, text)")),
    }
}

fn parse_passage(_: usize, line: &str) -> Result<Option<Passage>, String> {
    let (id, text) = two_columns(line, "passage")?;
    Ok(Some(Passage { id, title: String::new(), text }))
}

fn parse_query(_: usize, line: &str) -> Result<Option<Query>, String> {
    let (id, text) = two_columns(line, "query")?;
    Ok(Some(Query { id, text, ..Query::default() }))
}

/// Stream `collection.tsv` (passages have no title).
pub fn read_collection(path: &Path) -> Result<Records<Passage>> {
    Records::open(path, "passages", parse_passage)
}

/// Stream a queries tsv.
pub fn read_queries(path: &Path) -> Result<Records<Query>> {
    Records::open(path, "queries", parse_query)
}

fn parse_qrel(n: usize, line: &str) -> Result<Option<(usize, String, String, i32)>, String> {
    let cols: Vec<&str> = line.split_whitespace().collect();
    if cols.len() != 4 {
        return Err(format!("expected 4 columns (qid 0 pid rel), found {}", cols.len()));
    }
    let rel = cols[3].parse::<i32>().map_err(|_| format!("relevance {:?} is not an integer", cols[3]))?;
    Ok(Some((n, cols[0].to_string(), cols[2].to_string(), rel)))
}

/// Read TREC-style qrels (`qid iteration pid rel`; MS MARCO's `qrels.*.tsv`, trec_eval's qrels).
pub fn read_qrels(path: &Path) -> Result<Qrels> {
    let mut records = Records::open(path, "judgements", parse_qrel)?;
    collect_qrels(&mut records, |r| r)
}
