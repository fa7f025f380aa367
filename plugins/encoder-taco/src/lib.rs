//! The `taco` encoder plugin: a thin wrapper over [`rak_core::encoders::taco::TacoEncoder`]
//! (TACO's shared T5 with the ST5-EncDec embedding and a task prefix on queries).

use anyhow::Result;
use rak_core::encoders::taco::{TacoEncoder, TacoEncoderSettings};
use rak_core::plugin::PluginInfo;
use serde_json::Value;

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

rak_core::delegate_encoder!(Taco);

rak_core::export_encoder!(Taco);
