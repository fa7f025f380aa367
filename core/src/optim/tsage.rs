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
//!   final when `G_t` arrives, and `N = Σ_t e^{M_t/τ} G_t / Σ_t e^{M_t/τ}` is accumulated
//!   online as in a streaming softmax: a task arriving rescales `N` by `e^{L_before − L_after}`
//!   and adds `e^{M_t/τ − L_after} G_t`, where `L` is the log-denominator over the tasks in so
//!   far; the two factors are `1 − w` and `w` with `w = sigmoid(M_t/τ − L_before)`, one lerp.
//!   `L_before` is not kept: it is recomputed from those tasks' rows of `M`, which are final.
//! - `lean`: the weights come from the previous step's `M` (a one-step lag): `L` is that `M`'s
//!   log-denominator, computed at the start of the step and kept (rows of `M` change as tasks
//!   arrive, so it cannot be recomputed), and each task adds `e^{M_t/τ − L} G_t` before
//!   updating its `M_t`.
//!
//! So the exact form holds `M` and `N` (`(T+1)·P`), the lean one `L` too (`(T+2)·P`, `L`
//! kept between steps as a buffer); burn-in holds the plain sum instead of `N`. `N` takes the
//! place of the summed gradient plain AdamW holds, so over AdamW the extra is `T·P` and
//! `(T+1)·P`. The median is found by two counting passes over the float bit patterns
//! (non-negative floats order as their bits), never concatenating the `P` sensitivities.
//!
//! On the CPU (every tensor contiguous float32) each stage is one fused pass of
//! `optim::kernels` per parameter: the NaN check, the two counting passes, the momentum
//! update with the fold (the exact form's weight as `w = 1/(1 + Σ_s e^{(M_s − M_t)/τ})`, no
//! logarithm), and the lean form's `L`. Elsewhere the same arithmetic runs as tch operations
//! over chunks of at most `CHUNK` elements, so temporaries stay small next to `P`; so does
//! the exact form's correction at the end of a step that some task sat out.

use super::{clip_grad_norm, kernels, AdamW, AdamWConfig};
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
    /// Scale the combined gradient `Σ_t A_t ⊙ G_t` by T instead, so that uniform weights give
    /// the plain sum the burn-in stepped on. With the authors' division the gradient drops T²
    /// times at the end of burn-in (`ΣG/T²` for uniform weights) while AdamW's second moment
    /// still holds the burn-in's gradients (β2 = 0.999 forgets them over about 1,000 steps),
    /// so the steps after burn-in shrink, unless gradient clipping binds on the plain sum (it
    /// does in the mini-KILT recipes, where the two step sizes measured within 2%).
    pub scale_to_sum: bool,
    pub form: Form,
    #[serde(flatten)]
    pub adamw: AdamWConfig,
}

impl Default for TSageConfig {
    fn default() -> Self {
        TSageConfig {
            beta: 0.999,
            tau: 2.0,
            median_normalise: true,
            median_of: MedianOf::All,
            divide_by_tasks: true,
            scale_to_sum: false,
            form: Form::Exact,
            adamw: AdamWConfig::default(),
        }
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
    /// After burn-in: `N`, the running softmax-weighted mean of the task gradients, flat.
    weighted: BTreeMap<String, Tensor>,
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
    /// Lean form only: the previous step's log-denominator `L` per parameter, flat (kept
    /// between steps as a buffer, remade at each step's start).
    log_denominator: BTreeMap<String, Tensor>,
    step: Option<Step>,
    /// Use the fused loops of `kernels` where every tensor allows (contiguous float32 on the
    /// CPU); off, the tch operations run everywhere (tests check both against the formulas).
    cpu_kernels: bool,
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

/// Elements per chunk of the element-wise arithmetic: temporaries are a few chunks (times
/// `T` for the rows of `M`), not a few copies of the largest parameter. Tests use a tiny
/// chunk, so that their parameters span several chunks and a partial last one.
const CHUNK: i64 = if cfg!(test) { 5 } else { 1 << 18 };

/// `(start, len)` of each chunk of a flat tensor of `n` elements.
fn chunks(n: i64) -> impl Iterator<Item = (i64, i64)> {
    (0..n).step_by(CHUNK as usize).map(move |s| (s, CHUNK.min(n - s)))
}

/// A tensor as one flat row (a view of it: parameters, gradients and `M` are contiguous).
fn flat_view(x: &Tensor) -> Tensor {
    x.reshape([-1])
}

/// The rows of `M` to sum over, as an index tensor on `device` (made once per call site, not
/// per chunk).
fn row_index(rows: &[i64], device: tch::Device) -> Tensor {
    Tensor::from_slice(rows).to_device(device)
}

/// The log-denominator `log Σ_{s ∈ rows} e^{M_s/τ}` of one chunk of `M` (`[T, len]`).
fn log_sum_exp_rows(m: &Tensor, rows: &Tensor, tau: f64) -> Tensor {
    (m.index_select(0, rows) / tau).logsumexp([0i64].as_slice(), false)
}

/// `N`'s chunk, made on first use (zero: nothing folded in yet).
fn weighted_chunk(weighted: &mut BTreeMap<String, Tensor>, name: &str, numel: i64, device: tch::Device, start: i64, len: i64) -> Tensor {
    weighted.entry(name.to_string()).or_insert_with(|| Tensor::zeros([numel], (Kind::Float, device))).narrow(0, start, len)
}

/// Counts of one pass of the median search: with `None`, a histogram of the high 16 bits of
/// every value's bit pattern; with `Some(high)`, of the low 16 bits among values whose high
/// bits are `high`. Returns the 65,536 counts and how many values were exactly 0.
type CountPass<'a> = dyn FnMut(Option<u32>) -> Result<(Vec<i64>, i64)> + 'a;

/// The lower median (`torch.median`'s) of non-negative, finite values counted by `count`, plus
/// `zeros` more zeros, without holding them together: non-negative floats order as their bit
/// patterns, so one pass counts the high 16 bits, a second the low 16 bits inside the bin
/// holding the median. With `skip_zeros`, zeros do not count.
fn lower_median_by_counting(count: &mut CountPass, zeros: i64, skip_zeros: bool) -> Result<f64> {
    let mut pass = |select_high: Option<u32>| -> Result<Vec<i64>> {
        let (mut hist, zeros_seen) = count(select_high)?;
        // Zeros have bit pattern 0: bin 0 of the first pass, and of the second inside bin 0.
        if select_high.is_none_or(|h| h == 0) {
            hist[0] += if skip_zeros { -zeros_seen } else { zeros };
        }
        Ok(hist)
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
    let high = pass(None)?;
    let n: i64 = high.iter().sum();
    if n == 0 {
        return Ok(0.0);
    }
    let (hi, rank) = nth(&high, (n - 1) / 2);
    let low = pass(Some(hi as u32))?;
    let (lo, _) = nth(&low, rank);
    Ok(f32::from_bits(((hi as u32) << 16) | lo as u32) as f64)
}

/// A counting pass (see [`CountPass`]) in tch operations over values handed over chunk by
/// chunk by `chunks`, on any device; the counts stay there and come to the host once.
fn count_tensors(chunks: &dyn Fn(&mut dyn FnMut(&Tensor)), select_high: Option<u32>) -> Result<(Vec<i64>, i64)> {
    const BINS: i64 = 1 << 16;
    let bits = |x: &Tensor| x.to_kind(Kind::Float).contiguous().view_dtype(Kind::Int).flatten(0, -1);
    let mut hist: Option<Tensor> = None;
    let mut zeros_seen: Option<Tensor> = None;
    chunks(&mut |x: &Tensor| {
        let b = bits(x);
        let z = b.eq(0).sum(Kind::Int64);
        zeros_seen = Some(match zeros_seen.take() {
            Some(total) => total + z,
            None => z,
        });
        let keys = match select_high {
            None => b.bitwise_right_shift_tensor_scalar(16),
            Some(high) => b.masked_select(&b.bitwise_right_shift_tensor_scalar(16).eq(high as i64)).bitwise_and(0xFFFF),
        };
        let c = keys.bincount::<Tensor>(None, BINS);
        match hist.as_mut() {
            Some(h) => {
                let _ = h.g_add_(&c);
            }
            None => hist = Some(c),
        }
    });
    let hist: Vec<i64> = match hist {
        Some(h) => Vec::try_from(h.to_device(tch::Device::Cpu))?,
        None => vec![0; BINS as usize],
    };
    Ok((hist, zeros_seen.map_or(0, |z| z.int64_value(&[]))))
}

/// [`lower_median_by_counting`] over tensors handed over by `chunks`.
#[cfg(test)]
fn streaming_lower_median(chunks: &dyn Fn(&mut dyn FnMut(&Tensor)), zeros: i64, skip_zeros: bool) -> Result<f64> {
    lower_median_by_counting(&mut |high| count_tensors(chunks, high), zeros, skip_zeros)
}

impl TSage {
    pub fn new(config: TSageConfig) -> Result<Self> {
        if !(0.0..1.0).contains(&config.beta) || config.tau <= 0.0 {
            bail!("tsage: beta must be in [0, 1) and tau positive (got {}, {})", config.beta, config.tau);
        }
        Ok(TSage { adam: AdamW::new(config.adamw.clone()), config, tasks: Vec::new(), momentum: BTreeMap::new(), log_denominator: BTreeMap::new(), step: None, cpu_kernels: true })
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
            let mut shape = vec![t];
            shape.extend(p.size());
            match self.momentum.get_mut(name) {
                // Loaded from a checkpoint: on the CPU, and from whatever model wrote it.
                Some(m) => {
                    if m.size() != shape {
                        bail!("tsage: the momentum of {name} has shape {:?}, the parameter needs {shape:?} (a checkpoint of another model or task list?)", m.size());
                    }
                    if m.device() != p.device() || m.kind() != Kind::Float || !m.is_contiguous() {
                        *m = m.to_device(p.device()).to_kind(Kind::Float).contiguous();
                    }
                }
                None => {
                    self.momentum.insert(name.clone(), Tensor::zeros(shape, (Kind::Float, p.device())));
                }
            }
        }
        let burn_in = ctx.step < ctx.warmup_steps;
        if self.config.form == Form::Lean && !burn_in {
            // Into the buffers of the last step: allocating P floats anew each step costs
            // page faults and leaves the allocator a hole the size of the largest parameter.
            for (name, p) in &params {
                let n = p.numel() as i64;
                let l = self.log_denominator.entry(name.clone()).or_insert_with(|| Tensor::empty([n], (Kind::Float, p.device())));
                if l.device() != p.device() {
                    *l = l.to_device(p.device());
                }
                let m = &self.momentum[name];
                // SAFETY: this optimizer's own tensors, `M` only read, `L` written by nothing else.
                if let (true, Some(m), Some(l)) = (self.cpu_kernels, unsafe { kernels::f32_slice(m) }, unsafe { kernels::f32_slice_mut(l) }) {
                    kernels::log_sum_exp_rows(m, self.config.tau as f32, l);
                    continue;
                }
                let m = m.view([t, -1]);
                for (start, len) in chunks(n) {
                    l.narrow(0, start, len).copy_(&(m.narrow(1, start, len) / self.config.tau).logsumexp([0i64].as_slice(), false));
                }
            }
        }
        self.step = Some(Step {
            params,
            ctx,
            burn_in,
            arrived: vec![false; self.tasks.len()],
            plain: BTreeMap::new(),
            weighted: BTreeMap::new(),
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
        // On the CPU, every tensor of this task as float32 elements: the fused loops of
        // `kernels` then do the work (one pass per stage instead of one per tch operation).
        let on_cpu = self.cpu_kernels && step.params.iter().all(|(_, p)| kernels::is_cpu_f32(p)) && grads.values().all(kernels::is_cpu_f32);
        fn elements(x: &Tensor) -> &[f32] {
            // SAFETY: parameters, gradients and `L` are only read during the call.
            unsafe { kernels::f32_slice(x) }.expect("checked by on_cpu")
        }
        // A NaN or an infinity would reach every later step through the momentum (0 · inf is
        // NaN): refuse it before anything is folded in, and abandon the step. On the CPU with
        // the median, its first counting pass looks while it reads the gradient anyway.
        let find_non_finite = || super::first_non_finite(grads.iter().map(|(n, g)| (n.as_str(), g)));
        let checked_in_count = on_cpu && self.config.median_normalise;
        let mut non_finite = if checked_in_count { None } else { find_non_finite() };
        let sensitivity = |theta: &Tensor, g: &Tensor| (theta.to_kind(Kind::Float) * g.to_kind(Kind::Float)).abs();
        let mut scale = 1.0;
        if self.config.median_normalise && non_finite.is_none() {
            // One global median over all P elements; parameters without gradient count as 0
            // (or, with `median_of = nonzero`, not at all).
            let missing: i64 = step.params.iter().filter(|(n, _)| !grads.contains_key(n)).map(|(_, p)| p.numel() as i64).sum();
            let with_grad = || step.params.iter().filter_map(|(name, theta)| grads.get(name).map(|g| (theta, g)));
            let skip_zeros = self.config.median_of == MedianOf::Nonzero;
            let median = if on_cpu {
                let pairs: Vec<(&[f32], &[f32])> = with_grad().map(|(theta, g)| (elements(theta), elements(g))).collect();
                let mut bad = false;
                let mut count = |high: Option<u32>| -> Result<(Vec<i64>, i64)> {
                    let mut hist = vec![0i64; 1 << 16];
                    if bad {
                        // The first pass found a non-finite gradient: the median is dropped.
                        return Ok((hist, 0));
                    }
                    let c = kernels::sensitivity_counts(&pairs, high, &mut hist);
                    bad |= c.non_finite;
                    Ok((hist, c.zeros))
                };
                let median = lower_median_by_counting(&mut count, missing, skip_zeros)?;
                // The first pass found one: the median of such counts means nothing, and the
                // search names the parameter.
                if bad {
                    match find_non_finite() {
                        Some(found) => non_finite = Some(found),
                        None => bail!("internal error: T-SAGE's counting pass saw a non-finite gradient that the search for it did not find"),
                    }
                    None
                } else {
                    Some(median)
                }
            } else {
                let chunks = |visit: &mut dyn FnMut(&Tensor)| {
                    for (theta, g) in with_grad() {
                        let (theta, g) = (flat_view(theta), flat_view(g));
                        for (start, len) in chunks(theta.numel() as i64) {
                            visit(&sensitivity(&theta.narrow(0, start, len), &g.narrow(0, start, len)));
                        }
                    }
                };
                Some(lower_median_by_counting(&mut |high| count_tensors(&chunks, high), missing, skip_zeros)?)
            };
            if let Some(median) = median {
                step.medians.insert(task.to_string(), median);
                scale = 1.0 / (median + 1e-12);
            }
        }
        if let Some(name) = non_finite {
            let name = name.to_string();
            self.step = None;
            bail!("tsage: task {task:?}: the gradient of {name} is not finite (NaN or infinite); the step is abandoned: no parameter is updated and this task's momentum is untouched (tasks handed over before it this step are already folded in)");
        }
        let (beta, tau) = (self.config.beta, self.config.tau);
        let tasks = self.tasks.len() as i64;
        let t = t as i64;
        // The exact form's softmax runs over the tasks in so far: those before this one, then it.
        let before: Vec<i64> = (0..tasks).filter(|&u| step.arrived[u as usize] && u != t).collect();
        if on_cpu {
            let before: Vec<usize> = before.iter().map(|&u| u as usize).collect();
            for (name, theta) in &step.params {
                let g = grads.get(name);
                let acc_map = if step.burn_in { &mut step.plain } else { &mut step.weighted };
                // Nothing to fold into and nothing to fold: only the momentum decays.
                let needs_acc = g.is_some() || (!step.burn_in && self.config.form == Form::Exact && acc_map.contains_key(name));
                let acc = needs_acc.then(|| acc_map.entry(name.clone()).or_insert_with(|| Tensor::zeros([theta.numel() as i64], (Kind::Float, theta.device()))));
                let fold = match (step.burn_in, self.config.form) {
                    (true, _) => kernels::Fold::Sum,
                    (false, Form::Exact) => kernels::Fold::Exact { before: &before, first: before.is_empty() },
                    (false, Form::Lean) => kernels::Fold::Lean { log_denominator: elements(&self.log_denominator[name]) },
                };
                // SAFETY: `M` and the accumulator are this optimizer's own tensors, written by
                // nothing else during the call.
                let m = unsafe { kernels::f32_slice_mut(&self.momentum[name]) }.expect("momentum is made contiguous float32 in begin_step");
                let acc = acc.map(|a| unsafe { kernels::f32_slice_mut(a) }.expect("made contiguous float32 here"));
                kernels::tsage_task(elements(theta), g.map(elements), m, t as usize, acc, &fold, beta as f32, ((1.0 - beta) * scale) as f32, tau as f32);
            }
            return Ok(());
        }
        let device = step.params.first().map_or(tch::Device::Cpu, |(_, p)| p.device());
        let before = row_index(&before, device);
        for (name, theta) in &step.params {
            let n = theta.numel() as i64;
            let (theta, g) = (flat_view(theta), grads.get(name).map(flat_view));
            if step.burn_in {
                if let Some(g) = &g {
                    let sum = step.plain.entry(name.clone()).or_insert_with(|| Tensor::zeros([n], (Kind::Float, theta.device())));
                    let _ = sum.g_add_(g);
                }
            }
            let m = self.momentum.get_mut(name).expect("made in begin_step").view([tasks, -1]);
            for (start, len) in chunks(n) {
                let m_c = m.narrow(1, start, len);
                let mut m_t = m_c.get(t);
                let g_c = g.as_ref().map(|g| g.narrow(0, start, len).to_kind(Kind::Float));
                if !step.burn_in && self.config.form == Form::Lean {
                    if let Some(g_c) = &g_c {
                        // Weights from the previous step's M (this task's row is not updated yet).
                        let a_t = (&m_t / tau - self.log_denominator[name].narrow(0, start, len)).exp();
                        let _ = weighted_chunk(&mut step.weighted, name, n, theta.device(), start, len).g_add_(&(a_t * g_c));
                    }
                }
                let _ = m_t.g_mul_scalar_(beta);
                if let Some(g_c) = &g_c {
                    let _ = m_t.g_add_(&(sensitivity(&theta.narrow(0, start, len), g_c) * ((1.0 - beta) * scale)));
                }
                if !step.burn_in && self.config.form == Form::Exact {
                    // With x = M_t/τ: L_after = logaddexp(L_before, x), so the mean so far keeps
                    // e^{L_before − L_after} = 1 − w and G_t gets e^{x − L_after} = w, where
                    // w = sigmoid(x − L_before): N ← N + w·(G_t − N). The first task in has w = 1.
                    let has_n = step.weighted.contains_key(name.as_str());
                    if before.numel() == 0 {
                        if let Some(g_c) = &g_c {
                            weighted_chunk(&mut step.weighted, name, n, theta.device(), start, len).copy_(g_c);
                        }
                    } else if has_n || g_c.is_some() {
                        let d = &m_t / tau - log_sum_exp_rows(&m_c, &before, tau);
                        let mut n_c = weighted_chunk(&mut step.weighted, name, n, theta.device(), start, len);
                        let _ = match &g_c {
                            Some(g_c) => n_c.lerp_tensor_(g_c, &d.sigmoid()),
                            // 1 − w as sigmoid(−d): exact where w rounds to 1 (d above ~17).
                            None => n_c.g_mul_(&(-d).sigmoid()),
                        };
                    }
                }
            }
        }
        Ok(())
    }

    pub fn finish_step(&mut self) -> Result<serde_json::Value> {
        let Some(mut step) = self.step.take() else { bail!("tsage: finish_step before begin_step") };
        let burn_in = step.burn_in;
        let _guard = tch::no_grad_guard();
        let mut combined = self.combined_gradient(&mut step);
        let norm = step.ctx.max_grad_norm.map(|max| clip_grad_norm(&mut combined, max)).transpose()?;
        self.adam.step(&step.params, &combined, &step.ctx)?;
        let norm = norm.map(|n| n.value());
        Ok(serde_json::json!({"grad_norm": norm, "burn_in": burn_in, "sensitivity_medians": step.medians}))
    }

    /// The step's combined gradient per parameter, in the parameter's shape (before clipping):
    /// the plain sum during burn-in, else `Σ_t A_t ⊙ G_t` (N, the weighted mean) divided by T
    /// (the authors'), left as is (`divide_by_tasks = false`) or times T (`scale_to_sum`).
    fn combined_gradient(&self, step: &mut Step) -> BTreeMap<String, Tensor> {
        let burn_in = step.burn_in;
        let t = self.tasks.len() as f64;
        let div = match (self.config.scale_to_sum, self.config.divide_by_tasks) {
            (true, _) => 1.0 / t,
            (false, true) => t,
            (false, false) => 1.0,
        };
        let combined = if burn_in {
            std::mem::take(&mut step.plain)
        } else {
            if self.config.form == Form::Exact && step.arrived.iter().any(|a| !a) {
                // Tasks absent from this step (one task per batch) still count in the softmax.
                let tasks = self.tasks.len() as i64;
                let arrived: Vec<i64> = (0..tasks).filter(|&u| step.arrived[u as usize]).collect();
                let all: Vec<i64> = (0..tasks).collect();
                for (name, n) in step.weighted.iter_mut() {
                    let (arrived, all) = (row_index(&arrived, n.device()), row_index(&all, n.device()));
                    let m = self.momentum[name].view([tasks, -1]);
                    for (start, len) in chunks(n.numel() as i64) {
                        let m_c = m.narrow(1, start, len);
                        let _ = n.narrow(0, start, len).g_mul_(&(log_sum_exp_rows(&m_c, &arrived, self.config.tau) - log_sum_exp_rows(&m_c, &all, self.config.tau)).exp());
                    }
                }
            }
            std::mem::take(&mut step.weighted)
        };
        // Back to each parameter's shape, divided by T in place.
        let shapes: BTreeMap<&str, Vec<i64>> = step.params.iter().map(|(n, p)| (n.as_str(), p.size())).collect();
        combined
            .into_iter()
            .map(|(n, mut g)| {
                if !burn_in && div != 1.0 {
                    let _ = g.g_div_scalar_(div);
                }
                let shaped = g.view(shapes[n.as_str()].as_slice());
                (n, shaped)
            })
            .collect()
    }

    /// AdamW's state, then `momentum/NAME` (`[T, ..shape]`, rows in the step context's task
    /// order, which every step checks).
    pub fn state(&self) -> Vec<(String, Tensor)> {
        let mut out = self.adam.state();
        out.extend(self.momentum.iter().map(|(n, m)| (format!("momentum/{n}"), m.shallow_clone())));
        out
    }

    pub fn load_state(&mut self, state: Vec<(String, Tensor)>) -> Result<()> {
        let (momentum, adam): (Vec<_>, Vec<_>) = state.into_iter().partition(|(n, _)| n.starts_with("momentum/"));
        self.adam.load_state(adam)?;
        // Each checked as it comes (floating, finite); its shape against the parameter's by
        // the next step.
        self.momentum = momentum.into_iter().map(|(n, m)| Ok((n["momentum/".len()..].to_string(), super::moment(&n, &m, false)?))).collect::<Result<_>>()?;
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

    /// What a run did: the final flat weights and (runs without AdamW) each step's combined
    /// gradient, flat, before clipping.
    struct Run {
        theta: Tensor,
        combined: Vec<Tensor>,
    }

    fn config(form: Form, median_of: MedianOf, beta: f64, tau: f64) -> TSageConfig {
        TSageConfig { form, median_of, beta, tau, ..Default::default() }
    }

    /// The formulas of REFERENCE §4 on dense `[T, P]` tensors, then (with `adam`) AdamW on the
    /// flat vector; without it the weights stay as they are.
    fn dense_reference(cfg: &TSageConfig, one: bool, steps: u64, warmup: u64, max_norm: Option<f64>, adam: bool) -> Run {
        let theta = flat(&params());
        let p = theta.size()[0];
        let mut m = Tensor::zeros([TASKS as i64, p], (Kind::Float, tch::Device::Cpu));
        let mut opt = AdamW::new(cfg.adamw.clone());
        let mut seen = Vec::new();
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
            let median = |row: Tensor| match cfg.median_of {
                MedianOf::All => lower_median(&row),
                MedianOf::Nonzero => lower_median(&row.masked_select(&row.gt(0.0))),
            };
            let med = Tensor::stack(&(0..TASKS as i64).map(|t| Tensor::from(median(s.get(t)) as f32)).collect::<Vec<_>>(), 0);
            let s = &s / (med.unsqueeze(1) + 1e-12);
            let a_prev = (&m / cfg.tau).softmax(0, Kind::Float);
            // Absent tasks' rows are not touched.
            m = (&m * cfg.beta + &s * (1.0 - cfg.beta)) * &mask + &m * (1.0 - &mask);
            let a = if cfg.form == Form::Lean { a_prev } else { (&m / cfg.tau).softmax(0, Kind::Float) };
            let combined = if step < warmup { g.sum_dim_intlist(0, false, Kind::Float) } else { (&a * &g).sum_dim_intlist(0, false, Kind::Float) / TASKS as f64 };
            seen.push(combined.copy());
            if adam {
                let mut gm: BTreeMap<String, Tensor> = [("flat".to_string(), combined)].into();
                if let Some(max) = max_norm {
                    clip_grad_norm(&mut gm, max).unwrap();
                }
                let ctx = StepContext { lr: 0.01, ..Default::default() };
                opt.step(&[("flat".to_string(), theta.shallow_clone())], &gm, &ctx).unwrap();
            }
        }
        Run { theta, combined: seen }
    }

    /// The optimizer over the same steps. Tasks arrive in index order, or with `rotate` in an
    /// order that changes every step (so the task without a gradient for `p2` also comes first).
    #[allow(clippy::too_many_arguments)]
    fn ours(cfg: &TSageConfig, one: bool, steps: u64, warmup: u64, max_norm: Option<f64>, adam: bool, rotate: bool, cpu_kernels: bool) -> Run {
        let mut opt = TSage::new(cfg.clone()).unwrap();
        opt.cpu_kernels = cpu_kernels;
        let ps = params();
        let tasks: Vec<String> = (0..TASKS).map(|t| format!("task{t}")).collect();
        let mut seen = Vec::new();
        for step in 0..steps {
            let ctx = StepContext { step, total_steps: steps, warmup_steps: warmup, lr: 0.01, tasks: tasks.clone(), max_grad_norm: max_norm, ..Default::default() };
            opt.begin_step(ps.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect(), ctx).unwrap();
            let mut order: Vec<usize> = (0..TASKS).collect();
            if rotate {
                order.rotate_right(step as usize % TASKS);
            }
            for t in order.into_iter().filter(|&t| present(one, step, t)) {
                let lent = grads(step, t);
                opt.task_gradients(&tasks[t], lent.iter().map(|(n, g)| (n.clone(), g.shallow_clone())).collect()).unwrap();
                // The trainer reuses the gradient storage for the next task.
                for (_, g) in &lent {
                    let _ = g.shallow_clone().zero_();
                }
            }
            if adam {
                opt.finish_step().unwrap();
            } else {
                // What `finish_step` would hand to clipping and AdamW; the weights stay.
                let mut current = opt.step.take().unwrap();
                let combined = opt.combined_gradient(&mut current);
                let full: Vec<(String, Tensor)> =
                    ps.iter().map(|(n, p)| (n.clone(), combined.get(n).map_or_else(|| Tensor::zeros_like(p), |g| g.copy()))).collect();
                seen.push(flat(&full));
            }
        }
        Run { theta: flat(&ps), combined: seen }
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
        (a - b).abs().max().double_value(&[])
    }

    /// The combined gradient of every step against the formulas, with a momentum and a
    /// temperature that make the task weights far from uniform (β = 0.5, τ = 0.1), tasks
    /// arriving in a changing order, and one task per step. Compared before AdamW, whose
    /// update would hide a wrong scale (such as a missing division by T). Both the CPU
    /// kernels and the tch operations (the path of other devices).
    #[test]
    fn the_combined_gradient_equals_the_formulas() {
        for (form, kernels) in [(Form::Exact, true), (Form::Lean, true), (Form::Exact, false), (Form::Lean, false)] {
            for (warmup, median_of, one) in [(1, MedianOf::All, false), (2, MedianOf::Nonzero, false), (1, MedianOf::All, true), (0, MedianOf::All, true)] {
                let cfg = config(form, median_of, 0.5, 0.1);
                let (a, b) = (ours(&cfg, one, 6, warmup, None, false, true, kernels), dense_reference(&cfg, one, 6, warmup, None, false));
                for (step, (x, y)) in a.combined.iter().zip(&b.combined).enumerate() {
                    let scale = y.abs().max().double_value(&[]);
                    assert!(max_diff(x, y) <= 1e-6 * scale.max(1.0), "{form:?} kernels {kernels} {median_of:?} one-at-a-time {one} warmup {warmup} step {step}: {x} vs {y}");
                }
                // The weights are far from uniform: the combined gradient is not the plain mean.
                let last = b.combined.last().unwrap();
                let plain = dense_grads(5).to_kind(Kind::Float) * Tensor::from_slice(&(0..TASKS).map(|t| present(one, 5, t) as i64 as f32).collect::<Vec<_>>()).unsqueeze(1);
                let mean = plain.sum_dim_intlist(0, false, Kind::Float) / TASKS as f64;
                assert!(max_diff(last, &mean) > 0.05, "{form:?}: the test's weights are too close to uniform to tell");
            }
        }
    }

    /// A temperature so low that `e^{(M_s − M_t)/τ}` overflows float32 for most elements, with
    /// a task that has no gradient for one parameter (its share of `N` must shrink by
    /// `1 − w = 1`, not become ∞/∞): still the formulas, and finite.
    #[test]
    fn overflowing_task_weights_stay_finite() {
        for (form, kernels) in [(Form::Exact, true), (Form::Lean, true), (Form::Exact, false), (Form::Lean, false)] {
            let cfg = config(form, MedianOf::All, 0.5, 0.001);
            let (a, b) = (ours(&cfg, false, 4, 1, None, false, true, kernels), dense_reference(&cfg, false, 4, 1, None, false));
            for (step, (x, y)) in a.combined.iter().zip(&b.combined).enumerate() {
                assert!(x.isfinite().all().int64_value(&[]) == 1, "{form:?} kernels {kernels} step {step}: {x}");
                let scale = y.abs().max().double_value(&[]);
                assert!(max_diff(x, y) <= 1e-6 * scale.max(1.0), "{form:?} kernels {kernels} step {step}: {x} vs {y}");
            }
        }
    }

    /// Through clipping and AdamW over several steps, with REFERENCE §4's defaults; the CPU
    /// kernels and the tch operations.
    #[test]
    fn both_forms_equal_the_dense_formulas() {
        for (form, kernels) in [(Form::Exact, true), (Form::Lean, true), (Form::Exact, false), (Form::Lean, false)] {
            for (warmup, clip, median_of, one) in [
                (1, None, MedianOf::All, false),
                (0, Some(0.5), MedianOf::All, false),
                (3, None, MedianOf::All, false),
                (1, None, MedianOf::Nonzero, false),
                (1, None, MedianOf::All, true),
            ] {
                let cfg = config(form, median_of, 0.999, 2.0);
                let (a, b) = (ours(&cfg, one, 6, warmup, clip, true, false, kernels), dense_reference(&cfg, one, 6, warmup, clip, true));
                let diff = max_diff(&a.theta, &b.theta);
                assert!(diff < 1e-6, "{form:?} kernels {kernels} {median_of:?} one-at-a-time {one} warmup {warmup} clip {clip:?}: max diff {diff}");
            }
        }
        // The two forms differ once the weights matter (not during burn-in), and so do the medians.
        let run = |form, median_of| ours(&config(form, median_of, 0.999, 2.0), false, 6, 1, None, true, false, true).theta;
        let diff = max_diff(&run(Form::Exact, MedianOf::All), &run(Form::Lean, MedianOf::All));
        assert!(diff > 1e-7, "exact and lean should differ: {diff}");
        let diff = max_diff(&run(Form::Exact, MedianOf::All), &run(Form::Exact, MedianOf::Nonzero));
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
                assert_eq!(streaming_lower_median(&chunks, extra, false).unwrap(), lower_median(&with_extra), "seed {seed} extra {extra}");
                let nonzero = all.masked_select(&all.gt(0.0));
                assert_eq!(streaming_lower_median(&chunks, extra, true).unwrap(), lower_median(&nonzero), "seed {seed} nonzero");
                // The CPU kernel's counts, over the values as two parameters (θ = v, G = 1).
                let ones = vec![1f32; n];
                let (a, b) = v.split_at(n / 3);
                for skip_zeros in [false, true] {
                    let mut count = |high| {
                        let mut hist = vec![0; 1 << 16];
                        let c = kernels::sensitivity_counts(&[(a, &ones[..a.len()]), (b, &ones[a.len()..])], high, &mut hist);
                        assert!(!c.non_finite);
                        Ok((hist, c.zeros))
                    };
                    let expect = if skip_zeros { lower_median(&nonzero) } else { lower_median(&with_extra) };
                    assert_eq!(lower_median_by_counting(&mut count, extra, skip_zeros).unwrap(), expect, "seed {seed} extra {extra} kernel");
                }
            }
        }
        assert_eq!(streaming_lower_median(&|_: &mut dyn FnMut(&Tensor)| {}, 0, false).unwrap(), 0.0);
    }

    /// Most elements without gradient: the median of all is 0 and the scale 1e12. Both forms
    /// stay finite (the lean form's weights are a stable softmax too).
    #[test]
    fn a_zero_median_stays_finite() {
        for form in [Form::Exact, Form::Lean] {
            let mut opt = TSage::new(TSageConfig { form, ..Default::default() }).unwrap();
            let p = [("w".to_string(), Tensor::from_slice(&values(5, 20)))];
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
    fn a_non_finite_gradient_is_refused_and_abandons_the_step() {
        // With the median, the CPU path finds it in the median's first counting pass; without,
        // in a pass of its own. In the first parameter or the last (another group of the
        // counting kernel's blocks in tests).
        let cases = [(f64::NAN, true, true), (f64::INFINITY, true, true), (f64::NEG_INFINITY, true, true), (f64::INFINITY, false, true), (f64::NAN, true, false)];
        for ((bad_value, cpu_kernels, median_normalise), bad_param) in cases.into_iter().flat_map(|c| [(c, 0usize), (c, SHAPES.len() - 1)]) {
            let mut opt = TSage::new(TSageConfig { median_normalise, ..TSageConfig::default() }).unwrap();
            opt.cpu_kernels = cpu_kernels;
            let ps = params();
            let before = flat(&ps);
            let tasks: Vec<String> = (0..TASKS).map(|t| format!("task{t}")).collect();
            let ctx = StepContext { step: 5, total_steps: 10, warmup_steps: 1, lr: 0.01, tasks: tasks.clone(), ..Default::default() };
            opt.begin_step(ps.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect(), ctx).unwrap();
            opt.task_gradients("task0", grads(0, 0)).unwrap();
            let bad = grads(0, 1);
            let last = bad[bad_param].1.numel() as i64 - 1;
            let _ = bad[bad_param].1.view(-1).get(last).fill_(bad_value);
            let err = opt.task_gradients("task1", bad).unwrap_err().to_string();
            assert!(err.contains("task1") && err.contains(&format!("p{bad_param}")) && err.contains("not finite"), "{err}");
            assert!(opt.finish_step().is_err(), "{bad_value}: the step was abandoned");
            assert!(flat(&ps).equal(&before), "no update");
            let m = &opt.momentum["p0"];
            assert_eq!(m.get(1).abs().sum(Kind::Float).double_value(&[]), 0.0, "task1's momentum untouched");
            assert!(m.get(0).abs().sum(Kind::Float).double_value(&[]) > 0.0, "task0, handed over first, is folded in (the streaming design)");
            assert!(m.isfinite().all().int64_value(&[]) == 1, "{bad_value}: the momentum stays finite");
        }
    }

    /// With `scale_to_sum` and uniform weights (a huge τ), a step after burn-in is AdamW's on
    /// the plain sum of the task gradients, as in burn-in; the authors' scale is that / T².
    #[test]
    fn scale_to_sum_makes_uniform_weights_the_plain_sum() {
        let tasks: Vec<String> = (0..TASKS).map(|t| format!("task{t}")).collect();
        let ctx = StepContext { step: 3, total_steps: 10, warmup_steps: 1, lr: 0.01, tasks: tasks.clone(), ..Default::default() };
        for (scale_to_sum, divide_by_tasks, factor) in [(true, true, 1.0), (false, true, 1.0 / (TASKS * TASKS) as f64), (false, false, 1.0 / TASKS as f64)] {
            // A large eps makes AdamW's step proportional to the gradient (its first step is
            // otherwise sign(g)·lr whatever the scale), so the scale is what is compared.
            let adamw = AdamWConfig { eps: 10.0, ..AdamWConfig::default() };
            let cfg = TSageConfig { tau: 1e12, scale_to_sum, divide_by_tasks, adamw, ..TSageConfig::default() };
            let (ps, plain) = (params(), params());
            let mut opt = TSage::new(cfg.clone()).unwrap();
            opt.begin_step(ps.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect(), ctx.clone()).unwrap();
            for t in 0..TASKS {
                opt.task_gradients(&tasks[t], grads(3, t)).unwrap();
            }
            opt.finish_step().unwrap();
            // The reference: one AdamW step on factor × Σ_t G_t.
            let mut adam = AdamW::new(cfg.adamw.clone());
            let mut sum: BTreeMap<String, Tensor> = BTreeMap::new();
            for t in 0..TASKS {
                for (n, g) in grads(3, t) {
                    let g = g * factor;
                    let total = match sum.remove(&n) {
                        Some(s) => s + g,
                        None => g,
                    };
                    sum.insert(n, total);
                }
            }
            adam.step(&plain, &sum, &ctx).unwrap();
            let moved = (flat(&plain) - flat(&params())).abs().max().double_value(&[]);
            let diff = (flat(&ps) - flat(&plain)).abs().max().double_value(&[]);
            assert!(diff < moved * 1e-4, "scale_to_sum {scale_to_sum}, divide_by_tasks {divide_by_tasks}: {diff} (the step moved {moved})");
        }
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
