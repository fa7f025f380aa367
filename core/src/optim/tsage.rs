//! T-SAGE: task-sensitivity-guided adaptive learning (REFERENCE §4, TACO paper Algorithm 1).
//!
//! Per step, for each task `t` with gradient `G_t`: sensitivity `S_t = |θ ⊙ G_t|`, divided by
//! its median over all parameter elements; momentum `M_t ← β·M_t + (1−β)·S_t` (from zero, no
//! bias correction, every step); weights `A = softmax_t(M / τ)` per element; combined gradient
//! `g = Σ_t A_t ⊙ G_t / T` (the authors' code divides by T). During burn-in (the warm-up
//! steps) `g = Σ_t G_t` while `M` keeps accumulating. Then clipping and AdamW, as for plain
//! training. A step where a task gradient holds a NaN takes no update (the authors fall back
//! to the plain sum, which carries the NaN into the weights) and that task's `M` is left as is.
//!
//! Nothing of size `T·P` is held besides `M`: each task is folded in as it arrives.
//! - `exact`: the weights come from this step's `M`. `M_t` depends on task t alone, so it is
//!   final when `G_t` arrives, and `Σ_t e^{M_t/τ} G_t / Σ_t e^{M_t/τ}` is accumulated online as
//!   in a streaming softmax: a running log-denominator `L` and a running weighted mean `N`;
//!   a task arriving rescales `N` by `e^{L_old − L_new}` and adds `e^{M_t/τ − L_new} G_t`.
//! - `lean`: the weights come from the previous step's `M` (a one-step lag): `L` is that `M`'s
//!   log-denominator, computed once at the start of the step, and each task adds
//!   `e^{M_t/τ − L} G_t` before updating its `M_t`.
//!
//! Both hold `M` (`T·P`), `N` and `L` (`2·P`) and per-parameter temporaries; burn-in holds the
//! plain sum instead. The median is found by two counting passes over the float bit patterns
//! (non-negative floats order as their bits), never concatenating the `P` sensitivities.

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
    burn_in: bool,
    /// Which tasks handed over gradients.
    arrived: Vec<bool>,
    /// Burn-in: the plain sum of the task gradients.
    plain: BTreeMap<String, Tensor>,
    /// After burn-in: `N`, the running softmax-weighted mean of the task gradients, and `L`,
    /// the running (exact) or previous step's (lean) log-denominator, per parameter.
    weighted: BTreeMap<String, Tensor>,
    log_denominator: BTreeMap<String, Tensor>,
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

impl crate::plugin::Optimizer for TSage {
    fn begin_step(&mut self, params: Vec<(String, Tensor)>, ctx: StepContext) -> Result<()> {
        TSage::begin_step(self, params, ctx)
    }
    fn task_gradients(&mut self, task: &str, _loss: f64, grads: Vec<(String, Tensor)>) -> Result<()> {
        TSage::task_gradients(self, task, grads)
    }
    fn finish_step(&mut self) -> Result<serde_json::Value> {
        TSage::finish_step(self)
    }
    fn state(&self) -> Result<Vec<(String, Tensor)>> {
        Ok(TSage::state(self))
    }
    fn load_state(&mut self, state: Vec<(String, Tensor)>) -> Result<()> {
        TSage::load_state(self, state)
    }
}

/// One task into the running softmax-weighted mean of `name`: `w` is the task's `M_t / τ`,
/// `g` its gradient (absent: it only enters the denominator).
fn fold_online(weighted: &mut BTreeMap<String, Tensor>, log_den: &mut BTreeMap<String, Tensor>, name: &str, w: &Tensor, g: Option<&Tensor>) {
    let new_den = match log_den.get(name) {
        Some(old) => {
            let new = old.logaddexp(w);
            if let Some(n) = weighted.get_mut(name) {
                let _ = n.g_mul_(&(old - &new).exp());
            }
            new
        }
        None => w.copy(),
    };
    if let Some(g) = g {
        let term = (w - &new_den).exp() * g;
        match weighted.get_mut(name) {
            Some(n) => {
                let _ = n.g_add_(&term);
            }
            None => {
                weighted.insert(name.to_string(), term);
            }
        }
    }
    log_den.insert(name.to_string(), new_den);
}

/// The lower median (`torch.median`'s) of non-negative, finite values handed over chunk by
/// chunk by `chunks`, plus `zeros` more zeros, without holding them together: non-negative
/// floats order as their bit patterns, so one pass counts the high 16 bits, a second the low
/// 16 bits inside the bin holding the median. With `skip_zeros`, zeros do not count.
fn streaming_lower_median(chunks: &dyn Fn(&mut dyn FnMut(&Tensor)), zeros: i64, skip_zeros: bool) -> f64 {
    const BINS: i64 = 1 << 16;
    let bits = |x: &Tensor| x.to_kind(Kind::Float).contiguous().view_dtype(Kind::Int).flatten(0, -1);
    let count = |select_high: Option<i64>| -> Vec<i64> {
        let mut hist = vec![0i64; BINS as usize];
        let mut zeros_seen = 0i64;
        chunks(&mut |x: &Tensor| {
            let b = bits(x);
            zeros_seen += b.eq(0).sum(Kind::Int64).int64_value(&[]);
            let keys = match select_high {
                None => b.bitwise_right_shift_tensor_scalar(16),
                Some(high) => b.masked_select(&b.bitwise_right_shift_tensor_scalar(16).eq(high)).bitwise_and(0xFFFF),
            };
            if keys.numel() == 0 {
                return;
            }
            let c: Vec<i64> = Vec::try_from(keys.to_kind(Kind::Int64).bincount::<Tensor>(None, BINS)).unwrap_or_default();
            for (h, v) in hist.iter_mut().zip(c) {
                *h += v;
            }
        });
        // Zeros have bit pattern 0: bin 0 of the first pass, and of the second inside bin 0.
        if select_high.is_none_or(|h| h == 0) {
            hist[0] += if skip_zeros { -zeros_seen } else { zeros };
        }
        hist
    };
    let nth = |hist: &[i64], rank: i64| -> (usize, i64) {
        let mut seen = 0;
        for (bin, &c) in hist.iter().enumerate() {
            if seen + c > rank {
                return (bin, rank - seen);
            }
            seen += c;
        }
        (hist.len() - 1, 0)
    };
    let high = count(None);
    let n: i64 = high.iter().sum();
    if n == 0 {
        return 0.0;
    }
    let (hi, rank) = nth(&high, (n - 1) / 2);
    let low = count(Some(hi as i64));
    let (lo, _) = nth(&low, rank);
    f32::from_bits(((hi as u32) << 16) | lo as u32) as f64
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
        let burn_in = ctx.step < ctx.warmup_steps;
        let log_denominator = match self.config.form {
            Form::Lean if !burn_in => params.iter().map(|(n, _)| (n.clone(), (&self.momentum[n] / self.config.tau).logsumexp([0i64].as_slice(), false))).collect(),
            _ => BTreeMap::new(),
        };
        self.step = Some(Step {
            params,
            ctx,
            burn_in,
            arrived: vec![false; self.tasks.len()],
            plain: BTreeMap::new(),
            weighted: BTreeMap::new(),
            log_denominator,
            saw_nan: false,
            medians: BTreeMap::new(),
        });
        Ok(())
    }

    pub fn task_gradients(&mut self, task: &str, grads: Vec<(String, Tensor)>) -> Result<()> {
        let Some(step) = self.step.as_mut() else { bail!("tsage: task_gradients before begin_step") };
        let Some(t) = self.tasks.iter().position(|n| n == task) else { bail!("tsage: unknown task {task:?} (tasks: {:?})", self.tasks) };
        if step.arrived[t] {
            bail!("tsage: task {task:?} handed over twice in one step");
        }
        step.arrived[t] = true;
        let _guard = tch::no_grad_guard();
        // Lent: read now, fold in, keep nothing that shares their storage.
        let grads: BTreeMap<String, Tensor> = grads.into_iter().filter(|(_, g)| g.defined()).collect();
        if let Some(name) = grads.keys().find(|n| !step.params.iter().any(|(p, _)| p == *n)) {
            bail!("tsage: gradient for unknown parameter {name:?}");
        }
        if grads.values().any(|g| g.isnan().any().int64_value(&[]) != 0) {
            step.saw_nan = true;
            return Ok(());
        }
        let sensitivity = |name: &str, theta: &Tensor| grads.get(name).map(|g| (theta.to_kind(Kind::Float) * g.to_kind(Kind::Float)).abs());
        let scale = if self.config.median_normalise {
            // One global median over all P elements; parameters without gradient count as 0
            // (or, with `median_of = nonzero`, not at all).
            let missing: i64 = step.params.iter().filter(|(n, _)| !grads.contains_key(n)).map(|(_, p)| p.numel() as i64).sum();
            let median = streaming_lower_median(
                &|visit: &mut dyn FnMut(&Tensor)| {
                    for (name, theta) in &step.params {
                        if let Some(s) = sensitivity(name, theta) {
                            visit(&s);
                        }
                    }
                },
                missing,
                self.config.median_of == MedianOf::Nonzero,
            );
            step.medians.insert(task.to_string(), median);
            1.0 / (median + 1e-12)
        } else {
            1.0
        };
        let (beta, tau) = (self.config.beta, self.config.tau);
        for (name, theta) in &step.params {
            let g = grads.get(name).map(|g| g.to_kind(Kind::Float));
            let m = self.momentum.get_mut(name).expect("made in begin_step");
            let mut m_t = m.get(t as i64);
            if step.burn_in {
                if let Some(g) = &g {
                    add_into(&mut step.plain, name, g);
                }
            } else if self.config.form == Form::Lean {
                if let Some(g) = &g {
                    // Weights from the previous step's M (this task's row is not updated yet).
                    let a_t = (&m_t / tau - &step.log_denominator[name]).exp();
                    add_into(&mut step.weighted, name, &(a_t * g));
                }
            }
            let _ = m_t.g_mul_scalar_(beta);
            if let Some(s) = sensitivity(name, theta) {
                let _ = m_t.g_add_(&(s * ((1.0 - beta) * scale)));
            }
            if !step.burn_in && self.config.form == Form::Exact {
                fold_online(&mut step.weighted, &mut step.log_denominator, name, &(&m_t / tau), g.as_ref());
            }
        }
        Ok(())
    }

    pub fn finish_step(&mut self) -> Result<serde_json::Value> {
        let Some(mut step) = self.step.take() else { bail!("tsage: finish_step before begin_step") };
        let burn_in = step.burn_in;
        if step.saw_nan {
            return Ok(serde_json::json!({"grad_norm": null, "burn_in": burn_in, "nan_skipped": true, "sensitivity_medians": step.medians}));
        }
        let t = self.tasks.len() as f64;
        let div = if self.config.divide_by_tasks { t } else { 1.0 };
        let _guard = tch::no_grad_guard();
        let mut combined = if burn_in {
            std::mem::take(&mut step.plain)
        } else {
            if self.config.form == Form::Exact {
                // Tasks absent from this step (one task per batch) still count in the softmax.
                for (u, _) in step.arrived.iter().enumerate().filter(|(_, a)| !**a) {
                    for (name, _) in &step.params {
                        let w = self.momentum[name].get(u as i64) / self.config.tau;
                        fold_online(&mut step.weighted, &mut step.log_denominator, name, &w, None);
                    }
                }
            }
            step.weighted.into_iter().map(|(n, g)| (n, g / div)).collect()
        };
        let norm = step.ctx.max_grad_norm.map(|max| clip_grad_norm(&mut combined, max));
        self.adam.step(&step.params, &combined, &step.ctx)?;
        Ok(serde_json::json!({"grad_norm": norm, "burn_in": burn_in, "nan_skipped": false, "sensitivity_medians": step.medians}))
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


#[cfg(test)]
mod tests {
    use super::*;

    /// The median as `torch.median` defines it for an even count: the lower of the two middle
    /// values.
    fn lower_median(x: &Tensor) -> f64 {
        let n = x.numel() as i64;
        if n == 0 {
            return 0.0;
        }
        x.kthvalue((n - 1) / 2 + 1, 0, false).0.double_value(&[])
    }

    use crate::optim::testutil::*;

    /// The formulas of REFERENCE §4 on dense `[T, P]` tensors, then AdamW on the flat vector.
    /// Tasks 0 and 1 alternate when `one` (MT-DPR's one task per step; they reach every
    /// parameter, so AdamW's skipping of gradient-less parameters does not come in).
    fn present(one: bool, step: u64, t: usize) -> bool {
        !one || step as usize % 2 == t
    }

    fn dense_reference(form: Form, median_of: MedianOf, one: bool, steps: u64, warmup: u64, max_norm: Option<f64>) -> Tensor {
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
            let mask = Tensor::from_slice(&(0..TASKS).map(|t| present(one, step, t) as i64 as f32).collect::<Vec<_>>()).unsqueeze(1);
            let g = g * &mask;
            let median = |row: Tensor| match median_of {
                MedianOf::All => lower_median(&row),
                MedianOf::Nonzero => lower_median(&row.masked_select(&row.gt(0.0))),
            };
            let med = Tensor::stack(&(0..TASKS as i64).map(|t| Tensor::from(median(s.get(t)) as f32)).collect::<Vec<_>>(), 0);
            let s = &s / (med.unsqueeze(1) + 1e-12);
            let a_prev = (&m / cfg.tau).softmax(0, Kind::Float);
            // Absent tasks' rows are not touched.
            m = (&m * cfg.beta + &s * (1.0 - cfg.beta)) * &mask + &m * (1.0 - &mask);
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

    fn ours(form: Form, median_of: MedianOf, one: bool, steps: u64, warmup: u64, max_norm: Option<f64>) -> Tensor {
        let mut opt = TSage::new(TSageConfig { form, median_of, ..Default::default() }).unwrap();
        let ps = params();
        let tasks: Vec<String> = (0..TASKS).map(|t| format!("task{t}")).collect();
        for step in 0..steps {
            let ctx = StepContext { step, total_steps: steps, warmup_steps: warmup, lr: 0.01, tasks: tasks.clone(), max_grad_norm: max_norm, ..Default::default() };
            opt.begin_step(ps.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect(), ctx).unwrap();
            for (t, name) in tasks.iter().enumerate().filter(|(t, _)| present(one, step, *t)) {
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
            for (warmup, clip, median_of, one) in [
                (1, None, MedianOf::All, false),
                (0, Some(0.5), MedianOf::All, false),
                (3, None, MedianOf::All, false),
                (1, None, MedianOf::Nonzero, false),
                (1, None, MedianOf::All, true),
            ] {
                let (a, b) = (ours(form, median_of, one, 6, warmup, clip), dense_reference(form, median_of, one, 6, warmup, clip));
                let diff = (&a - &b).abs().max().double_value(&[]);
                assert!(diff < 1e-6, "{form:?} {median_of:?} one-at-a-time {one} warmup {warmup} clip {clip:?}: max diff {diff}");
            }
        }
        // The two forms differ once the weights matter (not during burn-in), and so do the medians.
        let diff = (&ours(Form::Exact, MedianOf::All, false, 6, 1, None) - &ours(Form::Lean, MedianOf::All, false, 6, 1, None)).abs().max().double_value(&[]);
        assert!(diff > 1e-7, "exact and lean should differ: {diff}");
        let diff = (&ours(Form::Exact, MedianOf::All, false, 6, 1, None) - &ours(Form::Exact, MedianOf::Nonzero, false, 6, 1, None)).abs().max().double_value(&[]);
        assert!(diff > 1e-7, "the two medians should differ here: {diff}");
    }

    #[test]
    fn streaming_median_equals_torch_median() {
        for (seed, n, zero_every) in [(1u64, 1001usize, 3usize), (2, 64, 1), (3, 4096, 2), (4, 7, 100)] {
            let v: Vec<f32> = values(seed, n).iter().enumerate().map(|(i, x)| if i % zero_every == 0 { 0.0 } else { x.abs() * 10f32.powi((i % 7) as i32 - 3) }).collect();
            let all = Tensor::from_slice(&v);
            let chunks = |visit: &mut dyn FnMut(&Tensor)| {
                for c in all.split(97, 0) {
                    visit(&c);
                }
            };
            for extra in [0i64, 5, 2000] {
                let with_extra = Tensor::cat(&[all.shallow_clone(), Tensor::zeros([extra], (Kind::Float, tch::Device::Cpu))], 0);
                assert_eq!(streaming_lower_median(&chunks, extra, false), lower_median(&with_extra), "seed {seed} extra {extra}");
                let nonzero = all.masked_select(&all.gt(0.0));
                assert_eq!(streaming_lower_median(&chunks, extra, true), lower_median(&nonzero), "seed {seed} nonzero");
            }
        }
        assert_eq!(streaming_lower_median(&|_: &mut dyn FnMut(&Tensor)| {}, 0, false), 0.0);
    }

    /// Most elements without gradient: the median of all is 0 and the scale 1e12. Both forms
    /// stay finite (the lean form's weights are a stable softmax too).
    #[test]
    fn a_zero_median_stays_finite() {
        for form in [Form::Exact, Form::Lean] {
            let mut opt = TSage::new(TSageConfig { form, ..Default::default() }).unwrap();
            let p = vec![("w".to_string(), Tensor::from_slice(&values(5, 20)))];
            let tasks = vec!["a".to_string(), "b".to_string()];
            for step in 0..4 {
                let ctx = StepContext { step, total_steps: 4, warmup_steps: 1, lr: 0.01, tasks: tasks.clone(), ..Default::default() };
                opt.begin_step(p.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect(), ctx).unwrap();
                for (i, task) in tasks.iter().enumerate() {
                    let mut g = vec![0f32; 20];
                    g[i * 3] = 0.5;
                    g[i * 3 + 1] = -0.25;
                    opt.task_gradients(task, vec![("w".to_string(), Tensor::from_slice(&g))]).unwrap();
                }
                let stats = opt.finish_step().unwrap();
                assert_eq!(stats["sensitivity_medians"]["a"], 0.0);
            }
            assert!(p[0].1.isfinite().all().int64_value(&[]) == 1, "{form:?}: {}", p[0].1);
        }
    }

    #[test]
    fn a_nan_gradient_skips_the_step_and_leaves_that_task_s_momentum() {
        let mut opt = TSage::new(TSageConfig::default()).unwrap();
        let ps = params();
        let before = flat(&ps);
        let tasks: Vec<String> = (0..TASKS).map(|t| format!("task{t}")).collect();
        let ctx = StepContext { step: 5, total_steps: 10, warmup_steps: 1, lr: 0.01, tasks: tasks.clone(), ..Default::default() };
        opt.begin_step(ps.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect(), ctx).unwrap();
        opt.task_gradients("task0", grads(0, 0)).unwrap();
        let mut bad = grads(0, 1);
        bad[0].1 = bad[0].1.fill_(f64::NAN);
        opt.task_gradients("task1", bad).unwrap();
        let stats = opt.finish_step().unwrap();
        assert_eq!(stats["nan_skipped"], true);
        assert!(flat(&ps).equal(&before), "no update");
        assert_eq!(opt.momentum["p0"].get(1).abs().sum(Kind::Float).double_value(&[]), 0.0, "task1's momentum untouched");
        assert!(opt.momentum["p0"].get(0).abs().sum(Kind::Float).double_value(&[]) > 0.0, "task0's momentum updated");
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
