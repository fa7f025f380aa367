//! The `gradnorm` optimizer plugin: GradNorm's learned task weights (`rak_core::optim::gradnorm`),
//! finishing with AdamW.

use anyhow::{Context, Result};
use rak_core::optim::gradnorm::{GradNorm, GradNormConfig};
use rak_core::optim::weighted::Weighted;
use rak_core::optim::AdamWConfig;
use rak_core::plugin::PluginInfo;
use serde_json::{json, Value};

pub struct GradNormPlugin(Weighted<GradNorm>);

impl PluginInfo for GradNormPlugin {
    const NAME: &'static str = "gradnorm";

    fn settings_schema() -> Value {
        let d = GradNormConfig::default();
        let mut schema = AdamWConfig::default().schema();
        schema.insert("alpha".into(), json!({"type": "float", "default": d.alpha, "help": "restoring force towards balanced training rates"}));
        schema.insert("weight_lr".into(), json!({"type": "float", "default": d.weight_lr, "help": "Adam learning rate of the task weights"}));
        schema.insert("min_weight".into(), json!({"type": "float", "default": d.min_weight, "help": "smallest task weight before renormalising to sum T"}));
        Value::Object(schema)
    }

    fn create(settings: Value) -> Result<Self> {
        let (own, adamw) = AdamWConfig::split(settings).context("gradnorm settings")?;
        let config: GradNormConfig = serde_json::from_value(own).context("gradnorm settings")?;
        Ok(GradNormPlugin(Weighted::new(GradNorm::new(config)?, adamw)))
    }
}

rak_core::forward_optimizer!(GradNormPlugin);
rak_core::export_optimizer!(GradNormPlugin);
