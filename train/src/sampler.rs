//! Multitask batch samplers. Both hand out, per step, a list of `(task, example indices)`
//! sub-batches; both are deterministic given the seed and resume exactly from their state.
//!
//! - [`TacoSampler`] (TACO, REFERENCE §3): every step holds every task; task `t` gets
//!   `b_t` examples from the total batch by the rates `(N_t/ΣN)^(1/c)`, largest-remainder
//!   rounded with at least one example per task. An epoch is the largest task's number of
//!   batches; smaller tasks are cycled, re-shuffled each cycle.
//! - [`TaskPerBatchSampler`] (MT-DPR, REFERENCE §2): each batch holds one task; per epoch every
//!   task's examples are shuffled and cut into batches, and the order of all batches is
//!   shuffled.

use rak_core::rng::Rng;
use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

/// One task's share of a step: which of its examples (indices into its training set).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubBatch {
    pub task: usize,
    pub examples: Vec<usize>,
}

/// Per-task batch sizes (REFERENCE §3): rates `r_t = (N_t/ΣN)^(1/c)` renormalised, quotas
/// `B·r_t` rounded by largest remainder, at least one example per task.
pub fn task_batch_sizes(counts: &[usize], total: usize, c: f64) -> Result<Vec<usize>> {
    if counts.is_empty() {
        bail!("no tasks to sample from");
    }
    if let Some(t) = counts.iter().position(|&n| n == 0) {
        bail!("task {t} has no training examples");
    }
    if total < counts.len() {
        bail!("a batch of {total} cannot hold one example of each of {} tasks", counts.len());
    }
    if c <= 0.0 || !c.is_finite() {
        bail!("the temperature c must be positive (got {c})");
    }
    let available: usize = counts.iter().sum();
    if total > available {
        bail!("a batch of {total} is larger than all {available} training examples");
    }
    let sum: f64 = counts.iter().map(|&n| n as f64).sum();
    let rates: Vec<f64> = counts.iter().map(|&n| (n as f64 / sum).powf(1.0 / c)).collect();
    let rate_sum: f64 = rates.iter().sum();
    let quotas: Vec<f64> = rates.iter().map(|r| total as f64 * r / rate_sum).collect();
    // Floors, at least one, never more than the task has (a sub-batch would repeat examples,
    // and a repeated passage is a false in-batch negative).
    let mut sizes: Vec<usize> = quotas.iter().zip(counts).map(|(q, &n)| (q.floor() as usize).clamp(1, n)).collect();
    // What each task is still owed against its quota, measured from the size it has now: a
    // task already raised to its minimum of one is owed less than nothing, so it is the last
    // to get a leftover slot and the first to give one back.
    let owed = |sizes: &[usize], i: usize| quotas[i] - sizes[i] as f64;
    let mut assigned: usize = sizes.iter().sum();
    while assigned < total {
        // The most owed task with room; ties go to the earlier task.
        let i = (0..counts.len())
            .filter(|&i| sizes[i] < counts[i])
            .max_by(|&a, &b| owed(&sizes, a).total_cmp(&owed(&sizes, b)).then(b.cmp(&a)))
            .expect("total <= available leaves a task with room");
        sizes[i] += 1;
        assigned += 1;
    }
    while assigned > total {
        // The minimum of one pushed the sum over: take back from the least owed task above one.
        let i = (0..counts.len())
            .filter(|&i| sizes[i] > 1)
            .min_by(|&a, &b| owed(&sizes, a).total_cmp(&owed(&sizes, b)).then(b.cmp(&a)))
            .expect("total >= tasks leaves a task above one");
        sizes[i] -= 1;
        assigned -= 1;
    }
    Ok(sizes)
}

/// A task's shuffled pass over its examples; the order of cycle `k` is a function of
/// (seed, task, k), so the state is a position (and the few examples taken early).
///
/// When a cycle ends inside a sub-batch, the sub-batch is completed from the next cycle with
/// examples it does not already hold (`early`, taken ahead of their place in that cycle and
/// skipped when the cursor reaches them), so a sub-batch never repeats an example and every
/// cycle still yields each example exactly once.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Cursor {
    cycle: u64,
    pos: usize,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    early: Vec<usize>,
}

fn cycle_order(seed: u64, task: usize, cycle: u64, n: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    Rng::derive(seed, &[1, task as u64, cycle]).shuffle(&mut order);
    order
}

/// TACO's sampler (see the module docs).
#[derive(Debug, Clone)]
pub struct TacoSampler {
    seed: u64,
    counts: Vec<usize>,
    sizes: Vec<usize>,
    cursors: Vec<Cursor>,
    orders: Vec<Vec<usize>>,
}

/// What [`TacoSampler`] needs to resume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TacoSamplerState {
    cursors: Vec<Cursor>,
}

impl TacoSampler {
    pub fn new(counts: &[usize], batch_size: usize, c: f64, seed: u64) -> Result<Self> {
        let sizes = task_batch_sizes(counts, batch_size, c)?;
        let cursors = vec![Cursor { cycle: 0, pos: 0, early: Vec::new() }; counts.len()];
        let orders = counts.iter().enumerate().map(|(t, &n)| cycle_order(seed, t, 0, n)).collect();
        Ok(TacoSampler { seed, counts: counts.to_vec(), sizes, cursors, orders })
    }

    /// Examples of each task per step.
    pub fn sizes(&self) -> &[usize] {
        &self.sizes
    }

    /// Steps in one epoch: the largest number of batches any task needs to see all of its data.
    pub fn steps_per_epoch(&self) -> usize {
        self.counts.iter().zip(&self.sizes).map(|(&n, &b)| n.div_ceil(b)).max().unwrap_or(0)
    }

    /// The next step: every task's sub-batch.
    pub fn next_step(&mut self) -> Vec<SubBatch> {
        (0..self.counts.len()).map(|t| SubBatch { task: t, examples: self.take(t, self.sizes[t]) }).collect()
    }

    /// `k` examples of task `t` (`k` is at most the task's count), all different: the rest of
    /// the current cycle, then, if that is too few, examples of the next cycle's shuffle that
    /// the sub-batch does not hold yet.
    fn take(&mut self, t: usize, k: usize) -> Vec<usize> {
        let n = self.counts[t];
        let mut out = Vec::with_capacity(k);
        let c = &mut self.cursors[t];
        while out.len() < k && c.pos < n {
            let x = self.orders[t][c.pos];
            c.pos += 1;
            match c.early.iter().position(|&e| e == x) {
                Some(i) => {
                    c.early.swap_remove(i);
                }
                None => out.push(x),
            }
        }
        if out.len() < k {
            debug_assert!(c.early.is_empty(), "examples taken early lie ahead of the cursor");
            *c = Cursor { cycle: c.cycle + 1, pos: 0, early: Vec::new() };
            self.orders[t] = cycle_order(self.seed, t, c.cycle, n);
            if out.is_empty() {
                return self.take(t, k);
            }
            let tail = out.clone();
            let fill: Vec<usize> = self.orders[t].iter().copied().filter(|x| !tail.contains(x)).take(k - out.len()).collect();
            c.early = fill.clone();
            out.extend(fill);
        }
        out
    }

    pub fn state(&self) -> TacoSamplerState {
        TacoSamplerState { cursors: self.cursors.clone() }
    }

    pub fn load_state(&mut self, state: &TacoSamplerState) -> Result<()> {
        if state.cursors.len() != self.counts.len() {
            bail!("sampler state holds {} tasks, this run has {}", state.cursors.len(), self.counts.len());
        }
        for (t, c) in state.cursors.iter().enumerate() {
            if c.pos > self.counts[t] || c.early.iter().any(|&e| e >= self.counts[t]) {
                bail!("sampler state is past the end of task {t} ({} examples)", self.counts[t]);
            }
            self.orders[t] = cycle_order(self.seed, t, c.cycle, self.counts[t]);
        }
        self.cursors = state.cursors.clone();
        Ok(())
    }
}

/// MT-DPR's sampler (see the module docs).
#[derive(Debug, Clone)]
pub struct TaskPerBatchSampler {
    seed: u64,
    counts: Vec<usize>,
    batch_size: usize,
    epoch: u64,
    pos: usize,
    batches: Vec<SubBatch>,
}

/// What [`TaskPerBatchSampler`] needs to resume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskPerBatchState {
    epoch: u64,
    pos: usize,
}

impl TaskPerBatchSampler {
    pub fn new(counts: &[usize], batch_size: usize, seed: u64) -> Result<Self> {
        if batch_size == 0 {
            bail!("the batch size must be positive");
        }
        if let Some(t) = counts.iter().position(|&n| n == 0) {
            bail!("task {t} has no training examples");
        }
        if counts.is_empty() {
            bail!("no tasks to sample from");
        }
        let batches = Self::epoch_batches(seed, counts, batch_size, 0);
        Ok(TaskPerBatchSampler { seed, counts: counts.to_vec(), batch_size, epoch: 0, pos: 0, batches })
    }

    fn epoch_batches(seed: u64, counts: &[usize], batch_size: usize, epoch: u64) -> Vec<SubBatch> {
        let mut batches = Vec::new();
        for (t, &n) in counts.iter().enumerate() {
            let order = cycle_order(seed, t, epoch, n);
            batches.extend(order.chunks(batch_size).map(|c| SubBatch { task: t, examples: c.to_vec() }));
        }
        Rng::derive(seed, &[2, epoch]).shuffle(&mut batches);
        batches
    }

    pub fn steps_per_epoch(&self) -> usize {
        self.counts.iter().map(|n| n.div_ceil(self.batch_size)).sum()
    }

    /// The next step: one task's batch.
    pub fn next_step(&mut self) -> Vec<SubBatch> {
        if self.pos == self.batches.len() {
            self.epoch += 1;
            self.pos = 0;
            self.batches = Self::epoch_batches(self.seed, &self.counts, self.batch_size, self.epoch);
        }
        self.pos += 1;
        vec![self.batches[self.pos - 1].clone()]
    }

    pub fn state(&self) -> TaskPerBatchState {
        TaskPerBatchState { epoch: self.epoch, pos: self.pos }
    }

    pub fn load_state(&mut self, state: &TaskPerBatchState) -> Result<()> {
        let batches = Self::epoch_batches(self.seed, &self.counts, self.batch_size, state.epoch);
        if state.pos > batches.len() {
            bail!("sampler state is past the end of epoch {} ({} > {} batches)", state.epoch, state.pos, batches.len());
        }
        self.batches = batches;
        self.epoch = state.epoch;
        self.pos = state.pos;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_sizes_follow_the_tempered_rates() {
        // Rates (N_t/ΣN)^(1/4) for 1000:100:10 are 0.9743:0.5479:0.3081 (×1/Σ).
        let s = task_batch_sizes(&[10000, 1000, 100], 120, 4.0).unwrap();
        assert_eq!(s.iter().sum::<usize>(), 120);
        assert_eq!(s, vec![64, 36, 20]);
        // Equal tasks split evenly, a remainder to the earliest.
        assert_eq!(task_batch_sizes(&[5, 5, 5], 10, 4.0).unwrap(), vec![4, 3, 3]);
        // At least one each, even for a tiny task.
        let s = task_batch_sizes(&[1_000_000, 1], 4, 4.0).unwrap();
        assert_eq!(s.iter().sum::<usize>(), 4);
        assert!(s[1] >= 1);
        assert!(task_batch_sizes(&[3, 3, 3], 2, 4.0).is_err());
        // A task is never given more examples than it has.
        let s = task_batch_sizes(&[1000, 2], 40, 1.0).unwrap();
        assert_eq!(s.iter().sum::<usize>(), 40);
        assert!(s[1] <= 2, "{s:?}");
        assert!(task_batch_sizes(&[3, 2], 6, 4.0).is_err());
        assert!(task_batch_sizes(&[3, 0], 8, 4.0).is_err());
    }

    #[test]
    fn taco_steps_hold_every_task_and_cycle_small_ones() {
        let mut s = TacoSampler::new(&[10, 3], 6, 4.0, 11).unwrap();
        let sizes = s.sizes().to_vec();
        assert_eq!(sizes.iter().sum::<usize>(), 6);
        let mut seen_small = Vec::new();
        for _ in 0..6 {
            let step = s.next_step();
            assert_eq!(step.len(), 2);
            assert_eq!(step[0].examples.len(), sizes[0]);
            seen_small.extend(step[1].examples.clone());
        }
        // The small task was cycled: every full cycle of 3 is a permutation of 0..3.
        for cycle in seen_small.chunks(3).filter(|c| c.len() == 3) {
            let mut c = cycle.to_vec();
            c.sort();
            assert_eq!(c, vec![0, 1, 2]);
        }
    }

    #[test]
    fn leftover_slots_go_to_the_tasks_owed_most() {
        // Quotas 1.30 × 4 and 0.80: the small task is raised to one, so the sixth slot goes to
        // a large task, not to the small one (ranked by its original 0.80 it would get 2).
        assert_eq!(task_batch_sizes(&[1000, 1000, 1000, 1000, 143], 6, 4.0).unwrap(), vec![2, 1, 1, 1, 1]);
        // Taking back after the minimum: quotas 2.9994, 0.0003, 0.0003 -> floors raised to
        // 2, 1, 1 = 4 > B = 3: the slot comes back from the one task above one.
        assert_eq!(task_batch_sizes(&[10_000, 1, 1], 3, 1.0).unwrap(), vec![1, 1, 1]);
        // Over many shapes: sums to B, each at least one and at most its count, and every
        // task above one holds less than one slot more than its quota.
        for (counts, b, c) in [(vec![7, 300, 2, 41], 12, 2.0), (vec![5, 1, 1, 900], 7, 4.0), (vec![3, 3, 1000, 20, 20], 9, 1.0)] {
            let s = task_batch_sizes(&counts, b, c).unwrap();
            assert_eq!(s.iter().sum::<usize>(), b);
            assert!(s.iter().zip(&counts).all(|(&x, &n)| x >= 1 && x <= n), "{s:?}");
            let sum: f64 = counts.iter().map(|&n| n as f64).sum();
            let rates: Vec<f64> = counts.iter().map(|&n| (n as f64 / sum).powf(1.0 / c)).collect();
            let quota = |i: usize| b as f64 * rates[i] / rates.iter().sum::<f64>();
            assert!((0..counts.len()).all(|i| s[i] == 1 || (s[i] as f64) < quota(i) + 1.0), "{s:?} against quotas {:?}", (0..counts.len()).map(quota).collect::<Vec<_>>());
        }
    }

    #[test]
    fn taco_sub_batches_never_repeat_an_example_across_a_cycle_boundary() {
        // The review's case: 10 examples in sub-batches of 4 cross a cycle every 2.5 steps.
        let mut s = TacoSampler::new(&[10], 4, 4.0, 1).unwrap();
        let mut seen = Vec::new();
        for step in 0..50 {
            let mut ex = s.next_step()[0].examples.clone();
            seen.extend(ex.clone());
            ex.sort();
            ex.dedup();
            assert_eq!(ex.len(), 4, "step {step} repeats an example");
        }
        // 200 examples taken = 20 cycles: each example exactly 20 times.
        for x in 0..10 {
            assert_eq!(seen.iter().filter(|&&e| e == x).count(), 20, "example {x}");
        }
        // Several tasks and seeds, sub-batches as large as the task allows.
        for seed in 0..20 {
            let mut s = TacoSampler::new(&[5, 3, 40], 9, 1.0, seed).unwrap();
            for _ in 0..30 {
                for sub in s.next_step() {
                    let mut ex = sub.examples.clone();
                    ex.sort();
                    ex.dedup();
                    assert_eq!(ex.len(), sub.examples.len(), "seed {seed}: {:?}", sub.examples);
                }
            }
        }
    }

    #[test]
    fn taco_sampler_resumes_exactly() {
        let mut a = TacoSampler::new(&[17, 5, 9], 7, 4.0, 3).unwrap();
        for _ in 0..5 {
            a.next_step();
        }
        let state = a.state();
        assert!(state.cursors.iter().any(|c| !c.early.is_empty()), "the resume point should lie just after a cycle boundary");
        let json = serde_json::to_string(&state).unwrap();
        let mut b = TacoSampler::new(&[17, 5, 9], 7, 4.0, 3).unwrap();
        b.load_state(&serde_json::from_str(&json).unwrap()).unwrap();
        for _ in 0..20 {
            assert_eq!(a.next_step(), b.next_step());
        }
    }

    #[test]
    fn task_per_batch_covers_every_example_once_per_epoch() {
        let mut s = TaskPerBatchSampler::new(&[10, 4], 3, 5).unwrap();
        assert_eq!(s.steps_per_epoch(), 4 + 2);
        let mut seen = [Vec::new(), Vec::new()];
        for _ in 0..s.steps_per_epoch() {
            let step = s.next_step();
            assert_eq!(step.len(), 1);
            seen[step[0].task].extend(step[0].examples.clone());
        }
        for (t, n) in [(0, 10), (1, 4)] {
            seen[t].sort();
            assert_eq!(seen[t], (0..n).collect::<Vec<_>>());
        }
        let state = s.state();
        let mut r = TaskPerBatchSampler::new(&[10, 4], 3, 5).unwrap();
        r.load_state(&state).unwrap();
        for _ in 0..15 {
            assert_eq!(s.next_step(), r.next_step());
        }
    }
}
