//! GradNorm (Chen et al., 2018): learned task weights `w` (summing to T) that pull each task's
//! weighted gradient norm `w_t ‖G_t‖` towards the mean norm times `r_t^α`, where `r_t` is the
//! task's loss ratio `L_t / L_t(0)` relative to the mean ratio (a task that trains slower gets
//! a larger share). The step is on `Σ_t w_t G_t` with this step's weights; the weights then
//! take one Adam step on `Σ_t |w_t ‖G_t‖ − target_t|` (targets held constant, as in the paper)
//! and are renormalised to sum to T.
//!
//! Every parameter of a dual encoder is shared between tasks, so the norms are taken over all
//! of them (the paper picks the last shared layer only to save the cost, which is nothing
//! here: the norms come with the gradients). The weights are known before the step, so each
//! task is folded in as it arrives. `L_t(0)` is the task's loss at its first step.
//! The weights' own Adam learning rate `weight_lr` is not given by the paper; 0.025 is the
//! common choice of public implementations. Balancing needs two tasks in a step: with one task
//! per batch (MT-DPR's sampler) the weights never move and this is plain training.

use super::weighted::{tensor_vec, vec_tensor, StepView, Weighting};
use crate::plugin::StepContext;
use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};
use tch::Tensor;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GradNormConfig {
    /// Restoring force towards balanced training rates.
    pub alpha: f64,
    /// Adam learning rate of the task weights.
    pub weight_lr: f64,
    /// Smallest weight before renormalising (keeps every task in play).
    pub min_weight: f64,
}

impl Default for GradNormConfig {
    fn default() -> Self {
        GradNormConfig { alpha: 1.5, weight_lr: 0.025, min_weight: 1e-3 }
    }
}

pub struct GradNorm {
    pub config: GradNormConfig,
    weights: Vec<f64>,
    /// `L_t(0)`; NaN until the task's first step.
    initial_losses: Vec<f64>,
    /// Adam moments of the weights and their step count.
    m: Vec<f64>,
    v: Vec<f64>,
    adam_steps: u64,
}

impl GradNorm {
    pub fn new(config: GradNormConfig) -> Result<Self> {
        if !(config.weight_lr > 0.0) || !(config.min_weight > 0.0) {
            bail!("gradnorm: weight_lr and min_weight must be positive");
        }
        Ok(GradNorm { config, weights: Vec::new(), initial_losses: Vec::new(), m: Vec::new(), v: Vec::new(), adam_steps: 0 })
    }
}

impl Weighting for GradNorm {
    const NAME: &'static str = "gradnorm";

    fn early_weights(&mut self, ctx: &StepContext) -> Option<Vec<f64>> {
        let t = ctx.tasks.len();
        if self.weights.len() != t {
            // First step (a mismatch with a loaded state is reported by `weights`).
            if self.weights.is_empty() {
                self.weights = vec![1.0; t];
                self.initial_losses = vec![f64::NAN; t];
                self.m = vec![0.0; t];
                self.v = vec![0.0; t];
            }
        }
        Some(self.weights.clone())
    }

    fn weights(&mut self, view: &StepView) -> Result<Vec<f64>> {
        let t = view.present.len();
        if self.weights.len() != t {
            bail!("gradnorm: the state holds {} tasks, the step {t}", self.weights.len());
        }
        let used = self.weights.clone();
        for i in (0..t).filter(|&i| view.present[i]) {
            if self.initial_losses[i].is_nan() && view.losses[i] > 0.0 {
                self.initial_losses[i] = view.losses[i];
            }
        }
        let active: Vec<usize> = (0..t).filter(|&i| view.present[i] && self.initial_losses[i] > 0.0).collect();
        if active.len() < 2 {
            return Ok(used);
        }
        let n = active.len() as f64;
        let norms: Vec<f64> = (0..t).map(|i| view.gram[i][i].max(0.0).sqrt()).collect();
        let mean_norm = active.iter().map(|&i| used[i] * norms[i]).sum::<f64>() / n;
        let ratios: Vec<f64> = (0..t).map(|i| if active.contains(&i) { view.losses[i] / self.initial_losses[i] } else { 0.0 }).collect();
        let mean_ratio = active.iter().map(|&i| ratios[i]).sum::<f64>() / n;
        let mut grad = vec![0.0; t];
        for &i in &active {
            let target = mean_norm * (ratios[i] / mean_ratio).powf(self.config.alpha);
            let diff = used[i] * norms[i] - target;
            grad[i] = if diff > 0.0 { norms[i] } else if diff < 0.0 { -norms[i] } else { 0.0 };
        }
        // Adam (PyTorch's defaults) on the weights.
        let (b1, b2, eps) = (0.9f64, 0.999f64, 1e-8);
        self.adam_steps += 1;
        let (c1, c2) = (1.0 - b1.powi(self.adam_steps as i32), 1.0 - b2.powi(self.adam_steps as i32));
        for i in 0..t {
            self.m[i] = b1 * self.m[i] + (1.0 - b1) * grad[i];
            self.v[i] = b2 * self.v[i] + (1.0 - b2) * grad[i] * grad[i];
            self.weights[i] -= self.config.weight_lr * (self.m[i] / c1) / ((self.v[i] / c2).sqrt() + eps);
            self.weights[i] = self.weights[i].max(self.config.min_weight);
        }
        let total: f64 = self.weights.iter().sum();
        self.weights.iter_mut().for_each(|w| *w *= t as f64 / total);
        Ok(used)
    }

    fn report(&self) -> serde_json::Value {
        serde_json::json!({"next_weights": self.weights})
    }

    fn state(&self) -> Vec<(String, Tensor)> {
        if self.weights.is_empty() {
            return Vec::new();
        }
        vec![
            ("weights".to_string(), vec_tensor(&self.weights)),
            ("initial_losses".to_string(), vec_tensor(&self.initial_losses)),
            ("adam_m".to_string(), vec_tensor(&self.m)),
            ("adam_v".to_string(), vec_tensor(&self.v)),
            ("adam_steps".to_string(), Tensor::from(self.adam_steps as i64)),
        ]
    }

    fn load_state(&mut self, state: Vec<(String, Tensor)>) -> Result<()> {
        let mut fresh = GradNorm::new(self.config.clone())?;
        let len = state.iter().find(|(n, _)| n == "weights").map_or(0, |(_, t)| t.numel());
        for (name, t) in state {
            match name.as_str() {
                "weights" => fresh.weights = tensor_vec(&name, &t, len)?,
                "initial_losses" => fresh.initial_losses = tensor_vec(&name, &t, len)?,
                "adam_m" => fresh.m = tensor_vec(&name, &t, len)?,
                "adam_v" => fresh.v = tensor_vec(&name, &t, len)?,
                "adam_steps" => fresh.adam_steps = super::step_count(&name, &t)? as u64,
                other => bail!("unknown gradnorm state entry {other:?}"),
            }
        }
        if [fresh.initial_losses.len(), fresh.m.len(), fresh.v.len()].iter().any(|&l| l != len) {
            bail!("gradnorm state is incomplete (weights for {len} tasks)");
        }
        *self = fresh;
        Ok(())
    }
}
