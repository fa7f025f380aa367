//! TREC runs: `qid Q0 docid rank score tag`, one line per retrieved passage, whitespace-separated.

use super::lines::Records;
use super::Run;
use rak_core::fsutil;
use anyhow::{anyhow, bail, Result};
use std::collections::{BTreeMap, HashSet};
use std::fmt::Write as _;
use std::path::Path;

/// One line of a run file.
#[derive(Debug, Clone, PartialEq)]
pub struct RunLine {
    pub line: usize,
    pub qid: String,
    pub docid: String,
    pub rank: i64,
    pub score: f64,
    pub tag: String,
}

fn parse_line(n: usize, line: &str) -> Result<Option<RunLine>, String> {
    let cols: Vec<&str> = line.split_whitespace().collect();
    if cols.len() != 6 {
        return Err(format!("expected 6 columns (qid Q0 docid rank score tag), found {}", cols.len()));
    }
    let rank = cols[3].parse::<i64>().map_err(|_| format!("rank {:?} is not an integer", cols[3]))?;
    let score = match cols[4].parse::<f64>() {
        Ok(s) if s.is_finite() => s,
        _ => return Err(format!("score {:?} is not a finite number", cols[4])),
    };
    Ok(Some(RunLine { line: n, qid: cols[0].into(), docid: cols[2].into(), rank, score, tag: cols[5].into() }))
}

/// Stream the lines of a run file.
pub fn read_lines(path: &Path) -> Result<Records<RunLine>> {
    Records::open(path, "run lines", parse_line)
}

/// Read a run file. Rankings are re-sorted into trec_eval's order (score, then passage id
/// descending; the rank column is checked to be an integer and otherwise ignored, as trec_eval
/// does). A passage listed twice for one query is an error naming the line, as in trec_eval.
pub fn read_run(path: &Path) -> Result<Run> {
    type Ranked = (Vec<(String, f64)>, HashSet<String>);
    let mut by_query: BTreeMap<String, Ranked> = BTreeMap::new();
    for line in read_lines(path)? {
        let l = line?;
        let (docs, seen) = by_query.entry(l.qid.clone()).or_default();
        if !seen.insert(l.docid.clone()) {
            bail!("{}:{}: passage {:?} is listed twice for query {:?}", path.display(), l.line, l.docid, l.qid);
        }
        docs.push((l.docid, l.score));
    }
    let mut run = Run::new();
    for (q, (docs, _)) in by_query {
        run.insert(q, docs);
    }
    Ok(run)
}

/// Write a run atomically, ranks 1.. in the run's order, at most `k` lines per query (all when
/// `None`). `tag` must be one word.
pub fn write_run(path: &Path, run: &Run, tag: &str, k: Option<usize>) -> Result<()> {
    if tag.is_empty() || tag.chars().any(char::is_whitespace) {
        return Err(anyhow!("{}: run tag {tag:?} must be one non-empty word", path.display()));
    }
    let mut out = String::new();
    for (qid, docs) in run.iter() {
        for (i, (docid, score)) in docs.iter().take(k.unwrap_or(usize::MAX)).enumerate() {
            if qid.chars().any(char::is_whitespace) || docid.chars().any(char::is_whitespace) {
                bail!("{}: id {qid:?} / {docid:?} contains whitespace, which a TREC run cannot hold", path.display());
            }
            writeln!(out, "{qid} Q0 {docid} {} {score} {tag}", i + 1).unwrap();
        }
    }
    fsutil::write_bytes(path, out.as_bytes())
}
