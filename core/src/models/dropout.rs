//! Dropout whose mask is drawn by a vectorised hash on the CPU.
//!
//! libtorch 2.11 draws CPU dropout masks with its serial Bernoulli kernel, one generator call
//! per element: in a MiniLM training step (32 queries and 64 passages of 128 tokens, so
//! attention dropout over 6 × 64 × 12 × 128 × 128 probabilities) perf put 9.5% of the step
//! there on 2 cores. Here each element's keep/drop comes from a counter-based hash of (a seed
//! drawn from torch's generator, the element's index), vectorised (AVX-512 or AVX2 when the
//! CPU has them); the mask depends on the seed alone, so runs stay reproducible from the seed
//! the trainer sets each step. The arithmetic is torch's: `x ⊙ m` with `m` either 0 or
//! `1/(1−p)`, kept with probability `1−p` (to 2^-24). Outside keyed passes, other devices and
//! dtypes use torch's dropout (on CUDA it is one fused kernel).
//!
//! Per-example masks: inside [`with_example_keys`], row `b` of every dropout input (all of
//! them put the batch first) takes its mask from `(keys[b], the call's ordinal in the forward
//! pass, the element's coordinates)` alone, so an example's masks do not depend on which other
//! examples share its batch, how long they are, or which process encodes it: a data-parallel
//! run then trains as one process does, dropout on. Coordinates, not flat offsets, key the
//! elements, so padding the batch to another length moves no mask. On CUDA the same hash
//! runs as one kernel of our own (`shim/csrc/keyed_mask.cuh`, compiled by NVRTC when first needed,
//! one byte an element, as torch keeps its own masks), the example keys copied to the device
//! once a pass; elsewhere (or if the kernel cannot run) as int32 tensor operations, about 20
//! elementwise kernels. Either way the mask is kept for backward as bool, the CPU fill's bit
//! for bit, and BERT's attention takes its math path to apply it.

mod cuda;

use crate::optim::kernels::{f32_slice_mut, multiversion};
use std::cell::RefCell;
use tch::{Device, Kind, Tensor};

thread_local! {
    /// The keyed pass running on this thread. Thread-local because the models' signatures
    /// carry only `train`; the keys never cross a plugin boundary this way (the encoder that
    /// sets them and the model code that reads them are one copy of this crate).
    static KEYED: RefCell<Option<Pass>> = const { RefCell::new(None) };
}

/// A keyed forward pass: its example keys, how many dropout calls it has made, and the keys
/// as an int64 tensor on the device that asked for them (copied once a pass).
struct Pass {
    keys: Vec<u64>,
    calls: u32,
    on_device: Option<Tensor>,
}

/// Runs `f` (a training forward pass over `keys.len()` examples) with per-example masks.
pub fn with_example_keys<R>(keys: &[u64], f: impl FnOnce() -> R) -> R {
    struct Restore(Option<Pass>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let previous = self.0.take();
            KEYED.with(|k| *k.borrow_mut() = previous);
        }
    }
    let pass = Pass { keys: keys.to_vec(), calls: 0, on_device: None };
    let _restore = Restore(KEYED.with(|k| k.borrow_mut().replace(pass)));
    f()
}

/// This call's example keys and ordinal, when a keyed pass is running. Panics (an error at
/// the plugin boundary) on a tensor the keys cannot key: its first dimension not the batch's,
/// more than two dimensions between the batch's and the last, or one of 2^16 or more. A
/// quiet fallback to unkeyed masks would make data-parallel runs differ without a word.
fn next_keyed_call(shape: &[i64]) -> Option<(Vec<u64>, u32)> {
    KEYED.with(|k| {
        let mut k = k.borrow_mut();
        let pass = k.as_mut()?;
        let middle = middle_dims(shape);
        assert!(
            shape.first() == Some(&(pass.keys.len() as i64)) && middle.len() <= 2 && middle.iter().all(|&d| d < 1 << 16),
            "keyed dropout over {} examples cannot key a tensor of shape {shape:?} (the batch first, then at most two dimensions under 65,536 before the last)",
            pass.keys.len()
        );
        pass.calls += 1;
        Some((pass.keys.clone(), pass.calls))
    })
}

/// The running pass's keys as int64 on `device`, copied there at the first call that asks.
fn keys_on(device: Device) -> Option<Tensor> {
    KEYED.with(|k| {
        let mut k = k.borrow_mut();
        let pass = k.as_mut()?;
        if pass.on_device.as_ref().is_none_or(|t| t.device() != device) {
            let words: Vec<i64> = pass.keys.iter().map(|&key| key as i64).collect();
            pass.on_device = Some(super::upload(&Tensor::from_slice(&words), device));
        }
        pass.on_device.as_ref().map(Tensor::shallow_clone)
    })
}

/// Whether a keyed pass is running (the attention of `bert` then applies dropout itself).
pub fn keyed() -> bool {
    KEYED.with(|k| k.borrow().is_some())
}

/// `x` with each element zeroed with probability `p` and the rest scaled by `1/(1−p)`, when
/// `train`; else `x` itself.
pub fn dropout(x: &Tensor, p: f64, train: bool) -> Tensor {
    if !train || p == 0.0 || x.numel() == 0 {
        return x.shallow_clone();
    }
    if !(0.0..1.0).contains(&p) {
        return x.dropout(p, train);
    }
    if let Some((keys, call)) = next_keyed_call(&x.size()) {
        let threshold = (p * (1u64 << 24) as f64).round() as u32;
        let keep = 1.0 / (1.0 - p);
        if fillable_on_cpu(x) {
            return x * keyed_mask_cpu(&x.size(), threshold, keep as f32, &keys, call);
        }
        // Elsewhere (CUDA, other dtypes) a bool mask, applied as torch's own dropout applies
        // its mask: one kernel (`native_dropout_backward`, itself differentiable) computing
        // `mask · x · scale` in float and rounding once, so a NaN or infinity dropped stays
        // NaN, as on the CPU; backward keeps the mask, 1 byte an element.
        let kept = match x.device().is_cuda().then(|| cuda::keyed_kept(&x.size(), x.device(), threshold, call)) {
            Some(Ok(kept)) => kept,
            Some(Err(e)) => {
                cuda::warn_once(&e);
                keyed_kept_tensor(x, threshold, &keys, call)
            }
            None => keyed_kept_tensor(x, threshold, &keys, call),
        };
        return Tensor::native_dropout_backward(x, &kept, keep);
    }
    if !fillable_on_cpu(x) {
        return x.dropout(p, train);
    }
    x * mask_like(x, p)
}

/// Whether [`dropout`] draws its own mask for `x` (float32 on the CPU, under 2^32 elements,
/// or any tensor in a keyed pass; the mask is made contiguous, and `x ⊙ m` broadcasts over any
/// layout); the attention of `bert` uses this to apply it to the probabilities itself.
pub fn own_mask_applies(x: &Tensor) -> bool {
    keyed() || fillable_on_cpu(x)
}

/// Whether this module's vectorised CPU fill can make `x`'s mask.
fn fillable_on_cpu(x: &Tensor) -> bool {
    x.device() == Device::Cpu && x.kind() == Kind::Float && (x.numel() as u64) < (1 << 32)
}

/// The key of one run of a keyed mask: the example's key, the call's ordinal and the run's
/// coordinates `r` (every dimension but the batch's and the last, each in 16 bits). The last
/// dimension's index keys the elements of a run.
fn run_key(key: u64, call: u32, r: u32) -> (u32, u32) {
    let call_key = mix((key as u32) ^ call.wrapping_mul(0x9e37_79b9));
    (mix(call_key ^ mix(r)), (key >> 32) as u32)
}

/// Run coordinates of a shape's middle dimensions (between the batch and the last), row-major.
fn middle_dims(shape: &[i64]) -> &[i64] {
    if shape.len() <= 2 {
        &[]
    } else {
        &shape[1..shape.len() - 1]
    }
}

/// The keyed mask filled run by run on the CPU (the vectorised fill of [`seeded_mask`]).
fn keyed_mask_cpu(shape: &[i64], threshold: u32, keep: f32, keys: &[u64], call: u32) -> Tensor {
    let mask = Tensor::empty(shape, (Kind::Float, Device::Cpu));
    let n = if shape.len() >= 2 { *shape.last().unwrap() as usize } else { 1 };
    let middle = middle_dims(shape);
    let runs: usize = middle.iter().map(|&d| d as usize).product();
    // SAFETY: a fresh tensor no one else holds.
    let out = unsafe { f32_slice_mut(&mask) }.expect("a float32 CPU tensor");
    let mut coords = vec![0i64; middle.len()];
    for (b, &key) in keys.iter().enumerate() {
        coords.iter_mut().for_each(|c| *c = 0);
        for run in 0..runs {
            let r = coords.iter().fold(0u32, |r, &c| r.wrapping_shl(16) ^ c as u32);
            let (k1, k2) = run_key(key, call, r);
            let start = (b * runs + run) * n;
            fill_block(&mut out[start..start + n], 0, k1, k2, threshold, keep);
            // The next run's coordinates (row-major).
            for (c, &d) in coords.iter_mut().zip(middle).rev() {
                *c += 1;
                if *c < d {
                    break;
                }
                *c = 0;
            }
        }
    }
    mask
}

/// Which elements the keyed mask keeps (`true`), computed with tensor operations on `x`'s
/// device: the same bits as [`keyed_mask_cpu`]. The words are int32 (4 bytes an element; the
/// mixer's multiplications wrap modulo 2^32 as the CPU fill's do, and each right shift is made
/// logical by masking off the bits an arithmetic shift copies from the sign).
fn keyed_kept_tensor(x: &Tensor, threshold: u32, keys: &[u64], call: u32) -> Tensor {
    let shape = x.size();
    let (device, int) = (x.device(), (Kind::Int, x.device()));
    let middle = middle_dims(&shape);
    // Views that put a vector along one dimension of x's rank.
    let along = |dim: usize, t: Tensor| {
        let mut view = vec![1i64; shape.len()];
        view[dim] = t.size()[0];
        t.view(view.as_slice())
    };
    // Each run's coordinates folded as in the CPU fill: [1, middle..., 1].
    let mut r = Tensor::zeros([1], int);
    for (i, &d) in middle.iter().enumerate() {
        r = r.bitwise_left_shift_tensor_scalar(16).bitwise_xor_tensor(&along(i + 1, Tensor::arange(d, int)));
    }
    let words = |f: fn(u64) -> u32| Tensor::from_slice(&keys.iter().map(|&k| f(k) as i32).collect::<Vec<i32>>()).to_device(device);
    let lo = along(0, words(|k| k as u32));
    let hi = along(0, words(|k| (k >> 32) as u32));
    let call_key = tmix(lo.bitwise_xor(call.wrapping_mul(0x9e37_79b9) as i32 as i64));
    let k1 = tmix(call_key.bitwise_xor_tensor(&tmix(r)));
    let last = shape.len() - 1;
    let n = if shape.len() >= 2 { shape[last] } else { 1 };
    let j = along(last, Tensor::arange(n, int));
    // The full-size words: one int32 tensor of x's shape, mixed in place (with one temporary
    // at a time), then compared.
    let mut bits = tmix(tmix(j.bitwise_xor_tensor(&k1)).bitwise_xor_tensor_(&hi));
    let _ = logical_shift_right_(&mut bits, 8);
    bits.ge(threshold as i64)
}

/// `x ← x >> by` on 32-bit words held in int32, without the sign's copies.
fn logical_shift_right_(x: &mut Tensor, by: i64) -> Tensor {
    let _ = x.bitwise_right_shift_tensor_scalar_(by);
    x.bitwise_and_((1i64 << (32 - by)) - 1)
}

/// [`mix`] on 32-bit words held in an int32 tensor, in place.
fn tmix(mut x: Tensor) -> Tensor {
    let xor_shift = |x: &mut Tensor, by: i64| {
        let mut shifted = x.bitwise_right_shift_tensor_scalar(by);
        let _ = shifted.bitwise_and_((1i64 << (32 - by)) - 1);
        let _ = x.bitwise_xor_tensor_(&shifted);
    };
    xor_shift(&mut x, 16);
    let _ = x.g_mul_scalar_(0x7feb_352d_u32 as i32 as i64);
    xor_shift(&mut x, 15);
    let _ = x.g_mul_scalar_(0x846c_a68b_u32 as i32 as i64);
    xor_shift(&mut x, 16);
    x
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
    mix(mix(i ^ k1) ^ k2) >> 8
}

/// Wellons' lowbias32 integer mixer.
#[inline(always)]
fn mix(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^ (x >> 16)
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

    /// Row `b` of a keyed mask for `key` in a batch of `shape`, cut to `keep` (each middle and
    /// last dimension's leading extent).
    fn keyed_row(shape: &[i64], keys: &[u64], b: usize, keep: &[i64]) -> Tensor {
        let m = keyed_mask_cpu(shape, (0.3 * (1u64 << 24) as f64) as u32, 1.0 / 0.7, keys, 1);
        let mut row = m.get(b as i64);
        for (d, &n) in keep.iter().enumerate() {
            row = row.narrow(d as i64, 0, n);
        }
        row
    }

    #[test]
    fn a_keyed_row_ignores_its_batch_companions_and_padding() {
        // Hidden states [B, L, D]: the example keyed 7 in a batch of three padded to 5 tokens
        // and in a batch of two padded to 9 has the same mask over its first 5 tokens.
        let a = keyed_row(&[3, 5, 16], &[1, 7, 2], 1, &[5, 16]);
        let b = keyed_row(&[2, 9, 16], &[7, 3], 0, &[5, 16]);
        assert!(a.equal(&b));
        // Attention probabilities [B, heads, L, L].
        let a = keyed_row(&[2, 3, 5, 5], &[1, 7], 1, &[3, 5, 5]);
        let b = keyed_row(&[1, 3, 9, 9], &[7], 0, &[3, 5, 5]);
        assert!(a.equal(&b));
        // Another key, another mask; the kept share is 1 − p.
        let c = keyed_row(&[1, 3, 9, 9], &[8], 0, &[3, 5, 5]);
        assert!(!a.equal(&c));
        let big = keyed_mask_cpu(&[4, 64, 128], (0.3 * (1u64 << 24) as f64) as u32, 1.0 / 0.7, &[1, 2, 3, 4], 1);
        let kept = big.ne(0.0).to_kind(Kind::Double).mean(Kind::Double).double_value(&[]);
        assert!((kept - 0.7).abs() < 5.0 * (0.21f64 / 32768.0).sqrt(), "kept {kept}");
    }

    #[test]
    fn the_tensor_form_draws_the_cpu_fill_s_masks() {
        // Float64 is not filled on the CPU, so it takes the tensor form (the path other
        // devices and dtypes take).
        for shape in [vec![5i64], vec![3, 40], vec![2, 7, 33], vec![2, 3, 6, 6]] {
            let keys = [u64::MAX, 0, 0x1234_5678_9abc_def0, 42, 9][..shape[0] as usize].to_vec();
            for call in [1, 2, 1000] {
                let cpu = keyed_mask_cpu(&shape, (0.25 * (1u64 << 24) as f64) as u32, 1.0 / 0.75, &keys, call);
                let x = Tensor::ones(shape.as_slice(), (Kind::Double, Device::Cpu)).set_requires_grad(true);
                let kept = keyed_kept_tensor(&x, (0.25 * (1u64 << 24) as f64) as u32, &keys, call);
                assert!(kept.equal(&cpu.ne(0.0)), "shape {shape:?} call {call}");
                // Through `dropout` in a keyed pass: the kept elements scaled, the rest 0.
                let y = with_example_keys(&keys, || {
                    (1..call).for_each(|_| drop(next_keyed_call(&shape)));
                    dropout(&x, 0.25, true)
                });
                assert!(y.to_kind(Kind::Float).equal(&cpu), "shape {shape:?} call {call}: dropout's values");
                y.sum(Kind::Double).backward();
                assert!(x.grad().to_kind(Kind::Float).equal(&cpu), "shape {shape:?} call {call}: d/dx is the mask");
            }
        }
    }

    /// The shapes and calls the keyed-mask tests run over: every rank the keys take, a
    /// hidden-state and an attention shape, and batches whose keys differ in either half.
    fn keyed_cases() -> Vec<(Vec<i64>, Vec<u64>, u32)> {
        let keys = [u64::MAX, 0, 0x1234_5678_9abc_def0, 42, 9, 1 << 40, 7, 0xdead_beef];
        let shapes = [vec![5i64], vec![3, 40], vec![2, 7, 33], vec![2, 3, 6, 6], vec![4, 64, 128], vec![2, 12, 17, 17], vec![8, 1, 300]];
        let mut out = Vec::new();
        for shape in shapes {
            for call in [1, 2, 1000] {
                out.push((shape.clone(), keys[..shape[0] as usize].to_vec(), call));
            }
        }
        out
    }

    #[test]
    fn the_cuda_kernel_s_arithmetic_draws_the_cpu_fill_s_masks() {
        // shim/csrc/keyed_mask.cuh compiled for the host: the element function the GPU runs.
        for (shape, keys, call) in keyed_cases() {
            for p in [0.1, 0.5] {
                let threshold = (p * (1u64 << 24) as f64).round() as u32;
                let cpu = keyed_mask_cpu(&shape, threshold, 1.0 / (1.0 - p as f32), &keys, call);
                assert!(cuda::host_mask(&shape, &keys, threshold, call).equal(&cpu.ne(0.0)), "shape {shape:?} call {call} p {p}");
            }
        }
    }

    #[test]
    fn nvrtc_compiles_the_cuda_kernel() {
        // No GPU is needed to compile; a libtorch without CUDA has no NVRTC to compile with.
        if !cuda::torch_is_cuda_build() {
            eprintln!("skipped: this libtorch is not a CUDA build");
            return;
        }
        // Ampere, Hopper (the machines gpu_check runs on) and one NVRTC may not know exactly.
        for (major, minor) in [(8, 0), (9, 0), (12, 9)] {
            cuda::compile_check(major, minor).unwrap_or_else(|e| panic!("sm_{major}{minor}: {e:#}"));
        }
    }

    /// On a GPU only (bench/gpu_check.sh runs it there): the kernel's masks through
    /// `dropout` in a keyed pass, against the CPU fill, bit for bit.
    #[test]
    fn on_cuda_the_kernel_draws_the_cpu_fill_s_masks() {
        if !tch::Cuda::is_available() {
            eprintln!("skipped: no CUDA device");
            return;
        }
        let device = Device::Cuda(0);
        for (shape, keys, call) in keyed_cases() {
            let threshold = (0.25 * (1u64 << 24) as f64) as u32;
            let cpu = keyed_mask_cpu(&shape, threshold, 1.0 / 0.75, &keys, call);
            let gpu = with_example_keys(&keys, || {
                (1..call).for_each(|_| drop(next_keyed_call(&shape)));
                assert!(next_keyed_call(&shape).is_some());
                cuda::keyed_kept(&shape, device, threshold, call).expect("the kernel runs")
            });
            assert!(gpu.to_device(Device::Cpu).equal(&cpu.ne(0.0)), "shape {shape:?} call {call}");
            let x = Tensor::ones(shape.as_slice(), (Kind::Float, device)).set_requires_grad(true);
            let y = with_example_keys(&keys, || {
                (1..call).for_each(|_| drop(next_keyed_call(&shape)));
                dropout(&x, 0.25, true)
            });
            assert!(y.to_device(Device::Cpu).equal(&cpu), "shape {shape:?} call {call}: dropout's values");
            y.sum(Kind::Float).backward();
            assert!(x.grad().to_device(Device::Cpu).equal(&cpu), "shape {shape:?} call {call}: d/dx is the mask");
        }
    }

    #[test]
    fn each_call_of_a_keyed_pass_draws_anew_and_the_pass_ends_cleanly() {
        let x = Tensor::ones([2, 4, 32], (Kind::Float, Device::Cpu));
        let (first, second) = with_example_keys(&[5, 6], || (dropout(&x, 0.5, true), dropout(&x, 0.5, true)));
        assert!(!first.equal(&second), "the second call has its own masks");
        // A tensor whose first dimension is not the batch's cannot be keyed: said, not drawn
        // unkeyed in silence.
        let other_batch = std::panic::catch_unwind(|| with_example_keys(&[5, 6], || dropout(&Tensor::ones([3, 4], (Kind::Float, Device::Cpu)), 0.5, true)));
        let message = other_batch.err().and_then(|e| e.downcast_ref::<String>().cloned()).expect("a panic with a message");
        assert!(message.contains("cannot key a tensor of shape [3, 4]"), "{message}");
        let again = with_example_keys(&[6], || dropout(&x.narrow(0, 0, 1), 0.5, true));
        assert!(again.equal(&first.narrow(0, 1, 1)), "example 6's first mask again");
        assert!(!keyed(), "the pass's keys are gone after it");
        // Panics inside a pass leave no keys behind either.
        let _ = std::panic::catch_unwind(|| with_example_keys(&[1], || panic!("inside")));
        assert!(!keyed());
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
