//! The `dpr` encoder plugin: BERT dual encoder, DPR and multi-task DPR (Maillard et al. 2021).
//! Two towers (a checkpoint with `query_encoder/` and `passage_encoder/`, or `passage_model`)
//! or one shared encoder; `[CLS]` pooling unless the checkpoint's sentence-transformers
//! settings say otherwise. MT-DPR's `?` suffix and task markers are settings.

use anyhow::Result;
use rak_core::abi::Role;
use rak_core::encoders::bert::{BertEncoder, BertEncoderSettings};
use rak_core::plugin::{Encoder, PluginInfo};
use serde_json::{json, Value};
use std::path::Path;
use tch::Tensor;

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
            "device": {"type": "string", "default": "cpu"},
            "bf16": {"type": "bool", "default": false},
        })
    }

    fn create(settings: Value) -> Result<Self> {
        Ok(Dpr(BertEncoder::create(settings, BertEncoderSettings::default())?))
    }
}

impl Encoder for Dpr {
    fn encode(&mut self, texts: &[&str], role: Role, task: Option<&str>, train: bool) -> Result<Tensor> {
        self.0.encode(texts, role, task, train)
    }
    fn parameters(&self) -> Result<Vec<(String, Tensor)>> {
        self.0.parameters()
    }
    fn info(&self) -> Result<Value> {
        self.0.info()
    }
    fn save(&self, dir: &Path) -> Result<()> {
        self.0.save(dir)
    }
    fn token_lengths(&mut self, texts: &[&str], role: Role, task: Option<&str>) -> Result<Option<Vec<usize>>> {
        self.0.token_lengths(texts, role, task)
    }
}

rak_core::export_encoder!(Dpr);
