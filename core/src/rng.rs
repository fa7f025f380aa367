//! A small seeded generator whose whole state is one `u64`, so a checkpoint can store it and a
//! resumed run draws exactly the numbers an uninterrupted one would.

/// SplitMix64 (Steele, Lea and Flood 2014): fast, statistically sound for shuffling and
/// sampling, and trivially serialisable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Rng(pub u64);

impl Rng {
    /// A generator for one purpose, derived from a run seed and labels (task index, cycle, ...)
    /// so that independent streams do not depend on each other's draws.
    pub fn derive(seed: u64, labels: &[u64]) -> Self {
        let mut r = Rng(seed ^ 0x6a09e667f3bcc909);
        for &l in labels {
            r = Rng(r.next_u64() ^ l.wrapping_mul(0x9e3779b97f4a7c15));
        }
        r
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e3779b97f4a7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`), without modulo bias.
    pub fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0, "Rng::below(0)");
        let zone = u64::MAX - u64::MAX % n;
        loop {
            let v = self.next_u64();
            if v < zone {
                return v % n;
            }
        }
    }

    /// Fisher-Yates shuffle.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            items.swap(i, j);
        }
    }

    /// `k` distinct items of `items` in random order (all of them, shuffled, if `k >= len`).
    pub fn sample<T: Clone>(&mut self, items: &[T], k: usize) -> Vec<T> {
        let mut idx: Vec<usize> = (0..items.len()).collect();
        let k = k.min(items.len());
        for i in 0..k {
            let j = i + self.below((items.len() - i) as u64) as usize;
            idx.swap(i, j);
        }
        idx[..k].iter().map(|&i| items[i].clone()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shuffles_are_permutations_and_reproducible() {
        let mut a: Vec<u32> = (0..100).collect();
        let mut b = a.clone();
        Rng::derive(7, &[1, 2]).shuffle(&mut a);
        Rng::derive(7, &[1, 2]).shuffle(&mut b);
        assert_eq!(a, b);
        let mut sorted = a.clone();
        sorted.sort();
        assert_eq!(sorted, (0..100).collect::<Vec<_>>());
        assert_ne!(a, (0..100).collect::<Vec<_>>());
        let mut c: Vec<u32> = (0..100).collect();
        Rng::derive(7, &[1, 3]).shuffle(&mut c);
        assert_ne!(a, c, "another label, another stream");
    }

    #[test]
    fn below_is_roughly_uniform() {
        let mut r = Rng(1);
        let mut counts = [0usize; 5];
        for _ in 0..50_000 {
            counts[r.below(5) as usize] += 1;
        }
        assert!(counts.iter().all(|&c| (9_000..11_000).contains(&c)), "{counts:?}");
    }

    #[test]
    fn sample_draws_distinct_items() {
        let items: Vec<u32> = (0..10).collect();
        let s = Rng(3).sample(&items, 4);
        assert_eq!(s.len(), 4);
        let mut d = s.clone();
        d.sort();
        d.dedup();
        assert_eq!(d.len(), 4);
        assert_eq!(Rng(3).sample(&items, 20).len(), 10);
    }
}
