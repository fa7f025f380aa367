//! Turning token states into one vector per text, and reading the sentence-transformers
//! settings (`modules.json`, `1_Pooling/config.json`, `Normalize`) a checkpoint may carry.

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;
use tch::{Kind, Tensor};

/// How token states become a text embedding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Pooling {
    /// The first token's state (`[CLS]`), as DPR and TASER use.
    Cls,
    /// The mean over real (unmasked) tokens, as sentence-transformers' MiniLM uses.
    Mean,
}

/// Pool `[B, L, H]` states with the `[B, L]` mask into `[B, H]`, optionally L2-normalised.
pub fn pool(states: &Tensor, mask: &Tensor, pooling: Pooling, normalize: bool) -> Tensor {
    let out = match pooling {
        Pooling::Cls => states.select(1, 0),
        Pooling::Mean => {
            let m = mask.to_kind(states.kind()).unsqueeze(-1);
            let sum = (states * &m).sum_dim_intlist(1, false, states.kind());
            sum / m.sum_dim_intlist(1, false, states.kind()).clamp_min(1e-9)
        }
    };
    if normalize {
        // As torch.nn.functional.normalize: x / max(||x||, eps).
        let norm = out.norm_scalaropt_dim(2, [-1], true).clamp_min(1e-12);
        out / norm
    } else {
        out
    }
}

/// What a sentence-transformers checkpoint directory asks for.
#[derive(Debug, Clone, PartialEq)]
pub struct SentenceTransformersSettings {
    pub pooling: Pooling,
    pub normalize: bool,
    pub max_seq_length: Option<usize>,
}

/// Read sentence-transformers settings from `dir`, if it has a `modules.json`.
pub fn sentence_transformers_settings(dir: &Path) -> Result<Option<SentenceTransformersSettings>> {
    let modules_path = dir.join("modules.json");
    if !modules_path.exists() {
        return Ok(None);
    }
    let read = |p: &Path| -> Result<serde_json::Value> {
        let text = std::fs::read_to_string(p).with_context(|| format!("{}: cannot read", p.display()))?;
        serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", p.display()))
    };
    let modules = read(&modules_path)?;
    let list = modules.as_array().with_context(|| format!("{}: expected a list of modules", modules_path.display()))?;
    let mut pooling = Pooling::Cls;
    let mut normalize = false;
    for m in list {
        let kind = m["type"].as_str().unwrap_or_default();
        if kind.ends_with("Pooling") {
            let p = dir.join(m["path"].as_str().unwrap_or("1_Pooling")).join("config.json");
            let cfg = read(&p)?;
            pooling = if cfg["pooling_mode_mean_tokens"].as_bool() == Some(true) {
                Pooling::Mean
            } else if cfg["pooling_mode_cls_token"].as_bool() == Some(true) {
                Pooling::Cls
            } else {
                anyhow::bail!("{}: only CLS or mean pooling is supported", p.display());
            };
        } else if kind.ends_with("Normalize") {
            normalize = true;
        }
    }
    let max_seq_length = std::fs::read_to_string(dir.join("sentence_bert_config.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .and_then(|v| v["max_seq_length"].as_u64())
        .map(|n| n as usize);
    Ok(Some(SentenceTransformersSettings { pooling, normalize, max_seq_length }))
}

/// Convert to f32 for comparisons and output files.
pub fn to_f32(t: &Tensor) -> Tensor {
    t.to_kind(Kind::Float)
}
