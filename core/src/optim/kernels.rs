//! Fused CPU loops for the optimizers' element-wise arithmetic on float32 tensors.
//!
//! Written as tch operations, T-SAGE's per-task work is some fifteen passes over memory per
//! element (every operation reads its inputs and allocates its output) and AdamW's about ten;
//! here each is one pass over blocks of elements on rayon's pool, with the AVX-512 or AVX2 build
//! of the loop picked at run time (the release build targets baseline x86-64; see
//! `retrieval/src/index/simd.rs`). On 22.6M parameters and 2 cores that took T-SAGE's
//! optimizer work per step from 1.30 s to 0.68 s, and AdamW's update from 0.11 to 0.02 s
//! (docs/BENCHMARKS.md). Other devices, and tensors that are not contiguous float32, keep
//! the tch path.
//!
//! The arithmetic is the tch path's, operation for operation, except where noted; `exp` and
//! `ln` are polynomials within 2 ulp of the C library's.

use rayon::prelude::*;
use tch::{Device, Kind, Tensor};

/// Elements per parallel block: a few hundred KB per stream, so blocks stay in L2.
const BLOCK: usize = if cfg!(test) { 7 } else { 1 << 16 };
/// Blocks counted into one set of 32-bit counts (fewer than 2^32 elements; tests take several
/// groups of their small inputs).
const GROUP_BLOCKS: usize = if cfg!(test) { 3 } else { u32::MAX as usize / BLOCK };

/// Whether the loops here can take `x`: float32, contiguous, on the CPU.
pub fn is_cpu_f32(x: &Tensor) -> bool {
    x.device() == Device::Cpu && x.kind() == Kind::Float && x.is_contiguous()
}

/// `x`'s elements, when [`is_cpu_f32`].
///
/// # Safety
/// Nothing writes the elements while the slice lives.
pub unsafe fn f32_slice(x: &Tensor) -> Option<&[f32]> {
    f32_slice_mut(x).map(|s| &*s)
}

/// `x`'s elements, writable, when [`is_cpu_f32`].
///
/// # Safety
/// No other reference to the elements (through this tensor or another sharing its storage)
/// lives while the slice does.
#[allow(clippy::mut_from_ref)]
pub unsafe fn f32_slice_mut(x: &Tensor) -> Option<&mut [f32]> {
    if !is_cpu_f32(x) {
        return None;
    }
    // An empty tensor may have no storage: a dangling, aligned pointer is what a slice of
    // length 0 needs.
    Some(match x.numel() {
        0 => &mut [],
        n => std::slice::from_raw_parts_mut(x.data_ptr() as *mut f32, n),
    })
}

/// A raw pointer that rayon's workers may share: every block touches its own elements only.
#[derive(Clone, Copy)]
pub(crate) struct Shared(pub(crate) *mut f32);
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}

impl Shared {
    /// Elements `start..start + len`.
    ///
    /// # Safety
    /// In bounds, and no other live reference writes them.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice(&self, start: usize, len: usize) -> &mut [f32] {
        std::slice::from_raw_parts_mut(self.0.add(start), len)
    }
}

/// `f(start, len)` over `[0, n)` in blocks, in parallel.
pub(crate) fn par_blocks(n: usize, f: impl Fn(usize, usize) + Sync) {
    (0..n.div_ceil(BLOCK)).into_par_iter().for_each(|b| {
        let start = b * BLOCK;
        f(start, BLOCK.min(n - start))
    });
}

/// Defines `$name`, which runs `$body` (an `#[inline(always)]` function) compiled for
/// AVX-512 or AVX2+FMA when the CPU has them, else for the baseline.
macro_rules! multiversion {
    ($name:ident => $body:ident ($($arg:ident : $ty:ty),*) $(-> $ret:ty)?) => {
        fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                unsafe fn v512($($arg: $ty),*) $(-> $ret)? { $body($($arg),*) }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn v256($($arg: $ty),*) $(-> $ret)? { $body($($arg),*) }
                if std::arch::is_x86_feature_detected!("avx512f") {
                    return unsafe { v512($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                    return unsafe { v256($($arg),*) };
                }
            }
            $body($($arg),*)
        }
    };
}
pub(crate) use multiversion;

/// `e^x` in float32, branch-free so that loops over it vectorise: `x = n·ln 2 + r` with
/// `|r| ≤ ln 2 / 2`, a degree-6 polynomial for `e^r` (Cephes' `expf` coefficients, under 1e-7
/// relative error) and `2^n` put into the exponent bits. Below -87.3 (where `e^x` leaves the
/// normal floats) it returns 0; above 88.7, infinity.
// Cephes' coefficients as published, past float32's precision.
#[allow(clippy::excessive_precision)]
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 in two parts, so that n·ln 2 is exact in the reduction.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding and subtracting 1.5·2^23 rounds to the nearest integer without SSE4.1's roundps.
    const ROUND: f32 = 12_582_912.0;
    let xc = x.clamp(-87.3, 88.7);
    let n = (xc * LOG2E + ROUND) - ROUND;
    let r = xc - n * LN2_HI - n * LN2_LO;
    let p = 1.987_569_1e-4;
    let p = p * r + 1.398_199_9e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 1.666_666_5e-1;
    let p = p * r + 5.000_000_1e-1;
    let y = p * r * r + r + 1.0;
    // 2^n as two factors, each a normal float for every n the clamp allows (-126..=128).
    let n = n as i32;
    let half = n >> 1;
    let pow2 = |e: i32| f32::from_bits(((e + 127) as u32) << 23);
    let scaled = y * pow2(half) * pow2(n - half);
    if x < -87.3 {
        0.0
    } else if x > 88.7 {
        f32::INFINITY
    } else {
        scaled
    }
}

/// `ln x` in float32 for positive normal `x`, branch-free: `x = m·2^e` with `m` in
/// `[√½, √2)`, then Cephes' `logf` polynomial for `ln m` (under 1e-7 relative error).
#[allow(clippy::excessive_precision)]
#[inline(always)]
pub fn ln(x: f32) -> f32 {
    let bits = x.to_bits();
    let e = ((bits >> 23) & 0xff) as i32 - 127;
    let m = f32::from_bits((bits & 0x007f_ffff) | 0x3f80_0000);
    let big = m > std::f32::consts::SQRT_2;
    let (m, e) = if big { (m * 0.5, e + 1) } else { (m, e) };
    let e = e as f32;
    let f = m - 1.0;
    let z = f * f;
    let p = 7.037_683_6e-2;
    let p = p * f - 1.151_461e-1;
    let p = p * f + 1.167_699_9e-1;
    let p = p * f - 1.242_014_1e-1;
    let p = p * f + 1.424_932_3e-1;
    let p = p * f - 1.666_805_8e-1;
    let p = p * f + 2.000_071_4e-1;
    let p = p * f - 2.499_999_4e-1;
    let p = p * f + 3.333_333_1e-1;
    let y = f * z * p - 2.121_944_4e-4 * e - 0.5 * z;
    f + y + 0.693_359_4 * e
}

/// `L = log Σ_t e^{M_t/τ}` per element of one parameter's momentum `m` (`[T, n]`, row-major)
/// into `out` (`n`): the lean form's log-denominator, in one pass over `M`.
pub fn log_sum_exp_rows(m: &[f32], tau: f32, out: &mut [f32]) {
    let n = out.len();
    if n == 0 {
        return;
    }
    assert!(m.len().is_multiple_of(n));
    let rows = m.len() / n;
    let out = Shared(out.as_mut_ptr());
    // SAFETY: disjoint blocks of `out`; `m` is only read.
    par_blocks(n, |start, len| unsafe {
        let rows: Vec<&[f32]> = (0..rows).map(|r| &m[r * n + start..r * n + start + len]).collect();
        lse_block(&rows, tau, out.slice(start, len))
    });
}

multiversion!(lse_block => lse_body(rows: &[&[f32]], tau: f32, out: &mut [f32]));
#[inline(always)]
fn lse_body(rows: &[&[f32]], tau: f32, out: &mut [f32]) {
    const TILE: usize = if cfg!(test) { 3 } else { 512 };
    let mut max = [0f32; 512];
    let mut sum = [0f32; 512];
    for start in (0..out.len()).step_by(TILE) {
        let len = TILE.min(out.len() - start);
        let (max, sum) = (&mut max[..len], &mut sum[..len]);
        max.fill(f32::NEG_INFINITY);
        sum.fill(0.0);
        for row in rows {
            for (mx, &m) in max.iter_mut().zip(&row[start..start + len]) {
                *mx = mx.max(m / tau);
            }
        }
        for row in rows {
            for ((s, &mx), &m) in sum.iter_mut().zip(max.iter()).zip(&row[start..start + len]) {
                *s += exp(m / tau - mx);
            }
        }
        // The sum is in [1, T]: a positive normal float, as `ln` needs.
        for ((o, &mx), &s) in out[start..start + len].iter_mut().zip(max.iter()).zip(sum.iter()) {
            *o = mx + ln(s);
        }
    }
}

/// Whether any element is NaN or infinite.
pub fn any_non_finite(x: &[f32]) -> bool {
    x.par_chunks(BLOCK).any(any_non_finite_block)
}

multiversion!(any_non_finite_block => any_non_finite_body(x: &[f32]) -> bool);
#[inline(always)]
fn any_non_finite_body(x: &[f32]) -> bool {
    // An OR over the block, which vectorises; an early exit would not. NaN and ±inf are the
    // floats whose exponent bits are all ones.
    let mut bad = false;
    for v in x {
        bad |= v.to_bits() & 0x7f80_0000 == 0x7f80_0000;
    }
    bad
}

/// What one counting pass over a task's parameters found besides the histogram.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counted {
    /// Elements whose `|θ ⊙ g|` was exactly 0.
    pub zeros: i64,
    /// Whether some gradient element was NaN or infinite (the first pass checks; the second
    /// does not, and T-SAGE skips it after a first that found one).
    pub non_finite: bool,
}

impl Counted {
    /// What two passes over disjoint elements found together.
    fn and(self, other: Counted) -> Counted {
        Counted { zeros: self.zeros + other.zeros, non_finite: self.non_finite || other.non_finite }
    }
}

/// Histogram of the bit patterns of `|θ ⊙ g|` over every `(θ, g)` of a task (non-negative floats
/// order as their bits): with `high = None` of the high 16 bits, else of the low 16 bits among
/// elements whose high bits are `high`. Adds into `hist` (65,536 bins).
///
/// One pass over all the parameters, not one per parameter: each worker keeps one set of
/// counts for every block it takes, and the sets are merged once, where a call per parameter
/// made, merged and added 65,536 counts for each of MiniLM's 101 tensors (most of them 384
/// elements). The first pass also looks for a non-finite gradient, which the step must refuse
/// before anything is folded in: reading `g` once for both saves a pass over the gradient.
pub fn sensitivity_counts(pairs: &[(&[f32], &[f32])], high: Option<u32>, hist: &mut [i64]) -> Counted {
    assert!(pairs.iter().all(|(t, g)| t.len() == g.len()));
    let blocks: Vec<(usize, usize)> = pairs.iter().enumerate().flat_map(|(i, (t, _))| (0..t.len()).step_by(BLOCK).map(move |s| (i, s))).collect();
    // Each worker's counts are 32-bit (half the cache of 64-bit ones): a group of blocks holds
    // fewer than 2^32 elements, so no bin overflows, and larger models take several groups.
    let mut counted = Counted::default();
    for group in blocks.chunks(GROUP_BLOCKS) {
        counted = counted.and(count_group(pairs, group, high, hist));
    }
    counted
}

fn count_group(pairs: &[(&[f32], &[f32])], blocks: &[(usize, usize)], high: Option<u32>, hist: &mut [i64]) -> Counted {
    let (counts, counted) = blocks
        .par_iter()
        .fold(
            || (vec![0u32; 1 << 16], Counted::default()),
            |(mut counts, c), &(i, s)| {
                let (t, g) = pairs[i];
                let e = BLOCK.min(t.len() - s);
                let (zeros, bad) = count_block(&t[s..s + e], &g[s..s + e], high, &mut counts);
                (counts, c.and(Counted { zeros, non_finite: bad }))
            },
        )
        .reduce(
            || (vec![0u32; 1 << 16], Counted::default()),
            |(mut a, ca), (b, cb)| {
                a.iter_mut().zip(&b).for_each(|(x, y)| *x += y);
                (a, ca.and(cb))
            },
        );
    hist.iter_mut().zip(&counts).for_each(|(h, &c)| *h += c as i64);
    counted
}

multiversion!(count_block => count_block_body(theta: &[f32], g: &[f32], high: Option<u32>, counts: &mut [u32]) -> (i64, bool));
/// Counts one block; returns its zeros and, in the first pass, whether some `g` is non-finite.
#[inline(always)]
fn count_block_body(theta: &[f32], g: &[f32], high: Option<u32>, counts: &mut [u32]) -> (i64, bool) {
    // The gradient check first, as one OR over the block, which vectorises (the counting loop
    // below cannot): the block is in L1/L2 for the second loop.
    let bad = high.is_none() && any_non_finite_body(g);
    // Zeros (every element of an embedding row no example touched) come in long runs: counted
    // apart, they cost a predictable branch instead of a chain of increments of one counter,
    // each waiting on the last.
    let mut zeros = 0;
    for (&t, &g) in theta.iter().zip(g) {
        let bits = (t * g).abs().to_bits();
        if bits == 0 {
            zeros += 1;
            continue;
        }
        match high {
            None => counts[(bits >> 16) as usize] += 1,
            Some(h) => {
                if bits >> 16 == h {
                    counts[(bits & 0xFFFF) as usize] += 1;
                }
            }
        }
    }
    // Bit pattern 0: bin 0 of the high bits, and bin 0 of the low bits inside high bin 0.
    if high.is_none_or(|h| h == 0) {
        counts[0] += zeros as u32;
    }
    (zeros, bad)
}

/// What a task's gradient is folded into (see `optim::tsage`).
pub enum Fold<'a> {
    /// Burn-in: `acc += G_t`.
    Sum,
    /// The exact form: `acc ← acc + w·(G_t − acc)` with `w = 1 / (1 + Σ_{s ∈ before} e^{(M_s − M_t)/τ})`
    /// from the updated `M_t`, the softmax weight of task t among those in so far (written
    /// without a logarithm: the tch path's `sigmoid(M_t/τ − logsumexp_s M_s/τ)`). `first`:
    /// no task came before, `acc ← G_t`.
    Exact { before: &'a [usize], first: bool },
    /// The lean form: `acc += e^{M_t/τ − L}·G_t` with the previous step's `M_t` and its
    /// log-denominator `L`.
    Lean { log_denominator: &'a [f32] },
}

/// One task of T-SAGE over one parameter of `n` elements: the momentum row `t` of `m`
/// (`[T, n]`, row-major) becomes `β·M_t + k·|θ ⊙ G_t|` (`k = (1−β)·scale`; `β·M_t` without a
/// gradient), and the gradient is folded into `acc` as `fold` says. Divides by `tau` as the tch path
/// does (a multiplication by `1/τ` rounds differently, which the softmax amplifies when `M/τ` is large). `acc` is `None` only
/// when there is nothing to fold into (no gradient and no earlier one).
#[allow(clippy::too_many_arguments)]
pub fn tsage_task(theta: &[f32], g: Option<&[f32]>, m: &mut [f32], t: usize, acc: Option<&mut [f32]>, fold: &Fold, beta: f32, k: f32, tau: f32) {
    let n = theta.len();
    if n == 0 {
        return;
    }
    assert!(m.len().is_multiple_of(n) && t < m.len() / n);
    assert!(g.is_none_or(|g| g.len() == n) && acc.as_ref().is_none_or(|a| a.len() == n));
    let m = Shared(m.as_mut_ptr());
    let acc = acc.map(|a| Shared(a.as_mut_ptr()));
    par_blocks(n, |start, len| {
        // SAFETY: rows of `m` and `acc` are split into disjoint blocks; row t is written, the
        // rows in `before` (never t) only read.
        unsafe {
            let theta = &theta[start..start + len];
            let g = g.map(|g| &g[start..start + len]);
            let m_t = m.slice(t * n + start, len);
            let acc = acc.as_ref().map(|a| a.slice(start, len));
            let rows: Vec<&[f32]> = match fold {
                Fold::Exact { before, .. } => before.iter().map(|&s| &*m.slice(s * n + start, len)).collect(),
                _ => Vec::new(),
            };
            let l = match fold {
                Fold::Lean { log_denominator } => Some(&log_denominator[start..start + len]),
                _ => None,
            };
            task_block(theta, g, m_t, acc, fold, &rows, l, beta, k, tau);
        }
    });
}

multiversion!(task_block => task_block_body(theta: &[f32], g: Option<&[f32]>, m_t: &mut [f32], acc: Option<&mut [f32]>, fold: &Fold, rows: &[&[f32]], l: Option<&[f32]>, beta: f32, k: f32, tau: f32));
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn task_block_body(theta: &[f32], g: Option<&[f32]>, m_t: &mut [f32], acc: Option<&mut [f32]>, fold: &Fold, rows: &[&[f32]], l: Option<&[f32]>, beta: f32, k: f32, tau: f32) {
    let mut acc = acc;
    // The lean form weighs by the momentum before this step's update.
    if let (Fold::Lean { .. }, Some(g), Some(acc), Some(l)) = (fold, g, acc.as_deref_mut(), l) {
        for (((a, &g), &m), &l) in acc.iter_mut().zip(g).zip(m_t.iter()).zip(l) {
            *a += exp(m / tau - l) * g;
        }
    }
    match g {
        Some(g) => {
            for ((m, &th), &g) in m_t.iter_mut().zip(theta).zip(g) {
                *m = *m * beta + (th * g).abs() * k;
            }
        }
        None => m_t.iter_mut().for_each(|m| *m *= beta),
    }
    let Some(acc) = acc else { return };
    match fold {
        Fold::Lean { .. } => {}
        Fold::Sum => {
            if let Some(g) = g {
                acc.iter_mut().zip(g).for_each(|(a, &g)| *a += g);
            }
        }
        Fold::Exact { first: true, .. } => {
            if let Some(g) = g {
                acc.copy_from_slice(g);
            }
        }
        Fold::Exact { first: false, .. } => {
            // Tiles, so that each loop is a plain vectorisable one over the tile.
            const TILE: usize = if cfg!(test) { 3 } else { 512 };
            let mut sum = [0f32; 512];
            for start in (0..acc.len()).step_by(TILE) {
                let len = TILE.min(acc.len() - start);
                let (sum, m_t) = (&mut sum[..len], &m_t[start..start + len]);
                sum.fill(0.0);
                for row in rows {
                    for ((s, &ms), &mt) in sum.iter_mut().zip(&row[start..start + len]).zip(m_t) {
                        *s += exp(ms / tau - mt / tau);
                    }
                }
                let acc = &mut acc[start..start + len];
                match g {
                    Some(g) => {
                        for ((a, &g), &s) in acc.iter_mut().zip(&g[start..start + len]).zip(sum.iter()) {
                            *a += (g - *a) / (1.0 + s);
                        }
                    }
                    // 1 − w = s / (1 + s), written so that s = ∞ (M_t far below another
                    // task's: e^x overflows, since the sum is not shifted by its maximum)
                    // gives 1, not ∞/∞; exact where w rounds to 1.
                    None => acc.iter_mut().zip(sum.iter()).for_each(|(a, &s)| *a *= 1.0 / (1.0 + 1.0 / s)),
                }
            }
        }
    }
}

/// AdamW's constants for one parameter's update.
#[derive(Debug, Clone, Copy)]
pub struct AdamWStep {
    /// `1 − lr·weight_decay` (1 without decay).
    pub decay: f32,
    /// `1 − β1` and `1 − β2` rounded from double, as torch passes them (`1 − β` taken in float
    /// from a rounded β is 1.3e-5 off for β2 = 0.999).
    pub one_minus_beta1: f32,
    pub beta2: f32,
    pub one_minus_beta2: f32,
    /// `√(1 − β2^step)`.
    pub bias2_sqrt: f32,
    pub eps: f32,
    /// `−lr / (1 − β1^step)`.
    pub step_size: f32,
}

/// One AdamW update in place, in `torch.optim.AdamW`'s order of operations (single-tensor
/// form): `p ← p·decay`; `m ← lerp(m, g, 1−β1)`; `v ← v·β2 + (1−β2)·g·g`;
/// `p ← p + step_size·m / (√v / √(1−β2^step) + eps)`.
pub fn adamw(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], c: AdamWStep) {
    let n = p.len();
    assert!(g.len() == n && m.len() == n && v.len() == n);
    let (p, m, v) = (Shared(p.as_mut_ptr()), Shared(m.as_mut_ptr()), Shared(v.as_mut_ptr()));
    // SAFETY: disjoint blocks of four equally long buffers.
    par_blocks(n, |start, len| unsafe { adamw_block(p.slice(start, len), &g[start..start + len], m.slice(start, len), v.slice(start, len), c) });
}

multiversion!(adamw_block => adamw_body(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], c: AdamWStep));
#[inline(always)]
fn adamw_body(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], c: AdamWStep) {
    let w = c.one_minus_beta1;
    for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
        // torch's lerp: `m + w·(g − m)` for weights under 0.5, else `g − (g − m)·(1 − w)`.
        *m = if w < 0.5 { *m + w * (g - *m) } else { g - (g - *m) * (1.0 - w) };
        *v = *v * c.beta2 + c.one_minus_beta2 * g * g;
        let denom = v.sqrt() / c.bias2_sqrt + c.eps;
        *p = *p * c.decay + c.step_size * *m / denom;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_two_ulp_of_libm() {
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x < 88.5 {
            let (ours, libm) = (exp(x) as f64, (x as f64).exp());
            worst = worst.max(((ours - libm) / libm).abs());
            x += 0.000_731;
        }
        assert!(worst < 2.5e-7, "worst relative error {worst}");
        assert_eq!(exp(-200.0), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(100.0), f32::INFINITY);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(0.0), 1.0);
    }

    #[test]
    fn ln_is_within_two_ulp_of_libm() {
        let mut worst = 0f64;
        let mut x = 1e-30f32;
        while x < 1e30 {
            let (ours, libm) = (ln(x) as f64, (x as f64).ln());
            // Relative, except near x = 1 where ln x passes through 0.
            worst = worst.max((ours - libm).abs() / libm.abs().max(1.0));
            x *= 1.000_37;
        }
        assert!(worst < 2.5e-7, "worst error {worst}");
        assert_eq!(ln(1.0), 0.0);
    }

    #[test]
    fn log_sum_exp_rows_matches_torch() {
        let (t, n) = (4i64, 3 * BLOCK as i64 + 2);
        tch::manual_seed(5);
        let m = Tensor::randn([t, n], (Kind::Float, Device::Cpu)) * 30.0;
        let tau = 2.0;
        let expect = (&m / tau).logsumexp([0i64].as_slice(), false);
        let mut out = vec![0f32; n as usize];
        log_sum_exp_rows(&Vec::<f32>::try_from(m.view([-1])).unwrap(), tau as f32, &mut out);
        let diff = (Tensor::from_slice(&out) - &expect).abs().max().double_value(&[]);
        assert!(diff < 1e-5, "max diff {diff}");
    }

    #[test]
    fn non_finite_values_are_found_in_any_block() {
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut x = vec![1.0f32; 3 * BLOCK + 5];
            x[BLOCK - 1] = f32::MAX;
            x[BLOCK] = -f32::MIN_POSITIVE / 2.0;
            assert!(!any_non_finite(&x));
            x[2 * BLOCK + 3] = bad;
            assert!(any_non_finite(&x), "{bad}");
        }
        assert!(!any_non_finite(&[]));
    }

    /// Against torch's AdamW arithmetic as the tch path writes it.
    #[test]
    fn adamw_matches_the_tensor_form() {
        let n = 2 * BLOCK + 17;
        let r = |seed| Tensor::randn([n as i64], (Kind::Float, Device::Cpu)) * (seed as f64);
        tch::manual_seed(3);
        let (p, g, m) = (r(1), r(2), r(3));
        let v = r(1).square() + 1e-3;
        let (lr, wd, b1, b2, eps, step) = (1e-3, 0.01, 0.9, 0.999, 1e-8, 3);
        let (bias1, bias2) = (1.0 - f64::powi(b1, step), 1.0 - f64::powi(b2, step));
        let expect_p = p.copy() * (1.0 - lr * wd);
        let expect_m = m.lerp(&g, 1.0 - b1);
        let expect_v = &v * b2 + (&g * (1.0 - b2)) * &g;
        let denom = expect_v.sqrt() / bias2.sqrt() + eps;
        let expect_p = expect_p.addcdiv(&(&expect_m * (-lr / bias1)), &denom);
        let c = AdamWStep {
            decay: (1.0 - lr * wd) as f32,
            one_minus_beta1: (1.0 - b1) as f32,
            beta2: b2 as f32,
            one_minus_beta2: (1.0 - b2) as f32,
            bias2_sqrt: bias2.sqrt() as f32,
            eps: eps as f32,
            step_size: (-lr / bias1) as f32,
        };
        let vec = |t: &Tensor| Vec::<f32>::try_from(t).unwrap();
        let (mut pv, mut mv, mut vv) = (vec(&p), vec(&m), vec(&v));
        adamw(&mut pv, &vec(&g), &mut mv, &mut vv, c);
        // ATen's vectorised lerp and addcmul fuse multiply-adds, so the two may be a rounding
        // or two apart, and no more. v is a sum of positive terms, so it is compared element
        // by element (a `1 − β2` taken in float from a rounded β2 puts it 1.3e-5 off); p and
        // m, which pass near 0, against their largest magnitude.
        let diff = |ours: Vec<f32>, theirs: &Tensor| (Tensor::from_slice(&ours).to_kind(Kind::Double) - theirs.to_kind(Kind::Double)).abs();
        let rel = (diff(vv, &expect_v) / expect_v.to_kind(Kind::Double)).max().double_value(&[]);
        assert!(rel < 5e-7, "v: max relative difference {rel}");
        for (what, ours, theirs) in [("p", pv, expect_p), ("m", mv, expect_m)] {
            let scale = theirs.abs().max().double_value(&[]);
            let d = diff(ours, &theirs).max().double_value(&[]);
            assert!(d < 5e-7 * scale, "{what}: max difference {d} at scale {scale}");
        }
    }
}
