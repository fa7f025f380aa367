//! BERT dual encoders: DPR / MT-DPR (two towers or one shared) and TASER (one shared BERT
//! with specialised feed-forward experts). Passages are `title [SEP] text` pairs; MT-DPR's
//! per-task query tweaks (a `?` on QA queries, a task-type marker token) are settings.

use super::ahead::{self, TokenizeAhead};
use super::{check_device, parse_device, TITLE_SEPARATOR};
use crate::abi::Role;
use crate::models::bert::{BertConfig, BertInput, BertModel};
use crate::models::pooling::{pool, sentence_transformers_settings, Pooling};
use crate::models::tokenizer::{save_tokenizer, Encoded, Padding, TextInput, TextTokenizer};
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tch::{Device, Kind, Tensor};

/// The settings file a saved encoder carries next to its weights.
pub const SETTINGS_FILE: &str = super::files::SETTINGS;

/// Settings of a BERT dual encoder. Unset fields come from the checkpoint's `rak_encoder.json`,
/// then its sentence-transformers files, then the defaults shown.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BertEncoderSettings {
    /// Checkpoint directory: the shared encoder, or one holding `query_encoder/` and
    /// `passage_encoder/`.
    pub model: Option<PathBuf>,
    /// A separate passage tower (DPR's two encoders); otherwise one encoder is shared.
    pub passage_model: Option<PathBuf>,
    /// `cls` or `mean` (default: the sentence-transformers setting, else `cls`).
    pub pooling: Option<Pooling>,
    /// L2-normalise embeddings (default: the sentence-transformers setting, else false).
    pub normalize: Option<bool>,
    /// Max tokens of a passage (default: sentence-transformers' max_seq_length, else 256).
    pub max_length: Option<usize>,
    /// Max tokens of a query (default: `max_length`).
    pub query_max_length: Option<usize>,
    /// MT-DPR: append `?` to queries of QA tasks that lack one.
    pub question_mark: Option<bool>,
    /// Task names that count as QA for `question_mark`.
    pub qa_tasks: Option<Vec<String>>,
    /// MT-DPR task markers: task name → marker token put right after `[CLS]` (e.g. `[unused0]`).
    pub task_markers: Option<BTreeMap<String, String>>,
    /// TACO-style task prefix: queries of a task become the pair `[CLS] TASK [SEP] query [SEP]`
    /// (passages are never prefixed, so one index serves every task).
    pub task_prefix: Option<bool>,
    /// With mean pooling, whether the prefix's own tokens (`TASK [SEP]`) count in the mean
    /// (default true, BERT's plain pair input). False pools over `[CLS]`, the query and its
    /// `[SEP]`, the tokens an unprefixed query pools over: the prefix then conditions the query's
    /// tokens through attention without adding the task name's word meaning ("FEVER" the
    /// illness, "VITAMIN C") to every query of the task (docs/RESULTS.md, "The task prefix on
    /// MiniLM"). Left out of the saved settings while unset, so older hosts read them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool_task_prefix: Option<bool>,
    /// TASER: specialise every T-th block (0 or absent: plain BERT).
    pub taser_every: Option<i64>,
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

impl BertEncoderSettings {
    /// Fill unset fields from `other` (explicit settings win over saved ones).
    fn or(mut self, other: BertEncoderSettings) -> Self {
        macro_rules! fill { ($($f:ident),*) => { $( if self.$f.is_none() { self.$f = other.$f; } )* } }
        fill!(model, passage_model, pooling, normalize, max_length, query_max_length, question_mark, qa_tasks, task_markers, task_prefix, pool_task_prefix, taser_every, device, bf16, tokenize_ahead);
        self
    }
}

fn default_qa_tasks() -> Vec<String> {
    ["squad", "nq", "tqa", "triviaqa", "hopo", "hotpotqa", "eli5"].iter().map(|s| s.to_string()).collect()
}

struct Tower {
    model: BertModel,
    tokenizer: Arc<TextTokenizer>,
    dir: PathBuf,
}

impl Tower {
    fn load(dir: &Path, taser_every: Option<i64>, device: Device) -> Result<Self> {
        let mut config = BertConfig::load(dir)?;
        if taser_every.is_some() {
            config.taser_specialize_every = taser_every.filter(|&t| t > 0);
        }
        let tokenizer = Arc::new(TextTokenizer::load(dir)?);
        let model = BertModel::load(dir, config, device)?;
        Ok(Tower { model, tokenizer, dir: dir.to_path_buf() })
    }
}

/// A BERT dual encoder (see the module docs).
pub struct BertEncoder {
    query: Tower,
    /// `None`: the query tower is shared.
    passage: Option<Tower>,
    settings: BertEncoderSettings,
    pooling: Pooling,
    normalize: bool,
    device: Device,
    tokenizing: Tokenizing,
    /// Batches [`Encoder::prepare`](crate::plugin::Encoder::prepare) handed over, when
    /// tokenising ahead is on.
    ahead: Option<TokenizeAhead>,
}

/// What tokenising takes, shared with the threads that tokenise ahead.
#[derive(Clone)]
struct Tokenizing {
    query: Arc<TextTokenizer>,
    passage: Arc<TextTokenizer>,
    settings: Arc<BertEncoderSettings>,
    max_length: usize,
    query_max_length: usize,
}

impl BertEncoder {
    /// Build from JSON settings; `defaults` are the plugin's own (e.g. TASER's `taser_every`).
    pub fn create(settings: Value, defaults: BertEncoderSettings) -> Result<Self> {
        let explicit: BertEncoderSettings = serde_json::from_value(settings).context("encoder settings")?;
        let Some(model_dir) = explicit.model.clone() else { bail!("encoder settings: \"model\" (a checkpoint directory) is required") };
        let saved = read_saved_settings(&model_dir)?;
        let mut s = explicit.or(saved).or(defaults);
        let device = parse_device(s.device.as_deref().unwrap_or("cpu"))?;
        check_device(device)?;
        let two_towers = model_dir.join("query_encoder").is_dir();
        let (query_dir, passage_dir) = if two_towers {
            (model_dir.join("query_encoder"), Some(model_dir.join("passage_encoder")))
        } else {
            (model_dir.clone(), s.passage_model.clone())
        };
        let mut query = Tower::load(&query_dir, s.taser_every, device)?;
        let mut passage = passage_dir.map(|d| Tower::load(&d, s.taser_every, device)).transpose()?;
        if passage.is_some() && s.taser_every.unwrap_or(0) > 0 {
            bail!("encoder settings: TASER shares one encoder; do not give a passage_model");
        }
        let st = sentence_transformers_settings(&query_dir)?;
        let pooling = s.pooling.or(st.as_ref().map(|st| st.pooling)).unwrap_or(Pooling::Cls);
        let normalize = s.normalize.or(st.as_ref().map(|st| st.normalize)).unwrap_or(false);
        let max_length = s.max_length.or(st.as_ref().and_then(|st| st.max_seq_length)).unwrap_or(256);
        let query_max_length = s.query_max_length.unwrap_or(max_length);
        if s.bf16.unwrap_or(false) {
            query.model.vs.bfloat16();
            if let Some(p) = passage.as_mut() {
                p.model.vs.bfloat16();
            }
        }
        if let Some(markers) = &s.task_markers {
            for (task, token) in markers {
                if query.tokenizer.token_to_id(token).is_none() {
                    bail!("task marker {token:?} for task {task:?} is not in {}", query.tokenizer.path().display());
                }
            }
        }
        s.model = Some(model_dir);
        let tokenizing = Tokenizing {
            query: query.tokenizer.clone(),
            passage: passage.as_ref().map_or(&query, |p| p).tokenizer.clone(),
            settings: Arc::new(s.clone()),
            max_length,
            query_max_length,
        };
        let ahead = ahead::enabled(s.tokenize_ahead, device).then(TokenizeAhead::default);
        Ok(BertEncoder { query, passage, settings: s, pooling, normalize, device, tokenizing, ahead })
    }

    fn tower(&self, role: Role) -> &Tower {
        match (role, &self.passage) {
            (Role::Passage, Some(p)) => p,
            _ => &self.query,
        }
    }

    /// Tokenise as the role and task ask: titled passages as `(title, text)` pairs, untitled
    /// ones as their text alone, queries with the MT-DPR tweaks.
    pub fn tokenize(&self, texts: &[&str], role: Role, task: Option<&str>) -> Result<Encoded> {
        self.tokenizing.tokenize(texts, role, task)
    }

    /// [`BertEncoder::tokenize`], or the batch prepared ahead for exactly these texts.
    fn tokens(&mut self, texts: &[&str], role: Role, task: Option<&str>) -> Result<Encoded> {
        let tokenizing = &self.tokenizing;
        ahead::take_or(self.ahead.as_mut(), texts, role, task, || tokenizing.tokenize(texts, role, task))
    }

    /// How many encode calls found their batch tokenised ahead (0 when it is off).
    pub fn tokenized_ahead(&self) -> u64 {
        ahead::hits(self.ahead.as_ref())
    }

    /// Token states of a tokenised batch (for parity tests and analysis).
    pub fn hidden_states(&self, enc: &Encoded, role: Role, train: bool) -> Tensor {
        let e = enc.to_device(self.device);
        let input = BertInput { input_ids: e.input_ids, attention_mask: e.attention_mask, token_type_ids: e.token_type_ids };
        self.tower(role).model.forward(&input, role, train)
    }

    fn models(&self) -> Vec<(&str, &BertModel)> {
        let mut out = vec![(if self.passage.is_some() { "query_encoder." } else { "" }, &self.query.model)];
        if let Some(p) = &self.passage {
            out.push(("passage_encoder.", &p.model));
        }
        out
    }

    /// Layer-wise learning-rate factors (TASER: decay 0.8 from the top block down;
    /// embeddings get decay^(L+2), block l (1-based) decay^(L+1-l)).
    pub fn lr_scale(&self, decay: f64) -> BTreeMap<String, f64> {
        let mut out = BTreeMap::new();
        for (prefix, model) in self.models() {
            let layers = model.config.num_hidden_layers as i32;
            for (name, _) in model.vs.variables() {
                let depth = if name.starts_with("embeddings.") {
                    layers + 2
                } else if let Some(rest) = name.strip_prefix("encoder.layer.") {
                    let l: i32 = rest.split('.').next().and_then(|n| n.parse().ok()).unwrap_or(0) + 1;
                    layers + 1 - l
                } else {
                    0
                };
                out.insert(format!("{prefix}{name}"), decay.powi(depth));
            }
        }
        out
    }

    /// The tokens the mean runs over: every real token, less a task prefix's own tokens when
    /// `pool_task_prefix` is false. The prefix is segment A and the query segment B, so the
    /// query keeps `[CLS]` and its segment: the tokens it pools over without a prefix (less
    /// those the pair's truncation cut, when the query is long).
    fn pooling_mask(&self, enc: &Encoded, role: Role, task: Option<&str>) -> Result<Tensor> {
        let prefixed = role == Role::Query && task.is_some() && self.settings.task_prefix.unwrap_or(false);
        if !prefixed || self.settings.pool_task_prefix.unwrap_or(true) {
            return Ok(enc.attention_mask.shallow_clone());
        }
        let keep = enc.token_type_ids.ne(0).to_kind(Kind::Int64);
        if keep.sum(Kind::Int64).int64_value(&[]) == 0 {
            bail!(
                "pool_task_prefix = false: {} gives the query segment of a pair token type 0, so the prefix cannot be told from the query",
                self.query.tokenizer.path().display()
            );
        }
        let _ = keep.narrow(1, 0, 1).fill_(1); // [CLS]
        Ok(&enc.attention_mask * keep)
    }
}

impl Tokenizing {
    fn tokenize(&self, texts: &[&str], role: Role, task: Option<&str>) -> Result<Encoded> {
        let tok = match role {
            Role::Passage => &self.passage,
            Role::Query => &self.query,
        };
        match role {
            Role::Passage => {
                // Each passage by its own form: an untitled one must not become `[CLS] [SEP]
                // text [SEP]` because a batchmate has a title (its embedding would depend on
                // how `host encode` happened to batch it).
                let inputs: Vec<TextInput> = texts.iter().copied().map(passage_input).collect();
                tok.encode_inputs(&inputs, self.max_length, Padding::Longest)
            }
            Role::Query => {
                let qa = task.is_some_and(|t| {
                    let t = t.to_lowercase();
                    self.settings.qa_tasks.clone().unwrap_or_else(default_qa_tasks).contains(&t)
                });
                let owned: Vec<String> = texts
                    .iter()
                    .map(|t| {
                        let t = t.trim_end();
                        if qa && self.settings.question_mark.unwrap_or(false) && !t.ends_with('?') {
                            format!("{t}?")
                        } else {
                            t.to_string()
                        }
                    })
                    .collect();
                let refs: Vec<&str> = owned.iter().map(String::as_str).collect();
                let marker = task.and_then(|t| self.settings.task_markers.as_ref()?.get(t)).and_then(|m| tok.token_to_id(m));
                // TACO's task prefix in BERT form (the paper's `TaskName [SEP] query`): the
                // upper-case task name as the first segment of a pair.
                let prefix = task.filter(|_| self.settings.task_prefix.unwrap_or(false)).map(str::to_uppercase);
                match (marker, prefix) {
                    (_, Some(prefix)) => {
                        let inputs: Vec<TextInput> = refs.iter().map(|q| TextInput::Pair(prefix.as_str(), q)).collect();
                        tok.encode_inputs(&inputs, self.query_max_length, Padding::Longest)
                    }
                    (None, None) => tok.encode(&refs, None, self.query_max_length, Padding::Longest),
                    (Some(id), None) => {
                        let e = tok.encode(&refs, None, self.query_max_length.saturating_sub(1).max(2), Padding::Longest)?;
                        Ok(insert_after_cls(e, id as i64))
                    }
                }
            }
        }
    }
}

/// A passage string as the tokenizer takes it: `(title, text)` when it carries a title.
fn passage_input(passage: &str) -> TextInput<'_> {
    match passage.split_once(TITLE_SEPARATOR) {
        Some((title, text)) if !title.is_empty() => TextInput::Pair(title, text),
        Some((_, text)) => TextInput::Single(text),
        None => TextInput::Single(passage),
    }
}

fn insert_after_cls(e: Encoded, marker: i64) -> Encoded {
    let (b, _) = e.input_ids.size2().unwrap();
    let col = |v: i64| Tensor::full([b, 1], v, (Kind::Int64, Device::Cpu));
    let splice = |t: &Tensor, v: i64| Tensor::cat(&[t.narrow(1, 0, 1), col(v), t.narrow(1, 1, t.size()[1] - 1)], 1);
    Encoded {
        input_ids: splice(&e.input_ids, marker),
        attention_mask: splice(&e.attention_mask, 1),
        token_type_ids: splice(&e.token_type_ids, 0),
    }
}

fn read_saved_settings(dir: &Path) -> Result<BertEncoderSettings> {
    let path = dir.join(SETTINGS_FILE);
    if !path.exists() {
        return Ok(BertEncoderSettings::default());
    }
    let text = std::fs::read_to_string(&path).with_context(|| format!("{}: cannot read", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{}: invalid encoder settings", path.display()))
}

impl crate::plugin::Encoder for BertEncoder {
    fn encode(&mut self, texts: &[&str], role: Role, task: Option<&str>, train: bool) -> Result<Tensor> {
        let enc = self.tokens(texts, role, task)?;
        let _no_grad = (!train).then(tch::no_grad_guard);
        // Uploaded before the forward pass is queued, as its inputs are.
        let mask = crate::models::upload(&self.pooling_mask(&enc, role, task)?, self.device);
        let states = self.hidden_states(&enc, role, train);
        Ok(pool(&states, &mask, self.pooling, self.normalize).to_kind(Kind::Float))
    }

    fn encode_keyed(&mut self, texts: &[&str], role: Role, task: Option<&str>, keys: &[u64]) -> Result<Tensor> {
        if keys.len() != texts.len() {
            bail!("{} dropout keys for {} texts", keys.len(), texts.len());
        }
        crate::models::dropout::with_example_keys(keys, || self.encode(texts, role, task, true))
    }

    fn parameters(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::new();
        for (prefix, model) in self.models() {
            let mut vars: Vec<(String, Tensor)> = model.vs.variables().into_iter().collect();
            vars.sort_by(|a, b| a.0.cmp(&b.0));
            out.extend(vars.into_iter().map(|(n, t)| (format!("{prefix}{n}"), t)));
        }
        Ok(out)
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
        let parameters: i64 = self.models().iter().map(|(_, m)| m.num_parameters()).sum();
        Ok(json!({
            "dim": self.query.model.config.hidden_size,
            "parameters": parameters,
            "towers": if self.passage.is_some() { 2 } else { 1 },
            "pooling": self.pooling,
            "normalize": self.normalize,
            "max_length": self.tokenizing.max_length,
            "query_max_length": self.tokenizing.query_max_length,
            "taser_every": self.settings.taser_every,
            "lr_scale": self.lr_scale(0.8),
        }))
    }

    fn save(&self, dir: &Path) -> Result<()> {
        let towers: Vec<(PathBuf, &Tower)> = match &self.passage {
            None => vec![(dir.to_path_buf(), &self.query)],
            Some(p) => vec![(dir.join("query_encoder"), &self.query), (dir.join("passage_encoder"), p)],
        };
        for (sub, tower) in towers {
            tower.model.save(&sub)?;
            save_tokenizer(&tower.tokenizer, &sub)?;
            copy_sentence_transformers_files(&tower.dir, &sub)?;
        }
        let mut s = self.settings.clone();
        s.model = None;
        s.passage_model = None;
        s.device = None;
        // How this process runs the model, as the device: a checkpoint saved with it would
        // load every later run, training included, with bf16 weights.
        s.bf16 = None;
        s.tokenize_ahead = None;
        s.pooling = Some(self.pooling);
        s.normalize = Some(self.normalize);
        s.max_length = Some(self.tokenizing.max_length);
        s.query_max_length = Some(self.tokenizing.query_max_length);
        crate::fsutil::write_bytes(&dir.join(SETTINGS_FILE), serde_json::to_string_pretty(&s)?.as_bytes())
    }
}

/// Keep a sentence-transformers checkpoint one after saving: its settings files at the top
/// (6.x keeps max_seq_length in `tokenizer_config.json`) and every file of the module folders
/// `modules.json` lists (`1_Pooling/`, `2_Normalize/`, a `2_Dense/` with its weights...).
fn copy_sentence_transformers_files(from: &Path, to: &Path) -> Result<()> {
    if from == to {
        return Ok(());
    }
    let mut names: Vec<PathBuf> = super::files::SENTENCE_TRANSFORMERS.iter().map(PathBuf::from).collect();
    names.extend(module_files(from)?);
    for name in names {
        let src = from.join(&name);
        if src.exists() {
            let bytes = std::fs::read(&src).with_context(|| format!("{}: cannot read", src.display()))?;
            crate::fsutil::write_bytes(&to.join(&name), &bytes)?;
        }
    }
    Ok(())
}

/// The files (relative paths) in the module folders `dir/modules.json` lists. The Transformer's
/// folder is the checkpoint itself (path ""), saved on its own; a path leaving the checkpoint
/// is skipped, so a crafted `modules.json` cannot make a save write elsewhere.
fn module_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let path = dir.join("modules.json");
    if !path.exists() {
        return Ok(Vec::new());
    }
    let text = std::fs::read_to_string(&path).with_context(|| format!("{}: cannot read", path.display()))?;
    let modules: Value = serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", path.display()))?;
    let mut out = Vec::new();
    for sub in modules.as_array().into_iter().flatten().filter_map(|m| m["path"].as_str()) {
        let sub = Path::new(sub);
        let inside = sub.components().all(|c| matches!(c, std::path::Component::Normal(_)));
        if sub.as_os_str().is_empty() || !inside || !dir.join(sub).is_dir() {
            continue;
        }
        let entries = std::fs::read_dir(dir.join(sub)).with_context(|| format!("{}: cannot list", dir.join(sub).display()))?;
        for entry in entries {
            let entry = entry?;
            if entry.file_type()?.is_file() {
                out.push(sub.join(entry.file_name()));
            }
        }
    }
    Ok(out)
}
