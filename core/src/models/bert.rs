//! BERT (Hugging Face `BertModel` parameter names), with optional TASER specialisation:
//! every `T`-th block's feed-forward sub-layer exists twice (`q_ffn`, `p_ffn`) and a text's
//! [`Role`] picks one; self-attention stays shared (REFERENCE §5).

use crate::abi::Role;
use crate::models::dropout::{self, dropout as apply_dropout};
use crate::models::onednn::{self, Dense, Epilogue};
use crate::models::weights::Checkpoint;
use anyhow::{bail, Context, Result};
use serde::Deserialize;
use std::path::Path;
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

/// The fields of a Hugging Face BERT `config.json` the model uses. The raw JSON is kept so a
/// saved checkpoint carries every field it was loaded with.
#[derive(Debug, Clone, Deserialize)]
pub struct BertConfig {
    pub vocab_size: i64,
    pub hidden_size: i64,
    pub num_hidden_layers: i64,
    pub num_attention_heads: i64,
    pub intermediate_size: i64,
    #[serde(default = "default_act")]
    pub hidden_act: String,
    #[serde(default = "default_dropout")]
    pub hidden_dropout_prob: f64,
    #[serde(default = "default_dropout")]
    pub attention_probs_dropout_prob: f64,
    pub max_position_embeddings: i64,
    #[serde(default = "default_type_vocab")]
    pub type_vocab_size: i64,
    #[serde(default = "default_eps")]
    pub layer_norm_eps: f64,
    #[serde(default)]
    pub model_type: Option<String>,
    /// TASER: 1-based block indices divisible by this are specialised. Absent for plain BERT.
    #[serde(default)]
    pub taser_specialize_every: Option<i64>,
    #[serde(skip)]
    pub raw: serde_json::Value,
}

fn default_act() -> String {
    "gelu".into()
}
fn default_dropout() -> f64 {
    0.1
}
fn default_type_vocab() -> i64 {
    2
}
fn default_eps() -> f64 {
    1e-12
}

impl BertConfig {
    /// Read `dir/config.json`; refuses other architectures with a message naming the file.
    pub fn load(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).with_context(|| format!("{}: cannot read", path.display()))?;
        let raw: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", path.display()))?;
        let mut config: BertConfig =
            serde_json::from_value(raw.clone()).with_context(|| format!("{}: not a BERT config", path.display()))?;
        match config.model_type.as_deref() {
            Some("bert") | None => {}
            Some(other) => bail!("{}: model_type {other:?} is not supported here (expected \"bert\")", path.display()),
        }
        if config.hidden_size % config.num_attention_heads != 0 {
            bail!("{}: hidden_size {} is not divisible by num_attention_heads {}", path.display(), config.hidden_size, config.num_attention_heads);
        }
        if !matches!(config.hidden_act.as_str(), "gelu" | "gelu_new" | "relu") {
            bail!("{}: hidden_act {:?} is not supported (gelu, gelu_new, relu)", path.display(), config.hidden_act);
        }
        config.raw = raw;
        Ok(config)
    }

    /// The feed-forward activation (`load` accepts only these three).
    fn activation(&self) -> Epilogue {
        match self.hidden_act.as_str() {
            "relu" => Epilogue::Relu,
            "gelu_new" => Epilogue::GeluTanh,
            _ => Epilogue::Gelu,
        }
    }

    /// Whether block `i` (0-based) has separate query and passage feed-forward experts.
    pub fn is_specialized(&self, i: i64) -> bool {
        self.taser_specialize_every.is_some_and(|t| t > 0 && (i + 1) % t == 0)
    }
}

/// Input of one forward pass, already on the model's device.
pub struct BertInput {
    pub input_ids: Tensor,
    pub attention_mask: Tensor,
    pub token_type_ids: Tensor,
}

struct Embeddings {
    word: nn::Embedding,
    position: nn::Embedding,
    token_type: nn::Embedding,
    norm: nn::LayerNorm,
}

struct FeedForward {
    intermediate: nn::Linear,
    output: nn::Linear,
    norm: nn::LayerNorm,
}

impl FeedForward {
    fn new(p: &nn::Path, c: &BertConfig) -> Self {
        FeedForward {
            intermediate: nn::linear(p / "intermediate" / "dense", c.hidden_size, c.intermediate_size, Default::default()),
            output: nn::linear(p / "output" / "dense", c.intermediate_size, c.hidden_size, Default::default()),
            norm: layer_norm(&(p / "output" / "LayerNorm"), c),
        }
    }

    fn forward(&self, x: &Tensor, act: Epilogue, dropout: f64, train: bool) -> Tensor {
        let h = act.apply(&self.intermediate.forward(x));
        let h = apply_dropout(&self.output.forward(&h), dropout, train);
        self.norm.forward(&(h + x))
    }
}

enum Ffn {
    Shared(FeedForward),
    /// TASER: (query expert, passage expert).
    Specialized(FeedForward, FeedForward),
}

impl Ffn {
    fn for_role(&self, role: Role) -> &FeedForward {
        match (self, role) {
            (Ffn::Shared(f), _) | (Ffn::Specialized(f, _), Role::Query) | (Ffn::Specialized(_, f), Role::Passage) => f,
        }
    }
}

struct Layer {
    query: nn::Linear,
    key: nn::Linear,
    value: nn::Linear,
    attn_out: nn::Linear,
    attn_norm: nn::LayerNorm,
    ffn: Ffn,
}

impl Layer {
    /// The query, key and value projections stacked into one `[3H, H]` weight. Built per
    /// forward pass (a small copy next to the GEMMs) so training still updates the HF-named
    /// parameters.
    fn fused_qkv(&self) -> (Tensor, Tensor) {
        let bias = |l: &nn::Linear| l.bs.as_ref().expect("BERT projections have a bias").shallow_clone();
        let w = Tensor::cat(&[&self.query.ws, &self.key.ws, &self.value.ws], 0);
        let b = Tensor::cat(&[bias(&self.query), bias(&self.key), bias(&self.value)], 0);
        (w, b)
    }
}

fn layer_norm(p: &nn::Path, c: &BertConfig) -> nn::LayerNorm {
    nn::layer_norm(p, vec![c.hidden_size], nn::LayerNormConfig { eps: c.layer_norm_eps, ..Default::default() })
}

/// A BERT encoder whose parameters live in its own `VarStore`, named as in Hugging Face.
pub struct BertModel {
    pub config: BertConfig,
    pub vs: nn::VarStore,
    embeddings: Embeddings,
    layers: Vec<Layer>,
}

impl BertModel {
    /// Build with fresh (random) parameters on `device`.
    pub fn new(config: BertConfig, device: Device) -> Self {
        let vs = nn::VarStore::new(device);
        let root = vs.root();
        let c = &config;
        let e = &root / "embeddings";
        let embeddings = Embeddings {
            word: nn::embedding(&e / "word_embeddings", c.vocab_size, c.hidden_size, Default::default()),
            position: nn::embedding(&e / "position_embeddings", c.max_position_embeddings, c.hidden_size, Default::default()),
            token_type: nn::embedding(&e / "token_type_embeddings", c.type_vocab_size, c.hidden_size, Default::default()),
            norm: layer_norm(&(&e / "LayerNorm"), c),
        };
        let layers = (0..c.num_hidden_layers)
            .map(|i| {
                let p = &root / "encoder" / "layer" / i;
                let a = &p / "attention";
                let lin = |name: &str| nn::linear(&a / "self" / name, c.hidden_size, c.hidden_size, Default::default());
                Layer {
                    query: lin("query"),
                    key: lin("key"),
                    value: lin("value"),
                    attn_out: nn::linear(&a / "output" / "dense", c.hidden_size, c.hidden_size, Default::default()),
                    attn_norm: layer_norm(&(&a / "output" / "LayerNorm"), c),
                    ffn: if c.is_specialized(i) {
                        Ffn::Specialized(FeedForward::new(&(&p / "q_ffn"), c), FeedForward::new(&(&p / "p_ffn"), c))
                    } else {
                        Ffn::Shared(FeedForward::new(&p, c))
                    },
                }
            })
            .collect();
        BertModel { config, vs, embeddings, layers }
    }

    /// Load `dir` (config.json + model.safetensors). Checkpoints saved from a task head
    /// (`bert.` prefix) load too; extra tensors (pooler, `position_ids`) are ignored. A TASER
    /// model loaded from plain BERT starts both experts from the shared feed-forward weights.
    pub fn load(dir: &Path, config: BertConfig, device: Device) -> Result<Self> {
        let mut model = BertModel::new(config, device);
        let ckpt = Checkpoint::open(dir)?;
        let mut aliases: Vec<(String, String)> = Vec::new();
        for (name, _) in model.vs.variables() {
            for expert in ["q_ffn.", "p_ffn."] {
                if let Some(i) = name.find(expert) {
                    let plain = format!("{}{}", &name[..i], &name[i + expert.len()..]);
                    aliases.push((name.clone(), plain.clone()));
                    aliases.push((name.clone(), format!("bert.{plain}")));
                }
            }
        }
        let aliases: Vec<(&str, &str)> = aliases.iter().map(|(a, b)| (a.as_str(), b.as_str())).collect();
        ckpt.load_into(&mut model.vs, &["", "bert."], &aliases)?;
        Ok(model)
    }

    /// Last hidden states `[B, L, hidden]`. `role` picks the TASER expert (ignored otherwise).
    pub fn forward(&self, input: &BertInput, role: Role, train: bool) -> Tensor {
        let c = &self.config;
        let (b, l) = input.input_ids.size2().expect("input_ids is [batch, length]");
        let device = input.input_ids.device();
        let positions = Tensor::arange(l, (Kind::Int64, device)).unsqueeze(0);
        let e = &self.embeddings;
        let x = e.word.forward(&input.input_ids)
            + e.position.forward(&positions)
            + e.token_type.forward(&input.token_type_ids);
        let mut x = apply_dropout(&e.norm.forward(&x), c.hidden_dropout_prob, train);
        let kind = x.kind();
        if !train && b * l >= onednn::MIN_ROWS && onednn::usable(device, kind) {
            match self.forward_onednn(&x, &input.attention_mask, role) {
                Ok(states) => return states,
                Err(err) => onednn::warn_once(&err),
            }
        }
        let mask = additive_mask(&input.attention_mask, kind);
        let heads = c.num_attention_heads;
        let head_dim = c.hidden_size / heads;
        let split = |t: Tensor| t.view([b, l, heads, head_dim]).transpose(1, 2);
        let attn_dropout = if train { c.attention_probs_dropout_prob } else { 0.0 };
        for layer in &self.layers {
            // One GEMM for Q, K and V: larger matrices run closer to the machine's peak.
            let (w, bias) = layer.fused_qkv();
            let qkv = x.linear(&w, Some(&bias));
            let h = c.hidden_size;
            let q = split(qkv.narrow(-1, 0, h));
            let k = split(qkv.narrow(-1, h, h));
            let v = split(qkv.narrow(-1, 2 * h, h));
            let ctx = if attn_dropout > 0.0 && dropout::own_mask_applies(&q) {
                // What SDPA runs here (its fused CPU kernel takes no dropout, so its math path:
                // scores, softmax, dropout, product), with the mask drawn by `dropout`. The math
                // path's guard for rows that are all −∞ is not needed: the additive mask is
                // finite (the dtype's minimum).
                let scores = (&q * (head_dim as f64).sqrt().recip()).matmul(&k.transpose(-2, -1)) + &mask;
                apply_dropout(&scores.softmax(-1, kind), attn_dropout, true).matmul(&v)
            } else {
                Tensor::scaled_dot_product_attention(&q, &k, &v, Some(&mask), attn_dropout, false, None, false)
            };
            let ctx = ctx.transpose(1, 2).contiguous().view([b, l, c.hidden_size]);
            let h = apply_dropout(&layer.attn_out.forward(&ctx), c.hidden_dropout_prob, train);
            x = layer.attn_norm.forward(&(h + &x));
            x = layer.ffn.for_role(role).forward(&x, c.activation(), c.hidden_dropout_prob, train);
        }
        x
    }

    /// Inference on CPU in f32 through oneDNN (see `models::onednn`): the same computation as
    /// the general path, with weights packed once per call and bias, GELU and residual adds
    /// fused into the GEMMs. `x` is the embedding output `[B, L, H]`.
    fn forward_onednn(&self, x: &Tensor, attention_mask: &Tensor, role: Role) -> Result<Tensor> {
        let c = &self.config;
        let (b, l, h) = x.size3()?;
        let rows = b * l;
        let heads = c.num_attention_heads;
        let split = |t: Tensor| t.view([b, l, heads, h / heads]).transpose(1, 2);
        // Unpadded batches (length bucketing makes most of them so) need no mask at all.
        let mask = (attention_mask.min().int64_value(&[]) != 1).then(|| additive_mask(attention_mask, x.kind()));
        let pack = |l: &nn::Linear| Dense::pack(&l.ws, l.bs.as_ref(), rows);
        let mut x = x.view([rows, h]);
        for layer in &self.layers {
            let (w, bias) = layer.fused_qkv();
            let qkv = Dense::pack(&w, Some(&bias), rows)?.forward(&x, Epilogue::None)?.view([b, l, 3 * h]);
            let (q, k, v) = (split(qkv.narrow(-1, 0, h)), split(qkv.narrow(-1, h, h)), split(qkv.narrow(-1, 2 * h, h)));
            let ctx = Tensor::scaled_dot_product_attention(&q, &k, &v, mask.as_ref(), 0.0, false, None, false);
            let ctx = ctx.transpose(1, 2).contiguous().view([rows, h]);
            x = layer.attn_norm.forward(&pack(&layer.attn_out)?.forward_add(&ctx, &x)?);
            let ffn = layer.ffn.for_role(role);
            let inner = pack(&ffn.intermediate)?.forward(&x, c.activation())?;
            x = ffn.norm.forward(&pack(&ffn.output)?.forward_add(&inner, &x)?);
        }
        Ok(x.view([b, l, h]))
    }

    /// Number of scalar parameters.
    pub fn num_parameters(&self) -> i64 {
        self.vs.trainable_variables().iter().map(Tensor::numel).sum::<usize>() as i64
    }

    /// The config as saved: the loaded JSON with this model's structural fields.
    pub fn config_json(&self) -> serde_json::Value {
        let mut raw = self.config.raw.clone();
        if !raw.is_object() {
            raw = serde_json::json!({});
        }
        raw["model_type"] = "bert".into();
        match self.config.taser_specialize_every {
            Some(t) => raw["taser_specialize_every"] = t.into(),
            None => {
                if let Some(o) = raw.as_object_mut() {
                    o.remove("taser_specialize_every");
                }
            }
        }
        raw
    }

    /// Write `dir/config.json` and `dir/model.safetensors` (Hugging Face `BertModel` layout).
    pub fn save(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).with_context(|| format!("{}: cannot create", dir.display()))?;
        let text = serde_json::to_string_pretty(&self.config_json())?;
        crate::fsutil::write_bytes(&dir.join("config.json"), text.as_bytes())?;
        let tensors: Vec<(String, Tensor)> = self.vs.variables().into_iter().map(|(n, t)| (n, t.to_kind(Kind::Float))).collect();
        crate::models::weights::save_safetensors(&dir.join("model.safetensors"), &tensors)
    }
}

/// `[B, L]` 1/0 attention mask -> additive `[B, 1, 1, L]`: 0 where attended, the dtype's
/// minimum on padding.
fn additive_mask(attention_mask: &Tensor, kind: Kind) -> Tensor {
    let (b, l) = attention_mask.size2().expect("attention_mask is [batch, length]");
    let m = attention_mask.to_kind(kind);
    (m.ones_like() - m).view([b, 1, 1, l]) * min_value(kind)
}

fn min_value(kind: Kind) -> f64 {
    match kind {
        Kind::BFloat16 => -3.3895313892515355e38,
        Kind::Half => -65504.0,
        Kind::Double => f64::MIN,
        _ => f32::MIN as f64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// Training attention with dropout runs its own math path; with a dropout probability so
    /// small that the mask keeps everything at scale 1 (p = 1e-9 rounds to a threshold of 0
    /// and 1/(1−p) to 1.0f), it must equal SDPA's path without dropout, outputs and
    /// gradients, on a padded batch.
    #[test]
    fn training_attention_with_dropout_equals_sdpa() {
        tch::manual_seed(21);
        let config: BertConfig = serde_json::from_value(serde_json::json!({
            "vocab_size": 50, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 64, "max_position_embeddings": 16,
            "hidden_dropout_prob": 1e-9, "attention_probs_dropout_prob": 1e-9,
        }))
        .unwrap();
        let mut model = BertModel::new(config, Device::Cpu);
        let ids = Tensor::from_slice(&[5i64, 7, 9, 11, 2, 0, 0, 3, 4, 5, 6, 7, 8, 9, 12, 13, 0, 0, 0, 0, 0]).view([3, 7]);
        let input = BertInput { attention_mask: ids.ne(0).to_kind(Kind::Int64), token_type_ids: ids.zeros_like(), input_ids: ids };
        let weights = Tensor::randn([3, 7, 32], (Kind::Float, Device::Cpu));
        let run = |model: &BertModel| {
            for (_, p) in model.vs.variables() {
                let mut g = p.grad();
                if g.defined() {
                    let _ = g.zero_();
                }
            }
            let out = model.forward(&input, Role::Query, true);
            (&out * &weights).sum(Kind::Float).backward();
            let grads: BTreeMap<String, Tensor> = model.vs.variables().into_iter().map(|(n, p)| (n, p.grad().copy())).collect();
            (out.detach(), grads)
        };
        let (ours, our_grads) = run(&model);
        model.config.hidden_dropout_prob = 0.0;
        model.config.attention_probs_dropout_prob = 0.0;
        let (sdpa, sdpa_grads) = run(&model);
        let diff = (&ours - &sdpa).abs().max().double_value(&[]);
        assert!(diff < 1e-5, "outputs differ by {diff}");
        for (name, g) in &sdpa_grads {
            let d = (g - &our_grads[name]).abs().max().double_value(&[]);
            let scale = g.abs().max().double_value(&[]).max(1.0);
            assert!(d < 1e-5 * scale, "gradient of {name} differs by {d} at scale {scale}");
        }
        assert!(sdpa_grads.values().any(|g| g.abs().sum(Kind::Float).double_value(&[]) > 0.0), "gradients reach the parameters");
    }
}
