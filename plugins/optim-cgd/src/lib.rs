//! The `cgd` optimizer plugin: CGD's task weights (`rak_core::optim::cgd`),
//! finishing with AdamW.

use anyhow::{Context, Result};
use rak_core::optim::cgd::{Cgd, CgdConfig};
use rak_core::optim::weighted::Weighted;
use rak_core::optim::AdamWConfig;
use rak_core::plugin::PluginInfo;
use serde_json::{json, Value};

pub struct CgdPlugin(Weighted<Cgd>);

impl PluginInfo for CgdPlugin {
    const NAME: &'static str = "cgd";

    fn settings_schema() -> Value {
        let d = CgdConfig::default();
        let mut schema = AdamWConfig::default().schema();
        schema.insert("beta".into(), json!({"type": "float", "default": d.beta, "help": "exponent of the loss products (l_i l_j)^beta"}));
        schema.insert("tau".into(), json!({"type": "float", "default": d.tau, "help": "temperature of the weight update"}));
        schema.insert("scale_by_tasks".into(), json!({"type": "bool", "default": d.scale_by_tasks, "help": "step on T x the weighted mean (uniform weights = the plain sum)"}));
        Value::Object(schema)
    }

    fn create(settings: Value) -> Result<Self> {
        let (own, adamw) = AdamWConfig::split(settings).context("cgd settings")?;
        let config: CgdConfig = serde_json::from_value(own).context("cgd settings")?;
        Ok(CgdPlugin(Weighted::new(Cgd::new(config)?, adamw)))
    }
}

rak_core::forward_optimizer!(CgdPlugin);
rak_core::export_optimizer!(CgdPlugin);
