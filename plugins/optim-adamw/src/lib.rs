//! The `adamw` optimizer plugin: decoupled-weight-decay Adam, numerically `torch.optim.AdamW`.
//! With several tasks it steps on the sum of their gradients (plain multitask training),
//! folding each task in as it arrives; the sum is clipped when the context asks.

use anyhow::{Context, Result};
use rak_core::optim::{clip_grad_norm, AdamW, AdamWConfig, GradSum};
use rak_core::plugin::{Optimizer, PluginInfo, StepContext};
use serde_json::{json, Value};
use tch::Tensor;

pub struct AdamWPlugin {
    adam: AdamW,
    step: Option<(Vec<(String, Tensor)>, StepContext)>,
    sum: GradSum,
}

impl PluginInfo for AdamWPlugin {
    const NAME: &'static str = "adamw";

    fn settings_schema() -> Value {
        Value::Object(AdamWConfig::default().schema())
    }

    fn create(settings: Value) -> Result<Self> {
        let config: AdamWConfig = serde_json::from_value(settings).context("adamw settings")?;
        Ok(AdamWPlugin { adam: AdamW::new(config), step: None, sum: GradSum::default() })
    }
}

impl Optimizer for AdamWPlugin {
    fn begin_step(&mut self, params: Vec<(String, Tensor)>, ctx: StepContext) -> Result<()> {
        self.sum.take();
        self.step = Some((params, ctx));
        Ok(())
    }

    fn task_gradients(&mut self, _task: &str, _loss: f64, grads: Vec<(String, Tensor)>) -> Result<()> {
        anyhow::ensure!(self.step.is_some(), "adamw: task_gradients before begin_step");
        self.sum.add(grads)
    }

    fn finish_step(&mut self) -> Result<Value> {
        let (params, ctx) = self.step.take().context("adamw: finish_step before begin_step")?;
        let mut grads = self.sum.take();
        let norm = ctx.max_grad_norm.map(|max| clip_grad_norm(&mut grads, max)).transpose()?;
        self.adam.step(&params, &grads, &ctx)?;
        // Read once the update is queued: on a GPU the wait then overlaps nothing but it.
        Ok(json!({"grad_norm": norm.map(|n| n.value())}))
    }

    fn state(&self) -> Result<Vec<(String, Tensor)>> {
        Ok(self.adam.state())
    }

    fn load_state(&mut self, state: Vec<(String, Tensor)>) -> Result<()> {
        self.adam.load_state(state)
    }

    /// It steps on the sum of the task gradients, which the trainer adds up as it goes.
    fn needs_task_gradients(&self) -> Result<bool> {
        Ok(false)
    }
}

rak_core::export_optimizer!(AdamWPlugin);
