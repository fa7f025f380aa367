//! T5 encoder-decoder (T5 v1.0, v1.1, Flan-T5) with Hugging Face parameter names.
//!
//! What the retrieval toolkit needs from it: encoder states, the "ST5-EncDec" embedding (one
//! decoder step from the start token), greedy generation with a key/value cache, rank
//! classification by length-normalised option loss, Fusion-in-Decoder (passages encoded
//! separately, concatenated for the decoder) and FiD cross-attention passage scores.
//!
//! Parameters live in a [`VarStore`] whose variable names are the checkpoint names
//! (`encoder.block.0.layer.0.SelfAttention.q.weight`), so loading and saving are name for name
//! and a saved directory loads in `transformers`.
//!
//! Tied vs untied output layer and output scaling are two separate facts:
//! - the lm_head is *untied* when `config.json` says `tie_word_embeddings: false` or the
//!   checkpoint has an `lm_head.weight` that differs from `shared.weight` (transformers 5
//!   decides the same way: it always sets `tie_word_embeddings = true` in its config object and
//!   keeps a distinct `lm_head.weight` it finds);
//! - the decoder output is multiplied by `d_model^-0.5` before the lm_head when
//!   `scale_decoder_outputs` says so (transformers 5 writes this key), else when
//!   `tie_word_embeddings` is not `false` (the convention of v1.0 vs v1.1 configs).

use crate::models::dropout::dropout as apply_dropout;
use crate::models::onednn::{self, Dense, Epilogue};
use crate::models::weights::{save_safetensors, Checkpoint};
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Deserializer};
use std::path::Path;
use tch::nn::{self, Init, VarStore};
use tch::{Device, Kind, Tensor};

// ---------------------------------------------------------------------------------------------
// config
// ---------------------------------------------------------------------------------------------

/// The fields of a Hugging Face T5 `config.json` that the model uses. Everything else in the
/// file is kept verbatim (see [`T5Model::raw_config`]) and written back by [`T5Model::save`].
#[derive(Debug, Clone, Deserialize)]
pub struct T5Config {
    pub model_type: String,
    pub vocab_size: i64,
    pub d_model: i64,
    pub d_kv: i64,
    pub d_ff: i64,
    pub num_layers: usize,
    /// Defaults to `num_layers`.
    #[serde(default, deserialize_with = "null_as_default")]
    pub num_decoder_layers: Option<usize>,
    pub num_heads: i64,
    #[serde(default = "default_num_buckets")]
    pub relative_attention_num_buckets: i64,
    #[serde(default = "default_max_distance")]
    pub relative_attention_max_distance: i64,
    #[serde(default = "default_eps")]
    pub layer_norm_epsilon: f64,
    #[serde(default = "default_dropout")]
    pub dropout_rate: f64,
    /// `relu` (v1.0), `gated-gelu` (v1.1/Flan; uses the tanh-approximated gelu_new), or
    /// `[gated-]{relu,gelu,gelu_new,silu}`.
    #[serde(default = "default_ffp")]
    pub feed_forward_proj: String,
    #[serde(default = "default_true")]
    pub tie_word_embeddings: bool,
    /// transformers 5 writes this; when absent it follows `tie_word_embeddings`.
    #[serde(default, deserialize_with = "null_as_default")]
    pub scale_decoder_outputs: Option<bool>,
    #[serde(default, deserialize_with = "null_as_default")]
    pub decoder_start_token_id: i64,
    #[serde(default, deserialize_with = "null_as_default")]
    pub pad_token_id: i64,
    /// One id or a list of ids (generation stops at any of them).
    #[serde(default = "default_eos", deserialize_with = "one_or_many")]
    pub eos_token_id: Vec<i64>,
}

fn default_num_buckets() -> i64 {
    32
}
fn default_max_distance() -> i64 {
    128
}
fn default_eps() -> f64 {
    1e-6
}
fn default_dropout() -> f64 {
    0.1
}
fn default_ffp() -> String {
    "relu".into()
}
fn default_true() -> bool {
    true
}
fn default_eos() -> Vec<i64> {
    vec![1]
}

fn null_as_default<'de, D: Deserializer<'de>, T: Default + Deserialize<'de>>(d: D) -> Result<T, D::Error> {
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

fn one_or_many<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<i64>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(i64),
        Many(Vec<i64>),
    }
    Ok(match Option::<OneOrMany>::deserialize(d)? {
        None => default_eos(),
        Some(OneOrMany::One(id)) => vec![id],
        Some(OneOrMany::Many(ids)) => ids,
    })
}

impl T5Config {
    /// Read and check `dir/config.json`; also returns the file's full JSON.
    pub fn from_dir(dir: &Path) -> Result<(Self, serde_json::Value)> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).with_context(|| format!("{}: cannot read", path.display()))?;
        let raw: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", path.display()))?;
        let config = Self::from_value(&raw).with_context(|| format!("{}: not a usable T5 config", path.display()))?;
        Ok((config, raw))
    }

    /// Parse and check a config already read.
    pub fn from_value(raw: &serde_json::Value) -> Result<Self> {
        match raw.get("model_type").and_then(|t| t.as_str()) {
            Some("t5") => {}
            Some(other) => bail!("model_type is {other:?}, expected \"t5\" (this loader reads T5 / Flan-T5 checkpoints only)"),
            None => bail!("no \"model_type\" key (expected \"t5\")"),
        }
        let config: T5Config = serde_json::from_value(raw.clone())?;
        config.activation()?;
        if config.d_model <= 0 || config.d_kv <= 0 || config.num_heads <= 0 || config.d_ff <= 0 || config.vocab_size <= 0 {
            bail!("d_model, d_kv, num_heads, d_ff and vocab_size must be positive");
        }
        Ok(config)
    }

    pub fn decoder_layers(&self) -> usize {
        self.num_decoder_layers.unwrap_or(self.num_layers)
    }

    /// Whether the decoder output is multiplied by `d_model^-0.5` before the lm_head.
    pub fn scales_decoder_outputs(&self) -> bool {
        self.scale_decoder_outputs.unwrap_or(self.tie_word_embeddings)
    }

    /// (gated, activation) from `feed_forward_proj`, as transformers' T5Config reads it.
    fn activation(&self) -> Result<(bool, Activation)> {
        let parts: Vec<&str> = self.feed_forward_proj.split('-').collect();
        let (gated, name) = match parts.as_slice() {
            [name] => (false, *name),
            ["gated", name] => (true, *name),
            _ => bail!("feed_forward_proj {:?} is not \"ACT\" or \"gated-ACT\"", self.feed_forward_proj),
        };
        let act = match name {
            "relu" => Activation::Relu,
            // transformers maps "gated-gelu" to gelu_new for backward compatibility, but a plain
            // "gelu" stays the exact erf gelu.
            "gelu" if gated => Activation::GeluNew,
            "gelu" => Activation::Gelu,
            "gelu_new" => Activation::GeluNew,
            "gelu_pytorch_tanh" => Activation::GeluTanh,
            "silu" | "swish" => Activation::Silu,
            other => bail!("feed_forward_proj {:?}: unsupported activation {other:?}", self.feed_forward_proj),
        };
        Ok((gated, act))
    }
}

#[derive(Debug, Clone, Copy)]
enum Activation {
    Relu,
    Gelu,
    /// The tanh approximation written out op by op, as transformers' `gelu_new` computes it:
    /// the fused kernel (`GeluTanh`) differs in the last bits, which the v1.1 logits amplify.
    GeluNew,
    GeluTanh,
    Silu,
}

impl Activation {
    fn apply(self, x: &Tensor) -> Tensor {
        match self {
            Activation::Relu => x.relu(),
            Activation::Gelu => x.gelu("none"),
            Activation::GeluNew => {
                let inner = (x + x.pow_tensor_scalar(3.0) * 0.044715) * (2.0 / std::f64::consts::PI).sqrt();
                x * 0.5 * (inner.tanh() + 1.0)
            }
            Activation::GeluTanh => x.gelu("tanh"),
            Activation::Silu => x.silu(),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// layers
// ---------------------------------------------------------------------------------------------

/// The most negative finite value of `kind`: the additive mask. Finite, not -inf, so that a
/// fully masked row gives a uniform softmax instead of NaN, as in transformers.
fn mask_value(kind: Kind) -> f64 {
    match kind {
        Kind::BFloat16 => -3.3895313892515355e38,
        Kind::Half => -65504.0,
        Kind::Double => f64::MIN,
        _ => f32::MIN as f64,
    }
}

/// `x·Wᵀ` (T5 projections have no bias). Large CPU inference products go through oneDNN
/// (see `models::onednn`: the weight packed once, no repacking inside the GEMM).
fn linear(x: &Tensor, w: &Tensor) -> Tensor {
    let shape = x.size();
    let inner = *shape.last().expect("linear input has a feature axis");
    let rows = if inner == 0 { 0 } else { x.numel() as i64 / inner };
    // Smaller inputs (decoding steps, short batches) stay on `linear`: see `onednn::MIN_ROWS`.
    if rows >= onednn::MIN_ROWS && onednn::usable(x.device(), x.kind()) && w.kind() == x.kind() {
        let product = Dense::pack(w, None, rows).and_then(|d| d.forward(&x.reshape([rows, inner]), Epilogue::None));
        match product {
            Ok(y) => {
                let mut out = shape;
                *out.last_mut().unwrap() = w.size()[0];
                return y.view(out.as_slice());
            }
            Err(err) => onednn::warn_once(&err),
        }
    }
    x.linear::<Tensor>(w, None)
}

/// T5's RMS norm: no mean subtraction, no bias.
struct LayerNorm {
    weight: Tensor,
    eps: f64,
}

impl LayerNorm {
    fn new(p: nn::Path, d: i64, eps: f64) -> Self {
        LayerNorm { weight: p.var("weight", &[d], Init::Const(1.0)), eps }
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        // The variance is accumulated in f32 even for bf16/f16 activations, as transformers does.
        let x32 = x.to_kind(Kind::Float);
        let variance = x32.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float);
        let normed = (x32 * (variance + self.eps).rsqrt()).to_kind(self.weight.kind());
        normed * &self.weight
    }
}

struct Attention {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    /// Only the first block of each stack owns one; the bias is shared by all blocks.
    relative_attention_bias: Option<Tensor>,
    n_heads: i64,
    d_kv: i64,
}

impl Attention {
    fn new(p: nn::Path, c: &T5Config, has_relative_bias: bool) -> Self {
        let inner = c.num_heads * c.d_kv;
        // Zeros, not a random init: every T5Model is filled from a checkpoint.
        let w = |name: &str, out: i64, inp: i64| (&p / name).var("weight", &[out, inp], Init::Const(0.0));
        Attention {
            q: w("q", inner, c.d_model),
            k: w("k", inner, c.d_model),
            v: w("v", inner, c.d_model),
            o: w("o", c.d_model, inner),
            relative_attention_bias: has_relative_bias.then(|| {
                (&p / "relative_attention_bias").var("weight", &[c.relative_attention_num_buckets, c.num_heads], Init::Const(0.0))
            }),
            n_heads: c.num_heads,
            d_kv: c.d_kv,
        }
    }

    /// [B, T, H*d_kv] -> [B, H, T, d_kv]
    fn heads(&self, x: &Tensor) -> Tensor {
        let (b, t, _) = x.size3().unwrap();
        x.view([b, t, self.n_heads, self.d_kv]).transpose(1, 2)
    }

    /// `bias` is the position bias plus the additive mask, broadcastable to [B, H, Tq, Tk].
    /// Returns the output and, when `keep_logits`, the pre-softmax `q·k` [B, H, Tq, Tk]
    /// (T5 does not scale by 1/sqrt(d_kv): the init of `q` absorbs it).
    fn attend(&self, q: &Tensor, k: &Tensor, v: &Tensor, bias: &Tensor, dropout: f64, keep_logits: bool) -> (Tensor, Option<Tensor>) {
        let logits = q.matmul(&k.transpose(-1, -2));
        // As transformers: the bias added in the logits' precision (in place there: bf16 logits
        // under autocast, whatever the bias's), the softmax taken in float32 and its result
        // put back in that precision.
        let scores = (&logits + bias).to_kind(logits.kind());
        let probs = apply_dropout(&scores.softmax(-1, Kind::Float).to_kind(scores.kind()), dropout, dropout > 0.0);
        let (b, _, t, _) = q.size4().unwrap();
        let out = probs.matmul(v).transpose(1, 2).contiguous().view([b, t, self.n_heads * self.d_kv]);
        (linear(&out, &self.o), keep_logits.then_some(logits))
    }
}

/// Relative position -> bucket, exactly as Mesh TensorFlow / transformers: half the buckets
/// for exact small distances, the rest logarithmic up to `max_distance`; the decoder
/// (unidirectional) only sees the past.
fn relative_position_bucket(rel: &Tensor, bidirectional: bool, num_buckets: i64, max_distance: i64) -> Tensor {
    let mut nb = num_buckets;
    let (mut buckets, rel) = if bidirectional {
        nb /= 2;
        (rel.gt(0).to_kind(Kind::Int64) * nb, rel.abs())
    } else {
        (rel.zeros_like(), -rel.clamp_max(0))
    };
    let max_exact = nb / 2;
    let is_small = rel.lt(max_exact);
    // f32 then truncation toward zero, like transformers (`.float()` ... `.to(torch.long)`).
    let large = (rel.to_kind(Kind::Float) / max_exact as f64).log() / (max_distance as f64 / max_exact as f64).ln()
        * (nb - max_exact) as f64;
    let large = (large.to_kind(Kind::Int64) + max_exact).clamp_max(nb - 1);
    buckets += rel.where_self(&is_small, &large);
    buckets
}

enum FeedForward {
    Dense { wi: Tensor, wo: Tensor },
    Gated { wi_0: Tensor, wi_1: Tensor, wo: Tensor },
}

struct LayerFF {
    ff: FeedForward,
    act: Activation,
    layer_norm: LayerNorm,
}

impl LayerFF {
    fn new(p: nn::Path, c: &T5Config) -> Result<Self> {
        let (gated, act) = c.activation()?;
        let d = &p / "DenseReluDense";
        let w = |name: &str, out: i64, inp: i64| (&d / name).var("weight", &[out, inp], Init::Const(0.0));
        let ff = if gated {
            FeedForward::Gated { wi_0: w("wi_0", c.d_ff, c.d_model), wi_1: w("wi_1", c.d_ff, c.d_model), wo: w("wo", c.d_model, c.d_ff) }
        } else {
            FeedForward::Dense { wi: w("wi", c.d_ff, c.d_model), wo: w("wo", c.d_model, c.d_ff) }
        };
        Ok(LayerFF { ff, act, layer_norm: LayerNorm::new(&p / "layer_norm", c.d_model, c.layer_norm_epsilon) })
    }

    fn forward(&self, x: &Tensor, dropout: f64) -> Tensor {
        let h = self.layer_norm.forward(x);
        let (h, wo) = match &self.ff {
            FeedForward::Dense { wi, wo } => (self.act.apply(&linear(&h, wi)), wo),
            FeedForward::Gated { wi_0, wi_1, wo } => (self.act.apply(&linear(&h, wi_0)) * linear(&h, wi_1), wo),
        };
        // `wo` may be kept in f32 while the rest is bf16 (transformers does that for Flan-T5-XXL).
        let h = linear(&apply_dropout(&h, dropout, dropout > 0.0).to_kind(wo.kind()), wo);
        x + apply_dropout(&h.to_kind(x.kind()), dropout, dropout > 0.0)
    }
}

struct Block {
    self_ln: LayerNorm,
    self_attn: Attention,
    /// Decoder blocks only.
    cross: Option<(LayerNorm, Attention)>,
    ff: LayerFF,
}

/// Per decoder block: self-attention keys/values so far, and the cross-attention keys/values
/// (computed from the encoder output once).
#[derive(Default)]
struct LayerCache {
    self_kv: Option<(Tensor, Tensor)>,
    cross_kv: Option<(Tensor, Tensor)>,
}

/// Key/value cache for incremental decoding. One cache belongs to one encoder output: start a
/// new one for new inputs.
#[derive(Default)]
pub struct KvCache {
    layers: Vec<LayerCache>,
    len: i64,
}

impl KvCache {
    pub fn new() -> Self {
        Self::default()
    }

    /// Decoder positions already cached.
    pub fn len(&self) -> i64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

struct Stack {
    blocks: Vec<Block>,
    final_layer_norm: LayerNorm,
    is_decoder: bool,
    num_buckets: i64,
    max_distance: i64,
}

/// What the decoder stack is asked for besides its output.
struct DecoderExtras<'a> {
    cache: Option<&'a mut KvCache>,
    /// Filled with each block's cross-attention `q·k` [B, H, Tq, Tk].
    cross_logits: Option<&'a mut Vec<Tensor>>,
}

impl Stack {
    fn new(p: nn::Path, c: &T5Config, n_layers: usize, is_decoder: bool) -> Result<Self> {
        let mut blocks = Vec::with_capacity(n_layers);
        for i in 0..n_layers {
            let layer = &p / "block" / i as i64 / "layer";
            let self_ln = LayerNorm::new(&layer / 0 / "layer_norm", c.d_model, c.layer_norm_epsilon);
            let self_attn = Attention::new(&layer / 0 / "SelfAttention", c, i == 0);
            let cross = is_decoder.then(|| {
                (
                    LayerNorm::new(&layer / 1 / "layer_norm", c.d_model, c.layer_norm_epsilon),
                    Attention::new(&layer / 1 / "EncDecAttention", c, false),
                )
            });
            let ff = LayerFF::new(&layer / if is_decoder { 2 } else { 1 }, c)?;
            blocks.push(Block { self_ln, self_attn, cross, ff });
        }
        Ok(Stack {
            blocks,
            final_layer_norm: LayerNorm::new(&p / "final_layer_norm", c.d_model, c.layer_norm_epsilon),
            is_decoder,
            num_buckets: c.relative_attention_num_buckets,
            max_distance: c.relative_attention_max_distance,
        })
    }

    /// [1, H, q_len, k_len] relative position bias for queries at `offset..offset+q_len`.
    fn position_bias(&self, q_len: i64, k_len: i64, offset: i64, device: Device) -> Tensor {
        let table = self.blocks[0].self_attn.relative_attention_bias.as_ref().expect("block 0 owns the bias");
        let ctx = Tensor::arange_start(offset, offset + q_len, (Kind::Int64, device)).unsqueeze(1);
        let mem = Tensor::arange(k_len, (Kind::Int64, device)).unsqueeze(0);
        let bucket = relative_position_bucket(&(mem - ctx), !self.is_decoder, self.num_buckets, self.max_distance);
        Tensor::embedding(table, &bucket, -1, false, false).permute([2, 0, 1]).unsqueeze(0)
    }

    #[allow(clippy::assign_op_pattern)]
    fn forward(
        &self,
        embeds: &Tensor,
        self_mask: Option<&Tensor>,
        encoder: Option<(&Tensor, &Tensor)>,
        mut extras: DecoderExtras,
        dropout: f64,
    ) -> Tensor {
        let kind = embeds.kind();
        let device = embeds.device();
        let (_, t, _) = embeds.size3().unwrap();
        let offset = extras.cache.as_ref().map_or(0, |c| c.len);
        let k_len = offset + t;

        let mut self_bias = self.position_bias(t, k_len, offset, device).to_kind(kind);
        if self.is_decoder {
            // causal: position offset+i sees keys 0..=offset+i
            let q_pos = Tensor::arange_start(offset, k_len, (Kind::Int64, device)).unsqueeze(1);
            let k_pos = Tensor::arange(k_len, (Kind::Int64, device)).unsqueeze(0);
            let future = k_pos.gt_tensor(&q_pos).to_kind(kind) * mask_value(kind);
            self_bias = self_bias + future.view([1, 1, t, k_len]);
        }
        if let Some(mask) = self_mask {
            // not `+=`: in place cannot broadcast [1, H, T, T] up to [B, H, T, T]
            self_bias = self_bias + additive_mask(mask, kind);
        }
        let cross_bias = encoder.map(|(_, m)| additive_mask(m, kind));

        if let Some(cache) = extras.cache.as_deref_mut() {
            cache.layers.resize_with(self.blocks.len().max(cache.layers.len()), LayerCache::default);
        }

        let mut h = apply_dropout(embeds, dropout, dropout > 0.0);
        for (i, block) in self.blocks.iter().enumerate() {
            // self-attention
            let a = &block.self_attn;
            let x = block.self_ln.forward(&h);
            let q = a.heads(&linear(&x, &a.q));
            let mut k = a.heads(&linear(&x, &a.k));
            let mut v = a.heads(&linear(&x, &a.v));
            if let Some(cache) = extras.cache.as_deref_mut() {
                let slot = &mut cache.layers[i].self_kv;
                if let Some((pk, pv)) = slot.as_ref() {
                    k = Tensor::cat(&[pk, &k], 2);
                    v = Tensor::cat(&[pv, &v], 2);
                }
                *slot = Some((k.shallow_clone(), v.shallow_clone()));
            }
            let (out, _) = a.attend(&q, &k, &v, &self_bias, dropout, false);
            h = &h + apply_dropout(&out, dropout, dropout > 0.0);

            // cross-attention
            if let (Some((ln, ca)), Some((enc, _))) = (&block.cross, encoder) {
                let x = ln.forward(&h);
                let q = ca.heads(&linear(&x, &ca.q));
                let cached = extras.cache.as_deref().and_then(|c| c.layers[i].cross_kv.as_ref()).map(|(k, v)| (k.shallow_clone(), v.shallow_clone()));
                let (k, v) = match cached {
                    Some(kv) => kv,
                    None => {
                        let kv = (ca.heads(&linear(enc, &ca.k)), ca.heads(&linear(enc, &ca.v)));
                        if let Some(cache) = extras.cache.as_deref_mut() {
                            cache.layers[i].cross_kv = Some((kv.0.shallow_clone(), kv.1.shallow_clone()));
                        }
                        kv
                    }
                };
                let keep = extras.cross_logits.is_some();
                let (out, logits) = ca.attend(&q, &k, &v, cross_bias.as_ref().unwrap(), dropout, keep);
                if let (Some(sink), Some(l)) = (extras.cross_logits.as_deref_mut(), logits) {
                    sink.push(l);
                }
                h = &h + apply_dropout(&out, dropout, dropout > 0.0);
            }

            h = block.ff.forward(&h, dropout);
        }
        if let Some(cache) = extras.cache.as_deref_mut() {
            cache.len = k_len;
        }
        apply_dropout(&self.final_layer_norm.forward(&h), dropout, dropout > 0.0)
    }
}

/// [B, Tk] 1/0 mask -> [B, 1, 1, Tk] additive bias.
fn additive_mask(mask: &Tensor, kind: Kind) -> Tensor {
    let (b, tk) = mask.size2().unwrap();
    let padding: Tensor = 1.0 - mask.to_kind(kind);
    padding.view([b, 1, 1, tk]) * mask_value(kind)
}

// ---------------------------------------------------------------------------------------------
// the model
// ---------------------------------------------------------------------------------------------

/// T5 for conditional generation (`T5ForConditionalGeneration` in transformers).
pub struct T5Model {
    vs: VarStore,
    config: T5Config,
    raw_config: serde_json::Value,
    shared: Tensor,
    encoder: Stack,
    decoder: Stack,
    /// `None`: the output layer is `shared`.
    lm_head: Option<Tensor>,
    train: bool,
}

impl T5Model {
    /// Read `dir/config.json` and `dir/model.safetensors` (or a sharded index). Errors name the
    /// file, and the tensor when one is missing or has the wrong shape.
    pub fn load(dir: &Path, device: Device) -> Result<Self> {
        let (config, raw_config) = T5Config::from_dir(dir)?;
        let ckpt = Checkpoint::open(dir)?;
        let untied = !config.tie_word_embeddings || (ckpt.contains("lm_head.weight") && lm_head_differs(&ckpt)?);
        let mut model = Self::new(config, raw_config, untied, device)
            .with_context(|| format!("{}: not a usable T5 config", dir.join("config.json").display()))?;
        // Tied embeddings are stored once; older exports name them after the stacks.
        let aliases = [("shared.weight", "encoder.embed_tokens.weight"), ("shared.weight", "decoder.embed_tokens.weight")];
        ckpt.load_into(&mut model.vs, &[""], &aliases)?;
        Ok(model)
    }

    /// A model with zero weights in a fresh VarStore (callers then load a checkpoint into it).
    fn new(config: T5Config, raw_config: serde_json::Value, untied: bool, device: Device) -> Result<Self> {
        let vs = VarStore::new(device);
        let root = vs.root();
        let shared = (&root / "shared").var("weight", &[config.vocab_size, config.d_model], Init::Const(0.0));
        let encoder = Stack::new(&root / "encoder", &config, config.num_layers, false)?;
        let decoder = Stack::new(&root / "decoder", &config, config.decoder_layers(), true)?;
        let lm_head = untied.then(|| (&root / "lm_head").var("weight", &[config.vocab_size, config.d_model], Init::Const(0.0)));
        Ok(T5Model { vs, config, raw_config, shared, encoder, decoder, lm_head, train: false })
    }

    pub fn config(&self) -> &T5Config {
        &self.config
    }

    /// `config.json` as read, including the fields [`T5Config`] does not model.
    pub fn raw_config(&self) -> &serde_json::Value {
        &self.raw_config
    }

    /// The parameters (`trainable_variables()` for an optimizer).
    pub fn var_store(&self) -> &VarStore {
        &self.vs
    }

    /// For `bfloat16()`, `to_device`, `freeze`: the model's tensors follow the store.
    pub fn var_store_mut(&mut self) -> &mut VarStore {
        &mut self.vs
    }

    pub fn device(&self) -> Device {
        self.vs.device()
    }

    /// Whether the output layer has its own weight (v1.1/Flan) rather than `shared`.
    pub fn has_separate_lm_head(&self) -> bool {
        self.lm_head.is_some()
    }

    /// Dropout on (`config.dropout_rate`) in training mode, off in eval mode (the default).
    pub fn set_train(&mut self, train: bool) {
        self.train = train;
    }

    pub fn is_train(&self) -> bool {
        self.train
    }

    fn dropout(&self) -> f64 {
        if self.train {
            self.config.dropout_rate
        } else {
            0.0
        }
    }

    fn embed(&self, ids: &Tensor) -> Tensor {
        Tensor::embedding(&self.shared, &super::upload(ids, self.device()), -1, false, false)
    }

    /// Encoder last hidden state [B, L, d] (after the final layer norm).
    /// `attention_mask` is 1 for real tokens, 0 for padding.
    pub fn encode(&self, input_ids: &Tensor, attention_mask: &Tensor) -> Tensor {
        let mask = super::upload(attention_mask, self.device());
        let extras = DecoderExtras { cache: None, cross_logits: None };
        self.encoder.forward(&self.embed(input_ids), Some(&mask), None, extras, self.dropout())
    }

    /// Decoder hidden states [B, T, d] after the final layer norm (before any output scaling).
    /// With a cache, `decoder_input_ids` are only the new positions.
    pub fn decode(&self, decoder_input_ids: &Tensor, encoder_hidden: &Tensor, encoder_mask: &Tensor, cache: Option<&mut KvCache>) -> Tensor {
        self.decode_with(decoder_input_ids, encoder_hidden, encoder_mask, DecoderExtras { cache, cross_logits: None })
    }

    fn decode_with(&self, ids: &Tensor, enc: &Tensor, enc_mask: &Tensor, extras: DecoderExtras) -> Tensor {
        let enc_mask = super::upload(enc_mask, self.device());
        self.decoder.forward(&self.embed(ids), None, Some((enc, &enc_mask)), extras, self.dropout())
    }

    /// Vocabulary logits [.., V] from decoder hidden states.
    pub fn lm_logits(&self, hidden: &Tensor) -> Tensor {
        let h = if self.config.scales_decoder_outputs() { hidden * (self.config.d_model as f64).powf(-0.5) } else { hidden.shallow_clone() };
        linear(&h, self.lm_head.as_ref().unwrap_or(&self.shared))
    }

    fn start_tokens(&self, batch: i64) -> Tensor {
        Tensor::full([batch, 1], self.config.decoder_start_token_id, (Kind::Int64, self.device()))
    }

    /// ST5-EncDec embedding [B, d]: the decoder's final hidden state after one step from the
    /// start token (REFERENCE §3).
    pub fn st5_embedding(&self, input_ids: &Tensor, attention_mask: &Tensor) -> Tensor {
        let enc = self.encode(input_ids, attention_mask);
        let start = self.start_tokens(enc.size()[0]);
        self.decode(&start, &enc, attention_mask, None).select(1, 0)
    }

    /// Greedy decoding with a key/value cache. Each row starts with the start token, as in
    /// transformers, and ends at its first eos (included) or after `max_new_tokens`; unlike
    /// transformers' padded matrix, rows are not padded to a common length.
    pub fn generate_greedy(&self, input_ids: &Tensor, attention_mask: &Tensor, max_new_tokens: usize) -> Vec<Vec<i64>> {
        let _no_grad = tch::no_grad_guard();
        let enc = self.encode(input_ids, attention_mask);
        self.generate_greedy_from_encoded(&enc, attention_mask, max_new_tokens)
    }

    /// [`generate_greedy`](Self::generate_greedy) from encoder states (e.g. [`fid_encode`](Self::fid_encode)'s).
    pub fn generate_greedy_from_encoded(&self, encoder_hidden: &Tensor, encoder_mask: &Tensor, max_new_tokens: usize) -> Vec<Vec<i64>> {
        let _no_grad = tch::no_grad_guard();
        let b = encoder_hidden.size()[0];
        let start = self.config.decoder_start_token_id;
        let mut rows: Vec<Vec<i64>> = vec![vec![start]; b as usize];
        let mut done = vec![false; b as usize];
        let mut cache = KvCache::new();
        let mut next = self.start_tokens(b);
        for _ in 0..max_new_tokens {
            let h = self.decode(&next, encoder_hidden, encoder_mask, Some(&mut cache));
            let best = Vec::<i64>::try_from(self.lm_logits(&h.select(1, -1)).argmax(-1, false).to_device(Device::Cpu)).unwrap();
            // Finished rows are fed padding, as transformers does; their output is not kept.
            let mut fed = Vec::with_capacity(best.len());
            for (r, &tok) in best.iter().enumerate() {
                if done[r] {
                    fed.push(self.config.pad_token_id);
                } else {
                    rows[r].push(tok);
                    done[r] = self.config.eos_token_id.contains(&tok);
                    fed.push(tok);
                }
            }
            if done.iter().all(|&d| d) {
                break;
            }
            next = Tensor::from_slice(&fed).view([b, 1]).to_device(self.device());
        }
        rows
    }

    /// Rank classification: for every input row and every option, the mean (over the option's
    /// tokens) cross-entropy of the option as decoder labels, teacher-forced (decoder input =
    /// start token + option shifted right). Returns [B, K] in f32; lower is better.
    pub fn option_losses(&self, input_ids: &Tensor, attention_mask: &Tensor, options: &[Vec<i64>]) -> Result<Tensor> {
        let enc = self.encode(input_ids, attention_mask);
        self.option_losses_from_encoded(&enc, attention_mask, options)
    }

    /// [`option_losses`](Self::option_losses) from encoder states (FiD rank classification).
    pub fn option_losses_from_encoded(&self, encoder_hidden: &Tensor, encoder_mask: &Tensor, options: &[Vec<i64>]) -> Result<Tensor> {
        if options.is_empty() || options.iter().any(|o| o.is_empty()) {
            bail!("option_losses: every option needs at least one token");
        }
        let device = self.device();
        let (b, k) = (encoder_hidden.size()[0], options.len() as i64);
        let t = options.iter().map(Vec::len).max().unwrap();
        let (mut labels, mut dec_in) = (Vec::new(), Vec::new());
        for o in options {
            labels.extend(o.iter().copied().chain(std::iter::repeat_n(-100, t - o.len())));
            dec_in.push(self.config.decoder_start_token_id);
            dec_in.extend(o[..o.len() - 1].iter().copied().chain(std::iter::repeat_n(self.config.pad_token_id, t - o.len())));
        }
        let t = t as i64;
        let labels = Tensor::from_slice(&labels).view([1, k, t]).expand([b, k, t], false).reshape([b * k, t]).to_device(device);
        let dec_in = Tensor::from_slice(&dec_in).view([1, k, t]).expand([b, k, t], false).reshape([b * k, t]).to_device(device);
        let enc = encoder_hidden.repeat_interleave_self_int(k, 0, None);
        let mask = encoder_mask.to_device(device).repeat_interleave_self_int(k, 0, None);
        let logits = self.lm_logits(&self.decode(&dec_in, &enc, &mask, None)).to_kind(Kind::Float);
        let valid = labels.ne(-100);
        let logp = logits.log_softmax(-1, Kind::Float).gather(-1, &labels.clamp_min(0).unsqueeze(-1), false).squeeze_dim(-1);
        let nll = -(logp * valid.to_kind(Kind::Float));
        Ok((nll.sum_dim_intlist(1, false, Kind::Float) / valid.sum_dim_intlist(1, false, Kind::Float)).view([b, k]))
    }

    /// Fusion-in-Decoder encoding: passages [N, L] (one question) or [B, N, L] are encoded one
    /// row at a time and concatenated along the sequence: ([B, N*L, d], mask [B, N*L]).
    pub fn fid_encode(&self, passages_ids: &Tensor, passages_mask: &Tensor) -> (Tensor, Tensor) {
        let (ids, mask) = fid_batch(passages_ids, passages_mask);
        let (b, n, l) = ids.size3().unwrap();
        let enc = self.encode(&ids.reshape([b * n, l]), &mask.reshape([b * n, l]));
        (enc.reshape([b, n * l, self.config.d_model]), mask.reshape([b, n * l]).to_device(self.device()))
    }

    /// AAR passage scores [B, N] (REFERENCE §6): the pre-softmax cross-attention logits `q·k` of
    /// decoder position 0 (one step from the start token) in every decoder layer, padding zeroed,
    /// summed over layers, heads and each passage's real tokens, divided by
    /// real tokens × layers × heads. Passages as for [`fid_encode`](Self::fid_encode).
    pub fn cross_attention_scores(&self, passages_ids: &Tensor, passages_mask: &Tensor) -> Tensor {
        let (ids, _) = fid_batch(passages_ids, passages_mask);
        let n = ids.size()[1];
        let (enc, mask) = self.fid_encode(passages_ids, passages_mask);
        self.cross_attention_scores_from_encoded(&enc, &mask, n)
    }

    /// [`cross_attention_scores`](Self::cross_attention_scores) from FiD encoder states
    /// [B, N*L, d] and mask [B, N*L] of `n_passages` equal-length segments.
    pub fn cross_attention_scores_from_encoded(&self, encoder_hidden: &Tensor, encoder_mask: &Tensor, n_passages: i64) -> Tensor {
        let (b, nl, _) = encoder_hidden.size3().unwrap();
        let mut logits = Vec::new();
        let extras = DecoderExtras { cache: None, cross_logits: Some(&mut logits) };
        let _hidden = self.decode_with(&self.start_tokens(b), encoder_hidden, encoder_mask, extras);
        let layers = logits.len() as f64;
        // [B, H, 1, N*L] per layer -> summed over layers and heads: [B, N*L]
        let total = logits
            .iter()
            .map(|l| l.select(2, 0).to_kind(Kind::Float).sum_dim_intlist(1, false, Kind::Float))
            .reduce(|a, c| a + c)
            .expect("the decoder has at least one layer");
        let real = encoder_mask.to_device(self.device()).to_kind(Kind::Float);
        let l = nl / n_passages;
        let per_passage = (total * &real).view([b, n_passages, l]).sum_dim_intlist(2, false, Kind::Float);
        // An all-padding passage scores 0 rather than NaN.
        let count = real.view([b, n_passages, l]).sum_dim_intlist(2, false, Kind::Float).clamp_min(1.0);
        per_passage / (count * layers * self.config.num_heads as f64)
    }

    /// Write `dir/config.json` (the original file's JSON, unknown keys kept) and
    /// `dir/model.safetensors` (HF names; a tied model stores `shared.weight` only, which
    /// transformers loads with no missing keys).
    pub fn save(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).with_context(|| format!("{}: cannot create directory", dir.display()))?;
        let text = serde_json::to_string_pretty(&self.raw_config)? + "\n";
        crate::fsutil::write_bytes(&dir.join("config.json"), text.as_bytes())?;
        let mut tensors: Vec<(String, Tensor)> = self.vs.variables().into_iter().collect();
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        save_safetensors(&dir.join("model.safetensors"), &tensors)
    }
}

/// [N, L] -> [1, N, L]; [B, N, L] unchanged.
fn fid_batch(ids: &Tensor, mask: &Tensor) -> (Tensor, Tensor) {
    if ids.dim() == 2 {
        (ids.unsqueeze(0), mask.unsqueeze(0))
    } else {
        (ids.shallow_clone(), mask.shallow_clone())
    }
}

/// A checkpoint that stores `lm_head.weight` equal to `shared.weight` is a tied model saved
/// with both names; one whose values differ is untied even if its config says otherwise
/// (transformers 5 behaves the same way).
fn lm_head_differs(ckpt: &Checkpoint) -> Result<bool> {
    if !ckpt.contains("shared.weight") {
        return Ok(true);
    }
    let (a, b) = (ckpt.tensor("lm_head.weight")?, ckpt.tensor("shared.weight")?);
    Ok(a.size() != b.size() || !a.equal(&b))
}
