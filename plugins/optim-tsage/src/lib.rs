//! The `tsage` optimizer plugin: TACO's task-sensitivity-guided adaptive learning
//! (`rak_core::optim::tsage`), in its exact form or the lean one-step-lag form
//! (`{"form": "lean"}`), finishing with AdamW.

use anyhow::{Context, Result};
use rak_core::optim::tsage::{TSage, TSageConfig};
use rak_core::plugin::PluginInfo;
use serde_json::{json, Value};

pub struct TSagePlugin(TSage);

impl PluginInfo for TSagePlugin {
    const NAME: &'static str = "tsage";

    fn settings_schema() -> Value {
        let d = TSageConfig::default();
        let mut schema = d.adamw.schema();
        schema.extend(json!({
            "beta": {"type": "float", "default": d.beta, "help": "momentum of the task sensitivities"},
            "tau": {"type": "float", "default": d.tau, "help": "softmax temperature across tasks"},
            "median_normalise": {"type": "bool", "default": d.median_normalise, "help": "divide each task's sensitivities by their median"},
            "median_of": {"type": "string", "default": d.median_of, "help": "all (the authors') or nonzero: the elements the median is taken over"},
            "divide_by_tasks": {"type": "bool", "default": d.divide_by_tasks, "help": "divide the combined gradient by the number of tasks (the authors' code)"},
            "scale_to_sum": {"type": "bool", "default": d.scale_to_sum, "help": "multiply the combined gradient by the number of tasks instead: uniform weights give the plain sum burn-in steps on"},
            "form": {"type": "string", "default": "exact", "help": "exact (this step's weights) or lean (the previous step's: a one-step lag); both fold each task in as it arrives"},
        }).as_object().cloned().unwrap_or_default());
        Value::Object(schema)
    }

    fn create(settings: Value) -> Result<Self> {
        let config: TSageConfig = serde_json::from_value(settings).context("tsage settings")?;
        Ok(TSagePlugin(TSage::new(config)?))
    }
}

rak_core::forward_optimizer!(TSagePlugin);
rak_core::export_optimizer!(TSagePlugin);
