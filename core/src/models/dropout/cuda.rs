//! The keyed mask as one CUDA kernel of our own: `shim/csrc/keyed_mask.cuh`, compiled by NVRTC the
//! first time a device needs it and launched on torch's current stream (`shim/csrc/cuda_kernels.cpp`).
//! The same file compiled for the host is the reference [`host_mask`] the tests hold to the CPU
//! fill, so the arithmetic a GPU runs is the arithmetic tested here.

use super::{keys_on, middle_dims};
use crate::autograd::shim_call;
use anyhow::{bail, Context, Result};
use std::ffi::{c_char, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use tch::{Device, Kind, Tensor};

/// The kernel's source, compiled at run time (NUL-terminated for the C side).
const SOURCE: &str = rak_torch_shim::KEYED_MASK_CUH;

extern "C" {
    fn rak_keyed_mask_cuda(out: *mut c_void, keys: *mut c_void, m1: u32, m2: u32, n: u32, call: u32, threshold: u32, source: *const c_char, err: *mut c_char, len: usize) -> i32;
}

// What the tests call: the NVRTC compile without a GPU, and the kernel's arithmetic on the host.
#[cfg(test)]
extern "C" {
    fn rak_keyed_mask_compile(major: i32, minor: i32, source: *const c_char, err: *mut c_char, len: usize) -> i32;
    fn rak_torch_is_cuda_build() -> i32;
    fn rak_keyed_mask_host(out: *mut u8, keys: *const u64, b: u32, m1: u32, m2: u32, n: u32, call: u32, threshold: u32);
}

fn source() -> *const c_char {
    SOURCE.as_ptr() as *const c_char
}

/// Set once the kernel has failed in this process: the tensor form then draws every mask,
/// without compiling or loading again at each call.
static FAILED: AtomicBool = AtomicBool::new(false);

/// A shape as the kernel reads it, `[B, m1, m2, n]`: the middle dimensions right-aligned (a
/// missing one is 1, its coordinate 0, as the CPU fill folds them), `n` the last (1 for `[B]`).
fn kernel_dims(shape: &[i64]) -> (u32, u32, u32) {
    let middle = middle_dims(shape);
    let n = if shape.len() >= 2 { shape[shape.len() - 1] } else { 1 };
    let (m1, m2) = match middle {
        [] => (1, 1),
        [m] => (1, *m),
        [a, b] => (*a, *b),
        _ => unreachable!("next_keyed_call allows at most two middle dimensions"),
    };
    (m1 as u32, m2 as u32, n as u32)
}

/// Which elements of a tensor of `shape` on `device` (CUDA) the running pass's call `call`
/// keeps, as a contiguous bool tensor there. After a first failure, every call fails at once.
pub(super) fn keyed_kept(shape: &[i64], device: Device, threshold: u32, call: u32) -> Result<Tensor> {
    if FAILED.load(Ordering::Relaxed) {
        bail!("it failed earlier in this process");
    }
    // A shape the kernel does not take is refused for this call alone. Its threads step
    // through a run by their count, so a run must stay well inside 32 bits; one grid holds
    // under 2^31 runs.
    let n = if shape.len() >= 2 { shape[shape.len() - 1] } else { 1 };
    let runs = shape.iter().product::<i64>() / n.max(1);
    if n >= 1 << 31 || runs >= 1 << 31 {
        bail!("a tensor of shape {shape:?} is beyond one grid of it");
    }
    let keys = keys_on(device).context("no keyed pass is running")?;
    let out = Tensor::empty(shape, (Kind::Bool, device));
    let (m1, m2, n) = kernel_dims(shape);
    // SAFETY: live tensor handles and a NUL-terminated source for the length of the call; the
    // C++ side checks the tensors' device, dtype, layout and sizes before launching.
    let launched = shim_call("keyed dropout's CUDA kernel", |err, len| unsafe {
        rak_keyed_mask_cuda(out.as_ptr() as *mut c_void, keys.as_ptr() as *mut c_void, m1, m2, n, call, threshold, source(), err, len)
    });
    if launched.is_err() {
        // NVRTC or the driver failed: not worth trying again at every call.
        FAILED.store(true, Ordering::Relaxed);
    }
    launched.map(|()| out)
}

/// Says once a process that the kernel cannot run, and that the tensor form draws the same
/// masks instead (slower).
pub(super) fn warn_once(e: &anyhow::Error) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| eprintln!("warning: keyed dropout's CUDA kernel cannot run ({e:#}); its masks come from tensor operations instead (the same masks, slower)"));
}

/// Compiles the kernel with NVRTC for compute capability `major.minor`, no GPU needed.
#[cfg(test)]
pub fn compile_check(major: i32, minor: i32) -> Result<()> {
    // SAFETY: a NUL-terminated source and an error buffer, for the length of the call.
    shim_call("NVRTC", |err, len| unsafe { rak_keyed_mask_compile(major, minor, source(), err, len) })
}

/// Whether this libtorch is a CUDA build (so NVRTC comes with it), GPU or not.
#[cfg(test)]
pub fn torch_is_cuda_build() -> bool {
    // SAFETY: no arguments; it only looks for a file.
    unsafe { rak_torch_is_cuda_build() == 1 }
}

/// The kernel's arithmetic run on the host: which elements of a tensor of `shape` the keys'
/// call `call` keeps, as a bool CPU tensor.
#[cfg(test)]
pub(super) fn host_mask(shape: &[i64], keys: &[u64], threshold: u32, call: u32) -> Tensor {
    let (m1, m2, n) = kernel_dims(shape);
    let mut out = vec![0u8; keys.len() * (m1 * m2 * n) as usize];
    // SAFETY: `out` holds B·m1·m2·n bytes and `keys` B keys, as the loop writes and reads.
    unsafe { rak_keyed_mask_host(out.as_mut_ptr(), keys.as_ptr(), keys.len() as u32, m1, m2, n, call, threshold) };
    Tensor::from_slice(&out).view(shape).to_kind(Kind::Bool)
}
