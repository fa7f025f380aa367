//! BEIR: `corpus.jsonl` (`{"_id", "title", "text"}`), `queries.jsonl` (`{"_id", "text"}`, plus
//! mini-KILT's optional `"answers"` and `"pages"`), and `qrels/*.tsv`
//! (`query-id\tcorpus-id\tscore`, the header line optional).

use super::lines::Records;
use super::{id_string, Corpus, Passage, Qrels, Query};
use anyhow::{anyhow, Result};
use serde::Deserialize;
use std::collections::HashMap;
use std::path::Path;

#[derive(Deserialize)]
struct CorpusLine {
    #[serde(rename = "_id", deserialize_with = "id_string")]
    id: String,
    #[serde(default)]
    title: String,
    text: String,
}

#[derive(Deserialize)]
struct QueryLine {
    #[serde(rename = "_id", deserialize_with = "id_string")]
    id: String,
    text: String,
    #[serde(default)]
    answers: Vec<String>,
    #[serde(default)]
    pages: Vec<String>,
}

fn parse_passage(_: usize, line: &str) -> Result<Option<Passage>, String> {
    let p: CorpusLine = serde_json::from_str(line).map_err(|e| {
        format!("expected a JSON object with \"_id\" and \"text\" (and optional \"title\") strings: {e}")
    })?;
    Ok(Some(Passage { id: p.id, title: p.title, text: p.text }))
}

fn parse_query(_: usize, line: &str) -> Result<Option<Query>, String> {
    let q: QueryLine = serde_json::from_str(line).map_err(|e| {
        format!("expected a JSON object with \"_id\" and \"text\" strings (optional \"answers\", \"pages\": lists of strings): {e}")
    })?;
    Ok(Some(Query { id: q.id, text: q.text, answers: q.answers, pages: q.pages, page_sets: Vec::new() }))
}

/// Stream the passages of a BEIR `corpus.jsonl`.
pub fn read_corpus(path: &Path) -> Result<Records<Passage>> {
    Records::open(path, "passages", parse_passage)
}

/// Stream the queries of a BEIR (or mini-KILT) `queries.jsonl`.
pub fn read_queries(path: &Path) -> Result<Records<Query>> {
    Records::open(path, "queries", parse_query)
}

/// Read a whole corpus; the first bad line, or a repeated id, is an error naming its line.
pub fn load_corpus(path: &Path) -> Result<Corpus> {
    let mut map = HashMap::new();
    for p in read_corpus(path)?.numbered() {
        let (line, p) = p?;
        if map.contains_key(&p.id) {
            return Err(anyhow!("{}:{line}: passage id {:?} occurs twice; give each passage its own id", path.display(), p.id));
        }
        map.insert(p.id.clone(), p);
    }
    Ok(Corpus::from_map(map))
}

/// Read all queries in file order; the first bad line is an error.
pub fn load_queries(path: &Path) -> Result<Vec<Query>> {
    read_queries(path)?.collect()
}

struct QrelLine {
    line: usize,
    qid: String,
    docid: String,
    grade: i32,
}

fn parse_qrel(n: usize, line: &str) -> Result<Option<QrelLine>, String> {
    let cols: Vec<&str> = line.split('\t').collect();
    if cols.len() != 3 {
        return Err(format!("expected 3 tab-separated columns (query-id, corpus-id, score), found {}", cols.len()));
    }
    let grade = cols[2].trim();
    match grade.parse::<i32>() {
        Ok(g) => Ok(Some(QrelLine { line: n, qid: cols[0].trim().into(), docid: cols[1].trim().into(), grade: g })),
        // The header (`query-id corpus-id score`) is the one non-numeric line allowed; a first
        // line with a number that is not an integer (`1.0`) is a judgement, and wrong.
        Err(_) if n == 1 && grade.parse::<f64>().is_err() => Ok(None),
        Err(_) => Err(format!("score {grade:?} is not an integer")),
    }
}

/// Read a BEIR qrels tsv. A repeated (query, passage) pair is an error naming its line.
pub fn read_qrels(path: &Path) -> Result<Qrels> {
    let mut records = Records::open(path, "judgements", parse_qrel)?;
    collect_qrels(&mut records, |r| (r.line, r.qid, r.docid, r.grade))
}

pub(crate) fn collect_qrels<T>(
    records: &mut Records<T>,
    fields: impl Fn(T) -> (usize, String, String, i32),
) -> Result<Qrels> {
    let mut qrels = Qrels::new();
    let path = records.path().to_path_buf();
    for r in records {
        let (line, q, d, g) = fields(r?);
        if qrels.entry(q.clone()).or_default().insert(d.clone(), g).is_some() {
            return Err(anyhow!("{}:{}: judgement for query {q:?}, passage {d:?} given twice", path.display(), line));
        }
    }
    Ok(qrels)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only a first line whose score is not a number is a header: `q1 d1 1.0` is a judgement
    /// with a score that is not an integer, an error naming the line (it was once taken for the
    /// header, and q1 dropped out of the evaluation).
    #[test]
    fn a_first_line_is_a_header_only_without_a_number() {
        let dir = std::env::temp_dir().join(format!("rak-beir-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("qrels.tsv");
        std::fs::write(&p, "query-id\tcorpus-id\tscore\nq1\td1\t1\n").unwrap();
        assert_eq!(read_qrels(&p).unwrap()["q1"]["d1"], 1);
        std::fs::write(&p, "q1\td1\t1.0\nq2\td2\t1\n").unwrap();
        let e = read_qrels(&p).unwrap_err().to_string();
        assert!(e.contains("qrels.tsv:1:") && e.contains("not an integer"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
