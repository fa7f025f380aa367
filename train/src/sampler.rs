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

use crate::rng::Rng;
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
    let sum: f64 = counts.iter().map(|&n| n as f64).sum();
    let rates: Vec<f64> = counts.iter().map(|&n| (n as f64 / sum).powf(1.0 / c)).collect();
    let rate_sum: f64 = rates.iter().sum();
    let quotas: Vec<f64> = rates.iter().map(|r| total as f64 * r / rate_sum).collect();
    let mut sizes: Vec<usize> = quotas.iter().map(|q| (q.floor() as usize).max(1)).collect();
    let remainder = |i: usize| quotas[i] - quotas[i].floor();
    // Largest remainders first; ties go to the earlier task.
    let mut by_remainder: Vec<usize> = (0..counts.len()).collect();
    by_remainder.sort_by(|&a, &b| remainder(b).total_cmp(&remainder(a)).then(a.cmp(&b)));
    let assigned: usize = sizes.iter().sum();
    if assigned < total {
        for &i in by_remainder.iter().cycle().take(total - assigned) {
            sizes[i] += 1;
        }
    } else {
        // The minimum of one pushed the sum over: take back from the tasks whose quotas were
        // rounded least favourably, never below one.
        let mut excess = assigned - total;
        while excess > 0 {
            let i = *by_remainder.iter().rev().filter(|&&i| sizes[i] > 1).max_by(|&&a, &&b| sizes[a].cmp(&sizes[b])).expect("total >= tasks");
            sizes[i] -= 1;
            excess -= 1;
        }
    }
    // A task never gets more than it has (a sub-batch would repeat examples, and a repeated
    // passage is a false in-batch negative): hand the excess to tasks with room.
    let available: usize = counts.iter().sum();
    if total > available {
        bail!("a batch of {total} is larger than all {available} training examples");
    }
    loop {
        let excess: usize = sizes.iter().zip(counts).map(|(&s, &n)| s.saturating_sub(n)).sum();
        if excess == 0 {
            break;
        }
        for (s, &n) in sizes.iter_mut().zip(counts) {
            *s = (*s).min(n);
        }
        let mut left = excess;
        for &i in by_remainder.iter().cycle().take(counts.len() * excess) {
            if left == 0 {
                break;
            }
            if sizes[i] < counts[i] {
                sizes[i] += 1;
                left -= 1;
            }
        }
    }
    Ok(sizes)
}

/// A task's shuffled pass over its examples; the order of cycle `k` is a function of
/// (seed, task, k), so the state is two numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct Cursor {
    cycle: u64,
    pos: usize,
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
        let cursors = vec![Cursor { cycle: 0, pos: 0 }; counts.len()];
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

    /// `k` examples of task `t`, continuing into a fresh shuffle when a cycle ends (a
    /// sub-batch never holds one example twice unless the task has fewer than `k`).
    fn take(&mut self, t: usize, k: usize) -> Vec<usize> {
        let mut out = Vec::with_capacity(k);
        while out.len() < k {
            let c = &mut self.cursors[t];
            if c.pos == self.counts[t] {
                c.cycle += 1;
                c.pos = 0;
                self.orders[t] = cycle_order(self.seed, t, c.cycle, self.counts[t]);
            }
            let c = &mut self.cursors[t];
            let take = (k - out.len()).min(self.counts[t] - c.pos);
            out.extend_from_slice(&self.orders[t][c.pos..c.pos + take]);
            c.pos += take;
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
            if c.pos > self.counts[t] {
                bail!("sampler state is past the end of task {t} ({} > {} examples)", c.pos, self.counts[t]);
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
    fn taco_sampler_resumes_exactly() {
        let mut a = TacoSampler::new(&[17, 5, 9], 7, 4.0, 3).unwrap();
        for _ in 0..5 {
            a.next_step();
        }
        let state = a.state();
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
