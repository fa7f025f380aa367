//! A T5 / Flan-T5 Fusion-in-Decoder reader (REFERENCE §6): greedy generation, rank
//! classification over options, and AAR's cross-attention passage preferences.
//!
//! Encoder input per passage, as AAR's code builds it: `passage_text[:passage_chars] + prompt`
//! (plain concatenation, the cut on Unicode characters as Python slicing, no markers), `</s>`
//! appended by the tokenizer. Titles are dropped by default (AAR feeds the corpus `text` column
//! only); `include_title` makes a passage `"{title} {text}"` before the cut. With no passages an
//! item is plain seq2seq: the encoder reads the prompt alone.
//!
//! Lengths: AAR does not truncate FiD inputs at all (500 characters of passage bound them);
//! `max_length` (default 512, Flan-T5's `model_max_length`; 0 = no limit) is a safety cut that
//! keeps the final `</s>`.
//!
//! Requests (JSON, unknown keys are errors so a misspelt `passages` is not silently ignored):
//! - `generate`: one item `{"prompt" | "question": str, "passages": [{"title", "text"}...],
//!   "max_new_tokens": n}` or `{"items": [...], "max_new_tokens": n}` (the batch default; 32
//!   when neither gives one) → `{"outputs": [{"text": str, "ids": [..]}]}`; `ids` are the
//!   generated tokens (no start token; the eos included when produced), `text` their decoding
//!   without special tokens.
//! - `score_options`: `{"items": [{"prompt", "passages", "options": [str]}]}` →
//!   `{"items": [{"losses": [f32], "best": i}]}`, the mean token cross-entropy of each option
//!   (with its `</s>`), lowest best.
//! - `passage_preferences`: `{"items": [{"prompt", "passages"}]}` →
//!   `{"items": [{"scores": [f32 per passage]}]}` ([`T5Model::cross_attention_scores`]).
//!
//! Items with the same number of passages (and, for options, the same options) are run
//! together, `batch_size` at a time; their passages are padded to a common length, which
//! padding masks make exact.

use crate::encoders::{check_device, parse_device};
use crate::models::t5::T5Model;
use crate::models::tokenizer::{Padding, TextTokenizer};
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::PathBuf;
use tch::{Device, Kind, Tensor};

pub const DEFAULT_MAX_LENGTH: usize = 512;
pub const DEFAULT_PASSAGE_CHARS: usize = 500;
pub const DEFAULT_BATCH_SIZE: usize = 8;
pub const DEFAULT_MAX_NEW_TOKENS: usize = 32;

/// Settings of the FiD reader.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FidReaderSettings {
    /// Hugging Face T5 / Flan-T5 checkpoint directory (config.json, model.safetensors, tokenizer.json).
    pub model: Option<PathBuf>,
    /// `cpu`, `cuda`, `cuda:N`.
    pub device: Option<String>,
    /// Run in bfloat16 (GPU).
    pub bf16: Option<bool>,
    /// Max tokens of one encoder input (passage + prompt + `</s>`); 0 = no limit (default 512).
    pub max_length: Option<usize>,
    /// Characters of each passage kept before the prompt (default 500).
    pub passage_chars: Option<usize>,
    /// Put the title before the passage text (default false, as AAR).
    pub include_title: Option<bool>,
    /// Items per forward pass (default 8).
    pub batch_size: Option<usize>,
}

impl FidReaderSettings {
    /// The settings description `plugins inspect` shows.
    pub fn schema() -> Value {
        json!({
            "model": {"type": "path", "required": true, "help": "Hugging Face T5 / Flan-T5 checkpoint directory"},
            "device": {"type": "string", "default": "cpu", "help": "cpu, cuda or cuda:N"},
            "bf16": {"type": "bool", "default": false, "help": "run in bfloat16"},
            "max_length": {"type": "int", "default": DEFAULT_MAX_LENGTH, "help": "max tokens per encoder input incl. </s>; 0 = no limit (AAR does not truncate)"},
            "passage_chars": {"type": "int", "default": DEFAULT_PASSAGE_CHARS, "help": "characters of each passage before the prompt (AAR: 500)"},
            "include_title": {"type": "bool", "default": false, "help": "read \"title text\" instead of the text alone"},
            "batch_size": {"type": "int", "default": DEFAULT_BATCH_SIZE, "help": "items per forward pass"},
        })
    }
}

/// One passage of a request.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Passage {
    #[serde(default)]
    pub title: String,
    pub text: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct GenerateItem {
    #[serde(alias = "question")]
    prompt: String,
    #[serde(default)]
    passages: Vec<Passage>,
    max_new_tokens: Option<usize>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct GenerateBatch {
    items: Vec<GenerateItem>,
    max_new_tokens: Option<usize>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct OptionsItem {
    #[serde(alias = "question")]
    prompt: String,
    #[serde(default)]
    passages: Vec<Passage>,
    options: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PreferenceItem {
    #[serde(alias = "question")]
    prompt: String,
    passages: Vec<Passage>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Items<T> {
    items: Vec<T>,
}

/// `{"items": [...]}`, or one bare item.
fn items<T: serde::de::DeserializeOwned>(request: Value, what: &str) -> Result<Vec<T>> {
    if request.get("items").is_some() {
        Ok(serde_json::from_value::<Items<T>>(request).with_context(|| format!("{what} request"))?.items)
    } else {
        Ok(vec![serde_json::from_value::<T>(request).with_context(|| format!("{what} request"))?])
    }
}

/// The first `chars` Unicode characters of `text` (Python's `text[:chars]`).
pub fn char_prefix(text: &str, chars: usize) -> &str {
    match text.char_indices().nth(chars) {
        Some((i, _)) => &text[..i],
        None => text,
    }
}

/// One FiD encoder input: `passage[:chars] + prompt`.
pub fn fid_text(passage: &str, prompt: &str, chars: usize) -> String {
    format!("{}{prompt}", char_prefix(passage, chars))
}

/// Indices grouped by key (in key order, each group in input order), at most `batch` a group.
fn groups<K: Ord>(keys: Vec<K>, batch: usize) -> Vec<Vec<usize>> {
    let mut by_key: BTreeMap<K, Vec<usize>> = BTreeMap::new();
    for (i, k) in keys.into_iter().enumerate() {
        by_key.entry(k).or_default().push(i);
    }
    by_key.into_values().flat_map(|v| v.chunks(batch.max(1)).map(<[usize]>::to_vec).collect::<Vec<_>>()).collect()
}

/// The FiD reader (see the module docs).
pub struct FidReader {
    model: T5Model,
    tokenizer: TextTokenizer,
    max_length: usize,
    passage_chars: usize,
    include_title: bool,
    batch_size: usize,
}

impl FidReader {
    pub fn create(settings: Value) -> Result<Self> {
        let s: FidReaderSettings = serde_json::from_value(settings).context("fid settings")?;
        let Some(dir) = s.model.clone() else { bail!("fid settings: \"model\" (a T5 checkpoint directory) is required") };
        if !dir.is_dir() {
            bail!("fid settings: model directory {} does not exist", dir.display());
        }
        let device = parse_device(s.device.as_deref().unwrap_or("cpu"))?;
        check_device(device)?;
        let tokenizer = TextTokenizer::load(&dir)?;
        let mut model = T5Model::load(&dir, device)?;
        if s.bf16.unwrap_or(false) {
            model.var_store_mut().bfloat16();
        }
        let max_length = match s.max_length.unwrap_or(DEFAULT_MAX_LENGTH) {
            0 => usize::MAX / 2,
            1 => bail!("fid settings: max_length must be 0 (no limit) or at least 2"),
            n => n,
        };
        Ok(FidReader {
            model,
            tokenizer,
            max_length,
            passage_chars: s.passage_chars.unwrap_or(DEFAULT_PASSAGE_CHARS),
            include_title: s.include_title.unwrap_or(false),
            batch_size: s.batch_size.unwrap_or(DEFAULT_BATCH_SIZE).max(1),
        })
    }

    pub fn model(&self) -> &T5Model {
        &self.model
    }

    pub fn device(&self) -> Device {
        self.model.device()
    }

    /// The encoder texts of one item: one per passage, or the prompt alone without passages.
    pub fn encoder_texts(&self, prompt: &str, passages: &[Passage]) -> Vec<String> {
        if passages.is_empty() {
            return vec![prompt.to_string()];
        }
        passages
            .iter()
            .map(|p| {
                if self.include_title && !p.title.is_empty() {
                    fid_text(&format!("{} {}", p.title, p.text), prompt, self.passage_chars)
                } else {
                    fid_text(&p.text, prompt, self.passage_chars)
                }
            })
            .collect()
    }

    /// Tokenise items with the same number of texts N into ids and mask `[B, N, L]`.
    pub fn tokenize(&self, items: &[Vec<String>]) -> Result<(Tensor, Tensor)> {
        let n = items[0].len() as i64;
        anyhow::ensure!(items.iter().all(|t| t.len() as i64 == n), "items of one batch need the same number of passages");
        let flat: Vec<&str> = items.iter().flatten().map(String::as_str).collect();
        let enc = self.tokenizer.encode(&flat, None, self.max_length, Padding::Longest)?;
        let l = enc.input_ids.size()[1];
        let b = items.len() as i64;
        Ok((enc.input_ids.view([b, n, l]), enc.attention_mask.view([b, n, l])))
    }

    /// `generate` (see the module docs).
    pub fn generate(&mut self, request: Value) -> Result<Value> {
        let (items, default_max) = if request.get("items").is_some() {
            let b: GenerateBatch = serde_json::from_value(request).context("generate request")?;
            (b.items, b.max_new_tokens)
        } else {
            (vec![serde_json::from_value::<GenerateItem>(request).context("generate request")?], None)
        };
        let limits: Vec<usize> =
            items.iter().map(|i| i.max_new_tokens.or(default_max).unwrap_or(DEFAULT_MAX_NEW_TOKENS)).collect();
        let texts: Vec<Vec<String>> = items.iter().map(|i| self.encoder_texts(&i.prompt, &i.passages)).collect();
        let mut outputs = vec![Value::Null; items.len()];
        let _no_grad = tch::no_grad_guard();
        for group in groups(texts.iter().map(Vec::len).collect(), self.batch_size) {
            let batch: Vec<Vec<String>> = group.iter().map(|&i| texts[i].clone()).collect();
            let (ids, mask) = self.tokenize(&batch)?;
            let (enc, enc_mask) = self.model.fid_encode(&ids, &mask);
            let max_new = group.iter().map(|&i| limits[i]).max().unwrap_or(0);
            let rows = self.model.generate_greedy_from_encoded(&enc, &enc_mask, max_new);
            for (row, &i) in rows.iter().zip(&group) {
                // Rows are independent in greedy decoding: a shorter limit is a prefix.
                let ids: Vec<i64> = row.iter().skip(1).take(limits[i]).copied().collect();
                let u: Vec<u32> = ids.iter().map(|&t| t as u32).collect();
                outputs[i] = json!({"text": self.tokenizer.decode(&u)?, "ids": ids});
            }
        }
        Ok(json!({ "outputs": outputs }))
    }

    /// `score_options` (see the module docs).
    pub fn score_options(&mut self, request: Value) -> Result<Value> {
        let items: Vec<OptionsItem> = items(request, "score_options")?;
        let mut options: Vec<Vec<Vec<i64>>> = Vec::with_capacity(items.len());
        for (n, item) in items.iter().enumerate() {
            if item.options.is_empty() {
                bail!("score_options request: item {n} has no options");
            }
            let ids = item
                .options
                .iter()
                .map(|o| Ok(self.tokenizer.ids(o, true)?.into_iter().map(i64::from).collect()))
                .collect::<Result<Vec<Vec<i64>>>>()?;
            options.push(ids);
        }
        let texts: Vec<Vec<String>> = items.iter().map(|i| self.encoder_texts(&i.prompt, &i.passages)).collect();
        let keys: Vec<(usize, Vec<Vec<i64>>)> = texts.iter().map(Vec::len).zip(options.iter().cloned()).collect();
        let mut out = vec![Value::Null; items.len()];
        let _no_grad = tch::no_grad_guard();
        for group in groups(keys, self.batch_size) {
            let batch: Vec<Vec<String>> = group.iter().map(|&i| texts[i].clone()).collect();
            let (ids, mask) = self.tokenize(&batch)?;
            let (enc, enc_mask) = self.model.fid_encode(&ids, &mask);
            let losses = self.model.option_losses_from_encoded(&enc, &enc_mask, &options[group[0]])?;
            let losses: Vec<Vec<f32>> = Vec::<Vec<f32>>::try_from(&losses.to_kind(Kind::Float).to_device(Device::Cpu))?;
            for (row, &i) in losses.into_iter().zip(&group) {
                let best = row.iter().enumerate().fold(0, |b, (k, &l)| if l < row[b] { k } else { b });
                out[i] = json!({"losses": row, "best": best});
            }
        }
        Ok(json!({ "items": out }))
    }

    /// `passage_preferences` (see the module docs).
    pub fn passage_preferences(&mut self, request: Value) -> Result<Value> {
        let items: Vec<PreferenceItem> = items(request, "passage_preferences")?;
        let texts: Vec<Vec<String>> = items.iter().map(|i| self.encoder_texts(&i.prompt, &i.passages)).collect();
        let mut out = vec![json!({"scores": []}); items.len()];
        let with_passages: Vec<usize> = (0..items.len()).filter(|&i| !items[i].passages.is_empty()).collect();
        let _no_grad = tch::no_grad_guard();
        for group in groups(with_passages.iter().map(|&i| texts[i].len()).collect(), self.batch_size) {
            let group: Vec<usize> = group.into_iter().map(|g| with_passages[g]).collect();
            let batch: Vec<Vec<String>> = group.iter().map(|&i| texts[i].clone()).collect();
            let (ids, mask) = self.tokenize(&batch)?;
            let scores = self.model.cross_attention_scores(&ids, &mask);
            let scores: Vec<Vec<f32>> = Vec::<Vec<f32>>::try_from(&scores.to_kind(Kind::Float).to_device(Device::Cpu))?;
            for (row, &i) in scores.into_iter().zip(&group) {
                out[i] = json!({ "scores": row });
            }
        }
        Ok(json!({ "items": out }))
    }
}

impl crate::plugin::Reader for FidReader {
    fn generate(&mut self, request: Value) -> Result<Value> {
        FidReader::generate(self, request)
    }
    fn score_options(&mut self, request: Value) -> Result<Value> {
        FidReader::score_options(self, request)
    }
    fn passage_preferences(&mut self, request: Value) -> Result<Value> {
        FidReader::passage_preferences(self, request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn char_prefix_cuts_characters_not_bytes() {
        assert_eq!(char_prefix("24–10 win", 3), "24–");
        assert_eq!(char_prefix("abc", 10), "abc");
        assert_eq!(char_prefix("", 5), "");
        assert_eq!(fid_text("Agnès", "Q:", 4), "AgnèQ:");
    }

    #[test]
    fn groups_by_key_in_batches() {
        assert_eq!(groups(vec![3, 1, 3, 3, 1], 2), vec![vec![1, 4], vec![0, 2], vec![3]]);
    }
}
