//! DPR: the retriever train/dev json (a list of `{"question", "answers", "positive_ctxs":
//! [{"title", "text", "passage_id" | "psg_id"}], "negative_ctxs", "hard_negative_ctxs"}`) and
//! the passage tsv (`id\ttext\ttitle`, header line, CSV-style quoting as in `psgs_w100.tsv`).

use super::lines::Records;
use super::{push_unique, Passage, Qrels, Query};
use anyhow::{anyhow, Result};
use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::Deserialize;
use std::path::Path;

/// One context of a DPR question.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct DprContext {
    #[serde(default)]
    pub title: String,
    #[serde(default)]
    pub text: String,
    /// `passage_id` (NQ, TriviaQA files) or `psg_id` (some others); absent in a few files.
    #[serde(default, alias = "psg_id", deserialize_with = "opt_id")]
    pub passage_id: Option<String>,
}

/// One DPR question with its contexts.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct DprQuestion {
    pub question: String,
    #[serde(default)]
    pub answers: Vec<String>,
    #[serde(default)]
    pub positive_ctxs: Vec<DprContext>,
    #[serde(default)]
    pub negative_ctxs: Vec<DprContext>,
    #[serde(default)]
    pub hard_negative_ctxs: Vec<DprContext>,
}

fn opt_id<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    Ok(match serde_json::Value::deserialize(d)? {
        serde_json::Value::String(s) => Some(s),
        serde_json::Value::Number(n) => Some(n.to_string()),
        serde_json::Value::Null => None,
        other => return Err(de::Error::custom(format!("expected a string or number passage id, found {other}"))),
    })
}

struct Each<'f, F> {
    f: &'f mut F,
    failed: Option<anyhow::Error>,
    count: usize,
}

impl<'de, F: FnMut(usize, DprQuestion) -> Result<()>> Visitor<'de> for &mut Each<'_, F> {
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON list of DPR questions")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while let Some(q) = seq.next_element::<DprQuestion>()? {
            if let Err(e) = (self.f)(self.count, q) {
                self.failed = Some(e);
                return Err(de::Error::custom("stopped by the caller"));
            }
            self.count += 1;
        }
        Ok(())
    }
}

/// Stream the questions of a DPR json file, one at a time, without holding the list: `f` gets
/// the 0-based position and the question. Parse errors name the file and line.
pub fn for_each_question(path: &Path, mut f: impl FnMut(usize, DprQuestion) -> Result<()>) -> Result<usize> {
    let file = std::fs::File::open(path).map_err(|e| anyhow!("{}: cannot open: {e}", path.display()))?;
    let mut de = serde_json::Deserializer::from_reader(std::io::BufReader::with_capacity(1 << 20, file));
    let mut each = Each { f: &mut f, failed: None, count: 0 };
    let res = de.deserialize_seq(&mut each).and_then(|()| de.end());
    if let Some(e) = each.failed {
        return Err(e);
    }
    if let Err(e) = res {
        return Err(anyhow!(
            "{}:{}: expected a JSON list of {{\"question\", \"answers\", \"positive_ctxs\", ...}} objects: {e}",
            path.display(),
            e.line()
        ));
    }
    if each.count == 0 {
        return Err(anyhow!("{}: empty: no questions in the file", path.display()));
    }
    Ok(each.count)
}

/// Queries and qrels from a DPR json file.
#[derive(Debug, Clone, Default)]
pub struct DprData {
    /// Query ids are the 0-based positions in the file (DPR questions carry no id);
    /// `pages` are the titles of the positive contexts.
    pub queries: Vec<Query>,
    /// Positive contexts with a passage id, grade 1.
    pub qrels: Qrels,
    /// Positive contexts without a passage id (they cannot be judged by id).
    pub positives_without_id: usize,
}

/// Read a DPR json file as queries and qrels.
pub fn load(path: &Path) -> Result<DprData> {
    let mut data = DprData::default();
    for_each_question(path, |i, q| {
        let id = i.to_string();
        let mut query = Query { id: id.clone(), text: q.question, answers: q.answers, ..Query::default() };
        for ctx in &q.positive_ctxs {
            if !ctx.title.is_empty() {
                push_unique(&mut query.pages, &ctx.title);
            }
            match &ctx.passage_id {
                Some(pid) => {
                    data.qrels.entry(id.clone()).or_default().insert(pid.clone(), 1);
                }
                None => data.positives_without_id += 1,
            }
        }
        data.queries.push(query);
        Ok(())
    })?;
    Ok(data)
}

/// One tsv field with CSV quoting undone (`"a ""b"""` -> `a "b"`), as Python's csv reader does.
fn unquote(field: &str) -> String {
    match field.strip_prefix('"').and_then(|f| f.strip_suffix('"')) {
        Some(inner) => inner.replace("\"\"", "\""),
        None => field.to_string(),
    }
}

fn parse_passage(n: usize, line: &str) -> Result<Option<Passage>, String> {
    let cols: Vec<&str> = line.split('\t').collect();
    if n == 1 && cols.first() == Some(&"id") {
        return Ok(None);
    }
    if cols.len() != 3 {
        return Err(format!("expected 3 tab-separated columns (id, text, title), found {}", cols.len()));
    }
    Ok(Some(Passage { id: cols[0].to_string(), text: unquote(cols[1]), title: unquote(cols[2]) }))
}

/// Stream a DPR passage tsv (`id\ttext\ttitle`; the header line is skipped).
pub fn read_passages(path: &Path) -> Result<Records<Passage>> {
    Records::open(path, "passages", parse_passage)
}
