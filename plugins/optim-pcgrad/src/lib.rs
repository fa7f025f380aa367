//! The `pcgrad` optimizer plugin: PCGrad's gradient surgery (`rak_core::optim::pcgrad`),
//! finishing with AdamW.

use anyhow::{Context, Result};
use rak_core::optim::pcgrad::{PcGrad, PcGradConfig};
use rak_core::optim::weighted::Weighted;
use rak_core::optim::AdamWConfig;
use rak_core::plugin::PluginInfo;
use serde_json::{json, Value};

pub struct PcGradPlugin(Weighted<PcGrad>);

impl PluginInfo for PcGradPlugin {
    const NAME: &'static str = "pcgrad";

    fn settings_schema() -> Value {
        let d = PcGradConfig::default();
        let mut schema = AdamWConfig::default().schema();
        schema.insert("reduction".into(), json!({"type": "string", "default": d.reduction, "help": "sum or mean of the projected task gradients"}));
        schema.insert("seed".into(), json!({"type": "int", "default": d.seed, "help": "seed of the random projection orders"}));
        Value::Object(schema)
    }

    fn create(settings: Value) -> Result<Self> {
        let (own, adamw) = AdamWConfig::split(settings).context("pcgrad settings")?;
        let config: PcGradConfig = serde_json::from_value(own).context("pcgrad settings")?;
        Ok(PcGradPlugin(Weighted::new(PcGrad::new(config), adamw)))
    }
}

rak_core::forward_optimizer!(PcGradPlugin);
rak_core::export_optimizer!(PcGradPlugin);
