//! Multitask optimizers that step on a weighted sum of the task gradients, `g = Σ_t w_t G_t`,
//! with weights a [`Weighting`] computes from the tasks' losses and the inner products of
//! their gradients (the Gram matrix `K = G Gᵀ`): PCGrad, CGD and GradNorm (REFERENCE §4,
//! "Baselines"). Then clipping and AdamW, as for plain training.
//!
//! PCGrad's projections are linear, so a projected gradient is a combination of the original
//! ones and the whole method runs on `K` (`T × T`) instead of on `T` vectors of `P` floats: the
//! coefficients are found first and the gradients summed once.
//!
//! Weightings that know their weights before the step (GradNorm's come from the previous
//! step) fold each task in as it arrives and keep only the norms; the others hold every task
//! gradient until `finish_step` (`T·P` floats) and the Gram matrix grows as they come.

use super::{clip_grad_norm, AdamW, AdamWConfig};
use crate::plugin::StepContext;
use anyhow::{bail, Result};
use std::collections::BTreeMap;
use tch::{Kind, Tensor};

/// What a weighting sees at the end of a step, tasks in the step context's order.
pub struct StepView<'a> {
    pub ctx: &'a StepContext,
    /// Which tasks handed over gradients this step (MT-DPR's sampler gives one per step).
    pub present: &'a [bool],
    pub losses: &'a [f64],
    /// `K[i][j] = <G_i, G_j>` over every parameter element; only the diagonal when the
    /// weighting folds early (see [`Weighting::early_weights`]).
    pub gram: &'a [Vec<f64>],
}

/// Turns a step's losses and gradient inner products into task weights.
pub trait Weighting: Send {
    const NAME: &'static str;
    /// Weights known when the step begins (so tasks can be folded in as they arrive), or
    /// `None` when they depend on this step's gradients.
    fn early_weights(&mut self, _ctx: &StepContext) -> Option<Vec<f64>> {
        None
    }
    /// The weights of this step; with early weights, the chance to update them for the next.
    fn weights(&mut self, view: &StepView) -> Result<Vec<f64>>;
    /// Statistics for the log.
    fn report(&self) -> serde_json::Value {
        serde_json::Value::Null
    }
    fn state(&self) -> Vec<(String, Tensor)>;
    fn load_state(&mut self, state: Vec<(String, Tensor)>) -> Result<()>;
}

/// `Σ_i <a_i, b_i>` over matching parameter names, in f64.
fn dot(a: &BTreeMap<String, Tensor>, b: &BTreeMap<String, Tensor>) -> f64 {
    a.iter().filter_map(|(n, x)| b.get(n).map(|y| (x * y).sum(Kind::Double).double_value(&[]))).sum()
}

struct Step {
    params: Vec<(String, Tensor)>,
    ctx: StepContext,
    early: Option<Vec<f64>>,
    present: Vec<bool>,
    losses: Vec<f64>,
    gram: Vec<Vec<f64>>,
    /// Held gradients (late weights) by task.
    grads: Vec<BTreeMap<String, Tensor>>,
    /// Running weighted sum (early weights).
    folded: BTreeMap<String, Tensor>,
}

/// The optimizer: a weighting, then AdamW.
pub struct Weighted<W: Weighting> {
    pub weighting: W,
    adam: AdamW,
    step: Option<Step>,
}

impl<W: Weighting> Weighted<W> {
    pub fn new(weighting: W, adamw: AdamWConfig) -> Self {
        Weighted { weighting, adam: AdamW::new(adamw), step: None }
    }

    pub fn begin_step(&mut self, params: Vec<(String, Tensor)>, ctx: StepContext) -> Result<()> {
        let t = ctx.tasks.len();
        if t == 0 {
            bail!("{}: the step context names no tasks", W::NAME);
        }
        let early = self.weighting.early_weights(&ctx);
        if early.as_ref().is_some_and(|w| w.len() != t) {
            bail!("{}: {} early weights for {t} tasks", W::NAME, early.map_or(0, |w| w.len()));
        }
        self.step = Some(Step {
            params,
            ctx,
            early,
            present: vec![false; t],
            losses: vec![0.0; t],
            gram: vec![vec![0.0; t]; t],
            grads: (0..t).map(|_| BTreeMap::new()).collect(),
            folded: BTreeMap::new(),
        });
        Ok(())
    }

    pub fn task_gradients(&mut self, task: &str, loss: f64, grads: Vec<(String, Tensor)>) -> Result<()> {
        let Some(step) = self.step.as_mut() else { bail!("{}: task_gradients before begin_step", W::NAME) };
        let Some(t) = step.ctx.tasks.iter().position(|n| n == task) else {
            bail!("{}: unknown task {task:?} (tasks: {:?})", W::NAME, step.ctx.tasks)
        };
        if step.present[t] {
            bail!("{}: task {task:?} handed over twice in one step", W::NAME);
        }
        let _guard = tch::no_grad_guard();
        let grads: BTreeMap<String, Tensor> = grads.into_iter().filter(|(_, g)| g.defined()).map(|(n, g)| (n, g.to_kind(Kind::Float))).collect();
        step.present[t] = true;
        step.losses[t] = loss;
        step.gram[t][t] = dot(&grads, &grads);
        match &step.early {
            Some(w) => {
                for (name, g) in grads {
                    let term = g * w[t];
                    match step.folded.get_mut(&name) {
                        Some(s) => {
                            let _ = s.g_add_(&term);
                        }
                        None => {
                            step.folded.insert(name, term);
                        }
                    }
                }
            }
            None => {
                for u in (0..step.grads.len()).filter(|&u| step.present[u] && u != t) {
                    let k = dot(&grads, &step.grads[u]);
                    step.gram[t][u] = k;
                    step.gram[u][t] = k;
                }
                // `to_kind` above may have returned the caller's storage: copy what is kept.
                step.grads[t] = grads.into_iter().map(|(n, g)| (n, g.copy())).collect();
            }
        }
        Ok(())
    }

    pub fn finish_step(&mut self) -> Result<serde_json::Value> {
        let Some(step) = self.step.take() else { bail!("{}: finish_step before begin_step", W::NAME) };
        let view = StepView { ctx: &step.ctx, present: &step.present, losses: &step.losses, gram: &step.gram };
        let weights = self.weighting.weights(&view)?;
        if weights.len() != step.present.len() || weights.iter().any(|w| !w.is_finite()) {
            bail!("{}: bad task weights {weights:?}", W::NAME);
        }
        let _guard = tch::no_grad_guard();
        let mut combined = match step.early {
            Some(_) => step.folded,
            None => {
                let mut sum: BTreeMap<String, Tensor> = BTreeMap::new();
                for (t, grads) in step.grads.into_iter().enumerate() {
                    for (name, g) in grads {
                        let term = g * weights[t];
                        match sum.get_mut(&name) {
                            Some(s) => {
                                let _ = s.g_add_(&term);
                            }
                            None => {
                                sum.insert(name, term);
                            }
                        }
                    }
                }
                sum
            }
        };
        let norm = step.ctx.max_grad_norm.map(|max| clip_grad_norm(&mut combined, max)).transpose()?;
        self.adam.step(&step.params, &combined, &step.ctx)?;
        let norm = norm.map(|n| n.value());
        Ok(serde_json::json!({"grad_norm": norm, "task_weights": weights, W::NAME: self.weighting.report()}))
    }

    /// AdamW's state, then the weighting's under `NAME/`.
    pub fn state(&self) -> Vec<(String, Tensor)> {
        let mut out = self.adam.state();
        out.extend(self.weighting.state().into_iter().map(|(n, t)| (format!("{}/{n}", W::NAME), t)));
        out
    }

    pub fn load_state(&mut self, state: Vec<(String, Tensor)>) -> Result<()> {
        let prefix = format!("{}/", W::NAME);
        let (own, adam): (Vec<_>, Vec<_>) = state.into_iter().partition(|(n, _)| n.starts_with(&prefix));
        self.adam.load_state(adam)?;
        self.weighting.load_state(own.into_iter().map(|(n, t)| (n[prefix.len()..].to_string(), t)).collect())
    }
}

impl<W: Weighting> crate::plugin::Optimizer for Weighted<W> {
    fn begin_step(&mut self, params: Vec<(String, Tensor)>, ctx: StepContext) -> Result<()> {
        Weighted::begin_step(self, params, ctx)
    }
    fn task_gradients(&mut self, task: &str, loss: f64, grads: Vec<(String, Tensor)>) -> Result<()> {
        Weighted::task_gradients(self, task, loss, grads)
    }
    fn finish_step(&mut self) -> Result<serde_json::Value> {
        Weighted::finish_step(self)
    }
    fn state(&self) -> Result<Vec<(String, Tensor)>> {
        Ok(Weighted::state(self))
    }
    fn load_state(&mut self, state: Vec<(String, Tensor)>) -> Result<()> {
        Weighted::load_state(self, state)
    }
}

/// A per-task f64 vector as a tensor (for checkpoints).
pub(crate) fn vec_tensor(v: &[f64]) -> Tensor {
    Tensor::from_slice(v)
}

/// Back from [`vec_tensor`], checking the length.
pub(crate) fn tensor_vec(name: &str, t: &Tensor, len: usize) -> Result<Vec<f64>> {
    let v: Vec<f64> = Vec::<f64>::try_from(t.f_to_kind(Kind::Double)?.f_flatten(0, -1)?)?;
    if v.len() != len {
        bail!("state {name:?} holds {} values for {len} tasks", v.len());
    }
    if v.iter().any(|x| !x.is_finite()) {
        bail!("state {name:?} holds NaN or infinite values");
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::super::cgd::{Cgd, CgdConfig};
    use super::super::gradnorm::{GradNorm, GradNormConfig};
    use super::super::pcgrad::{order_seed, projection_order, PcGrad, PcGradConfig, Reduction};
    use super::*;
    use crate::optim::testutil::*;

    const STEPS: u64 = 6;
    const LR: f64 = 0.01;

    /// Which tasks take part in `step`: all, or one at a time (MT-DPR's sampler), alternating
    /// tasks 0 and 1, which reach every parameter (AdamW skips a parameter without gradient,
    /// which the dense loop cannot express).
    fn present(one_at_a_time: bool, step: u64, t: usize) -> bool {
        !one_at_a_time || step as usize % 2 == t
    }

    fn ctx(step: u64, clip: Option<f64>) -> StepContext {
        let tasks = (0..TASKS).map(|t| format!("task{t}")).collect();
        StepContext { step, total_steps: STEPS, warmup_steps: 0, lr: LR, tasks, max_grad_norm: clip, ..Default::default() }
    }

    /// Our optimizer over the fixture; the final flat parameters.
    fn ours<W: Weighting>(mut opt: Weighted<W>, one: bool, clip: Option<f64>) -> Tensor {
        let ps = params();
        for step in 0..STEPS {
            opt.begin_step(ps.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect(), ctx(step, clip)).unwrap();
            for t in (0..TASKS).filter(|&t| present(one, step, t)) {
                let lent = grads(step, t);
                opt.task_gradients(&format!("task{t}"), loss(step, t), lent.iter().map(|(n, g)| (n.clone(), g.shallow_clone())).collect()).unwrap();
                // The trainer reuses the gradient storage for the next task.
                for (_, g) in &lent {
                    let _ = g.shallow_clone().zero_();
                }
            }
            opt.finish_step().unwrap();
        }
        flat(&ps)
    }

    /// The dense loop: `combine(step, G [T, P] f64, present, losses) -> g [P]`, then clipping and
    /// AdamW on the flat vector.
    fn dense(one: bool, clip: Option<f64>, mut combine: impl FnMut(u64, &Tensor, &[bool], &[f64]) -> Tensor) -> Tensor {
        let theta = flat(&params());
        let mut adam = AdamW::new(AdamWConfig::default());
        for step in 0..STEPS {
            let pres: Vec<bool> = (0..TASKS).map(|t| present(one, step, t)).collect();
            let mask = Tensor::from_slice(&pres.iter().map(|&p| p as i64 as f64).collect::<Vec<_>>()).unsqueeze(1);
            let g = dense_grads(step) * mask;
            let losses: Vec<f64> = (0..TASKS).map(|t| if pres[t] { loss(step, t) } else { 0.0 }).collect();
            let mut gm: BTreeMap<String, Tensor> = [("flat".to_string(), combine(step, &g, &pres, &losses).to_kind(Kind::Float))].into();
            if let Some(max) = clip {
                clip_grad_norm(&mut gm, max).unwrap();
            }
            adam.step(&[("flat".to_string(), theta.shallow_clone())], &gm, &ctx(step, clip)).unwrap();
        }
        theta
    }

    fn close(a: &Tensor, b: &Tensor, what: &str) {
        let diff = (a - b).abs().max().double_value(&[]);
        assert!(diff < 1e-6, "{what}: max diff {diff}");
    }

    fn dotv(a: &Tensor, b: &Tensor) -> f64 {
        (a * b).sum(Kind::Double).double_value(&[])
    }

    #[test]
    fn pcgrad_equals_projecting_the_vectors() {
        for (reduction, one, clip) in [(Reduction::Sum, false, None), (Reduction::Mean, false, Some(0.5)), (Reduction::Sum, true, None)] {
            let cfg = PcGradConfig { reduction, seed: 7 };
            let got = ours(Weighted::new(PcGrad::new(cfg.clone()), AdamWConfig::default()), one, clip);
            let want = dense(one, clip, |step, g, pres, _| {
                let mut total = Tensor::zeros([g.size()[1]], (Kind::Double, tch::Device::Cpu));
                for i in (0..TASKS).filter(|&i| pres[i]) {
                    let mut gi = g.get(i as i64).copy();
                    for j in projection_order(order_seed(0, cfg.seed), step, i, TASKS).into_iter().filter(|&j| pres[j]) {
                        let gj = g.get(j as i64);
                        let inner = dotv(&gi, &gj);
                        if inner < 0.0 {
                            gi = &gi - &gj * (inner / dotv(&gj, &gj));
                        }
                    }
                    total += gi;
                }
                let n = pres.iter().filter(|p| **p).count() as f64;
                if reduction == Reduction::Mean {
                    total / n
                } else {
                    total
                }
            });
            close(&got, &want, &format!("pcgrad {reduction:?} one-at-a-time {one} clip {clip:?}"));
        }
        // The fixture's gradients do conflict, so projections happened.
        let plain = ours(Weighted::new(PcGrad::new(PcGradConfig::default()), AdamWConfig::default()), false, None);
        let sum = dense(false, None, |_, g, _, _| g.sum_dim_intlist(0, false, Kind::Double));
        assert!((&plain - &sum).abs().max().double_value(&[]) > 1e-4, "pcgrad should differ from the plain sum here");
    }

    #[test]
    fn cgd_equals_the_dense_formula() {
        for (one, clip, scale) in [(false, None, true), (false, Some(0.5), false), (true, None, true)] {
            let cfg = CgdConfig { beta: 0.5, tau: 2.0, scale_by_tasks: scale };
            let got = ours(Weighted::new(Cgd::new(cfg.clone()).unwrap(), AdamWConfig::default()), one, clip);
            let mut w_prev = vec![1.0 / TASKS as f64; TASKS];
            let want = dense(one, clip, |_, g, pres, l| {
                let k = g.matmul(&g.tr());
                let logits: Vec<f64> = (0..TASKS)
                    .map(|i| {
                        let s: f64 = (0..TASKS).filter(|&j| pres[i] && pres[j]).map(|j| (l[i] * l[j]).powf(cfg.beta) * k.double_value(&[i as i64, j as i64])).sum();
                        s / cfg.tau + w_prev[i].ln()
                    })
                    .collect();
                let w = Tensor::from_slice(&logits).softmax(0, Kind::Double);
                w_prev = Vec::<f64>::try_from(&w).unwrap();
                let scale = if scale { TASKS as f64 } else { 1.0 };
                (w.unsqueeze(1) * g).sum_dim_intlist(0, false, Kind::Double) * scale
            });
            close(&got, &want, &format!("cgd one-at-a-time {one} clip {clip:?} scale {scale}"));
        }
    }

    #[test]
    fn gradnorm_equals_the_dense_formula() {
        for (one, clip) in [(false, None), (false, Some(0.5)), (true, None)] {
            let cfg = GradNormConfig { alpha: 1.5, weight_lr: 0.05, min_weight: 1e-3 };
            let got = ours(Weighted::new(GradNorm::new(cfg.clone()).unwrap(), AdamWConfig::default()), one, clip);
            let (mut w, mut l0, mut m, mut v) = (vec![1.0f64; TASKS], vec![f64::NAN; TASKS], vec![0.0; TASKS], vec![0.0; TASKS]);
            let mut adam_steps = 0;
            let want = dense(one, clip, |_, g, pres, l| {
                let combined = (Tensor::from_slice(&w).unsqueeze(1) * g).sum_dim_intlist(0, false, Kind::Double);
                for i in 0..TASKS {
                    if pres[i] && l0[i].is_nan() {
                        l0[i] = l[i];
                    }
                }
                let active: Vec<usize> = (0..TASKS).filter(|&i| pres[i]).collect();
                if active.len() >= 2 {
                    let norm: Vec<f64> = (0..TASKS).map(|i| g.get(i as i64).norm().double_value(&[])).collect();
                    let n = active.len() as f64;
                    let gbar: f64 = active.iter().map(|&i| w[i] * norm[i]).sum::<f64>() / n;
                    let rbar: f64 = active.iter().map(|&i| l[i] / l0[i]).sum::<f64>() / n;
                    adam_steps += 1;
                    for i in 0..TASKS {
                        let gi = if active.contains(&i) { (w[i] * norm[i] - gbar * ((l[i] / l0[i]) / rbar).powf(cfg.alpha)).signum() * norm[i] } else { 0.0 };
                        m[i] = 0.9 * m[i] + 0.1 * gi;
                        v[i] = 0.999 * v[i] + 0.001 * gi * gi;
                        let mh = m[i] / (1.0 - 0.9f64.powi(adam_steps));
                        let vh = v[i] / (1.0 - 0.999f64.powi(adam_steps));
                        w[i] = (w[i] - cfg.weight_lr * mh / (vh.sqrt() + 1e-8)).max(cfg.min_weight);
                    }
                    let total: f64 = w.iter().sum();
                    w.iter_mut().for_each(|x| *x *= TASKS as f64 / total);
                }
                combined
            });
            close(&got, &want, &format!("gradnorm one-at-a-time {one} clip {clip:?}"));
        }
    }

    #[test]
    fn states_round_trip() {
        fn check<W: Weighting>(make: impl Fn() -> Weighted<W>) {
            let ps = params();
            let run = |opt: &mut Weighted<W>, steps: std::ops::Range<u64>| {
                for step in steps {
                    opt.begin_step(ps.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect(), ctx(step, None)).unwrap();
                    for t in 0..TASKS {
                        opt.task_gradients(&format!("task{t}"), loss(step, t), grads(step, t)).unwrap();
                    }
                    opt.finish_step().unwrap();
                }
            };
            let mut a = make();
            run(&mut a, 0..3);
            let saved = ps.iter().map(|(_, t)| t.copy()).collect::<Vec<_>>();
            let mut b = make();
            b.load_state(a.state()).unwrap();
            run(&mut a, 3..5);
            let after_a = flat(&ps);
            for ((_, p), s) in ps.iter().zip(&saved) {
                p.shallow_clone().copy_(s);
            }
            run(&mut b, 3..5);
            assert!(after_a.equal(&flat(&ps)), "{}: a restored optimizer continues identically", W::NAME);
            assert!(make().load_state(vec![(format!("{}/bogus", W::NAME), Tensor::from(1.0))]).is_err());
        }
        check(|| Weighted::new(PcGrad::new(PcGradConfig::default()), AdamWConfig::default()));
        check(|| Weighted::new(Cgd::new(CgdConfig::default()).unwrap(), AdamWConfig::default()));
        check(|| Weighted::new(GradNorm::new(GradNormConfig::default()).unwrap(), AdamWConfig::default()));
    }

    #[test]
    fn misuse_is_an_error() {
        let mut opt = Weighted::new(PcGrad::new(PcGradConfig::default()), AdamWConfig::default());
        assert!(opt.task_gradients("task0", 1.0, grads(0, 0)).is_err(), "before begin_step");
        opt.begin_step(params(), ctx(0, None)).unwrap();
        assert!(opt.task_gradients("nope", 1.0, grads(0, 0)).is_err());
        opt.task_gradients("task0", 1.0, grads(0, 0)).unwrap();
        assert!(opt.task_gradients("task0", 1.0, grads(0, 0)).is_err(), "twice");
    }
}
