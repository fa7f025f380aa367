//! T-SAGE: task-sensitivity-guided adaptive learning (REFERENCE §4, TACO paper Algorithm 1).
//!
//! Per step, for each task `t` with gradient `G_t`: sensitivity `S_t = |θ ⊙ G_t|`, divided by
//! its median over all parameter elements; momentum `M_t ← β·M_t + (1−β)·S_t` (from zero, no
//! bias correction, every step); weights `A = softmax_t(M / τ)` per element; combined gradient
//! `g = Σ_t A_t ⊙ G_t / T` (the authors' code divides by T). During burn-in (the warm-up
//! steps) and on a step where a task gradient holds a NaN, `g = Σ_t G_t` while `M` keeps
//! accumulating. Then clipping and AdamW, as for plain training.
//!
//! Two forms:
//! - `exact`: the weights come from this step's `M`. Each task's `M_t` is updated as its
//!   gradient arrives (it depends on that task alone), but the combination has to wait for
//!   every task, so the step holds every `G_t`: `T·P` floats beside `M`'s `T·P`.
//! - `lean`: the weights come from the previous step's `M` (a one-step lag). A task's
//!   contribution `A_t ⊙ G_t` is folded into a running sum as it arrives, with the softmax
//!   denominator computed once per step, and its `M_t` updated right after; no `G_t` is kept.

use super::{clip_grad_norm, AdamW, AdamWConfig};
use crate::plugin::StepContext;
use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use tch::{Kind, Tensor};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Form {
    Exact,
    Lean,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MedianOf {
    All,
    Nonzero,
}

/// T-SAGE's settings (REFERENCE §4 defaults) and the AdamW that takes the step.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TSageConfig {
    /// Momentum of the sensitivities.
    pub beta: f64,
    /// Softmax temperature across tasks.
    pub tau: f64,
    /// Divide each task's sensitivities by their median.
    pub median_normalise: bool,
    /// Which elements the median is over: `all` (REFERENCE §4, the authors' code) or
    /// `nonzero`. When most parameter elements get no gradient (a BERT whose word embeddings
    /// are half its parameters, of which a batch touches a few thousand rows), the median of
    /// all is 0, the scale 1e12, and the task softmax a hard argmax per element.
    pub median_of: MedianOf,
    /// Divide the combined gradient by the number of tasks, as the authors' code does.
    pub divide_by_tasks: bool,
    pub form: Form,
    #[serde(flatten)]
    pub adamw: AdamWConfig,
}

impl Default for TSageConfig {
    fn default() -> Self {
        TSageConfig { beta: 0.999, tau: 2.0, median_normalise: true, median_of: MedianOf::All, divide_by_tasks: true, form: Form::Exact, adamw: AdamWConfig::default() }
    }
}

/// One step in progress.
struct Step {
    params: Vec<(String, Tensor)>,
    ctx: StepContext,
    /// Exact form: each task's gradients by parameter (copies).
    grads: Vec<BTreeMap<String, Tensor>>,
    /// Plain sum of the task gradients (burn-in and the NaN fallback) and, in the lean form,
    /// the weighted sum.
    plain: BTreeMap<String, Tensor>,
    weighted: BTreeMap<String, Tensor>,
    /// Lean form: Σ_u exp(M_u/τ) from the previous step's M, per parameter.
    denominators: BTreeMap<String, Tensor>,
    saw_nan: bool,
    /// Each task's sensitivity median this step (for the log: a median near 0, when most
    /// parameters get no gradient, makes the normalisation scale huge).
    medians: BTreeMap<String, f64>,
}

/// The optimizer (see the module docs).
pub struct TSage {
    pub config: TSageConfig,
    adam: AdamW,
    /// Task names, fixed by the first step.
    tasks: Vec<String>,
    /// `M` per parameter: `[T, ..shape]`.
    momentum: BTreeMap<String, Tensor>,
    step: Option<Step>,
}

fn add_into(sum: &mut BTreeMap<String, Tensor>, name: &str, g: &Tensor) {
    match sum.get_mut(name) {
        Some(s) => {
            let _ = s.g_add_(g);
        }
        None => {
            sum.insert(name.to_string(), g.copy());
        }
    }
}

impl TSage {
    pub fn new(config: TSageConfig) -> Result<Self> {
        if !(0.0..1.0).contains(&config.beta) || config.tau <= 0.0 {
            bail!("tsage: beta must be in [0, 1) and tau positive (got {}, {})", config.beta, config.tau);
        }
        Ok(TSage { adam: AdamW::new(config.adamw.clone()), config, tasks: Vec::new(), momentum: BTreeMap::new(), step: None })
    }

    pub fn begin_step(&mut self, params: Vec<(String, Tensor)>, ctx: StepContext) -> Result<()> {
        if self.tasks.is_empty() {
            self.tasks = ctx.tasks.clone();
        } else if self.tasks != ctx.tasks {
            bail!("tsage: the tasks changed from {:?} to {:?}", self.tasks, ctx.tasks);
        }
        if self.tasks.is_empty() {
            bail!("tsage: the step context names no tasks");
        }
        let t = self.tasks.len() as i64;
        let _guard = tch::no_grad_guard();
        for (name, p) in &params {
            self.momentum.entry(name.clone()).or_insert_with(|| {
                let mut shape = vec![t];
                shape.extend(p.size());
                Tensor::zeros(shape, (Kind::Float, p.device()))
            });
        }
        let denominators = match self.config.form {
            Form::Lean => params
                .iter()
                .map(|(n, _)| (n.clone(), (&self.momentum[n] / self.config.tau).exp().sum_dim_intlist(0, false, Kind::Float)))
                .collect(),
            Form::Exact => BTreeMap::new(),
        };
        self.step = Some(Step {
            params,
            ctx,
            grads: (0..self.tasks.len()).map(|_| BTreeMap::new()).collect(),
            plain: BTreeMap::new(),
            weighted: BTreeMap::new(),
            denominators,
            saw_nan: false,
            medians: BTreeMap::new(),
        });
        Ok(())
    }

    pub fn task_gradients(&mut self, task: &str, grads: Vec<(String, Tensor)>) -> Result<()> {
        let Some(step) = self.step.as_mut() else { bail!("tsage: task_gradients before begin_step") };
        let Some(t) = self.tasks.iter().position(|n| n == task) else { bail!("tsage: unknown task {task:?} (tasks: {:?})", self.tasks) };
        let _guard = tch::no_grad_guard();
        let grads: BTreeMap<String, Tensor> =
            grads.into_iter().filter(|(_, g)| g.defined()).map(|(n, g)| (n, g.to_kind(Kind::Float))).collect();
        let nan = grads.values().any(|g| g.isnan().any().int64_value(&[]) != 0);
        step.saw_nan |= nan;
        for (name, g) in &grads {
            add_into(&mut step.plain, name, g);
        }
        if nan {
            // A NaN would poison M for good; this step falls back to the plain sum anyway.
            return Ok(());
        }
        // S_t = |θ ⊙ G_t| over every parameter element (none for parameters without gradient).
        let theta: BTreeMap<&str, &Tensor> = step.params.iter().map(|(n, p)| (n.as_str(), p)).collect();
        let sens: BTreeMap<&str, Tensor> = grads
            .iter()
            .map(|(n, g)| Ok((n.as_str(), (theta.get(n.as_str()).ok_or_else(|| anyhow::anyhow!("tsage: gradient for unknown parameter {n:?}"))?.to_kind(Kind::Float) * g).abs())))
            .collect::<Result<_>>()?;
        let scale = if self.config.median_normalise {
            // One global median over all P elements; parameters without gradient count as 0.
            let mut flat: Vec<Tensor> = sens.values().map(|s| s.flatten(0, -1)).collect();
            let missing: i64 = step.params.iter().filter(|(n, _)| !sens.contains_key(n.as_str())).map(|(_, p)| p.numel() as i64).sum();
            if missing > 0 {
                flat.push(Tensor::zeros([missing], (Kind::Float, flat.first().map_or(tch::Device::Cpu, |f| f.device()))));
            }
            let all = Tensor::cat(&flat, 0);
            let median = match self.config.median_of {
                MedianOf::All => lower_median(&all),
                MedianOf::Nonzero => lower_median(&all.masked_select(&all.gt(0.0))),
            };
            step.medians.insert(task.to_string(), median);
            1.0 / (median + 1e-12)
        } else {
            1.0
        };
        let beta = self.config.beta;
        for (name, _) in &step.params {
            let m = self.momentum.get_mut(name).expect("made in begin_step");
            let mut m_t = m.get(t as i64);
            if self.config.form == Form::Lean {
                if let Some(g) = grads.get(name) {
                    // Weights from the previous step's M (this task's row is not updated yet).
                    let a_t = (&m_t / self.config.tau).exp() / &step.denominators[name];
                    add_into(&mut step.weighted, name, &(a_t * g));
                }
            }
            let _ = m_t.g_mul_scalar_(beta);
            if let Some(s) = sens.get(name.as_str()) {
                let _ = m_t.g_add_(&(s * ((1.0 - beta) * scale)));
            }
        }
        if self.config.form == Form::Exact {
            // Kept until finish_step: copy, since `to_kind` to the same kind shares the
            // caller's storage, which the trainer zeroes for the next task.
            step.grads[t] = grads.into_iter().map(|(n, g)| (n, g.copy())).collect();
        }
        Ok(())
    }

    pub fn finish_step(&mut self) -> Result<serde_json::Value> {
        let Some(mut step) = self.step.take() else { bail!("tsage: finish_step before begin_step") };
        let burn_in = step.ctx.step < step.ctx.warmup_steps;
        let t = self.tasks.len() as f64;
        let div = if self.config.divide_by_tasks { t } else { 1.0 };
        let _guard = tch::no_grad_guard();
        let mut combined = if burn_in || step.saw_nan {
            std::mem::take(&mut step.plain)
        } else {
            match self.config.form {
                Form::Lean => step.weighted.into_iter().map(|(n, g)| (n, g / div)).collect(),
                Form::Exact => {
                    let mut out = BTreeMap::new();
                    for (name, _) in &step.params {
                        let a = (&self.momentum[name] / self.config.tau).softmax(0, Kind::Float);
                        let mut sum: Option<Tensor> = None;
                        for (ti, g) in step.grads.iter().enumerate() {
                            if let Some(g) = g.get(name) {
                                let term = a.get(ti as i64) * g;
                                sum = Some(match sum {
                                    None => term,
                                    Some(s) => s + term,
                                });
                            }
                        }
                        if let Some(s) = sum {
                            out.insert(name.clone(), s / div);
                        }
                    }
                    out
                }
            }
        };
        let norm = step.ctx.max_grad_norm.map(|max| clip_grad_norm(&mut combined, max));
        self.adam.step(&step.params, &combined, &step.ctx)?;
        Ok(serde_json::json!({"grad_norm": norm, "burn_in": burn_in, "nan_fallback": step.saw_nan, "sensitivity_medians": step.medians}))
    }

    /// AdamW's state, then `momentum/NAME` (`[T, ..shape]`, rows in the step context's task
    /// order, which every step checks).
    pub fn state(&self) -> Vec<(String, Tensor)> {
        let mut out = self.adam.state();
        out.extend(self.momentum.iter().map(|(n, m)| (format!("momentum/{n}"), m.copy())));
        out
    }

    pub fn load_state(&mut self, state: Vec<(String, Tensor)>) -> Result<()> {
        let (momentum, adam): (Vec<_>, Vec<_>) = state.into_iter().partition(|(n, _)| n.starts_with("momentum/"));
        self.adam.load_state(adam)?;
        self.momentum = momentum.into_iter().map(|(n, m)| (n["momentum/".len()..].to_string(), m.copy())).collect();
        Ok(())
    }
}

/// The median as `torch.median` defines it for an even count: the lower of the two middle
/// values.
fn lower_median(x: &Tensor) -> f64 {
    let n = x.numel() as i64;
    if n == 0 {
        return 0.0;
    }
    x.kthvalue((n - 1) / 2 + 1, 0, false).0.double_value(&[])
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::optim::testutil::*;

    /// The formulas of REFERENCE §4 on dense `[T, P]` tensors, then AdamW on the flat vector.
    fn dense_reference(form: Form, median_of: MedianOf, steps: u64, warmup: u64, max_norm: Option<f64>) -> Tensor {
        let cfg = TSageConfig { form, median_of, ..Default::default() };
        let theta = flat(&params());
        let p = theta.size()[0];
        let mut m = Tensor::zeros([TASKS as i64, p], (Kind::Float, tch::Device::Cpu));
        let mut adam = AdamW::new(cfg.adamw.clone());
        for step in 0..steps {
            let g = Tensor::stack(
                &(0..TASKS)
                    .map(|t| {
                        let mut full: Vec<(String, Tensor)> = params().iter().map(|(n, x)| (n.clone(), Tensor::zeros_like(x))).collect();
                        for (n, v) in grads(step, t) {
                            full.iter_mut().find(|(m, _)| *m == n).unwrap().1 = v;
                        }
                        flat(&full)
                    })
                    .collect::<Vec<_>>(),
                0,
            );
            let s = (&theta.unsqueeze(0) * &g).abs();
            let median = |row: Tensor| match median_of {
                MedianOf::All => lower_median(&row),
                MedianOf::Nonzero => lower_median(&row.masked_select(&row.gt(0.0))),
            };
            let med = Tensor::stack(&(0..TASKS as i64).map(|t| Tensor::from(median(s.get(t)) as f32)).collect::<Vec<_>>(), 0);
            let s = &s / (med.unsqueeze(1) + 1e-12);
            let a_prev = (&m / cfg.tau).softmax(0, Kind::Float);
            m = &m * cfg.beta + &s * (1.0 - cfg.beta);
            let a = if form == Form::Lean { a_prev } else { (&m / cfg.tau).softmax(0, Kind::Float) };
            let combined = if step < warmup { g.sum_dim_intlist(0, false, Kind::Float) } else { (&a * &g).sum_dim_intlist(0, false, Kind::Float) / TASKS as f64 };
            let mut gm: BTreeMap<String, Tensor> = [("flat".to_string(), combined)].into();
            if let Some(max) = max_norm {
                clip_grad_norm(&mut gm, max);
            }
            let ctx = StepContext { lr: 0.01, ..Default::default() };
            adam.step(&[("flat".to_string(), theta.shallow_clone())], &gm, &ctx).unwrap();
        }
        theta
    }

    fn ours(form: Form, median_of: MedianOf, steps: u64, warmup: u64, max_norm: Option<f64>) -> Tensor {
        let mut opt = TSage::new(TSageConfig { form, median_of, ..Default::default() }).unwrap();
        let ps = params();
        let tasks: Vec<String> = (0..TASKS).map(|t| format!("task{t}")).collect();
        for step in 0..steps {
            let ctx = StepContext { step, total_steps: steps, warmup_steps: warmup, lr: 0.01, tasks: tasks.clone(), max_grad_norm: max_norm, ..Default::default() };
            opt.begin_step(ps.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect(), ctx).unwrap();
            for (t, name) in tasks.iter().enumerate() {
                let lent = grads(step, t);
                opt.task_gradients(name, lent.iter().map(|(n, g)| (n.clone(), g.shallow_clone())).collect()).unwrap();
                // The trainer reuses the gradient storage for the next task.
                for (_, g) in &lent {
                    let _ = g.shallow_clone().zero_();
                }
            }
            opt.finish_step().unwrap();
        }
        flat(&ps)
    }

    #[test]
    fn both_forms_equal_the_dense_formulas() {
        for form in [Form::Exact, Form::Lean] {
            for (warmup, clip, median_of) in [(1, None, MedianOf::All), (0, Some(0.5), MedianOf::All), (3, None, MedianOf::All), (1, None, MedianOf::Nonzero)] {
                let (a, b) = (ours(form, median_of, 6, warmup, clip), dense_reference(form, median_of, 6, warmup, clip));
                let diff = (&a - &b).abs().max().double_value(&[]);
                assert!(diff < 1e-6, "{form:?} {median_of:?} warmup {warmup} clip {clip:?}: max diff {diff}");
            }
        }
        // The two forms differ once the weights matter (not during burn-in), and so do the medians.
        let diff = (&ours(Form::Exact, MedianOf::All, 6, 1, None) - &ours(Form::Lean, MedianOf::All, 6, 1, None)).abs().max().double_value(&[]);
        assert!(diff > 1e-7, "exact and lean should differ: {diff}");
        let diff = (&ours(Form::Exact, MedianOf::All, 6, 1, None) - &ours(Form::Exact, MedianOf::Nonzero, 6, 1, None)).abs().max().double_value(&[]);
        assert!(diff > 1e-7, "the two medians should differ here: {diff}");
    }

    #[test]
    fn state_round_trips() {
        let mut a = TSage::new(TSageConfig::default()).unwrap();
        let ps = params();
        let tasks: Vec<String> = (0..TASKS).map(|t| format!("task{t}")).collect();
        let ctx = StepContext { lr: 0.01, tasks: tasks.clone(), ..Default::default() };
        a.begin_step(ps.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect(), ctx.clone()).unwrap();
        for (t, name) in tasks.iter().enumerate() {
            a.task_gradients(name, grads(0, t)).unwrap();
        }
        a.finish_step().unwrap();
        let mut b = TSage::new(TSageConfig::default()).unwrap();
        b.load_state(a.state()).unwrap();
        assert_eq!(a.momentum.len(), b.momentum.len());
        for (n, m) in &a.momentum {
            assert!(m.equal(&b.momentum[n]));
        }
        assert!(a.begin_step(Vec::new(), StepContext { tasks: vec!["other".into()], ..ctx }).is_err(), "tasks may not change");
    }
}
