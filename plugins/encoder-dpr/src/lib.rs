//! The `dpr` encoder plugin: BERT dual encoder, DPR and multi-task DPR (Maillard et al. 2021).
//! Two towers (a checkpoint with `query_encoder/` and `passage_encoder/`, or `passage_model`)
//! or one shared encoder; `[CLS]` pooling unless the checkpoint's sentence-transformers
//! settings say otherwise. MT-DPR's `?` suffix and task markers are settings.

use anyhow::Result;
use rak_core::encoders::bert::{BertEncoder, BertEncoderSettings};
use rak_core::plugin::PluginInfo;
use serde_json::{json, Value};

pub struct Dpr(BertEncoder);

impl PluginInfo for Dpr {
    const NAME: &'static str = "dpr";

    fn settings_schema() -> Value {
        json!({
            "model": {"type": "path", "required": true, "help": "BERT checkpoint directory (shared encoder, or one holding query_encoder/ and passage_encoder/)"},
            "passage_model": {"type": "path", "help": "separate passage tower (two-tower DPR)"},
            "pooling": {"type": "cls|mean", "default": "sentence-transformers setting, else cls"},
            "normalize": {"type": "bool", "default": "sentence-transformers setting, else false"},
            "max_length": {"type": "int", "default": "sentence-transformers max_seq_length, else 256"},
            "query_max_length": {"type": "int", "default": "max_length"},
            "question_mark": {"type": "bool", "default": false, "help": "MT-DPR: append ? to QA queries"},
            "qa_tasks": {"type": "[string]", "default": ["squad", "nq", "tqa", "triviaqa", "hopo", "hotpotqa", "eli5"]},
            "task_markers": {"type": "{task: token}", "help": "MT-DPR task-type marker inserted after [CLS], e.g. {\"squad\": \"[unused0]\"}"},
            "task_prefix": {"type": "bool", "default": false, "help": "queries become [CLS] TASK [SEP] query [SEP] (TACO's prefix for BERT); passages never get one"},
            "pool_task_prefix": {"type": "bool", "default": true, "help": "mean pooling: count the prefix's own tokens (false: pool over [CLS], the query and its [SEP] only)"},
            "device": {"type": "string", "default": "cpu"},
            "bf16": {"type": "bool", "default": false},
            "tokenize_ahead": {"type": "bool", "default": "on CUDA only", "help": "tokenise the batches the trainer and host encode announce on a thread of their own, while the device works"},
        })
    }

    fn create(settings: Value) -> Result<Self> {
        Ok(Dpr(BertEncoder::create(settings, BertEncoderSettings::default())?))
    }
}

rak_core::delegate_encoder!(Dpr);

rak_core::export_encoder!(Dpr);
