//! TACO's multitask T5 retriever (REFERENCE §3): one T5 shared by queries and passages, the
//! "ST5-EncDec" embedding (encoder, then one decoder step from the start token; the decoder's
//! final hidden state at position 0), and a task prefix on queries only.
//!
//! Input formats, as the authors' code (WenzhengZhang/TACO, OpenMatch-based) builds them:
//! - query with the prefix on: `"{TASK} <extra_id_1> {query}"` (`' '.join([task, '<extra_id_1>',
//!   text])`), `TASK` the upper-cased task name (or the name `task_names` maps it to). A query
//!   with no task, or with `task_prefix: false`, is the query text alone.
//! - passage: `"Title: {title} Text: {text}"` (their `--doc_template`) when the string carries a
//!   title (see [`super::passage_string`]); a passage without a title is its text alone, so a
//!   bare text encodes exactly as the plain ST5 embedding of that text. The template is a setting.
//! - lengths: passages 160 tokens and queries 32 + 4 for the prefix = 36 (their KILT scripts'
//!   `p_max_len` / `max_q_len`), both counting `</s>`.

use super::ahead::{self, TokenizeAhead};
use super::{check_device, parse_device, TITLE_SEPARATOR};
use crate::abi::Role;
use crate::models::t5::T5Model;
use crate::models::tokenizer::{save_tokenizer, Encoded, Padding, TextTokenizer};
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tch::{Device, Kind, Tensor};

pub use super::bert::SETTINGS_FILE;

/// The sentinel the prefix puts between the task name and the query.
pub const PREFIX_TOKEN: &str = "<extra_id_1>";
pub const DEFAULT_PASSAGE_TEMPLATE: &str = "Title: <title> Text: <text>";
pub const DEFAULT_MAX_LENGTH: usize = 160;
pub const DEFAULT_QUERY_MAX_LENGTH: usize = 36;

/// Settings of the TACO encoder. Unset fields come from the checkpoint's `rak_encoder.json`,
/// then the defaults shown.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TacoEncoderSettings {
    /// Hugging Face T5 checkpoint directory (config.json, model.safetensors, tokenizer.json).
    pub model: Option<PathBuf>,
    /// Max tokens of a passage, `</s>` included (default 160).
    pub max_length: Option<usize>,
    /// Max tokens of a query, prefix and `</s>` included (default 36 = 32 + 4 for the prefix).
    pub query_max_length: Option<usize>,
    /// Put `"{TASK} <extra_id_1> "` before queries that come with a task (default true; the
    /// authors turn it off for the BM25 warm-up stage). Passages never get one.
    pub task_prefix: Option<bool>,
    /// Task name → the name written in the prefix. Names not listed use the built-in KILT
    /// aliases (nq, tqa/triviaqa, hopo/hotpotqa, wow, trex, fever, zsre, aida...), else the
    /// task name upper-cased.
    pub task_names: Option<BTreeMap<String, String>>,
    /// Template of a titled passage, with `<title>` and `<text>` (default
    /// `"Title: <title> Text: <text>"`).
    pub passage_template: Option<String>,
    /// `cpu`, `cuda`, `cuda:N`.
    pub device: Option<String>,
    /// Run in bfloat16 (GPU). Never saved with a checkpoint (see `save`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bf16: Option<bool>,
    /// Tokenise the batches a caller prepares on a thread of their own (default: on CUDA
    /// only; see [`super::ahead`]). Never changes a result, and never saved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenize_ahead: Option<bool>,
}

impl TacoEncoderSettings {
    /// Fill unset fields from `other` (explicit settings win over saved ones).
    fn or(mut self, other: TacoEncoderSettings) -> Self {
        macro_rules! fill { ($($f:ident),*) => { $( if self.$f.is_none() { self.$f = other.$f; } )* } }
        fill!(model, max_length, query_max_length, task_prefix, task_names, passage_template, device, bf16, tokenize_ahead);
        self
    }

    /// The settings description `plugins inspect` shows.
    pub fn schema() -> Value {
        json!({
            "model": {"type": "path", "required": true, "help": "Hugging Face T5 checkpoint directory (config.json, model.safetensors, tokenizer.json)"},
            "max_length": {"type": "int", "default": DEFAULT_MAX_LENGTH, "help": "max passage tokens incl. </s> (authors' KILT p_max_len)"},
            "query_max_length": {"type": "int", "default": DEFAULT_QUERY_MAX_LENGTH, "help": "max query tokens incl. the task prefix and </s> (32 + 4)"},
            "task_prefix": {"type": "bool", "default": true, "help": "prefix queries with \"{TASK} <extra_id_1> \"; passages never get one"},
            "task_names": {"type": "map", "default": {}, "help": "task name -> name written in the prefix (default: KILT aliases, else upper-cased)"},
            "passage_template": {"type": "string", "default": DEFAULT_PASSAGE_TEMPLATE, "help": "titled passages; untitled ones are their text alone"},
            "device": {"type": "string", "default": "cpu", "help": "cpu, cuda or cuda:N"},
            "bf16": {"type": "bool", "default": false, "help": "run in bfloat16"},
            "tokenize_ahead": {"type": "bool", "default": "on CUDA only", "help": "tokenise the batches the trainer and host encode announce on a thread of their own, while the device works"},
        })
    }
}

/// The prefix name of a task: the settings' map, then KILT's names, else upper case.
pub fn prefix_name(task: &str, names: Option<&BTreeMap<String, String>>) -> String {
    if let Some(n) = names.and_then(|m| m.get(task).or_else(|| m.get(&task.to_lowercase()))) {
        return n.clone();
    }
    let lower = task.to_lowercase();
    let known = match lower.as_str() {
        "nq" | "naturalquestions" | "natural_questions" => "NQ",
        "tqa" | "triviaqa" | "trivia_qa" => "TQA",
        "hopo" | "hotpotqa" | "hotpot_qa" => "HOPO",
        "wow" | "wizard_of_wikipedia" => "WOW",
        "trex" | "t-rex" => "TREX",
        "fever" => "FEVER",
        "zsre" | "structured_zeroshot" | "zeroshot" | "zero_shot_re" => "ZSRE",
        "aida" | "aidayago2" | "aida-yago2" => "AIDA",
        _ => return task.to_uppercase(),
    };
    known.to_string()
}

/// The TACO encoder (see the module docs).
pub struct TacoEncoder {
    model: T5Model,
    dir: PathBuf,
    settings: TacoEncoderSettings,
    device: Device,
    tokenizing: Tokenizing,
    /// Batches [`Encoder::prepare`](crate::plugin::Encoder::prepare) handed over, when
    /// tokenising ahead is on.
    ahead: Option<TokenizeAhead>,
}

/// What tokenising takes, shared with the threads that tokenise ahead.
#[derive(Clone)]
struct Tokenizing {
    tokenizer: Arc<TextTokenizer>,
    settings: Arc<TacoEncoderSettings>,
    max_length: usize,
    query_max_length: usize,
    task_prefix: bool,
}

impl TacoEncoder {
    /// Build from JSON settings.
    pub fn create(settings: Value) -> Result<Self> {
        let explicit: TacoEncoderSettings = serde_json::from_value(settings).context("taco settings")?;
        let Some(model_dir) = explicit.model.clone() else { bail!("taco settings: \"model\" (a T5 checkpoint directory) is required") };
        if !model_dir.is_dir() {
            bail!("taco settings: model directory {} does not exist", model_dir.display());
        }
        let saved = read_saved_settings(&model_dir)?;
        let mut s = explicit.or(saved);
        let device = parse_device(s.device.as_deref().unwrap_or("cpu"))?;
        check_device(device)?;
        let tokenizer = TextTokenizer::load(&model_dir)?;
        let mut model = T5Model::load(&model_dir, device)?;
        if s.bf16.unwrap_or(false) {
            model.var_store_mut().bfloat16();
        }
        let max_length = s.max_length.unwrap_or(DEFAULT_MAX_LENGTH);
        let query_max_length = s.query_max_length.unwrap_or(DEFAULT_QUERY_MAX_LENGTH);
        if max_length < 2 || query_max_length < 2 {
            bail!("taco settings: max_length and query_max_length must be at least 2");
        }
        let task_prefix = s.task_prefix.unwrap_or(true);
        if task_prefix && tokenizer.token_to_id(PREFIX_TOKEN).is_none() {
            bail!("taco: the task prefix needs {PREFIX_TOKEN} but {} has no such token (set task_prefix: false)", tokenizer.path().display());
        }
        if let Some(t) = &s.passage_template {
            if !t.contains("<text>") {
                bail!("taco settings: passage_template {t:?} has no <text>");
            }
        }
        s.model = Some(model_dir.clone());
        let tokenizing = Tokenizing { tokenizer: Arc::new(tokenizer), settings: Arc::new(s.clone()), max_length, query_max_length, task_prefix };
        let ahead = ahead::enabled(s.tokenize_ahead, device).then(TokenizeAhead::default);
        Ok(TacoEncoder { model, dir: model_dir, settings: s, device, tokenizing, ahead })
    }

    /// The text a query or passage is tokenised as (see the module docs).
    pub fn input_text(&self, text: &str, role: Role, task: Option<&str>) -> String {
        self.tokenizing.input_text(text, role, task)
    }

    /// Tokenise as the role and task ask, padded to the longest.
    pub fn tokenize(&self, texts: &[&str], role: Role, task: Option<&str>) -> Result<Encoded> {
        self.tokenizing.tokenize(texts, role, task)
    }

    /// [`TacoEncoder::tokenize`], or the batch prepared ahead for exactly these texts.
    fn tokens(&mut self, texts: &[&str], role: Role, task: Option<&str>) -> Result<Encoded> {
        let tokenizing = &self.tokenizing;
        ahead::take_or(self.ahead.as_mut(), texts, role, task, || tokenizing.tokenize(texts, role, task))
    }

    /// How many encode calls found their batch tokenised ahead (0 when it is off).
    pub fn tokenized_ahead(&self) -> u64 {
        ahead::hits(self.ahead.as_ref())
    }

    pub fn model(&self) -> &T5Model {
        &self.model
    }

    pub fn device(&self) -> Device {
        self.device
    }
}

impl Tokenizing {
    fn input_text(&self, text: &str, role: Role, task: Option<&str>) -> String {
        match role {
            Role::Passage => match text.split_once(TITLE_SEPARATOR) {
                Some((title, body)) if !title.is_empty() => self
                    .settings
                    .passage_template
                    .as_deref()
                    .unwrap_or(DEFAULT_PASSAGE_TEMPLATE)
                    .replace("<title>", title)
                    .replace("<text>", body),
                Some((_, body)) => body.to_string(),
                None => text.to_string(),
            },
            Role::Query => match task.filter(|_| self.task_prefix) {
                Some(task) => format!("{} {PREFIX_TOKEN} {text}", prefix_name(task, self.settings.task_names.as_ref())),
                None => text.to_string(),
            },
        }
    }

    fn tokenize(&self, texts: &[&str], role: Role, task: Option<&str>) -> Result<Encoded> {
        let owned: Vec<String> = texts.iter().map(|t| self.input_text(t, role, task)).collect();
        let refs: Vec<&str> = owned.iter().map(String::as_str).collect();
        let max = if role == Role::Query { self.query_max_length } else { self.max_length };
        self.tokenizer.encode(&refs, None, max, Padding::Longest)
    }
}

fn read_saved_settings(dir: &Path) -> Result<TacoEncoderSettings> {
    let path = dir.join(SETTINGS_FILE);
    if !path.exists() {
        return Ok(TacoEncoderSettings::default());
    }
    let text = std::fs::read_to_string(&path).with_context(|| format!("{}: cannot read", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{}: invalid taco encoder settings", path.display()))
}

impl crate::plugin::Encoder for TacoEncoder {
    fn encode(&mut self, texts: &[&str], role: Role, task: Option<&str>, train: bool) -> Result<Tensor> {
        if texts.is_empty() {
            return Ok(Tensor::zeros([0, self.model.config().d_model], (Kind::Float, self.device)));
        }
        let enc = self.tokens(texts, role, task)?;
        let _no_grad = (!train).then(tch::no_grad_guard);
        self.model.set_train(train);
        let out = self.model.st5_embedding(&enc.input_ids, &enc.attention_mask);
        self.model.set_train(false);
        Ok(out.to_kind(Kind::Float))
    }

    fn encode_keyed(&mut self, texts: &[&str], role: Role, task: Option<&str>, keys: &[u64]) -> Result<Tensor> {
        if keys.len() != texts.len() {
            bail!("{} dropout keys for {} texts", keys.len(), texts.len());
        }
        crate::models::dropout::with_example_keys(keys, || self.encode(texts, role, task, true))
    }

    fn parameters(&self) -> Result<Vec<(String, Tensor)>> {
        let mut vars: Vec<(String, Tensor)> = self.model.var_store().variables().into_iter().collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(vars)
    }

    fn token_lengths(&mut self, texts: &[&str], role: Role, task: Option<&str>) -> Result<Option<Vec<usize>>> {
        let enc = self.tokenize(texts, role, task)?;
        let lengths: Vec<i64> = enc.attention_mask.sum_dim_intlist(1, false, Kind::Int64).try_into()?;
        Ok(Some(lengths.into_iter().map(|n| n as usize).collect()))
    }

    fn prepare(&mut self, texts: &[&str], role: Role, task: Option<&str>) -> Result<()> {
        if let Some(ahead) = self.ahead.as_mut() {
            let tokenizing = self.tokenizing.clone();
            ahead.start(texts, role, task, move |texts, role, task| tokenizing.tokenize(texts, role, task));
        }
        Ok(())
    }

    fn info(&self) -> Result<Value> {
        let parameters: i64 = self.model.var_store().trainable_variables().iter().map(|t| t.numel() as i64).sum();
        Ok(json!({
            "dim": self.model.config().d_model,
            "parameters": parameters,
            "towers": 1,
            "embedding": "st5-encdec",
            "max_length": self.tokenizing.max_length,
            "query_max_length": self.tokenizing.query_max_length,
            "task_prefix": self.tokenizing.task_prefix,
            "bf16": self.settings.bf16.unwrap_or(false),
        }))
    }

    fn save(&self, dir: &Path) -> Result<()> {
        self.model.save(dir)?;
        save_tokenizer(&self.tokenizing.tokenizer, dir)?;
        if self.dir != dir {
            for name in super::files::T5 {
                let src = self.dir.join(name);
                if src.exists() {
                    let bytes = std::fs::read(&src).with_context(|| format!("{}: cannot read", src.display()))?;
                    crate::fsutil::write_bytes(&dir.join(name), &bytes)?;
                }
            }
        }
        let mut s = self.settings.clone();
        s.model = None;
        s.device = None;
        // How this process runs the model, as the device: a checkpoint saved with it would
        // load every later run, training included, with bf16 weights.
        s.bf16 = None;
        s.tokenize_ahead = None;
        s.max_length = Some(self.tokenizing.max_length);
        s.query_max_length = Some(self.tokenizing.query_max_length);
        s.task_prefix = Some(self.tokenizing.task_prefix);
        crate::fsutil::write_bytes(&dir.join(SETTINGS_FILE), serde_json::to_string_pretty(&s)?.as_bytes())
    }
}
