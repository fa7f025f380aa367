//! Optimizer math shared by the optimizer plugins (AdamW itself, and T-SAGE, PCGrad, ... which
//! combine per-task gradients and then take an AdamW step).

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};
use tch::Tensor;

/// AdamW hyper-parameters; defaults are PyTorch's (and tch's `nn::AdamW`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 }
    }
}

/// AdamW moments for a list of parameters, following `torch.optim.AdamW` (decoupled weight
/// decay, bias-corrected moments, `eps` added after the bias-corrected square root).
pub struct AdamW {
    pub config: AdamWConfig,
    step: i64,
    exp_avg: Vec<Tensor>,
    exp_avg_sq: Vec<Tensor>,
}

impl AdamW {
    pub fn new(config: AdamWConfig) -> Self {
        AdamW { config, step: 0, exp_avg: Vec::new(), exp_avg_sq: Vec::new() }
    }

    /// One update. `grads[i]` is `None` (or undefined) for parameters without a gradient; they
    /// are left untouched, as PyTorch does.
    pub fn step(&mut self, params: &[Tensor], grads: &[Option<Tensor>], lr: f64) -> Result<()> {
        if self.exp_avg.is_empty() {
            self.exp_avg = params.iter().map(Tensor::zeros_like).collect();
            self.exp_avg_sq = params.iter().map(Tensor::zeros_like).collect();
        } else if self.exp_avg.len() != params.len() {
            bail!("AdamW was set up for {} parameters, got {}", self.exp_avg.len(), params.len());
        }
        self.step += 1;
        let c = &self.config;
        let bias1 = 1.0 - c.beta1.powi(self.step as i32);
        let bias2 = 1.0 - c.beta2.powi(self.step as i32);
        let step_size = lr / bias1;
        let _guard = tch::no_grad_guard();
        for (i, (p, g)) in params.iter().zip(grads).enumerate() {
            let Some(g) = g.as_ref().filter(|g| g.defined()) else { continue };
            let mut p = p.shallow_clone();
            let m = &mut self.exp_avg[i];
            let v = &mut self.exp_avg_sq[i];
            if c.weight_decay != 0.0 {
                let _ = p.g_mul_scalar_(1.0 - lr * c.weight_decay);
            }
            let _ = m.g_mul_scalar_(c.beta1);
            let _ = m.g_add_(&(g * (1.0 - c.beta1)));
            let _ = v.g_mul_scalar_(c.beta2);
            let _ = v.addcmul_(&(g * (1.0 - c.beta2)), g);
            let denom = v.sqrt() / bias2.sqrt() + c.eps;
            let _ = p.addcdiv_(&(&*m * -step_size), &denom);
        }
        Ok(())
    }

    /// Named copies of the state (`step`, `exp_avg.i`, `exp_avg_sq.i`).
    pub fn state(&self) -> Vec<(String, Tensor)> {
        let mut out = vec![("step".to_string(), Tensor::from(self.step))];
        for (i, (m, v)) in self.exp_avg.iter().zip(&self.exp_avg_sq).enumerate() {
            out.push((format!("exp_avg.{i}"), m.copy()));
            out.push((format!("exp_avg_sq.{i}"), v.copy()));
        }
        out
    }

    /// Restore what [`AdamW::state`] returned.
    pub fn load_state(&mut self, state: Vec<(String, Tensor)>) -> Result<()> {
        let mut step = None;
        let (mut m, mut v) = (Vec::new(), Vec::new());
        for (name, t) in state {
            let slot = |prefix: &str| name.strip_prefix(prefix).and_then(|i| i.parse::<usize>().ok());
            if name == "step" {
                step = Some(t.int64_value(&[]));
            } else if let Some(i) = slot("exp_avg.") {
                m.push((i, t.copy()));
            } else if let Some(i) = slot("exp_avg_sq.") {
                v.push((i, t.copy()));
            } else {
                bail!("unknown AdamW state entry {name:?}");
            }
        }
        let Some(step) = step else { bail!("AdamW state has no `step` entry") };
        m.sort_by_key(|(i, _)| *i);
        v.sort_by_key(|(i, _)| *i);
        if m.len() != v.len() || m.iter().enumerate().any(|(k, (i, _))| k != *i) {
            bail!("AdamW state has mismatched or missing moment entries");
        }
        self.step = step;
        self.exp_avg = m.into_iter().map(|(_, t)| t).collect();
        self.exp_avg_sq = v.into_iter().map(|(_, t)| t).collect();
        Ok(())
    }
}
