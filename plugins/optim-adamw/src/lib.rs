//! The `adamw` optimizer plugin: decoupled-weight-decay Adam, numerically `torch.optim.AdamW`.
//! With several tasks it steps on the sum of their gradients (plain multitask training).

use anyhow::{Context, Result};
use rak_core::optim::{AdamW, AdamWConfig};
use rak_core::plugin::{sum_task_grads, Optimizer, PluginInfo};
use serde_json::{json, Value};
use tch::Tensor;

pub struct AdamWPlugin(AdamW);

impl PluginInfo for AdamWPlugin {
    const NAME: &'static str = "adamw";

    fn settings_schema() -> Value {
        let d = AdamWConfig::default();
        json!({
            "beta1": {"type": "float", "default": d.beta1, "help": "first-moment decay"},
            "beta2": {"type": "float", "default": d.beta2, "help": "second-moment decay"},
            "eps": {"type": "float", "default": d.eps, "help": "added to the denominator"},
            "weight_decay": {"type": "float", "default": d.weight_decay, "help": "decoupled weight decay"},
        })
    }

    fn create(settings: Value) -> Result<Self> {
        let config: AdamWConfig = serde_json::from_value(settings).context("adamw settings")?;
        Ok(AdamWPlugin(AdamW::new(config)))
    }
}

impl Optimizer for AdamWPlugin {
    fn step(&mut self, params: &[Tensor], grads: &[Vec<Tensor>], lr: f64) -> Result<()> {
        self.0.step(params, &sum_task_grads(grads, params.len()), lr)
    }

    fn state(&self) -> Result<Vec<(String, Tensor)>> {
        Ok(self.0.state())
    }

    fn load_state(&mut self, state: Vec<(String, Tensor)>) -> Result<()> {
        self.0.load_state(state)
    }
}

rak_core::export_optimizer!(AdamWPlugin);
