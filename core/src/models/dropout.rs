//! Dropout whose mask is drawn by a vectorised hash on the CPU.
//!
//! libtorch 2.11 draws CPU dropout masks with its serial Bernoulli kernel, one generator call
//! per element: in a MiniLM training step (32 queries and 64 passages of 128 tokens, so
//! attention dropout over 6 × 64 × 12 × 128 × 128 probabilities) perf put 9.5% of the step
//! there on 2 cores. Here each element's keep/drop comes from a counter-based hash of (a seed
//! drawn from torch's generator, the element's index), vectorised (AVX-512 or AVX2 when the
//! CPU has them); the mask depends on the seed alone, so runs stay reproducible from the seed
//! the trainer sets each step. The arithmetic is torch's: `x ⊙ m` with `m` either 0 or
//! `1/(1−p)`, kept with probability `1−p` (to 2^-24). Other devices and dtypes use torch's
//! dropout (on CUDA it is one fused kernel).

use crate::optim::kernels::{f32_slice_mut, multiversion};
use tch::{Device, Kind, Tensor};

/// `x` with each element zeroed with probability `p` and the rest scaled by `1/(1−p)`, when
/// `train`; else `x` itself.
pub fn dropout(x: &Tensor, p: f64, train: bool) -> Tensor {
    if !train || p == 0.0 || x.numel() == 0 {
        return x.shallow_clone();
    }
    if !own_mask_applies(x) || !(0.0..1.0).contains(&p) {
        return x.dropout(p, train);
    }
    x * mask_like(x, p)
}

/// Whether [`dropout`] draws its own mask for `x` (float32 on the CPU, under 2^32 elements;
/// the mask is made contiguous, and `x ⊙ m` broadcasts over any layout); the attention of `bert` uses this to apply it to the probabilities itself.
pub fn own_mask_applies(x: &Tensor) -> bool {
    x.device() == Device::Cpu && x.kind() == Kind::Float && (x.numel() as u64) < (1 << 32)
}

/// A contiguous mask of `x`'s shape: 0 with probability `p`, else `1/(1−p)`.
fn mask_like(x: &Tensor, p: f64) -> Tensor {
    // One draw from torch's CPU generator per mask, so `tch::manual_seed` fixes every mask.
    let seed = Tensor::randint(i64::MAX, [1], (Kind::Int64, Device::Cpu)).int64_value(&[0]) as u64;
    seeded_mask(x, p, seed)
}

/// The mask of [`mask_like`] for a given seed.
fn seeded_mask(x: &Tensor, p: f64, seed: u64) -> Tensor {
    let mask = Tensor::empty(x.size(), (Kind::Float, Device::Cpu));
    let threshold = (p * (1u64 << 24) as f64).round() as u32;
    let keep = (1.0 / (1.0 - p)) as f32;
    // One thread: the fill is bound by memory writes, and a mask written by rayon's workers
    // raised the peak RSS of a 4-task MiniLM run by 200 MiB (2,381 against 2,180 MiB) for no
    // gain in step time (3.00 against 2.95 s; docs/BENCHMARKS.md).
    // SAFETY: a fresh tensor no one else holds.
    let out = unsafe { f32_slice_mut(&mask) }.expect("a float32 CPU tensor");
    fill_block(out, 0, seed as u32, (seed >> 32) as u32, threshold, keep);
    mask
}

multiversion!(fill_block => fill_body(out: &mut [f32], start: u32, k1: u32, k2: u32, threshold: u32, keep: f32));
#[inline(always)]
fn fill_body(out: &mut [f32], start: u32, k1: u32, k2: u32, threshold: u32, keep: f32) {
    for (j, o) in out.iter_mut().enumerate() {
        let bits = uniform24(start.wrapping_add(j as u32), k1, k2);
        *o = if bits >= threshold { keep } else { 0.0 };
    }
}

/// 24 uniform bits for element `i` under key `(k1, k2)`: two rounds of a 32-bit integer
/// mixer (Wellons' lowbias32), keyed before each; 32-bit multiplies vectorise everywhere.
#[inline(always)]
fn uniform24(i: u32, k1: u32, k2: u32) -> u32 {
    let mix = |mut x: u32| {
        x ^= x >> 16;
        x = x.wrapping_mul(0x7feb_352d);
        x ^= x >> 15;
        x = x.wrapping_mul(0x846c_a68b);
        x ^ (x >> 16)
    };
    mix(mix(i ^ k1) ^ k2) >> 8
}

#[cfg(test)]
mod tests {
    use super::*;

    // The tests draw masks from explicit seeds: torch's generator is one per process, and
    // other tests running at the same time draw from it too. `tch::manual_seed` fixing every
    // mask is what the trainer's exact-resume test checks.

    #[test]
    fn keeps_one_minus_p_scaled_and_is_reproducible() {
        let x = Tensor::ones([64, 1000], (Kind::Float, Device::Cpu));
        for p in [0.1, 0.5] {
            let a = seeded_mask(&x, p, 11);
            let kept = a.ne(0.0).to_kind(Kind::Double).mean(Kind::Double).double_value(&[]);
            // 64,000 draws: the kept share is within 5 standard deviations of 1 − p.
            let sd = (p * (1.0 - p) / 64_000.0).sqrt();
            assert!((kept - (1.0 - p)).abs() < 5.0 * sd, "p {p}: kept {kept}");
            let values = a.masked_select(&a.ne(0.0));
            assert!(values.eq(1.0 / (1.0 - p)).all().int64_value(&[]) == 1, "kept values are 1/(1-p)");
            assert!(seeded_mask(&x, p, 11).equal(&a), "same seed, same mask");
            assert!(!seeded_mask(&x, p, 12).equal(&a), "another seed, another mask");
            // Seeds that differ only in their high 32 bits give other masks too.
            assert!(!seeded_mask(&x, p, 11 + (1 << 32)).equal(&a), "the high half of the seed counts");
        }
        // Neighbouring elements are not correlated (the mask is not striped).
        let m = seeded_mask(&x, 0.5, 13).ne(0.0).to_kind(Kind::Double).view([-1]);
        let n = m.size()[0];
        let (a, b) = (m.narrow(0, 0, n - 1), m.narrow(0, 1, n - 1));
        let both = (&a * &b).mean(Kind::Double).double_value(&[]);
        assert!((both - 0.25).abs() < 0.01, "P(both kept) {both}");
    }

    #[test]
    fn off_or_zero_returns_the_input_and_gradients_follow_the_mask() {
        let x = Tensor::randn([8, 9], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        assert!(dropout(&x, 0.3, false).equal(&x));
        assert!(dropout(&x, 0.0, true).equal(&x));
        let y = dropout(&x, 0.3, true);
        y.sum(Kind::Float).backward();
        let mask = y.detach() / x.detach();
        assert!((x.grad() - mask).abs().max().double_value(&[]) < 1e-5, "d/dx (x ⊙ m) = m");
        // Other dtypes take torch's dropout.
        let d = Tensor::ones([100], (Kind::Double, Device::Cpu));
        assert_eq!(dropout(&d, 0.5, true).kind(), Kind::Double);
    }
}
