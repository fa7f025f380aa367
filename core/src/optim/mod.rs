//! Optimizer math shared by the optimizer plugins: AdamW (which T-SAGE, PCGrad, CGD and
//! GradNorm finish with), gradient clipping, folding per-task gradients into a sum, and the
//! multitask methods themselves.

pub mod cgd;
pub mod gradnorm;
pub mod kernels;
pub mod multi;
pub mod pcgrad;
#[cfg(test)]
mod testutil;
pub mod tsage;
pub mod weighted;

use crate::plugin::StepContext;
use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
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

impl AdamWConfig {
    /// The setting names of [`AdamWConfig`].
    pub const KEYS: [&'static str; 4] = ["beta1", "beta2", "eps", "weight_decay"];

    /// Split a plugin's settings object into AdamW's (these [`KEYS`](Self::KEYS)) and the
    /// rest, for an optimizer that finishes with AdamW.
    pub fn split(settings: serde_json::Value) -> Result<(serde_json::Value, AdamWConfig)> {
        let serde_json::Value::Object(mut rest) = settings else { bail!("optimizer settings must be a JSON object") };
        let own: serde_json::Map<String, serde_json::Value> = Self::KEYS.iter().filter_map(|k| rest.remove(*k).map(|v| (k.to_string(), v))).collect();
        let adamw = serde_json::from_value(serde_json::Value::Object(own))?;
        Ok((serde_json::Value::Object(rest), adamw))
    }

    /// The settings-schema entries of these keys (for `plugins inspect`).
    pub fn schema(&self) -> serde_json::Map<String, serde_json::Value> {
        let d = self;
        serde_json::json!({
            "beta1": {"type": "float", "default": d.beta1, "help": "AdamW first-moment decay"},
            "beta2": {"type": "float", "default": d.beta2, "help": "AdamW second-moment decay"},
            "eps": {"type": "float", "default": d.eps, "help": "AdamW epsilon"},
            "weight_decay": {"type": "float", "default": d.weight_decay, "help": "AdamW decoupled weight decay"},
        })
        .as_object()
        .cloned()
        .unwrap_or_default()
    }
}

/// One parameter's moments and its own step count (torch keeps one per parameter: a
/// parameter that missed steps is bias-corrected by the steps it took part in).
struct Moments {
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    step: i64,
    /// The step count as the fused multi-tensor update reads it (a float32 scalar on the
    /// parameter's device, advanced there), and the count it holds; made again from `step`
    /// when they disagree (a restored checkpoint).
    device_step: Option<(Tensor, i64)>,
}

/// AdamW moments by parameter name, following `torch.optim.AdamW` (decoupled weight decay,
/// bias-corrected moments, `eps` added after the bias-corrected square root). Each step's
/// learning rate is scaled per parameter by the context's `lr_scale`; parameters named in
/// `no_weight_decay` get none. Contiguous float32 parameters on the CPU step in this crate's
/// fused loops; other contiguous ones (a GPU's) in libtorch's fused multi-tensor AdamW, one
/// call for each group of parameters that share a device, a dtype, a learning rate and a weight
/// decay; any other layout in tch operations, as torch's single-tensor loop.
pub struct AdamW {
    pub config: AdamWConfig,
    moments: BTreeMap<String, Moments>,
    /// Moments loaded by [`AdamW::load_state`], not yet checked against the parameters.
    unchecked: bool,
}

impl AdamW {
    pub fn new(config: AdamWConfig) -> Self {
        AdamW { config, moments: BTreeMap::new(), unchecked: false }
    }

    /// One update of `params` from `grads` (by name). A parameter without a gradient (absent
    /// or undefined) is left untouched: no decay, no momentum, its step count not advanced,
    /// as PyTorch does.
    pub fn step(&mut self, params: &[(String, Tensor)], grads: &BTreeMap<String, Tensor>, ctx: &StepContext) -> Result<()> {
        let c = self.config.clone();
        let _guard = tch::no_grad_guard();
        // Parameters for libtorch's fused update, with what a group shares: (device, dtype,
        // learning rate, weight decay), (parameter, gradient, name).
        let mut fused = Vec::new();
        // Every shape checked before anything moves: an error leaves no parameter stepped and
        // no step count advanced.
        for (name, p) in params {
            let Some(g) = grads.get(name).filter(|g| g.defined()) else { continue };
            if g.size() != p.size() {
                bail!("gradient of {name} has shape {:?}, the parameter {:?}", g.size(), p.size());
            }
            // Moments loaded from a checkpoint of another model: an error, not a write past
            // the end of a buffer.
            if let Some(m) = self.moments.get(name).filter(|m| m.exp_avg.size() != p.size() || m.exp_avg_sq.size() != p.size()) {
                bail!("AdamW moments of {name} (exp_avg/{name}, exp_avg_sq/{name}) have shapes {:?} and {:?}, the parameter {:?} (a checkpoint of another model?)", m.exp_avg.size(), m.exp_avg_sq.size(), p.size());
            }
            // Of another dtype than the parameter (a checkpoint's float16 moments of float32
            // weights): no update mixes them.
            if let Some(m) = self.moments.get(name).filter(|m| m.exp_avg.kind() != p.kind() || m.exp_avg_sq.kind() != p.kind()) {
                bail!("AdamW moments of {name} (exp_avg/{name}, exp_avg_sq/{name}) are {:?}, the parameter {:?} (a corrupt or foreign optimizer state?)", m.exp_avg.kind(), p.kind());
            }
        }
        if self.unchecked {
            // Loaded moments of a parameter the model lacks: another model's state.
            let names: std::collections::BTreeSet<&str> = params.iter().map(|(n, _)| n.as_str()).collect();
            if let Some(name) = self.moments.keys().find(|n| !names.contains(n.as_str())) {
                bail!("AdamW state has moments of {name:?} (exp_avg/{name}), which is no parameter of this model (a checkpoint of another model?)");
            }
            self.unchecked = false;
        }
        for (name, p) in params {
            let Some(g) = grads.get(name).filter(|g| g.defined()) else { continue };
            let lr = ctx.lr * ctx.lr_scale.get(name).copied().unwrap_or(1.0);
            let p = p.shallow_clone();
            let m = self
                .moments
                .entry(name.clone())
                .or_insert_with(|| Moments { exp_avg: Tensor::zeros_like(&p), exp_avg_sq: Tensor::zeros_like(&p), step: 0, device_step: None });
            if m.exp_avg.device() != p.device() {
                // Restored from a checkpoint, which keeps state on the CPU.
                m.exp_avg = m.exp_avg.to_device(p.device());
                m.exp_avg_sq = m.exp_avg_sq.to_device(p.device());
            }
            m.step += 1;
            let weight_decay = if c.weight_decay != 0.0 && !ctx.no_weight_decay.contains(name) { c.weight_decay } else { 0.0 };
            // SAFETY: four distinct tensors of one shape (checked above): the parameter and the
            // moments written by nothing else, the gradient only read. Written through their
            // memory, the parameters' autograd version counters do not move: the step runs
            // after backward, when no graph holds them.
            let on_cpu = unsafe { (kernels::f32_slice_mut(&p), kernels::f32_slice(g), kernels::f32_slice_mut(&m.exp_avg), kernels::f32_slice_mut(&m.exp_avg_sq)) };
            if let (Some(pv), Some(gv), Some(mv), Some(vv)) = on_cpu {
                let consts = kernels::AdamWStep {
                    decay: (1.0 - lr * weight_decay) as f32,
                    one_minus_beta1: (1.0 - c.beta1) as f32,
                    beta2: c.beta2 as f32,
                    one_minus_beta2: (1.0 - c.beta2) as f32,
                    bias2_sqrt: (1.0 - c.beta2.powi(m.step as i32)).sqrt() as f32,
                    eps: c.eps as f32,
                    step_size: (-lr / (1.0 - c.beta1.powi(m.step as i32))) as f32,
                };
                kernels::adamw(pv, gv, mv, vv, consts);
                continue;
            }
            // libtorch's fused update walks its tensors' memory in order (its CPU kernel) or
            // refuses them (CUDA's) unless all four are contiguous, of one dtype: other layouts
            // step as torch.optim.AdamW's single-tensor loop does, in tch operations.
            let dense = [&p, g, &m.exp_avg, &m.exp_avg_sq].iter().all(|t| t.is_contiguous() && t.kind() == p.kind());
            if dense {
                fused.push(((p.device(), p.kind(), lr, weight_decay), (p, g.shallow_clone(), name.clone())));
                continue;
            }
            // Fallible calls: an error (another device, a dtype libtorch refuses) and no panic.
            let mut p = p;
            if weight_decay != 0.0 {
                let _ = p.f_mul_scalar_(1.0 - lr * weight_decay)?;
            }
            let (bias1, bias2) = (1.0 - c.beta1.powi(m.step as i32), 1.0 - c.beta2.powi(m.step as i32));
            let _ = m.exp_avg.f_lerp_(g, 1.0 - c.beta1)?;
            let _ = m.exp_avg_sq.f_mul_scalar_(c.beta2)?;
            let _ = m.exp_avg_sq.f_addcmul_(&g.f_mul_scalar(1.0 - c.beta2)?, g)?;
            let mut denom = m.exp_avg_sq.f_sqrt()?;
            let _ = denom.f_div_scalar_(bias2.sqrt())?;
            let _ = denom.f_add_scalar_(c.eps)?;
            let _ = p.f_addcdiv_(&m.exp_avg.f_mul_scalar(-lr / bias1)?, &denom)?;
        }
        for ((_, _, lr, weight_decay), group) in multi::grouped(fused) {
            let mut steps = Vec::with_capacity(group.len());
            for (p, _, name) in &group {
                let m = self.moments.get_mut(name).expect("moments made above");
                // Advanced on the device below, from the count before this step.
                let before = m.step - 1;
                if !matches!(&m.device_step, Some((t, at)) if *at == before && t.device() == p.device()) {
                    m.device_step = Some((Tensor::from(before as f32).to_device(p.device()), before));
                }
                steps.push(m.device_step.as_ref().expect("set above").0.shallow_clone());
            }
            let moments: Vec<&Moments> = group.iter().map(|(_, _, name)| &self.moments[name]).collect();
            let step_refs: Vec<&Tensor> = steps.iter().collect();
            multi::add_scalar_(&step_refs, 1.0)?;
            let run = multi::FusedAdamW {
                params: group.iter().map(|(p, _, _)| p).collect(),
                grads: group.iter().map(|(_, g, _)| g).collect(),
                exp_avgs: moments.iter().map(|m| &m.exp_avg).collect(),
                exp_avg_sqs: moments.iter().map(|m| &m.exp_avg_sq).collect(),
                steps: step_refs,
            };
            run.run(lr, c.beta1, c.beta2, weight_decay, c.eps)?;
            // Only now do the device counts hold this step (a failed call leaves them to be
            // made again from `step`).
            for (_, _, name) in &group {
                let m = self.moments.get_mut(name).expect("moments made above");
                if let Some((_, at)) = m.device_step.as_mut() {
                    *at = m.step;
                }
            }
        }
        Ok(())
    }

    /// The state by name: `step/NAME`, `exp_avg/NAME`, `exp_avg_sq/NAME` (views of the live
    /// moments; see [`crate::plugin::Optimizer::state`]).
    pub fn state(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::with_capacity(3 * self.moments.len());
        for (name, m) in &self.moments {
            out.push((format!("step/{name}"), Tensor::from(m.step)));
            out.push((format!("exp_avg/{name}"), m.exp_avg.shallow_clone()));
            out.push((format!("exp_avg_sq/{name}"), m.exp_avg_sq.shallow_clone()));
        }
        out
    }

    /// Restore what [`AdamW::state`] returned; entries with other prefixes are an error. A
    /// checkpoint of an older version holds one global `step`, which every parameter gets.
    /// Every entry is checked as it comes (an error names it): a step count is one
    /// non-negative integer; a parameter's two moments have one floating dtype and one shape,
    /// hold finite values (the second, none below 0), and come with a step count. What needs
    /// the parameters (each moment's shape and dtype are the parameter's, no moments of a
    /// parameter the model lacks) is checked by the next [`AdamW::step`] before it moves
    /// anything.
    pub fn load_state(&mut self, state: Vec<(String, Tensor)>) -> Result<()> {
        let mut global_step = None;
        let mut steps = BTreeMap::new();
        let mut avg = BTreeMap::new();
        let mut sq = BTreeMap::new();
        for (name, t) in state {
            if name == "step" {
                global_step = Some(step_count(&name, &t)?);
            } else if let Some(p) = name.strip_prefix("step/") {
                steps.insert(p.to_string(), step_count(&name, &t)?);
            } else if let Some(p) = name.strip_prefix("exp_avg/") {
                avg.insert(p.to_string(), moment(&name, &t, false)?);
            } else if let Some(p) = name.strip_prefix("exp_avg_sq/") {
                sq.insert(p.to_string(), moment(&name, &t, true)?);
            } else {
                bail!("unknown AdamW state entry {name:?}");
            }
        }
        if let Some(name) = avg.keys().find(|n| !sq.contains_key(*n)) {
            bail!("AdamW state has exp_avg/{name} but no exp_avg_sq/{name}");
        }
        if let Some(name) = sq.keys().find(|n| !avg.contains_key(*n)) {
            bail!("AdamW state has exp_avg_sq/{name} but no exp_avg/{name}");
        }
        let mut moments = BTreeMap::new();
        for ((name, exp_avg), exp_avg_sq) in avg.into_iter().zip(sq.into_values()) {
            if exp_avg.size() != exp_avg_sq.size() || exp_avg.kind() != exp_avg_sq.kind() {
                bail!(
                    "AdamW state: exp_avg/{name} is {:?} of shape {:?} but exp_avg_sq/{name} {:?} of shape {:?}",
                    exp_avg.kind(),
                    exp_avg.size(),
                    exp_avg_sq.kind(),
                    exp_avg_sq.size()
                );
            }
            let Some(step) = steps.remove(&name).or(global_step) else { bail!("AdamW state has no step count for {name:?} (no step/{name})") };
            moments.insert(name, Moments { exp_avg, exp_avg_sq, step, device_step: None });
        }
        if let Some(name) = steps.keys().next() {
            bail!("AdamW state has a step count for {name:?} but no moments");
        }
        self.moments = moments;
        self.unchecked = true;
        Ok(())
    }
}

/// A step count of the saved state: one integer, at least 0 (and within what the bias
/// correction's powers take).
pub(crate) fn step_count(name: &str, t: &Tensor) -> Result<i64> {
    use tch::Kind::*;
    if t.numel() != 1 {
        bail!("optimizer state entry {name:?}: a step count is one number, this holds {} (shape {:?})", t.numel(), t.size());
    }
    if !matches!(t.kind(), Int64 | Int | Int16 | Int8 | Uint8) {
        bail!("optimizer state entry {name:?}: a step count is an integer, this is {:?}", t.kind());
    }
    let step = t.f_reshape([1])?.f_int64_value(&[0])?;
    if !(0..=i32::MAX as i64).contains(&step) {
        bail!("optimizer state entry {name:?}: step count {step} (it must be at least 0)");
    }
    Ok(step)
}

/// A saved moment, copied: a floating tensor of finite values (a second moment: none below 0).
pub(crate) fn moment(name: &str, t: &Tensor, second: bool) -> Result<Tensor> {
    use tch::Kind::*;
    if !matches!(t.kind(), Float | Double | Half | BFloat16) {
        bail!("optimizer state entry {name:?}: a moment is a floating tensor, this is {:?}", t.kind());
    }
    let _guard = tch::no_grad_guard();
    if t.numel() > 0 {
        if t.f_isfinite()?.f_all()?.f_int64_value(&[])? == 0 {
            bail!("optimizer state entry {name:?} holds NaN or infinite values");
        }
        if second && t.f_lt(0.0)?.f_any()?.f_int64_value(&[])? != 0 {
            bail!("optimizer state entry {name:?} holds negative values (a second moment is a mean of squares)");
        }
    }
    Ok(t.f_detach_copy()?)
}

/// Scale `grads` in place so their global L2 norm is at most `max_norm`, as
/// `torch.nn.utils.clip_grad_norm_` does (the norm, and the factor `max_norm / (norm + 1e-6)`
/// clamped at 1, in float32 on the gradients' device; the norm from per-tensor norms off the
/// CPU, from per-gradient sums of squares on it). Returns
/// the norm before clipping as a one-element tensor on that device: off the CPU, reading it
/// waits for the device, so callers read it once their update is queued. On the CPU the factor
/// is read and the gradients are multiplied only when it is under 1 (a pass over every
/// gradient saved; the product by 1 changes nothing).
pub fn clip_grad_norm(grads: &mut BTreeMap<String, Tensor>, max_norm: f64) -> Result<ClippedNorm> {
    let _guard = tch::no_grad_guard();
    let defined: Vec<&Tensor> = grads.values().filter(|g| g.defined()).collect();
    if defined.is_empty() {
        return Ok(ClippedNorm(Tensor::from(0f32)));
    }
    // Gradients of one dtype and device in a model; the operators take one of each per list.
    let device = defined[0].device();
    let by_placement = multi::grouped(defined.into_iter().map(|g| ((g.device(), g.kind()), g)));
    // Squared norms by group: off the CPU libtorch's `_foreach_norm` (torch's own clipping's);
    // on the CPU a sum per gradient, because there `_foreach_norm` sums float32 in float32
    // order: 3.5e-5 off a float64 norm over MiniLM-sized gradients, where `sum` (cascaded) is
    // 5e-8 off, and that noise decided whether two processes trained as one.
    let mut squares = Vec::with_capacity(by_placement.len());
    for ((placement, _), list) in &by_placement {
        let part = match placement {
            tch::Device::Cpu => Tensor::stack(&list.iter().map(|g| g.to_kind(tch::Kind::Float).square().sum(tch::Kind::Float)).collect::<Vec<_>>(), 0),
            _ => multi::norms(list)?.square(),
        };
        squares.push(part.to_device(device));
    }
    let norm = Tensor::cat(&squares, 0).sum(tch::Kind::Float).sqrt();
    // `max_norm / (norm + 1e-6)` as torch evaluates a number over a tensor: the reciprocal
    // times the number (`Tensor.__rtruediv__`), so the factor is torch's to the bit.
    let coef = ((norm.shallow_clone() + 1e-6).reciprocal() * max_norm).clamp_max(1.0);
    // A NaN factor multiplies too, as torch's does.
    if device != tch::Device::Cpu || coef.double_value(&[]).is_nan() || coef.double_value(&[]) < 1.0 {
        for ((device, _), list) in &by_placement {
            multi::mul_(list, &coef.to_device(*device))?;
        }
    }
    Ok(ClippedNorm(norm))
}

/// The global gradient norm [`clip_grad_norm`] found, still on the gradients' device.
pub struct ClippedNorm(Tensor);

impl ClippedNorm {
    /// The norm (a wait for the device).
    pub fn value(&self) -> f64 {
        self.0.double_value(&[])
    }
}

/// The name of the first gradient (in `grads`' order) holding a NaN or an infinity. Float32
/// CPU gradients are scanned in place; the others (a GPU's) by one multi-tensor check per
/// device and dtype whose flag comes to the host in one copy (reading one flag per parameter
/// made the host wait for the device 101 times a MiniLM step, 199 a BERT-base one), and only
/// when it is set, one flag per gradient to name the first.
pub fn first_non_finite<'a>(grads: impl IntoIterator<Item = (&'a str, &'a Tensor)>) -> Option<&'a str> {
    let grads: Vec<(&str, &Tensor)> = grads.into_iter().collect();
    let mut others = Vec::new();
    let mut first_on_cpu = None;
    for (i, &(_, g)) in grads.iter().enumerate().filter(|(_, (_, g))| g.defined()) {
        // SAFETY: the gradient is only read, and nothing writes it during the call.
        match unsafe { kernels::f32_slice(g) } {
            Some(x) => {
                if first_on_cpu.is_none() && kernels::any_non_finite(x) {
                    first_on_cpu = Some(i);
                }
            }
            None => others.push(((g.device(), g.kind()), i)),
        }
    }
    let mut bad: Vec<usize> = first_on_cpu.into_iter().collect();
    for (_, list) in multi::grouped(others) {
        let tensors: Vec<&Tensor> = list.iter().map(|&i| grads[i].1).collect();
        // A check that cannot run (a dtype it does not take) counts as a hit: the flags below
        // then decide, one per gradient (a wait for the device each), said once a process.
        let found = match multi::any_non_finite(&tensors) {
            Ok(f) => f.double_value(&[0]) != 0.0,
            Err(e) => {
                static ONCE: std::sync::Once = std::sync::Once::new();
                ONCE.call_once(|| eprintln!("warning: the multi-tensor non-finite check failed ({e:#}); gradients are checked one by one"));
                true
            }
        };
        if found {
            bad.extend(list.iter().copied().filter(|&i| grads[i].1.isfinite().logical_not().any().int64_value(&[]) != 0).take(1));
        }
    }
    bad.into_iter().min().map(|i| grads[i].0)
}

/// Per-task gradients folded into one sum by name, as they arrive (plain multitask training):
/// copied and added by multi-tensor operators, one call per task for all its gradients.
#[derive(Default)]
pub struct GradSum {
    sum: BTreeMap<String, Tensor>,
}

impl GradSum {
    /// Add one task's gradients (copied: the caller reuses its storage).
    pub fn add(&mut self, grads: Vec<(String, Tensor)>) -> Result<()> {
        let _guard = tch::no_grad_guard();
        // New names are copied, known ones added, each set grouped by device and dtype.
        let (mut fresh, mut known) = (Vec::new(), Vec::new());
        for (name, g) in grads.into_iter().filter(|(_, g)| g.defined()) {
            let placement = (g.device(), g.kind());
            match self.sum.get(&name) {
                Some(s) if (s.device(), s.kind()) == placement => known.push((placement, (s.shallow_clone(), g))),
                // Another device or dtype than the sum so far (no model of ours makes one):
                // added on its own, cast to the sum's dtype as torch's in-place add casts.
                Some(s) => {
                    let _ = s.shallow_clone().f_add_(&g)?;
                }
                None => fresh.push((placement, (name, g))),
            }
        }
        for (_, pairs) in multi::grouped(known) {
            let (sums, adds): (Vec<&Tensor>, Vec<&Tensor>) = pairs.iter().map(|(s, g)| (s, g)).unzip();
            multi::add_(&sums, &adds)?;
        }
        for (_, list) in multi::grouped(fresh) {
            let copies = multi::copies(&list.iter().map(|(_, g)| g).collect::<Vec<_>>())?;
            self.sum.extend(list.into_iter().map(|(n, _)| n).zip(copies));
        }
        Ok(())
    }

    /// The sum so far, leaving this empty.
    pub fn take(&mut self) -> BTreeMap<String, Tensor> {
        std::mem::take(&mut self.sum)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Kind;

    #[test]
    fn clipping_matches_torch() {
        let mut g: BTreeMap<String, Tensor> =
            [("a".to_string(), Tensor::from_slice(&[3.0f32, 0.0])), ("b".to_string(), Tensor::from_slice(&[4.0f32]))].into();
        let norm = clip_grad_norm(&mut g, 1.0).unwrap().value();
        assert!((norm - 5.0).abs() < 1e-6);
        let coef = 1.0 / (5.0 + 1e-6);
        assert!((g["a"].double_value(&[0]) - 3.0 * coef).abs() < 1e-6);
        let mut small: BTreeMap<String, Tensor> = [("a".to_string(), Tensor::from_slice(&[0.3f32]))].into();
        clip_grad_norm(&mut small, 1.0).unwrap();
        assert!((small["a"].double_value(&[0]) - 0.3).abs() < 1e-7, "under the limit: unchanged");
    }

    /// The fused CPU loop (float32) and the tch operations (any other kind or device; float64
    /// here) take the same steps, with and without weight decay.
    #[test]
    fn the_fused_loop_equals_the_tensor_operations() {
        tch::manual_seed(7);
        let shape = [3i64, 50];
        let start = Tensor::randn(shape, (Kind::Double, tch::Device::Cpu));
        // Copies: `to_kind` to the same kind returns the tensor itself.
        let params = |kind| vec![("w".to_string(), start.to_kind(kind).copy()), ("b".to_string(), start.get(0).to_kind(kind).copy())];
        let (p32, p64) = (params(Kind::Float), params(Kind::Double));
        let (mut a32, mut a64) = (AdamW::new(AdamWConfig::default()), AdamW::new(AdamWConfig::default()));
        let ctx = StepContext { lr: 0.05, no_weight_decay: ["b".to_string()].into(), ..Default::default() };
        for step in 0..4 {
            let g = Tensor::randn(shape, (Kind::Double, tch::Device::Cpu)) * (step + 1) as f64;
            let grads = |kind| -> BTreeMap<String, Tensor> { [("w".to_string(), g.to_kind(kind)), ("b".to_string(), g.get(1).to_kind(kind))].into() };
            a32.step(&p32, &grads(Kind::Float), &ctx).unwrap();
            a64.step(&p64, &grads(Kind::Double), &ctx).unwrap();
        }
        for ((name, x), (_, y)) in p32.iter().zip(&p64) {
            let diff = (x.to_kind(Kind::Double) - y).abs().max().double_value(&[]);
            assert!(diff < 1e-5, "{name}: max diff {diff}");
            let before = if name == "w" { start.shallow_clone() } else { start.get(0) };
            assert!((x.to_kind(Kind::Double) - before).abs().max().double_value(&[]) > 0.01, "{name} moved");
        }
    }

    /// Values in [-1, 1] that vary along a tensor and with `salt`, without torch's generator
    /// (which other tests running at the same time draw from).
    fn noise(shape: &[i64], salt: f64) -> Tensor {
        let n: i64 = shape.iter().product();
        ((Tensor::arange(n, (Kind::Double, tch::Device::Cpu)) + salt) * 0.731).sin().view(shape)
    }

    /// Parameters in several groups (learning-rate scales, no weight decay) and one without a
    /// gradient in a step: the CPU's fused loops and libtorch's fused multi-tensor update
    /// (float64 on the CPU here; CUDA's float32 in the test below) take the same steps, and
    /// the per-parameter step counts survive a save and load between the two paths.
    fn grouped_steps(kind: Kind, device: tch::Device) -> Vec<(String, Tensor)> {
        let shapes: [(&str, Vec<i64>); 4] = [("a.weight", vec![6, 5]), ("a.bias", vec![6]), ("b.weight", vec![3, 4, 2]), ("c.LayerNorm.weight", vec![7])];
        let params: Vec<(String, Tensor)> = shapes.iter().enumerate().map(|(i, (n, s))| (n.to_string(), noise(s, i as f64).to_kind(kind).to_device(device))).collect();
        let ctx = StepContext {
            lr: 0.03,
            lr_scale: [("b.weight".to_string(), 0.5)].into(),
            no_weight_decay: ["a.bias".to_string(), "c.LayerNorm.weight".to_string()].into(),
            ..Default::default()
        };
        let mut opt = AdamW::new(AdamWConfig { weight_decay: 0.1, ..Default::default() });
        for step in 0..5 {
            let grads: BTreeMap<String, Tensor> = params
                .iter()
                .filter(|(n, _)| !(step == 2 && n == "b.weight"))
                .map(|(n, p)| (n.clone(), (noise(&p.size(), 10.0 * n.len() as f64 + step as f64) * (step + 1) as f64).to_kind(kind).to_device(device)))
                .collect();
            opt.step(&params, &grads, &ctx).unwrap();
            if step == 3 {
                let mut again = AdamW::new(opt.config.clone());
                again.load_state(opt.state().into_iter().map(|(n, t)| (n, t.to_device(tch::Device::Cpu))).collect()).unwrap();
                opt = again;
            }
        }
        params
    }

    #[test]
    fn the_multi_tensor_update_takes_the_cpu_loop_s_steps() {
        let cpu = grouped_steps(Kind::Float, tch::Device::Cpu);
        let multi = grouped_steps(Kind::Double, tch::Device::Cpu);
        for ((name, x), (_, y)) in cpu.iter().zip(&multi) {
            let diff = (x.to_kind(Kind::Double) - y).abs().max().double_value(&[]);
            assert!(diff < 1e-5, "{name}: max diff {diff}");
        }
    }

    /// A transposed parameter and gradient, and a strided slice of a larger tensor, step as
    /// their contiguous copies do, on either path (float32: the CPU loop's refusal; float64:
    /// the fused update's), and the slice's neighbours are left alone.
    #[test]
    fn a_parameter_that_is_not_contiguous_steps_as_its_contiguous_copy() {
        for kind in [Kind::Float, Kind::Double] {
            let base = noise(&[5, 8], 1.0).to_kind(kind);
            let transposed = base.copy().transpose(0, 1);
            let wide = base.copy();
            let slice = wide.slice(1, 0, 8, 2);
            let contiguous = [transposed.contiguous(), slice.contiguous()];
            let odd = vec![("t".to_string(), transposed.shallow_clone()), ("s".to_string(), slice.shallow_clone())];
            let plain = vec![("t".to_string(), contiguous[0].shallow_clone()), ("s".to_string(), contiguous[1].shallow_clone())];
            let (mut a, mut b) = (AdamW::new(AdamWConfig::default()), AdamW::new(AdamWConfig::default()));
            let ctx = StepContext { lr: 0.05, ..Default::default() };
            for step in 0..3 {
                let gt = noise(&[5, 8], 20.0 + step as f64).to_kind(kind).transpose(0, 1);
                let gs = noise(&[5, 4], 40.0 + step as f64).to_kind(kind);
                a.step(&odd, &[("t".to_string(), gt.shallow_clone()), ("s".to_string(), gs.shallow_clone())].into(), &ctx).unwrap();
                b.step(&plain, &[("t".to_string(), gt.contiguous()), ("s".to_string(), gs)].into(), &ctx).unwrap();
            }
            assert!(transposed.allclose(&contiguous[0], 1e-6, 1e-7, false), "{kind:?}: the transposed parameter");
            assert!(slice.allclose(&contiguous[1], 1e-6, 1e-7, false), "{kind:?}: the strided slice");
            assert!(wide.slice(1, 1, 8, 2).equal(&base.slice(1, 1, 8, 2)), "{kind:?}: the slice's neighbours moved");
        }
    }

    /// On a GPU only (bench/gpu_check.sh runs it there): the CUDA path (fused AdamW, clipping,
    /// the gradient sum and the non-finite check as multi-tensor operators) against the CPU's.
    #[test]
    fn on_cuda_the_optimizer_step_equals_the_cpu_s() {
        if !tch::Cuda::is_available() {
            eprintln!("skipped: no CUDA device");
            return;
        }
        let gpu = tch::Device::Cuda(0);
        let (cpu_params, gpu_params) = (grouped_steps(Kind::Float, tch::Device::Cpu), grouped_steps(Kind::Float, gpu));
        for ((name, x), (_, y)) in cpu_params.iter().zip(&gpu_params) {
            let diff = (x - y.to_device(tch::Device::Cpu)).abs().max().double_value(&[]);
            assert!(diff < 1e-6, "{name}: CPU and CUDA differ by {diff}");
        }
        let grads = |device| -> Vec<(String, Tensor)> { cpu_params.iter().enumerate().map(|(i, (n, p))| (n.clone(), (noise(&p.size(), 50.0 + i as f64) * 3.0).to_kind(Kind::Float).to_device(device))).collect() };
        let (mut on_cpu, mut on_gpu) = (GradSum::default(), GradSum::default());
        for _ in 0..2 {
            on_cpu.add(grads(tch::Device::Cpu)).unwrap();
            on_gpu.add(grads(gpu)).unwrap();
        }
        let (mut a, mut b) = (on_cpu.take(), on_gpu.take());
        let (na, nb) = (clip_grad_norm(&mut a, 1.0).unwrap().value(), clip_grad_norm(&mut b, 1.0).unwrap().value());
        assert!((na - nb).abs() < 1e-5 * na, "norms {na} and {nb}");
        for (name, g) in &a {
            assert!(g.allclose(&b[name].to_device(tch::Device::Cpu), 1e-6, 1e-7, false), "{name} clipped unlike the CPU");
        }
        let _ = b["b.weight"].get(1).get(2).get(0).fill_(f64::NAN);
        assert_eq!(first_non_finite(b.iter().map(|(n, g)| (n.as_str(), g))), Some("b.weight"));
    }

    /// As torch.optim.AdamW: a parameter that gets no gradient in a step is not touched (no
    /// decay, no momentum), and its bias correction counts only the steps it took part in.
    #[test]
    fn a_parameter_without_a_gradient_is_left_alone_and_keeps_its_own_step_count() {
        let ctx = StepContext { lr: 0.1, ..Default::default() };
        let p = vec![("a".to_string(), Tensor::from_slice(&[1.0f32, 2.0])), ("b".to_string(), Tensor::from_slice(&[1.0f32, 2.0]))];
        let g = |v: f32| Tensor::from_slice(&[v, -v]);
        let mut opt = AdamW::new(AdamWConfig::default());
        opt.step(&p, &[("a".to_string(), g(0.5)), ("b".to_string(), g(0.5))].into(), &ctx).unwrap();
        let b_after_one = p[1].1.copy();
        // Step 2: only `a` has a gradient (`b`'s undefined, as autograd leaves an unreached one).
        opt.step(&p, &[("a".to_string(), g(0.5)), ("b".to_string(), Tensor::new())].into(), &ctx).unwrap();
        assert!(p[1].1.equal(&b_after_one), "b moved without a gradient: {:?}", p[1].1);
        // Step 3: `b`'s first moment and bias correction are those of its second step, as a
        // lone parameter stepped twice.
        opt.step(&p, &[("a".to_string(), g(0.5)), ("b".to_string(), g(0.25))].into(), &ctx).unwrap();
        let alone = vec![("b".to_string(), Tensor::from_slice(&[1.0f32, 2.0]))];
        let mut solo = AdamW::new(AdamWConfig::default());
        solo.step(&alone, &[("b".to_string(), g(0.5))].into(), &ctx).unwrap();
        solo.step(&alone, &[("b".to_string(), g(0.25))].into(), &ctx).unwrap();
        assert!(p[1].1.allclose(&alone[0].1, 1e-7, 1e-7, false), "{:?} vs {:?}", p[1].1, alone[0].1);
        let state: BTreeMap<String, i64> = opt.state().into_iter().filter(|(n, _)| n.starts_with("step/")).map(|(n, t)| (n, t.int64_value(&[]))).collect();
        assert_eq!(state, [("step/a".to_string(), 3), ("step/b".to_string(), 2)].into());
        // An older checkpoint's global step still loads.
        let mut old = AdamW::new(AdamWConfig::default());
        let legacy: Vec<(String, Tensor)> = vec![("step".into(), Tensor::from(4i64)), ("exp_avg/a".into(), g(0.1)), ("exp_avg_sq/a".into(), g(0.1).square())];
        old.load_state(legacy).unwrap();
        assert_eq!(old.state()[0].1.int64_value(&[]), 4);
    }

    #[test]
    fn state_round_trips_by_name() {
        let p = vec![("w".to_string(), Tensor::from_slice(&[1.0f32, 2.0]))];
        let g: BTreeMap<String, Tensor> = [("w".to_string(), Tensor::from_slice(&[0.5f32, -0.5]))].into();
        let ctx = StepContext { lr: 0.1, ..Default::default() };
        let mut a = AdamW::new(AdamWConfig::default());
        a.step(&p, &g, &ctx).unwrap();
        let mut b = AdamW::new(AdamWConfig::default());
        b.load_state(a.state()).unwrap();
        let (pa, pb) = (vec![("w".to_string(), p[0].1.copy())], vec![("w".to_string(), p[0].1.copy())]);
        a.step(&pa, &g, &ctx).unwrap();
        b.step(&pb, &g, &ctx).unwrap();
        assert!(pa[0].1.equal(&pb[0].1));
        assert!(b.load_state(vec![("bogus".into(), Tensor::from(1))]).is_err());
    }

    /// A corrupt saved state is an error naming the entry, never a panic, a later failure
    /// that names nothing, or moments that train into NaN weights; and no parameter moves.
    #[test]
    fn a_corrupt_state_is_an_error_naming_the_entry() {
        let p = vec![("w".to_string(), Tensor::from_slice(&[1.0f32, 2.0]))];
        let g: BTreeMap<String, Tensor> = [("w".to_string(), Tensor::from_slice(&[0.5f32, -0.5]))].into();
        let ctx = StepContext { lr: 0.1, ..Default::default() };
        let mut a = AdamW::new(AdamWConfig::default());
        a.step(&p, &g, &ctx).unwrap();
        let good: Vec<(String, Tensor)> = a.state().into_iter().map(|(n, t)| (n, t.copy())).collect();
        let with = |name: &str, t: Option<Tensor>| -> Vec<(String, Tensor)> {
            let mut s: Vec<(String, Tensor)> = good.iter().filter(|(n, _)| n != name).map(|(n, t)| (n.clone(), t.copy())).collect();
            if let Some(t) = t {
                s.push((name.to_string(), t));
            }
            s
        };
        // Refused by load_state, each naming what is wrong.
        let cases: Vec<(Vec<(String, Tensor)>, &str)> = vec![
            (with("step/w", Some(Tensor::from_slice(&[1i64, 2]))), "\"step/w\": a step count is one number"),
            (with("step/w", Some(Tensor::from(-3i64))), "\"step/w\": step count -3"),
            (with("step/w", Some(Tensor::from(1.5f32))), "\"step/w\": a step count is an integer"),
            (with("step/w", None), "no step count for \"w\""),
            (with("exp_avg_sq/w", None), "exp_avg/w but no exp_avg_sq/w"),
            (with("exp_avg/w", Some(Tensor::from_slice(&[f32::NAN, 0.0]))), "\"exp_avg/w\" holds NaN"),
            (with("exp_avg_sq/w", Some(Tensor::from_slice(&[f32::INFINITY, 0.0]))), "\"exp_avg_sq/w\" holds NaN or infinite"),
            (with("exp_avg_sq/w", Some(Tensor::from_slice(&[-1.0f32, 0.0]))), "\"exp_avg_sq/w\" holds negative"),
            (with("exp_avg/w", Some(Tensor::from_slice(&[1i64, 0]))), "\"exp_avg/w\": a moment is a floating tensor"),
            (with("exp_avg/w", Some(Tensor::from_slice(&[0.0f32, 0.0, 0.0]))), "exp_avg/w is Float of shape [3] but exp_avg_sq/w Float of shape [2]"),
            (with("exp_avg/w", Some(Tensor::from_slice(&[0.0f32, 0.0]).to_kind(Kind::Half))), "exp_avg/w is Half"),
            (with("momentum/w", Some(Tensor::from_slice(&[0.0f32]))), "unknown AdamW state entry \"momentum/w\""),
        ];
        for (state, needle) in cases {
            let mut b = AdamW::new(AdamWConfig::default());
            let e = format!("{:#}", b.load_state(state).unwrap_err());
            assert!(e.contains(needle), "expected {needle:?} in {e:?}");
        }
        // Refused by the next step, before any parameter moves: moments of another shape or
        // dtype than the parameter's, and moments of a parameter the model lacks.
        let half = |v: &[f32]| Tensor::from_slice(v).to_kind(Kind::Half);
        let cases: Vec<(Vec<(String, Tensor)>, &str)> = vec![
            (with("exp_avg/w", Some(half(&[0.0, 0.0]))).into_iter().map(|(n, t)| if n == "exp_avg_sq/w" { (n, half(&[0.0, 0.0])) } else { (n, t) }).collect(), "moments of w (exp_avg/w, exp_avg_sq/w) are Half, the parameter Float"),
            (
                with("exp_avg/w", Some(Tensor::from_slice(&[0.0f32; 3]))).into_iter().map(|(n, t)| if n == "exp_avg_sq/w" { (n, Tensor::from_slice(&[0.0f32; 3])) } else { (n, t) }).collect(),
                "moments of w (exp_avg/w, exp_avg_sq/w) have shapes [3] and [3], the parameter [2]",
            ),
            (good.iter().map(|(n, t)| (n.clone(), t.copy())).chain(good.iter().map(|(n, t)| (n.replace("/w", "/gone"), t.copy()))).collect(), "moments of \"gone\" (exp_avg/gone), which is no parameter"),
        ];
        for (state, needle) in cases {
            let mut b = AdamW::new(AdamWConfig::default());
            b.load_state(state).unwrap();
            let before = p[0].1.copy();
            let e = format!("{:#}", b.step(&p, &g, &ctx).unwrap_err());
            assert!(e.contains(needle), "expected {needle:?} in {e:?}");
            assert!(p[0].1.equal(&before), "a parameter moved");
        }
        // The good state still loads and steps.
        let mut b = AdamW::new(AdamWConfig::default());
        b.load_state(good.iter().map(|(n, t)| (n.clone(), t.copy())).collect()).unwrap();
        b.step(&p, &g, &ctx).unwrap();
        assert!(p[0].1.isfinite().all().int64_value(&[]) == 1);
    }
}

#[cfg(test)]
mod non_finite_tests {
    use super::first_non_finite;
    use tch::{Device, Kind, Tensor};

    #[test]
    fn the_first_non_finite_gradient_is_named_on_either_path() {
        // Float32 CPU gradients take the in-place scan, float64 ones the path of other devices
        // (flags on the device, read at once); undefined gradients count as finite.
        let grad = |kind: Kind, bad: Option<f64>| {
            let g = Tensor::ones([4, 3], (kind, Device::Cpu));
            if let Some(v) = bad {
                let _ = g.get(2).get(1).fill_(v);
            }
            g
        };
        let named = |gs: Vec<(&str, Tensor)>| first_non_finite(gs.iter().map(|(n, g)| (*n, g))).map(str::to_string);
        for kind in [Kind::Float, Kind::Double] {
            assert_eq!(named(vec![("a", grad(kind, None)), ("u", Tensor::new()), ("b", grad(kind, None))]), None);
            for v in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
                assert_eq!(named(vec![("a", grad(kind, None)), ("b", grad(kind, Some(v))), ("c", grad(kind, Some(v)))]).as_deref(), Some("b"), "{kind:?} {v}");
            }
        }
        // Both paths in one list: the first in order, whichever path found it.
        assert_eq!(named(vec![("a", grad(Kind::Double, Some(f64::NAN))), ("b", grad(Kind::Float, Some(f64::NAN)))]).as_deref(), Some("a"));
        assert_eq!(named(vec![("a", grad(Kind::Float, Some(f64::NAN))), ("b", grad(Kind::Double, Some(f64::NAN)))]).as_deref(), Some("a"));
        assert_eq!(named(vec![("a", grad(Kind::Float, None)), ("b", grad(Kind::Double, Some(f64::INFINITY)))]).as_deref(), Some("b"));
    }
}
