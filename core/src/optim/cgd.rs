//! CGD (Piratla et al., 2022, "Focus on the common good"), as the TACO paper's baseline
//! (REFERENCE §4): task weights
//! `w = softmax(rowsum((l lᵀ)^β ⊙ G Gᵀ) / τ + log w_prev)`, starting from uniform, and the step
//! on `scale · Σ_t w_t G_t`. A task whose gradient agrees with the others' (weighted by the
//! losses) gains weight, multiplicatively from step to step.
//!
//! `scale` is T by default, so that uniform weights give the plain sum of the task gradients
//! that naive multitask training steps on (and its learning rate carries over); set
//! `scale_by_tasks = false` for the convex combination alone. The paper gives no values for β
//! and τ: β = 0.5 makes `(l_i l_j)^β` the geometric mean of two losses, and τ = 100 moves the
//! log-weights by about 0.1 a step for the task-gradient inner products MiniLM shows on
//! mini-KILT (about 10; with τ = 10 the weights were 0.08–0.43 after three steps and headed
//! for one task). Tasks absent from a step (MT-DPR's sampler) keep
//! their weight's share and contribute nothing.

use super::weighted::{tensor_vec, vec_tensor, StepView, Weighting};
use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};
use tch::Tensor;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CgdConfig {
    pub beta: f64,
    pub tau: f64,
    pub scale_by_tasks: bool,
}

impl Default for CgdConfig {
    fn default() -> Self {
        CgdConfig { beta: 0.5, tau: 100.0, scale_by_tasks: true }
    }
}

pub struct Cgd {
    pub config: CgdConfig,
    /// log w_prev per task (empty before the first step: uniform).
    log_weights: Vec<f64>,
}

impl Cgd {
    pub fn new(config: CgdConfig) -> Result<Self> {
        if config.tau <= 0.0 || !config.beta.is_finite() {
            bail!("cgd: tau must be positive and beta finite (got {}, {})", config.tau, config.beta);
        }
        Ok(Cgd { config, log_weights: Vec::new() })
    }
}

impl Weighting for Cgd {
    const NAME: &'static str = "cgd";

    fn weights(&mut self, view: &StepView) -> Result<Vec<f64>> {
        let t = view.present.len();
        if self.log_weights.is_empty() {
            self.log_weights = vec![-(t as f64).ln(); t];
        } else if self.log_weights.len() != t {
            bail!("cgd: the state holds {} tasks, the step {t}", self.log_weights.len());
        }
        let (l, k, cfg) = (view.losses, view.gram, &self.config);
        let logits: Vec<f64> = (0..t)
            .map(|i| {
                let s: f64 = if view.present[i] {
                    (0..t).filter(|&j| view.present[j]).map(|j| (l[i] * l[j]).max(0.0).powf(cfg.beta) * k[i][j]).sum()
                } else {
                    0.0
                };
                s / cfg.tau + self.log_weights[i]
            })
            .collect();
        let max = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let log_z = max + logits.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
        self.log_weights = logits.iter().map(|x| x - log_z).collect();
        let scale = if cfg.scale_by_tasks { t as f64 } else { 1.0 };
        Ok(self.log_weights.iter().map(|lw| scale * lw.exp()).collect())
    }

    fn report(&self) -> serde_json::Value {
        serde_json::json!({"weights": self.log_weights.iter().map(|l| l.exp()).collect::<Vec<_>>()})
    }

    fn state(&self) -> Vec<(String, Tensor)> {
        if self.log_weights.is_empty() {
            return Vec::new();
        }
        vec![("log_weights".to_string(), vec_tensor(&self.log_weights))]
    }

    fn load_state(&mut self, state: Vec<(String, Tensor)>) -> Result<()> {
        self.log_weights.clear();
        for (name, t) in state {
            match name.as_str() {
                "log_weights" => self.log_weights = tensor_vec(&name, &t, t.numel())?,
                other => bail!("unknown cgd state entry {other:?}"),
            }
        }
        Ok(())
    }
}
