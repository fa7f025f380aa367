//! Optimizer math shared by the optimizer plugins: AdamW (which T-SAGE, PCGrad, CGD and
//! GradNorm finish with), gradient clipping, folding per-task gradients into a sum, and the
//! multitask methods themselves.

pub mod cgd;
pub mod gradnorm;
pub mod kernels;
pub mod pcgrad;
#[cfg(test)]
mod testutil;
pub mod tsage;
pub mod weighted;

use crate::plugin::StepContext;
use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use tch::{Kind, Tensor};

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
}

/// AdamW moments by parameter name, following `torch.optim.AdamW` (decoupled weight decay,
/// bias-corrected moments, `eps` added after the bias-corrected square root). Each step's
/// learning rate is scaled per parameter by the context's `lr_scale`; parameters named in
/// `no_weight_decay` get none.
pub struct AdamW {
    pub config: AdamWConfig,
    moments: BTreeMap<String, Moments>,
}

impl AdamW {
    pub fn new(config: AdamWConfig) -> Self {
        AdamW { config, moments: BTreeMap::new() }
    }

    /// One update of `params` from `grads` (by name). A parameter without a gradient (absent
    /// or undefined) is left untouched: no decay, no momentum, its step count not advanced,
    /// as PyTorch does.
    pub fn step(&mut self, params: &[(String, Tensor)], grads: &BTreeMap<String, Tensor>, ctx: &StepContext) -> Result<()> {
        let c = self.config.clone();
        let _guard = tch::no_grad_guard();
        for (name, p) in params {
            let Some(g) = grads.get(name).filter(|g| g.defined()) else { continue };
            if g.size() != p.size() {
                bail!("gradient of {name} has shape {:?}, the parameter {:?}", g.size(), p.size());
            }
            let lr = ctx.lr * ctx.lr_scale.get(name).copied().unwrap_or(1.0);
            let mut p = p.shallow_clone();
            let m = self
                .moments
                .entry(name.clone())
                .or_insert_with(|| Moments { exp_avg: Tensor::zeros_like(&p), exp_avg_sq: Tensor::zeros_like(&p), step: 0 });
            if m.exp_avg.device() != p.device() {
                // Restored from a checkpoint, which keeps state on the CPU.
                m.exp_avg = m.exp_avg.to_device(p.device());
                m.exp_avg_sq = m.exp_avg_sq.to_device(p.device());
            }
            // Moments loaded from a checkpoint of another model: an error, not a write past
            // the end of a buffer.
            if m.exp_avg.size() != p.size() || m.exp_avg_sq.size() != p.size() {
                bail!("AdamW moments of {name} have shapes {:?} and {:?}, the parameter {:?} (a checkpoint of another model?)", m.exp_avg.size(), m.exp_avg_sq.size(), p.size());
            }
            m.step += 1;
            let bias1 = 1.0 - c.beta1.powi(m.step as i32);
            let bias2 = 1.0 - c.beta2.powi(m.step as i32);
            let decay = if c.weight_decay != 0.0 && !ctx.no_weight_decay.contains(name) { 1.0 - lr * c.weight_decay } else { 1.0 };
            // SAFETY: four distinct tensors of one shape (checked above): the parameter and the
            // moments written by nothing else, the gradient only read. Written through their
            // memory, the parameters' autograd version counters do not move: the step runs
            // after backward, when no graph holds them.
            let fused = unsafe { (kernels::f32_slice_mut(&p), kernels::f32_slice(g), kernels::f32_slice_mut(&m.exp_avg), kernels::f32_slice_mut(&m.exp_avg_sq)) };
            if let (Some(pv), Some(gv), Some(mv), Some(vv)) = fused {
                let consts = kernels::AdamWStep {
                    decay: decay as f32,
                    one_minus_beta1: (1.0 - c.beta1) as f32,
                    beta2: c.beta2 as f32,
                    one_minus_beta2: (1.0 - c.beta2) as f32,
                    bias2_sqrt: bias2.sqrt() as f32,
                    eps: c.eps as f32,
                    step_size: (-lr / bias1) as f32,
                };
                kernels::adamw(pv, gv, mv, vv, consts);
                continue;
            }
            if decay != 1.0 {
                let _ = p.g_mul_scalar_(decay);
            }
            // As torch.optim.AdamW's single-tensor loop (`lerp_` for the first moment, the
            // denominator built in place).
            let _ = m.exp_avg.lerp_(g, 1.0 - c.beta1);
            let _ = m.exp_avg_sq.g_mul_scalar_(c.beta2);
            let _ = m.exp_avg_sq.addcmul_(&(g * (1.0 - c.beta2)), g);
            let mut denom = m.exp_avg_sq.sqrt();
            let _ = denom.g_div_scalar_(bias2.sqrt());
            let _ = denom.g_add_scalar_(c.eps);
            let _ = p.addcdiv_(&(&m.exp_avg * (-lr / bias1)), &denom);
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
    pub fn load_state(&mut self, state: Vec<(String, Tensor)>) -> Result<()> {
        let mut global_step = None;
        let mut steps = BTreeMap::new();
        let mut avg = BTreeMap::new();
        let mut sq = BTreeMap::new();
        for (name, t) in state {
            if name == "step" {
                global_step = Some(t.int64_value(&[]));
            } else if let Some(p) = name.strip_prefix("step/") {
                steps.insert(p.to_string(), t.int64_value(&[]));
            } else if let Some(p) = name.strip_prefix("exp_avg/") {
                avg.insert(p.to_string(), t.copy());
            } else if let Some(p) = name.strip_prefix("exp_avg_sq/") {
                sq.insert(p.to_string(), t.copy());
            } else {
                bail!("unknown AdamW state entry {name:?}");
            }
        }
        if avg.keys().ne(sq.keys()) {
            bail!("AdamW state has first and second moments for different parameters");
        }
        let mut moments = BTreeMap::new();
        for ((name, exp_avg), exp_avg_sq) in avg.into_iter().zip(sq.into_values()) {
            let Some(step) = steps.remove(&name).or(global_step) else { bail!("AdamW state has no step count for {name:?}") };
            moments.insert(name, Moments { exp_avg, exp_avg_sq, step });
        }
        if let Some(name) = steps.keys().next() {
            bail!("AdamW state has a step count for {name:?} but no moments");
        }
        self.moments = moments;
        Ok(())
    }
}

/// Scale `grads` in place so their global L2 norm is at most `max_norm`, as
/// `torch.nn.utils.clip_grad_norm_` does (factor `max_norm / (norm + 1e-6)` when below 1).
/// Returns the norm before clipping.
pub fn clip_grad_norm(grads: &mut BTreeMap<String, Tensor>, max_norm: f64) -> f64 {
    let _guard = tch::no_grad_guard();
    let sq: Vec<Tensor> = grads.values().filter(|g| g.defined()).map(|g| g.to_kind(Kind::Float).square().sum(Kind::Float)).collect();
    if sq.is_empty() {
        return 0.0;
    }
    let norm = Tensor::stack(&sq, 0).sum(Kind::Float).sqrt().double_value(&[]);
    let coef = max_norm / (norm + 1e-6);
    if coef < 1.0 {
        for g in grads.values_mut().filter(|g| g.defined()) {
            let _ = g.g_mul_scalar_(coef);
        }
    }
    norm
}

/// The name of the first gradient (in `grads`' order) holding a NaN or an infinity. Float32
/// CPU gradients are scanned in place; for the others (a GPU's) a flag per gradient is made on
/// their device and all the flags come to the host in one copy: reading each one alone made
/// the host wait for the device once per parameter (101 times a MiniLM step, 199 a BERT-base
/// one), each wait leaving the device idle until the next kernels were queued.
pub fn first_non_finite<'a>(grads: impl IntoIterator<Item = (&'a str, &'a Tensor)>) -> Option<&'a str> {
    let grads: Vec<(&str, &Tensor)> = grads.into_iter().collect();
    let mut flags = Vec::new();
    let mut first_on_cpu = None;
    for (i, &(_, g)) in grads.iter().enumerate().filter(|(_, (_, g))| g.defined()) {
        // SAFETY: the gradient is only read, and nothing writes it during the call.
        match unsafe { kernels::f32_slice(g) } {
            Some(x) => {
                if first_on_cpu.is_none() && kernels::any_non_finite(x) {
                    first_on_cpu = Some(i);
                }
            }
            None => flags.push((i, g.isfinite().logical_not().any())),
        }
    }
    let mut bad: Vec<usize> = first_on_cpu.into_iter().collect();
    if !flags.is_empty() {
        let stacked = Tensor::f_stack(&flags.iter().map(|(_, f)| f.shallow_clone()).collect::<Vec<_>>(), 0)
            .and_then(|t| t.f_to_kind(Kind::Int64))
            .and_then(|t| Vec::<i64>::try_from(t.to_device(tch::Device::Cpu)));
        // Gradients on several devices cannot be stacked: each flag read alone then.
        let all = stacked.unwrap_or_else(|_| flags.iter().map(|(_, f)| f.int64_value(&[])).collect());
        bad.extend(flags.iter().zip(all).filter(|(_, f)| *f != 0).map(|((i, _), _)| *i));
    }
    bad.into_iter().min().map(|i| grads[i].0)
}

/// Per-task gradients folded into one sum by name, as they arrive (plain multitask training).
#[derive(Default)]
pub struct GradSum {
    sum: BTreeMap<String, Tensor>,
}

impl GradSum {
    /// Add one task's gradients (copied: the caller reuses its storage).
    pub fn add(&mut self, grads: Vec<(String, Tensor)>) {
        let _guard = tch::no_grad_guard();
        for (name, g) in grads.into_iter().filter(|(_, g)| g.defined()) {
            match self.sum.get_mut(&name) {
                Some(s) => {
                    let _ = s.g_add_(&g);
                }
                None => {
                    self.sum.insert(name, g.copy());
                }
            }
        }
    }

    /// The sum so far, leaving this empty.
    pub fn take(&mut self) -> BTreeMap<String, Tensor> {
        std::mem::take(&mut self.sum)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clipping_matches_torch() {
        let mut g: BTreeMap<String, Tensor> =
            [("a".to_string(), Tensor::from_slice(&[3.0f32, 0.0])), ("b".to_string(), Tensor::from_slice(&[4.0f32]))].into();
        let norm = clip_grad_norm(&mut g, 1.0);
        assert!((norm - 5.0).abs() < 1e-6);
        let coef = 1.0 / (5.0 + 1e-6);
        assert!((g["a"].double_value(&[0]) - 3.0 * coef).abs() < 1e-6);
        let mut small: BTreeMap<String, Tensor> = [("a".to_string(), Tensor::from_slice(&[0.3f32]))].into();
        clip_grad_norm(&mut small, 1.0);
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
