//! PCGrad (Yu et al., 2020, "Gradient surgery for multi-task learning"): each task gradient
//! is projected, in a random order, onto the normal plane of every task gradient it conflicts
//! with (negative inner product), then the projected gradients are summed (or averaged).
//!
//! As in the widely used PyTorch port, each task draws its own order over all tasks (itself
//! included; the authors' TensorFlow code discards its shuffle and keeps one fixed order), and
//! projections are onto the *original* gradients. A projected gradient stays a
//! combination `Σ_k c_ik G_k` of the originals, so the whole method runs on the Gram matrix:
//! `<Σ_k c_ik G_k, G_j> = Σ_k c_ik K_kj`. The orders come from (seed, step), so a resumed run
//! draws the same ones without saved state.

use super::weighted::{StepView, Weighting};
use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};
use tch::Tensor;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Reduction {
    /// Σ of the projected gradients (plain multitask training sums the tasks too).
    Sum,
    /// Their mean (the pytorch port's default).
    Mean,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PcGradConfig {
    pub reduction: Reduction,
    /// Mixed into the run's stream (`StepContext::seed`) for the projection orders: runs
    /// with other seeds draw other orders, and this picks another stream within one run.
    pub seed: u64,
}

impl Default for PcGradConfig {
    fn default() -> Self {
        PcGradConfig { reduction: Reduction::Sum, seed: 0 }
    }
}

pub struct PcGrad {
    pub config: PcGradConfig,
    /// Projections made in the last step (for the log).
    last_projections: usize,
}

impl PcGrad {
    pub fn new(config: PcGradConfig) -> Self {
        PcGrad { config, last_projections: 0 }
    }
}

/// SplitMix64: a small, well-mixed generator for the orders.
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The seed of the projection orders: the run's stream (`StepContext::seed`) mixed with the
/// plugin's own `seed` setting.
pub fn order_seed(run_seed: u64, config_seed: u64) -> u64 {
    let mut state = run_seed ^ config_seed.wrapping_mul(0xA076_1D64_78BD_642F);
    splitmix(&mut state)
}

/// The order in which task `i` of `t` visits the tasks at `step`: a Fisher-Yates shuffle of
/// `0..t` seeded from (seed, step, i).
pub fn projection_order(seed: u64, step: u64, i: usize, t: usize) -> Vec<usize> {
    let mut state = seed ^ step.wrapping_mul(0xD6E8_FEB8_6659_FD93) ^ (i as u64).wrapping_mul(0xA076_1D64_78BD_642F);
    let mut order: Vec<usize> = (0..t).collect();
    for k in (1..t).rev() {
        let j = (splitmix(&mut state) % (k as u64 + 1)) as usize;
        order.swap(k, j);
    }
    order
}

impl Weighting for PcGrad {
    const NAME: &'static str = "pcgrad";

    fn weights(&mut self, view: &StepView) -> Result<Vec<f64>> {
        let t = view.present.len();
        let k = view.gram;
        let mut weights = vec![0.0; t];
        self.last_projections = 0;
        for i in (0..t).filter(|&i| view.present[i]) {
            // Coefficients of task i's projected gradient over the original gradients.
            let mut c = vec![0.0; t];
            c[i] = 1.0;
            for j in projection_order(order_seed(view.ctx.seed, self.config.seed), view.ctx.step, i, t) {
                if !view.present[j] || k[j][j] <= 0.0 {
                    continue;
                }
                let inner: f64 = (0..t).map(|m| c[m] * k[m][j]).sum();
                if inner < 0.0 {
                    c[j] -= inner / k[j][j];
                    self.last_projections += 1;
                }
            }
            for (w, ci) in weights.iter_mut().zip(&c) {
                *w += ci;
            }
        }
        if self.config.reduction == Reduction::Mean {
            let n = view.present.iter().filter(|p| **p).count().max(1) as f64;
            weights.iter_mut().for_each(|w| *w /= n);
        }
        Ok(weights)
    }

    fn report(&self) -> serde_json::Value {
        serde_json::json!({"projections": self.last_projections})
    }

    fn state(&self) -> Vec<(String, Tensor)> {
        Vec::new()
    }

    fn load_state(&mut self, state: Vec<(String, Tensor)>) -> Result<()> {
        if let Some((name, _)) = state.first() {
            bail!("pcgrad keeps no state, got {name:?}");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs seeded differently draw other projection orders (the orders once came from the
    /// plugin's setting alone, the same in every run).
    #[test]
    fn projection_orders_follow_the_run_seed() {
        let orders = |run_seed| -> Vec<Vec<usize>> { (0..20).map(|step| projection_order(order_seed(run_seed, 0), step, 1, 4)).collect() };
        assert_eq!(orders(42), orders(42));
        assert_ne!(orders(42), orders(43));
        assert_ne!(order_seed(42, 0), order_seed(42, 1), "the setting picks another stream");
    }
}
