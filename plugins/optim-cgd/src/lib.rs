//! The `cgd` optimizer plugin: CGD's task weights (`rak_core::optim::cgd`),
//! finishing with AdamW.

use anyhow::{Context, Result};
use rak_core::optim::cgd::{Cgd, CgdConfig};
use rak_core::optim::weighted::Weighted;
use rak_core::optim::AdamWConfig;
use rak_core::plugin::{Optimizer, PluginInfo, StepContext};
use serde_json::{json, Value};
use tch::Tensor;

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

impl Optimizer for CgdPlugin {
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

rak_core::export_optimizer!(CgdPlugin);
