//! Target-LM probes of mini-KILT: MMLU-style multiple choice (`mc/*.jsonl`:
//! `{"_id", "subject", "question", "choices": [str], "answer": int}`) and PopQA-style short
//! answers (`shortqa/*.jsonl`: `{"_id", "question", "answers": [str], "pages": [str]}`).

use super::id_string;
use super::lines::Records;
use anyhow::{bail, Result};
use serde::Deserialize;
use std::collections::HashMap;
use std::path::Path;

/// A multiple-choice question; `answer` indexes `choices`.
#[derive(Debug, Clone, Deserialize)]
pub struct McItem {
    #[serde(rename = "_id", deserialize_with = "id_string")]
    pub id: String,
    #[serde(default)]
    pub subject: String,
    pub question: String,
    pub choices: Vec<String>,
    pub answer: usize,
    /// The file's line it was read from (for messages).
    #[serde(skip)]
    pub line: usize,
}

/// A short-answer question; a prediction is right when it contains an alias in `answers`.
#[derive(Debug, Clone, Deserialize)]
pub struct ShortQaItem {
    #[serde(rename = "_id", deserialize_with = "id_string")]
    pub id: String,
    pub question: String,
    pub answers: Vec<String>,
    #[serde(default)]
    pub pages: Vec<String>,
    /// The file's line it was read from (for messages).
    #[serde(skip)]
    pub line: usize,
}

/// Answer letters run A..Z, so a question has at most 26 choices.
pub const MAX_CHOICES: usize = 26;

fn parse_mc(n: usize, line: &str) -> Result<Option<McItem>, String> {
    let mut item: McItem = serde_json::from_str(line).map_err(|e| {
        format!("expected {{\"_id\", \"subject\", \"question\", \"choices\": [str], \"answer\": int}}: {e}")
    })?;
    if item.choices.len() < 2 || item.choices.len() > MAX_CHOICES {
        return Err(format!("{} choices; expected 2 to {MAX_CHOICES}", item.choices.len()));
    }
    if item.answer >= item.choices.len() {
        return Err(format!("answer {} indexes none of the {} choices", item.answer, item.choices.len()));
    }
    item.line = n;
    Ok(Some(item))
}

fn parse_shortqa(n: usize, line: &str) -> Result<Option<ShortQaItem>, String> {
    let mut item: ShortQaItem = serde_json::from_str(line)
        .map_err(|e| format!("expected {{\"_id\", \"question\", \"answers\": [str]}}: {e}"))?;
    if item.answers.iter().all(|a| a.trim().is_empty()) {
        return Err("no non-empty answer alias".into());
    }
    item.line = n;
    Ok(Some(item))
}

/// Every multiple-choice item of a file; a bad line or a repeated id names its line.
pub fn load_mc(path: &Path) -> Result<Vec<McItem>> {
    unique(Records::open(path, "questions", parse_mc)?.collect::<Result<Vec<_>>>()?, |i| (&i.id, i.line), path)
}

/// Every short-answer item of a file.
pub fn load_shortqa(path: &Path) -> Result<Vec<ShortQaItem>> {
    unique(Records::open(path, "questions", parse_shortqa)?.collect::<Result<Vec<_>>>()?, |i| (&i.id, i.line), path)
}

/// Refuses a repeated id, naming both lines.
fn unique<T>(items: Vec<T>, id_and_line: impl Fn(&T) -> (&String, usize), path: &Path) -> Result<Vec<T>> {
    let mut seen = HashMap::new();
    for item in &items {
        let (id, line) = id_and_line(item);
        if let Some(first) = seen.insert(id.clone(), line) {
            bail!("{}:{line}: question id {id:?} repeats line {first}'s", path.display());
        }
    }
    Ok(items)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_lines_name_file_and_line() {
        let dir = std::env::temp_dir().join(format!("rak-probes-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("mc.jsonl");
        std::fs::write(&p, "{\"_id\":\"a\",\"question\":\"q\",\"choices\":[\"x\",\"y\"],\"answer\":1}\n{\"_id\":\"b\",\"question\":\"q\",\"choices\":[\"x\",\"y\"],\"answer\":2}\n").unwrap();
        let e = load_mc(&p).unwrap_err().to_string();
        assert!(e.contains("mc.jsonl:2:") && e.contains("answer 2"), "{e}");
        std::fs::write(&p, "{\"_id\":\"a\",\"question\":\"q\",\"answers\":[\"x\"]}\n{\"_id\":\"a\",\"question\":\"r\",\"answers\":[\"y\"]}\n").unwrap();
        let e = load_shortqa(&p).unwrap_err().to_string();
        assert!(e.contains("mc.jsonl:2: question id \"a\" repeats line 1's"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
