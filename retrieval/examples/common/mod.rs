//! What the index benchmarks share.

use rak_retrieval::index::Hit;
use rak_retrieval::npy::NpyF32;

/// Recall@k of `hits` against `gt`, which holds the exact top-k rows of each query (as float32).
pub fn recall(hits: &[Vec<Hit>], gt: &NpyF32, k: usize) -> f64 {
    let mut found = 0;
    for (qi, h) in hits.iter().enumerate() {
        let truth: std::collections::HashSet<usize> = gt.row(qi)[..k].iter().map(|&v| v as usize).collect();
        found += h.iter().take(k).filter(|x| truth.contains(&x.row)).count();
    }
    found as f64 / (hits.len() * k) as f64
}
