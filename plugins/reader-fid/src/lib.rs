//! The `fid` reader plugin: a thin wrapper over [`rak_core::readers::fid::FidReader`]
//! (T5 / Flan-T5 Fusion-in-Decoder: generate, score options, AAR passage preferences).

use anyhow::Result;
use rak_core::plugin::{PluginInfo, Reader};
use rak_core::readers::fid::{FidReader, FidReaderSettings};
use serde_json::Value;

pub struct Fid(FidReader);

impl PluginInfo for Fid {
    const NAME: &'static str = "fid";

    fn settings_schema() -> Value {
        FidReaderSettings::schema()
    }

    fn create(settings: Value) -> Result<Self> {
        Ok(Fid(FidReader::create(settings)?))
    }
}

impl Reader for Fid {
    fn generate(&mut self, request: Value) -> Result<Value> {
        self.0.generate(request)
    }

    fn score_options(&mut self, request: Value) -> Result<Value> {
        self.0.score_options(request)
    }

    fn passage_preferences(&mut self, request: Value) -> Result<Value> {
        self.0.passage_preferences(request)
    }
}

rak_core::export_reader!(Fid);
