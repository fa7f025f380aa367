//! Shared fixtures of the optimizer tests: a small model of three parameters and seeded task
//! gradients.

use tch::Tensor;

/// Deterministic pseudo-random values in [-1, 1).
pub fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f64 / (1u64 << 24) as f64 * 2.0 - 1.0) as f32
        })
        .collect()
}

pub const SHAPES: [&[i64]; 3] = [&[4, 3], &[3], &[2, 2]];
pub const TASKS: usize = 3;

pub fn params() -> Vec<(String, Tensor)> {
    SHAPES.iter().enumerate().map(|(i, s)| (format!("p{i}"), Tensor::from_slice(&values(100 + i as u64, s.iter().product::<i64>() as usize)).view(*s))).collect()
}

/// Task `t`'s gradient at `step`; task 2 never reaches parameter p2 (a missing gradient).
pub fn grads(step: u64, t: usize) -> Vec<(String, Tensor)> {
    SHAPES
        .iter()
        .enumerate()
        .filter(|(i, _)| !(t == 2 && *i == 2))
        .map(|(i, s)| (format!("p{i}"), Tensor::from_slice(&values(step * 31 + t as u64 * 7 + i as u64, s.iter().product::<i64>() as usize)).view(*s)))
        .collect()
}

pub fn flat(list: &[(String, Tensor)]) -> Tensor {
    Tensor::cat(&list.iter().map(|(_, t)| t.flatten(0, -1)).collect::<Vec<_>>(), 0)
}


/// Task `t`'s loss at `step` (positive, different per task and step).
pub fn loss(step: u64, t: usize) -> f64 {
    0.5 + values(1000 + step * 13 + t as u64, 1)[0].abs() as f64 * 2.0
}

/// Every task's gradient at `step` as a dense `[T, P]` f64 matrix (zeros where a task has no
/// gradient).
pub fn dense_grads(step: u64) -> Tensor {
    let rows: Vec<Tensor> = (0..TASKS)
        .map(|t| {
            let mut full: Vec<(String, Tensor)> = params().iter().map(|(n, x)| (n.clone(), Tensor::zeros_like(x))).collect();
            for (n, v) in grads(step, t) {
                full.iter_mut().find(|(m, _)| *m == n).unwrap().1 = v;
            }
            flat(&full)
        })
        .collect();
    Tensor::stack(&rows, 0).to_kind(tch::Kind::Double)
}
