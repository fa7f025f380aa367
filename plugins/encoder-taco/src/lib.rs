//! The `taco` encoder plugin: a thin wrapper over [`rak_core::encoders::taco::TacoEncoder`]
//! (TACO's shared T5 with the ST5-EncDec embedding and a task prefix on queries).

use anyhow::Result;
use rak_core::abi::Role;
use rak_core::encoders::taco::{TacoEncoder, TacoEncoderSettings};
use rak_core::plugin::{Encoder, PluginInfo};
use serde_json::Value;
use std::path::Path;
use tch::Tensor;

pub struct Taco(TacoEncoder);

impl PluginInfo for Taco {
    const NAME: &'static str = "taco";

    fn settings_schema() -> Value {
        TacoEncoderSettings::schema()
    }

    fn create(settings: Value) -> Result<Self> {
        Ok(Taco(TacoEncoder::create(settings)?))
    }
}

impl Encoder for Taco {
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

rak_core::export_encoder!(Taco);
