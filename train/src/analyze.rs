//! Task-specialisation analysis of a multitask model (TACO paper §7.3, REFERENCE §4): from
//! per-parameter task sensitivities `I ∈ R^{T×P}`, each parameter's task entropy
//! `H = −Σ_t p_t ln p_t` with `p = softmax_t(I / τ)`, the share of task-specific parameters
//! (`H < 0.3`) and of parameters no task activates (`I_t < 0.1` for every t), histograms for
//! the plots, and the task commitment rate between two checkpoints (the share of one's
//! task-specific parameters whose most sensitive task is the same in the other).
//!
//! Sensitivities are `|θ ⊙ G_t|` divided by their median over all parameters, either as
//! T-SAGE's momentum saved in a checkpoint or from fresh gradients ([`SensitivityAccumulator`]).

use anyhow::{bail, Result};
use serde::Serialize;
use std::collections::BTreeMap;
use tch::{Kind, Tensor};

/// Thresholds and bins (the paper's values by default).
#[derive(Debug, Clone, Serialize)]
pub struct AnalysisConfig {
    /// Softmax temperature of the entropy.
    pub tau: f64,
    /// Entropy below which a parameter is task-specific.
    pub specific_below: f64,
    /// Sensitivity below which a task does not activate a parameter.
    pub active_from: f64,
    pub entropy_bins: usize,
    /// log10 range and bins of the sensitivity densities.
    pub log_sensitivity_range: (f64, f64),
    pub sensitivity_bins: usize,
}

impl Default for AnalysisConfig {
    fn default() -> Self {
        AnalysisConfig { tau: 2.0, specific_below: 0.3, active_from: 0.1, entropy_bins: 50, log_sensitivity_range: (-4.0, 3.0), sensitivity_bins: 140 }
    }
}

/// Per-task sensitivities of every parameter element, flattened in name order: `[T, P]`.
pub struct Sensitivities {
    pub tasks: Vec<String>,
    pub matrix: Tensor,
}

impl Sensitivities {
    /// From tensors `[T, ..shape]` by parameter name (T-SAGE's saved momentum).
    pub fn from_named(tasks: Vec<String>, named: &BTreeMap<String, Tensor>) -> Result<Self> {
        let t = tasks.len() as i64;
        let mut rows = Vec::with_capacity(named.len());
        for (name, m) in named {
            if m.dim() == 0 || m.size()[0] != t {
                bail!("sensitivities of {name} have shape {:?}, expected [{t}, ...] for tasks {tasks:?}", m.size());
            }
            rows.push(m.to_kind(Kind::Float).reshape([t, -1]));
        }
        if rows.is_empty() {
            bail!("no sensitivities");
        }
        Ok(Sensitivities { tasks, matrix: Tensor::cat(&rows, 1) })
    }

    pub fn params(&self) -> i64 {
        self.matrix.size()[1]
    }
}

/// Collects `|θ ⊙ G_t|` of a task's batches, then normalises each task by its median.
pub struct SensitivityAccumulator {
    pub tasks: Vec<String>,
    sums: Vec<BTreeMap<String, Tensor>>,
    batches: Vec<usize>,
}

impl SensitivityAccumulator {
    pub fn new(tasks: Vec<String>) -> Self {
        let n = tasks.len();
        SensitivityAccumulator { tasks, sums: (0..n).map(|_| BTreeMap::new()).collect(), batches: vec![0; n] }
    }

    /// One batch of `task`: the parameters and their gradients, by name.
    pub fn add(&mut self, task: &str, params: &[(String, Tensor)], grads: &[(String, Tensor)]) -> Result<()> {
        let Some(t) = self.tasks.iter().position(|n| n == task) else { bail!("unknown task {task:?}") };
        let _guard = tch::no_grad_guard();
        let theta: BTreeMap<&str, &Tensor> = params.iter().map(|(n, p)| (n.as_str(), p)).collect();
        for (name, g) in grads.iter().filter(|(_, g)| g.defined()) {
            let Some(p) = theta.get(name.as_str()) else { bail!("gradient for unknown parameter {name:?}") };
            let s = (p.to_kind(Kind::Float) * g.to_kind(Kind::Float)).abs();
            match self.sums[t].get_mut(name) {
                Some(acc) => {
                    let _ = acc.g_add_(&s);
                }
                None => {
                    self.sums[t].insert(name.clone(), s);
                }
            }
        }
        self.batches[t] += 1;
        Ok(())
    }

    /// Mean over batches, divided per task by its median over all `params` (a parameter with
    /// no gradient counts as 0), as T-SAGE normalises. Columns follow parameter names in
    /// order, as [`Sensitivities::from_named`] does.
    pub fn finish(self, params: &[(String, Tensor)]) -> Result<Sensitivities> {
        let mut params: Vec<&(String, Tensor)> = params.iter().collect();
        params.sort_by(|a, b| a.0.cmp(&b.0));
        let mut rows = Vec::new();
        for (t, sums) in self.sums.iter().enumerate() {
            if self.batches[t] == 0 {
                bail!("task {:?} had no batch", self.tasks[t]);
            }
            let flat: Vec<Tensor> = params
                .iter()
                .map(|(n, p)| sums.get(n).map_or_else(|| Tensor::zeros([p.numel() as i64], (Kind::Float, p.device())), |s| s.flatten(0, -1) / self.batches[t] as f64))
                .collect();
            let row = Tensor::cat(&flat, 0);
            let median = lower_median(&row);
            rows.push(row / (median + 1e-12));
        }
        Ok(Sensitivities { tasks: self.tasks, matrix: Tensor::stack(&rows, 0) })
    }
}

fn lower_median(x: &Tensor) -> f64 {
    let n = x.numel() as i64;
    if n == 0 {
        return 0.0;
    }
    x.kthvalue((n - 1) / 2 + 1, 0, false).0.double_value(&[])
}

/// Counts of values in `bins` equal bins over `[lo, hi]` (values outside are clamped in).
fn histogram(x: &Tensor, bins: usize, lo: f64, hi: f64) -> Vec<u64> {
    let scaled = (x.to_kind(Kind::Double) - lo) * (bins as f64 / (hi - lo));
    let index = scaled.floor().clamp(0.0, bins as f64 - 1.0).to_kind(Kind::Int64).flatten(0, -1);
    let counts = index.bincount::<Tensor>(None, bins as i64);
    Vec::<i64>::try_from(counts).unwrap_or_default().into_iter().map(|c| c as u64).collect()
}

#[derive(Debug, Clone, Serialize)]
pub struct TaskSummary {
    /// Share of parameters this task activates (`I_t ≥ active_from`).
    pub activated: f64,
    /// Share of all parameters that are task-specific with this task most sensitive.
    pub specific: f64,
    /// Quantiles (10, 50, 90, 99%) of the sensitivities (nearest rank).
    pub quantiles: [f64; 4],
    /// Share of parameters with sensitivity exactly 0.
    pub zero: f64,
    /// Density of log10 sensitivity of the nonzero ones over
    /// [`AnalysisConfig::log_sensitivity_range`] (it integrates to the share inside the range).
    pub log_sensitivity_density: Vec<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Analysis {
    pub config: AnalysisConfig,
    pub tasks: Vec<String>,
    pub parameters: i64,
    /// Share with entropy below `specific_below`.
    pub task_specific: f64,
    /// Share no task activates.
    pub not_activated: f64,
    pub mean_entropy: f64,
    pub max_entropy: f64,
    /// Counts over `entropy_bins` equal bins of [0, ln T].
    pub entropy_histogram: Vec<u64>,
    pub per_task: BTreeMap<String, TaskSummary>,
}

/// Entropy per parameter and the most sensitive task.
fn entropy_and_argmax(s: &Sensitivities, tau: f64) -> (Tensor, Tensor) {
    let logp = (&s.matrix / tau).log_softmax(0, Kind::Float);
    let h = -(logp.exp() * &logp).sum_dim_intlist(0, false, Kind::Float);
    (h, s.matrix.argmax(0, false))
}

pub fn analyze(s: &Sensitivities, config: &AnalysisConfig) -> Result<Analysis> {
    let _guard = tch::no_grad_guard();
    let p = s.params() as f64;
    let t = s.tasks.len();
    let (h, owner) = entropy_and_argmax(s, config.tau);
    let specific = h.lt(config.specific_below);
    let max_entropy = (t as f64).ln();
    let not_activated = s.matrix.lt(config.active_from).all_dim(0, false);
    let mut per_task = BTreeMap::new();
    let (lo, hi) = config.log_sensitivity_range;
    let width = (hi - lo) / config.sensitivity_bins as f64;
    for (i, name) in s.tasks.iter().enumerate() {
        let row = s.matrix.get(i as i64);
        // torch.quantile refuses more than 2^24 elements; read them off the sorted values.
        let (sorted, _) = row.sort(0, false);
        let n = sorted.numel() as f64;
        let q: Vec<f64> = [0.1, 0.5, 0.9, 0.99].iter().map(|f| sorted.double_value(&[((n - 1.0) * f).round() as i64])).collect();
        // Exact zeros (elements the task's batches never reached) are counted apart: on a log
        // axis they would pile up at the left edge.
        let nonzero = row.masked_select(&row.gt(0.0));
        let zero = 1.0 - nonzero.numel() as f64 / p;
        // Values outside the plotted range are left out (clamped in, they pile up at an edge).
        let logs = nonzero.log10();
        let inside = logs.masked_select(&logs.ge(lo).logical_and(&logs.lt(hi)));
        let counts = histogram(&inside, config.sensitivity_bins, lo, hi);
        let nz = nonzero.numel().max(1) as f64;
        per_task.insert(
            name.clone(),
            TaskSummary {
                activated: row.ge(config.active_from).sum(Kind::Double).double_value(&[]) / p,
                specific: (specific.logical_and(&owner.eq(i as i64))).sum(Kind::Double).double_value(&[]) / p,
                quantiles: [q[0], q[1], q[2], q[3]],
                zero,
                log_sensitivity_density: counts.iter().map(|&c| c as f64 / (nz * width)).collect(),
            },
        );
    }
    Ok(Analysis {
        config: config.clone(),
        tasks: s.tasks.clone(),
        parameters: s.params(),
        task_specific: specific.sum(Kind::Double).double_value(&[]) / p,
        not_activated: not_activated.sum(Kind::Double).double_value(&[]) / p,
        mean_entropy: h.mean(Kind::Double).double_value(&[]),
        max_entropy,
        entropy_histogram: histogram(&h, config.entropy_bins, 0.0, max_entropy.max(1e-9)),
        per_task,
    })
}

/// Of the parameters task-specific in `before`, the share whose most sensitive task is the
/// same in `after` (the paper's task commitment rate), and how many there were.
pub fn commitment_rate(before: &Sensitivities, after: &Sensitivities, config: &AnalysisConfig) -> Result<(f64, i64)> {
    if before.tasks != after.tasks || before.params() != after.params() {
        bail!(
            "the two checkpoints differ: tasks {:?} / {:?}, {} / {} parameters",
            before.tasks,
            after.tasks,
            before.params(),
            after.params()
        );
    }
    let _guard = tch::no_grad_guard();
    let (h, owner_before) = entropy_and_argmax(before, config.tau);
    let owner_after = after.matrix.argmax(0, false);
    let specific = h.lt(config.specific_below);
    let n = specific.sum(Kind::Int64).int64_value(&[]);
    if n == 0 {
        return Ok((0.0, 0));
    }
    let kept = specific.logical_and(&owner_before.eq_tensor(&owner_after)).sum(Kind::Int64).int64_value(&[]);
    Ok((kept as f64 / n as f64, n))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sens(rows: &[&[f32]]) -> Sensitivities {
        let t: Vec<Tensor> = rows.iter().map(|r| Tensor::from_slice(r)).collect();
        Sensitivities { tasks: (0..rows.len()).map(|i| format!("t{i}")).collect(), matrix: Tensor::stack(&t, 0) }
    }

    #[test]
    fn entropy_thresholds_and_commitment_by_hand() {
        // Parameter 0: task 0 far above task 1 → specific to t0. Parameter 1: equal → maximal
        // entropy. Parameter 2: nobody activates it. Parameter 3: task 1 dominant.
        let s = sens(&[&[20.0, 1.0, 0.01, 0.5], &[0.0, 1.0, 0.05, 30.0]]);
        let cfg = AnalysisConfig::default();
        let a = analyze(&s, &cfg).unwrap();
        let h = |x: f64, y: f64| {
            let (ex, ey) = ((x / 2.0).exp(), (y / 2.0).exp());
            let (p, q) = (ex / (ex + ey), ey / (ex + ey));
            -(p * p.ln() + q * q.ln())
        };
        let want = [h(20.0, 0.0), h(1.0, 1.0), h(0.01, 0.05), h(0.5, 30.0)];
        let specific = want.iter().filter(|&&x| x < 0.3).count() as f64 / 4.0;
        assert!((a.task_specific - specific).abs() < 1e-9, "{} vs {specific}", a.task_specific);
        assert_eq!(specific, 0.5);
        assert!((a.not_activated - 0.25).abs() < 1e-9);
        assert!((a.mean_entropy - want.iter().sum::<f64>() / 4.0).abs() < 1e-6);
        assert_eq!(a.entropy_histogram.iter().sum::<u64>(), 4);
        assert!((a.per_task["t0"].specific - 0.25).abs() < 1e-9 && (a.per_task["t1"].specific - 0.25).abs() < 1e-9);
        assert!((a.per_task["t0"].activated - 0.75).abs() < 1e-9, "t0 activates parameters 0, 1, 3");
        // The density integrates to 1 over its range.
        let width = (cfg.log_sensitivity_range.1 - cfg.log_sensitivity_range.0) / cfg.sensitivity_bins as f64;
        let total: f64 = a.per_task["t1"].log_sensitivity_density.iter().sum::<f64>() * width;
        assert!((total - 1.0).abs() < 1e-9, "{total}");
        // Parameter 0 keeps its task, parameter 3 changes to t0: rate 1/2 over 2 specific ones.
        let after = sens(&[&[20.0, 1.0, 0.01, 40.0], &[0.0, 1.0, 0.05, 30.0]]);
        assert_eq!(commitment_rate(&s, &after, &cfg).unwrap(), (0.5, 2));
    }

    #[test]
    fn accumulated_sensitivities_are_median_normalised_means() {
        let params = vec![("w".to_string(), Tensor::from_slice(&[1.0f32, -2.0, 4.0])), ("b".to_string(), Tensor::from_slice(&[0.5f32]))];
        let mut acc = SensitivityAccumulator::new(vec!["a".into(), "b".into()]);
        acc.add("a", &params, &[("w".into(), Tensor::from_slice(&[1.0f32, 1.0, 1.0])), ("b".into(), Tensor::from_slice(&[2.0f32]))]).unwrap();
        acc.add("a", &params, &[("w".into(), Tensor::from_slice(&[3.0f32, 1.0, 1.0])), ("b".into(), Tensor::from_slice(&[2.0f32]))]).unwrap();
        acc.add("b", &params, &[("w".into(), Tensor::from_slice(&[0.0f32, 1.0, 0.0]))]).unwrap();
        let s = acc.finish(&params).unwrap();
        // Task a: mean |θ·g| = [1, 2, 2, 4] (columns by name: b, then w), lower median 2.
        let a: Vec<f32> = Vec::try_from(s.matrix.get(0)).unwrap();
        assert_eq!(a, vec![0.5, 1.0, 1.0, 2.0]);
        // Task b: [0, 0, 2, 0] (b has no gradient), lower median 0 → divided by 1e-12.
        let b: Vec<f32> = Vec::try_from(s.matrix.get(1)).unwrap();
        assert!(b[2] > 1e11 && b[0] == 0.0 && b[1] == 0.0 && b[3] == 0.0);
        assert!(SensitivityAccumulator::new(vec!["a".into()]).finish(&params).is_err(), "a task without batches");
    }
}
