//! The `taser` encoder plugin: one shared BERT whose every T-th block has a query and a
//! passage feed-forward expert (TASER, REFERENCE §5). Both experts start from the pretrained
//! feed-forward weights; queries route to Q-FFN, passages to P-FFN. `info()` reports the
//! parameter count and layer-wise learning-rate factors (decay 0.8) as `lr_scale`.

use anyhow::{bail, Result};
use rak_core::encoders::bert::{BertEncoder, BertEncoderSettings};
use rak_core::models::pooling::Pooling;
use rak_core::plugin::PluginInfo;
use serde_json::{json, Value};

/// The authors' released checkpoints specialise blocks 3, 6, 9, 12 (the paper says 2).
const DEFAULT_EVERY: i64 = 3;

pub struct Taser(BertEncoder);

impl PluginInfo for Taser {
    const NAME: &'static str = "taser";

    fn settings_schema() -> Value {
        json!({
            "model": {"type": "path", "required": true, "help": "BERT checkpoint (plain BERT, or a saved TASER checkpoint)"},
            "taser_every": {"type": "int", "default": DEFAULT_EVERY, "help": "specialise every T-th block (1-based index divisible by T)"},
            "pooling": {"type": "cls|mean", "default": "cls"},
            "normalize": {"type": "bool", "default": false},
            "max_length": {"type": "int", "default": 256},
            "query_max_length": {"type": "int", "default": "max_length"},
            "question_mark": {"type": "bool", "default": false, "help": "append ? to QA queries"},
            "qa_tasks": {"type": "[string]", "default": ["squad", "nq", "tqa", "triviaqa", "hopo", "hotpotqa", "eli5"]},
            "task_markers": {"type": "{task: token}", "help": "task marker inserted after [CLS], e.g. {\"squad\": \"[unused0]\"}"},
            "task_prefix": {"type": "bool", "default": false, "help": "queries become [CLS] TASK [SEP] query [SEP]"},
            "pool_task_prefix": {"type": "bool", "default": true, "help": "mean pooling: count the prefix's own tokens (false: pool over [CLS], the query and its [SEP] only)"},
            "device": {"type": "string", "default": "cpu"},
            "bf16": {"type": "bool", "default": false},
            "tokenize_ahead": {"type": "bool", "default": "on CUDA only", "help": "tokenise the batches the trainer and host encode announce on a thread of their own, while the device works"},
        })
    }

    fn create(settings: Value) -> Result<Self> {
        if settings.get("passage_model").is_some() {
            bail!("taser shares one encoder between queries and passages: remove \"passage_model\"");
        }
        if settings.get("taser_every").and_then(Value::as_i64).is_some_and(|t| t < 1) {
            bail!("taser_every must be at least 1");
        }
        // TASER embeds with [CLS] unless told otherwise, whatever sentence-transformers says:
        // as defaults, below what the checkpoint saved (a stage that trained with mean pooling
        // saved it, and its checkpoint must load so).
        let defaults = BertEncoderSettings { taser_every: Some(DEFAULT_EVERY), pooling: Some(Pooling::Cls), normalize: Some(false), ..Default::default() };
        Ok(Taser(BertEncoder::create(settings, defaults)?))
    }
}

rak_core::delegate_encoder!(Taser);

rak_core::export_encoder!(Taser);
