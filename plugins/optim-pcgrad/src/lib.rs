//! The `pcgrad` optimizer plugin: PCGrad's gradient surgery (`rak_core::optim::pcgrad`),
//! finishing with AdamW.

use anyhow::{Context, Result};
use rak_core::optim::pcgrad::{PcGrad, PcGradConfig};
use rak_core::optim::weighted::Weighted;
use rak_core::optim::AdamWConfig;
use rak_core::plugin::{Optimizer, PluginInfo, StepContext};
use serde_json::{json, Value};
use tch::Tensor;

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

impl Optimizer for PcGradPlugin {
    fn begin_step(&mut self, params: Vec<(String, Tensor)>, ctx: StepContext) -> Result<()> {
        self.0.begin_step(params, ctx)
    }
    fn task_gradients(&mut self, task: &str, loss: f64, grads: Vec<(String, Tensor)>) -> Result<()> {
        self.0.task_gradients(task, loss, grads)
    }
    fn finish_step(&mut self) -> Result<Value> {
        self.0.finish_step()
    }
    fn state(&self) -> Result<Vec<(String, Tensor)>> {
        Ok(self.0.state())
    }
    fn load_state(&mut self, state: Vec<(String, Tensor)>) -> Result<()> {
        self.0.load_state(state)
    }
}

rak_core::export_optimizer!(PcGradPlugin);
