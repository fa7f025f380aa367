//! The files a run reads (BEIR queries, qrels and corpus), the retrieval stage's records that
//! every later stage reads ([`Retrieved`]), content digests that key the stages, and the
//! append-only JSONL record files that make long stages resumable. It depends on no other
//! module of the plugin: the stages depend on it.

use anyhow::{bail, Context, Result};
use serde::Deserialize;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};

/// One query with what the starting retriever found for it.
#[derive(Debug, Clone)]
pub struct Retrieved {
    pub id: String,
    pub query: String,
    pub answers: Vec<String>,
    /// Relevant passages that are in the corpus (at least one).
    pub gold: Vec<String>,
    /// The retriever's ranking, best first (at most `depth`; fewer in a small corpus).
    pub hits: Vec<String>,
}

impl Retrieved {
    /// The top N of the ranking (fewer when the corpus is small): what the source scores.
    pub fn top_n(&self, n: usize) -> &[String] {
        &self.hits[..n.min(self.hits.len())]
    }

    pub fn to_json(&self) -> Value {
        json!({"query_id": self.id, "query": self.query, "answers": self.answers, "gold": self.gold, "hits": self.hits})
    }

    pub fn from_json(v: &Value) -> Result<Retrieved> {
        let strings = |key: &str| -> Result<Vec<String>> { serde_json::from_value(v[key].clone()).with_context(|| format!("a retrieval record without {key:?}")) };
        Ok(Retrieved {
            id: v["query_id"].as_str().context("a retrieval record without query_id")?.to_string(),
            query: v["query"].as_str().context("a retrieval record without query")?.to_string(),
            answers: strings("answers")?,
            gold: strings("gold")?,
            hits: strings("hits")?,
        })
    }
}

/// One source-task query.
#[derive(Debug, Clone)]
pub struct Query {
    pub id: String,
    pub text: String,
    pub answers: Vec<String>,
}

#[derive(Deserialize)]
struct QueryLine {
    #[serde(rename = "_id")]
    id: String,
    text: String,
    #[serde(default)]
    answers: Vec<Value>,
}

/// The queries of a BEIR `queries.jsonl` (answers kept when present; non-string answers, as
/// labels written as numbers, are kept as their text).
pub fn read_queries(path: &Path) -> Result<Vec<Query>> {
    let file = std::fs::File::open(path).with_context(|| format!("{}: cannot read", path.display()))?;
    let mut out = Vec::new();
    for (n, line) in BufReader::new(file).lines().enumerate() {
        let line = line.with_context(|| format!("{}:{}: cannot read", path.display(), n + 1))?;
        if line.trim().is_empty() {
            continue;
        }
        let q: QueryLine = serde_json::from_str(&line).with_context(|| format!("{}:{}: not a query (\"_id\", \"text\")", path.display(), n + 1))?;
        let answers = q
            .answers
            .into_iter()
            .filter_map(|a| match a {
                Value::String(s) => Some(s),
                Value::Null => None,
                other => Some(other.to_string()),
            })
            .filter(|a| !a.trim().is_empty())
            .collect();
        out.push(Query { id: q.id, text: q.text, answers });
    }
    Ok(out)
}

/// Relevant passages (grade >= 1) per query, in file order, from a BEIR qrels TSV, read as
/// `rak-retrieval`'s reader reads it (which a plugin must not link): three tab-separated
/// columns, integer grades, a header only as the first line, and a (query, passage) pair
/// judged twice refused, naming its line, rather than deduplicated.
pub fn read_qrels(path: &Path) -> Result<HashMap<String, Vec<String>>> {
    let file = std::fs::File::open(path).with_context(|| format!("{}: cannot read", path.display()))?;
    let mut out: HashMap<String, Vec<String>> = HashMap::new();
    let mut judged: HashSet<(String, String)> = HashSet::new();
    for (i, line) in BufReader::new(file).lines().enumerate() {
        let n = i + 1;
        let line = line.with_context(|| format!("{}:{n}: cannot read", path.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        let cols: Vec<&str> = line.split('\t').collect();
        if cols.len() != 3 {
            bail!("{}:{n}: expected 3 tab-separated columns (query-id, corpus-id, score), found {}", path.display(), cols.len());
        }
        let grade = cols[2].trim();
        let grade: i32 = match grade.parse() {
            Ok(g) => g,
            // The header (`query-id corpus-id score`) is the one non-numeric line allowed.
            Err(_) if n == 1 => continue,
            Err(_) => bail!("{}:{n}: score {grade:?} is not an integer", path.display()),
        };
        let (q, d) = (cols[0].trim(), cols[1].trim());
        if !judged.insert((q.to_string(), d.to_string())) {
            bail!("{}:{n}: judgement for query {q:?}, passage {d:?} given twice", path.display());
        }
        if grade >= 1 {
            out.entry(q.to_string()).or_default().push(d.to_string());
        }
    }
    Ok(out)
}

#[derive(Deserialize)]
struct PassageId {
    #[serde(rename = "_id")]
    id: String,
}

#[derive(Deserialize)]
struct PassageLine {
    #[serde(rename = "_id")]
    id: String,
    #[serde(default)]
    title: String,
    #[serde(default)]
    text: String,
}

/// A passage's title and text.
#[derive(Debug, Clone)]
pub struct Passage {
    pub title: String,
    pub text: String,
}

fn corpus_lines(path: &Path, mut each: impl FnMut(usize, &str) -> Result<()>) -> Result<()> {
    let file = std::fs::File::open(path).with_context(|| format!("{}: cannot read", path.display()))?;
    for (n, line) in BufReader::new(file).lines().enumerate() {
        let line = line.with_context(|| format!("{}:{}: cannot read", path.display(), n + 1))?;
        if !line.trim().is_empty() {
            each(n + 1, &line)?;
        }
    }
    Ok(())
}

/// Every passage id of a corpus.
pub fn corpus_ids(path: &Path) -> Result<HashSet<String>> {
    let mut ids = HashSet::new();
    corpus_lines(path, |n, line| {
        let p: PassageId = serde_json::from_str(line).with_context(|| format!("{}:{n}: not a passage (\"_id\")", path.display()))?;
        ids.insert(p.id);
        Ok(())
    })?;
    Ok(ids)
}

/// The passages of a corpus that `wanted` names (streamed: the corpus is never held whole).
pub fn corpus_passages(path: &Path, wanted: &HashSet<&str>) -> Result<HashMap<String, Passage>> {
    let mut out = HashMap::with_capacity(wanted.len());
    corpus_lines(path, |n, line| {
        let p: PassageLine = serde_json::from_str(line).with_context(|| format!("{}:{n}: not a passage (\"_id\", \"title\", \"text\")", path.display()))?;
        if wanted.contains(p.id.as_str()) {
            out.insert(p.id, Passage { title: p.title, text: p.text });
        }
        Ok(())
    })?;
    if let Some(missing) = wanted.iter().find(|id| !out.contains_key(**id)) {
        bail!("{}: passage {missing:?} is not in the corpus (was it rewritten since the retrieval stage?)", path.display());
    }
    Ok(out)
}

/// SHA-256 of a file's contents.
pub fn file_sha256(path: &Path) -> Result<String> {
    let mut file = std::fs::File::open(path).with_context(|| format!("{}: cannot read", path.display()))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).with_context(|| format!("{}: cannot read", path.display()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(format!("{:x}", hasher.finalize()))
}

/// SHA-256 over what the score stage scores: each query's id, text, answers and top `n`.
pub fn top_n_sha256(queries: &[Retrieved], n: usize) -> String {
    let mut hasher = Sha256::new();
    for q in queries {
        let line = serde_json::json!([q.id, q.query, q.answers, q.top_n(n)]).to_string();
        hasher.update(line.as_bytes());
        hasher.update([b'\n']);
    }
    format!("{:x}", hasher.finalize())
}

/// An append-only JSONL file of per-query records: what a stage has done so far. A kill can
/// leave a partial last line; opening cuts it off, so every record read back is whole.
pub struct RecordLog {
    path: PathBuf,
    file: std::fs::File,
}

impl RecordLog {
    /// Open (creating) `path`; returns the log and the records already in it, in order.
    pub fn open(path: &Path) -> Result<(RecordLog, Vec<Value>)> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).with_context(|| format!("{}: cannot create", dir.display()))?;
        }
        let bytes = match std::fs::read(path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(e).with_context(|| format!("{}: cannot read", path.display())),
        };
        let (records, whole) = Self::whole_records(path, &bytes)?;
        let file = std::fs::OpenOptions::new().create(true).append(true).open(path).with_context(|| format!("{}: cannot open", path.display()))?;
        if whole < bytes.len() {
            file.set_len(whole as u64).with_context(|| format!("{}: cannot cut the partial last record", path.display()))?;
        }
        Ok((RecordLog { path: path.to_path_buf(), file }, records))
    }

    /// The whole records of `path`, read without writing to it (a run may still be appending:
    /// a last line it is writing is left out).
    pub fn read(path: &Path) -> Result<Vec<Value>> {
        let bytes = std::fs::read(path).with_context(|| format!("{}: cannot read", path.display()))?;
        Ok(Self::whole_records(path, &bytes)?.0)
    }

    /// The records of the whole lines of `bytes` (read from `path`), and how many bytes they take.
    fn whole_records(path: &Path, bytes: &[u8]) -> Result<(Vec<Value>, usize)> {
        let mut records = Vec::new();
        let mut whole = 0;
        for line in bytes.split_inclusive(|&b| b == b'\n') {
            if !line.ends_with(b"\n") {
                break;
            }
            match serde_json::from_slice::<Value>(line) {
                Ok(v) => records.push(v),
                // A line cut by a crash and completed by a later append cannot happen (the
                // partial tail is removed first); a torn line in the middle means the file was
                // edited or damaged.
                Err(e) => bail!("{}: a damaged record at byte {whole}: {e}; remove the file to redo this stage", path.display()),
            }
            whole += line.len();
        }
        Ok((records, whole))
    }

    /// Append records in one write, flushed to the disk before returning.
    pub fn append(&mut self, records: &[Value]) -> Result<()> {
        if records.is_empty() {
            return Ok(());
        }
        let mut buf = Vec::new();
        for r in records {
            serde_json::to_writer(&mut buf, r)?;
            buf.push(b'\n');
        }
        self.file.write_all(&buf).with_context(|| format!("{}: cannot append", self.path.display()))?;
        self.file.sync_data().with_context(|| format!("{}: cannot sync to disk", self.path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_partial_last_record_is_cut_and_appends_follow_whole_ones() {
        let dir = std::env::temp_dir().join(format!("aar-records-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let path = dir.join("r.jsonl");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(&path, "{\"a\":1}\n{\"a\":2}\n{\"a\":").unwrap();
        let (mut log, records) = RecordLog::open(&path).unwrap();
        assert_eq!(records, vec![serde_json::json!({"a": 1}), serde_json::json!({"a": 2})]);
        log.append(&[serde_json::json!({"a": 3})]).unwrap();
        drop(log);
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "{\"a\":1}\n{\"a\":2}\n{\"a\":3}\n");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Qrels as `rak-retrieval` reads them: a pair judged twice is refused with its line.
    #[test]
    fn qrels_refuse_a_pair_judged_twice() {
        let dir = std::env::temp_dir().join(format!("aar-qrels-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("qrels.tsv");
        std::fs::write(&path, "query-id\tcorpus-id\tscore\nq1\tp1\t1\nq1\tp2\t0\nq2\tp3\t2\n").unwrap();
        let q = read_qrels(&path).unwrap();
        assert_eq!((q["q1"].clone(), q["q2"].clone(), q.len()), (vec!["p1".to_string()], vec!["p3".to_string()], 2));
        std::fs::write(&path, "q1\tp1\t1\nq2\tp3\t1\nq1\tp1\t1\n").unwrap();
        let e = read_qrels(&path).unwrap_err().to_string();
        assert!(e.contains("qrels.tsv:3") && e.contains("given twice"), "{e}");
        std::fs::write(&path, "q1\tp1\t1\nq2\tp3\tx\n").unwrap();
        let e = read_qrels(&path).unwrap_err().to_string();
        assert!(e.contains("qrels.tsv:2") && e.contains("not an integer"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
