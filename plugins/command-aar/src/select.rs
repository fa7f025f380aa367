//! AAR's training examples from the source LM's scores (REFERENCE §6, steps 4 and 5): the
//! merged positives (gold ∪ the top K LM-preferred passages that are not gold) and the
//! negatives (the starting retriever's top `negatives_depth` minus the positives, a seeded
//! sample of them kept); and the analysis of how LM preferences and human labels overlap.

use sha2::{Digest, Sha256};

/// A seeded stream (SplitMix64): a few lines, stored as one number, the same on every machine.
pub struct Rng(u64);

impl Rng {
    /// A stream for one purpose of a run: the first 8 bytes of SHA-256(seed, parts...), so
    /// another seed or purpose gives an unrelated stream.
    pub fn derive(seed: u64, parts: &[&str]) -> Self {
        let mut h = Sha256::new();
        h.update(seed.to_le_bytes());
        for p in parts {
            h.update((p.len() as u64).to_le_bytes());
            h.update(p.as_bytes());
        }
        let d = h.finalize();
        Rng(u64::from_le_bytes(d[..8].try_into().expect("8 bytes")))
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (rejection sampling, no modulo bias); `n > 0`.
    pub fn below(&mut self, n: u64) -> u64 {
        let zone = u64::MAX - u64::MAX % n;
        loop {
            let x = self.next_u64();
            if x < zone {
                return x % n;
            }
        }
    }

    /// `k` distinct items of `items` (all of them when there are fewer), in draw order.
    pub fn sample<T: Clone>(&mut self, items: &[T], k: usize) -> Vec<T> {
        let mut idx: Vec<usize> = (0..items.len()).collect();
        let k = k.min(idx.len());
        for i in 0..k {
            let j = i + self.below((idx.len() - i) as u64) as usize;
            idx.swap(i, j);
        }
        idx[..k].iter().map(|&i| items[i].clone()).collect()
    }
}

/// The indices of the top `k` scored passages, best first; ties keep the retriever's order
/// (the lower rank first), and passages without a score (failed items) are never picked.
pub fn top_by_score(scores: &[Option<f64>], k: usize, eligible: impl Fn(usize) -> bool) -> Vec<usize> {
    let mut ranked: Vec<usize> = (0..scores.len()).filter(|&i| scores[i].is_some_and(f64::is_finite) && eligible(i)).collect();
    // A stable sort: equal scores stay in retrieval order.
    ranked.sort_by(|&a, &b| scores[b].unwrap().total_cmp(&scores[a].unwrap()));
    ranked.truncate(k);
    ranked
}

/// One query's selection.
#[derive(Debug, Clone, PartialEq)]
pub struct Selection {
    /// The top K LM-preferred passages that are not gold (the positives AAR adds).
    pub added: Vec<String>,
    /// The top K LM-preferred passages, gold or not (for the overlap analysis).
    pub lm_top: Vec<String>,
    /// Gold, then the added ones.
    pub positives: Vec<String>,
}

/// Merged positives for a query whose top N passages `scored` got `scores`.
pub fn select_positives(gold: &[String], scored: &[String], scores: &[Option<f64>], k: usize) -> Selection {
    let is_gold = |i: usize| gold.iter().any(|g| *g == scored[i]);
    let added: Vec<String> = top_by_score(scores, k, |i| !is_gold(i)).into_iter().map(|i| scored[i].clone()).collect();
    let lm_top: Vec<String> = top_by_score(scores, k, |_| true).into_iter().map(|i| scored[i].clone()).collect();
    let mut positives = gold.to_vec();
    positives.extend(added.iter().cloned());
    Selection { added, lm_top, positives }
}

/// How many of source A's top `k` LM-preferred passages are also source B's, over the same
/// scored passages: (shared, A's top k).
pub fn shared_top_k(a: &[Option<f64>], b: &[Option<f64>], k: usize) -> (usize, usize) {
    let top_a = top_by_score(a, k, |_| true);
    let top_b = top_by_score(b, k, |_| true);
    (top_a.iter().filter(|i| top_b.contains(i)).count(), top_a.len())
}

/// Negatives: the retriever's top `depth` (`ranked`, best first) minus `positives`, then
/// `sampled` of them drawn from `rng` (all when fewer remain).
pub fn select_negatives(ranked: &[String], positives: &[String], depth: usize, sampled: usize, rng: &mut Rng) -> Vec<String> {
    let pool: Vec<String> = ranked.iter().take(depth).filter(|p| !positives.contains(p)).cloned().collect();
    rng.sample(&pool, sampled)
}

/// An evenly spaced subset of `n` of `total` items (all when `n >= total`): the same subset
/// for the same file, spread over all of it (training files are often grouped by article).
pub fn spaced_subset(total: usize, n: usize) -> Vec<usize> {
    if n >= total {
        return (0..total).collect();
    }
    (0..n).map(|i| i * total / n).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn positives_are_gold_and_the_top_k_non_gold_by_score() {
        let scored = ids(&["a", "g", "b", "c", "d"]);
        let scores = [Some(0.1), Some(0.9), Some(0.5), None, Some(0.5)];
        let s = select_positives(&ids(&["g", "x"]), &scored, &scores, 2);
        // b and d tie: the retriever's order decides; c failed and is never picked.
        assert_eq!(s.added, ids(&["b", "d"]));
        assert_eq!(s.lm_top, ids(&["g", "b"]));
        assert_eq!(s.positives, ids(&["g", "x", "b", "d"]));
        // Fewer scored passages than K: what there is.
        let s = select_positives(&ids(&["g"]), &ids(&["g", "a"]), &[Some(1.0), None], 2);
        assert_eq!(s.added, Vec::<String>::new());
    }

    #[test]
    fn two_sources_share_their_top_k() {
        // A prefers 0 then 2; B prefers 2 then 1: one of A's two is B's too.
        assert_eq!(shared_top_k(&[Some(0.9), Some(0.1), Some(0.5)], &[Some(0.2), Some(0.6), Some(0.8)], 2), (1, 2));
        // A failed item is nobody's preference; with one scored passage A's top K is one.
        assert_eq!(shared_top_k(&[None, Some(0.1), None], &[Some(0.2), Some(0.6), Some(0.8)], 2), (1, 1));
        assert_eq!(shared_top_k(&[None, None], &[Some(1.0), Some(0.0)], 2), (0, 0));
    }

    #[test]
    fn negatives_exclude_positives_and_are_a_seeded_sample() {
        let ranked: Vec<String> = (0..50).map(|i| format!("p{i}")).collect();
        let positives = ids(&["p0", "p3"]);
        let a = select_negatives(&ranked, &positives, 20, 10, &mut Rng::derive(1, &["aar-negatives", "q1"]));
        let b = select_negatives(&ranked, &positives, 20, 10, &mut Rng::derive(1, &["aar-negatives", "q1"]));
        let c = select_negatives(&ranked, &positives, 20, 10, &mut Rng::derive(2, &["aar-negatives", "q1"]));
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_eq!(a.len(), 10);
        let mut seen = std::collections::HashSet::new();
        for n in &a {
            assert!(!positives.contains(n) && seen.insert(n.clone()));
            assert!(ranked[..20].contains(n), "{n} is deeper than the depth");
        }
        // Fewer than asked: all of them.
        assert_eq!(select_negatives(&ranked[..4], &positives, 20, 10, &mut Rng::derive(0, &[])).len(), 2);
    }

    #[test]
    fn subsets_are_spread_and_exact() {
        assert_eq!(spaced_subset(10, 3), vec![0, 3, 6]);
        assert_eq!(spaced_subset(3, 5), vec![0, 1, 2]);
        let mut r = Rng::derive(5, &[]);
        assert!((0..1000).all(|_| r.below(7) < 7));
    }
}
