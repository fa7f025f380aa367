//! Turning token states into one vector per text, and reading the sentence-transformers
//! settings (`modules.json`, `1_Pooling/config.json`, `Normalize`) a checkpoint may carry.

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;
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

/// Read sentence-transformers settings from `dir`, if it has a `modules.json`. Both formats are
/// read: up to 5.x (`sentence_transformers.models.Pooling` with `pooling_mode_*_tokens` flags,
/// `max_seq_length` in `sentence_bert_config.json`) and 6.x (type paths such as
/// `sentence_transformers.sentence_transformer.modules.pooling.Pooling`, `"pooling_mode":
/// "mean"`, the length in `tokenizer_config.json`).
pub fn sentence_transformers_settings(dir: &Path) -> Result<Option<SentenceTransformersSettings>> {
    let modules_path = dir.join("modules.json");
    if !modules_path.exists() {
        return Ok(None);
    }
    let modules = read_json(&modules_path)?;
    let list = modules.as_array().with_context(|| format!("{}: expected a list of modules", modules_path.display()))?;
    let mut pooling = Pooling::Cls;
    let mut normalize = false;
    for m in list {
        match module_class(m["type"].as_str().unwrap_or_default()) {
            "Pooling" => {
                let p = dir.join(m["path"].as_str().unwrap_or("1_Pooling")).join("config.json");
                pooling = pooling_mode(&p, &read_json(&p)?)?;
            }
            "Normalize" => normalize = true,
            _ => {}
        }
    }
    let max_seq_length = max_seq_length(dir)?;
    Ok(Some(SentenceTransformersSettings { pooling, normalize, max_seq_length }))
}

/// The class a `modules.json` type path names (its last component), so that old and new paths
/// match alike, and `WeightedLayerPooling` is not taken for `Pooling`.
fn module_class(type_path: &str) -> &str {
    type_path.rsplit('.').next().unwrap_or(type_path)
}

/// The pooling a `Pooling` module's `config.json` (at `path`) asks for. 6.x writes
/// `"pooling_mode": "mean"` (or a list, whose modes are concatenated); older versions one
/// boolean per mode, which 6.x still reads.
fn pooling_mode(path: &Path, cfg: &Value) -> Result<Pooling> {
    let modes: Vec<String> = match &cfg["pooling_mode"] {
        Value::String(mode) => vec![mode.clone()],
        Value::Array(list) => list.iter().map(|m| m.as_str().unwrap_or("?").to_string()).collect(),
        Value::Null => legacy_pooling_modes(cfg),
        other => bail!("{}: \"pooling_mode\" should be a string or a list, not {other}", path.display()),
    };
    match modes.iter().map(String::as_str).collect::<Vec<_>>().as_slice() {
        ["mean"] => Ok(Pooling::Mean),
        ["cls"] => Ok(Pooling::Cls),
        _ => bail!("{}: pooling {modes:?} is not supported (only \"mean\" or \"cls\", one mode)", path.display()),
    }
}

/// Modes switched on by the pre-6.0 booleans, under their 6.x names.
fn legacy_pooling_modes(cfg: &Value) -> Vec<String> {
    const NAMES: [(&str, &str); 6] = [
        ("pooling_mode_cls_token", "cls"),
        ("pooling_mode_mean_tokens", "mean"),
        ("pooling_mode_max_tokens", "max"),
        ("pooling_mode_mean_sqrt_len_tokens", "mean_sqrt_len_tokens"),
        ("pooling_mode_weightedmean_tokens", "weightedmean"),
        ("pooling_mode_lasttoken", "lasttoken"),
    ];
    NAMES.iter().filter(|(key, _)| cfg[*key].as_bool() == Some(true)).map(|(_, name)| name.to_string()).collect()
}

/// The longest input sentence-transformers feeds the model, decided as it does: the
/// `max_seq_length` of `sentence_bert_config.json` (up to 5.x) as is; else (6.x) the
/// tokenizer's `model_max_length` capped at `config.json`'s `max_position_embeddings`.
/// transformers writes 1e30 for an unset `model_max_length`; it is no `u64`, so it reads as
/// unset and the model's positions decide.
fn max_seq_length(dir: &Path) -> Result<Option<usize>> {
    let field = |file: &str, key: &str| -> Result<Option<u64>> {
        Ok(read_json_if_exists(&dir.join(file))?.and_then(|v| v[key].as_u64()).filter(|&n| n > 0))
    };
    if let Some(n) = field("sentence_bert_config.json", "max_seq_length")? {
        return Ok(Some(n as usize));
    }
    let tokenizer = field("tokenizer_config.json", "model_max_length")?;
    let positions = field("config.json", "max_position_embeddings")?;
    let n = match (tokenizer, positions) {
        (Some(t), Some(p)) => Some(t.min(p)),
        (t, p) => t.or(p),
    };
    Ok(n.map(|n| n as usize))
}

fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).with_context(|| format!("{}: cannot read", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", path.display()))
}

fn read_json_if_exists(path: &Path) -> Result<Option<Value>> {
    if path.exists() {
        read_json(path).map(Some)
    } else {
        Ok(None)
    }
}

/// Convert to f32 for comparisons and output files.
pub fn to_f32(t: &Tensor) -> Tensor {
    t.to_kind(Kind::Float)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A checkpoint directory holding only the given JSON files.
    fn checkpoint(tag: &str, files: &[(&str, Value)]) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("rak-st-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for (name, value) in files {
            let path = dir.join(name);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, value.to_string()).unwrap();
        }
        dir
    }

    fn modules(pooling_type: &str) -> Value {
        json!([{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.base.modules.transformer.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": pooling_type},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.base.modules.normalize.Normalize"}])
    }

    fn settings(tag: &str, pooling: Value, extra: &[(&str, Value)]) -> Result<Option<SentenceTransformersSettings>> {
        let mut files = vec![
            ("modules.json", modules("sentence_transformers.sentence_transformer.modules.pooling.Pooling")),
            ("1_Pooling/config.json", pooling),
        ];
        files.extend(extra.iter().cloned());
        let dir = checkpoint(tag, &files);
        let out = sentence_transformers_settings(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        out
    }

    #[test]
    fn pooling_modes_old_and_new() {
        let cases = [
            (json!({"pooling_mode": "mean"}), Pooling::Mean),
            (json!({"pooling_mode": "cls", "embedding_dimension": 8}), Pooling::Cls),
            (json!({"pooling_mode": ["cls"]}), Pooling::Cls),
            (json!({"pooling_mode_mean_tokens": true, "pooling_mode_cls_token": false}), Pooling::Mean),
            (json!({"pooling_mode_cls_token": true, "word_embedding_dimension": 8}), Pooling::Cls),
        ];
        for (i, (cfg, want)) in cases.into_iter().enumerate() {
            let got = settings(&format!("mode{i}"), cfg.clone(), &[]).unwrap().unwrap();
            assert_eq!(got.pooling, want, "{cfg}");
            assert!(got.normalize, "Normalize by its 6.x type path");
        }
    }

    #[test]
    fn unsupported_pooling_names_the_file_and_mode() {
        for (i, cfg) in [
            json!({"pooling_mode": "lasttoken"}),
            json!({"pooling_mode": ["mean", "max"]}),
            json!({"pooling_mode_mean_tokens": true, "pooling_mode_cls_token": true}),
            json!({"pooling_mode_max_tokens": true}),
            json!({}),
        ]
        .into_iter()
        .enumerate()
        {
            let msg = format!("{:#}", settings(&format!("bad{i}"), cfg.clone(), &[]).unwrap_err());
            assert!(msg.contains("1_Pooling/config.json") && msg.contains("not supported"), "{cfg}: {msg}");
        }
    }

    #[test]
    fn max_seq_length_from_either_file() {
        let mean = || json!({"pooling_mode": "mean"});
        let positions = ("config.json", json!({"max_position_embeddings": 512}));
        // Up to 5.x: sentence_bert_config.json wins, uncapped.
        let old = [("sentence_bert_config.json", json!({"max_seq_length": 256})), ("tokenizer_config.json", json!({"model_max_length": 512}))];
        assert_eq!(settings("len-old", mean(), &old).unwrap().unwrap().max_seq_length, Some(256));
        // 6.x: the tokenizer's model_max_length, capped at the model's positions.
        let new = [("sentence_bert_config.json", json!({"transformer_task": "feature-extraction"})), ("tokenizer_config.json", json!({"model_max_length": 256})), positions.clone()];
        assert_eq!(settings("len-new", mean(), &new).unwrap().unwrap().max_seq_length, Some(256));
        let long = [("tokenizer_config.json", json!({"model_max_length": 4096})), positions.clone()];
        assert_eq!(settings("len-cap", mean(), &long).unwrap().unwrap().max_seq_length, Some(512));
        // transformers' "unset" sentinel (int(1e30)) leaves the positions.
        let sentinel: Value = serde_json::from_str(r#"{"model_max_length": 1000000000000000019884624838656}"#).unwrap();
        let unset = [("tokenizer_config.json", sentinel), positions];
        assert_eq!(settings("len-unset", mean(), &unset).unwrap().unwrap().max_seq_length, Some(512));
        assert_eq!(settings("len-none", mean(), &[]).unwrap().unwrap().max_seq_length, None);
    }

    #[test]
    fn module_classes_match_whole_names() {
        assert_eq!(module_class("sentence_transformers.models.Pooling"), "Pooling");
        assert_eq!(module_class("sentence_transformers.sentence_transformer.modules.pooling.Pooling"), "Pooling");
        assert_eq!(module_class("sentence_transformers.models.WeightedLayerPooling"), "WeightedLayerPooling");
        assert_eq!(module_class("Normalize"), "Normalize");
    }
}
