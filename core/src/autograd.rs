//! Autograd controls libtorch has and tch does not wrap (`shim/csrc/autograd.cpp`): clearing a
//! gradient, and bf16 autocast on the CPU as well as CUDA.

use anyhow::{bail, Result};
use std::ffi::{c_char, c_void, CStr};
use std::marker::PhantomData;
use tch::{Device, Tensor};

extern "C" {
    fn rak_clear_grad(t: *mut c_void, err: *mut c_char, len: usize) -> i32;
    fn rak_autocast_enter(device: i32, was_on: *mut i32, was_dtype: *mut i32, err: *mut c_char, len: usize) -> i32;
    fn rak_autocast_exit(device: i32, was_on: i32, was_dtype: i32, err: *mut c_char, len: usize) -> i32;
}

/// The message a C++ shim wrote into `err` (also the c10d shim's, `dist.rs`).
pub(crate) fn message(err: &[c_char]) -> String {
    // SAFETY: the C++ side always NUL-terminates within the buffer (or leaves it zeroed).
    unsafe { CStr::from_ptr(err.as_ptr()) }.to_string_lossy().into_owned()
}

/// Runs one call into a C++ shim that returns 1 on success, else 0 with a message in the
/// buffer it is given: that message as an error naming `what`.
pub(crate) fn shim_call(what: &str, f: impl FnOnce(*mut c_char, usize) -> i32) -> Result<()> {
    let mut err = [0 as c_char; 4096];
    if f(err.as_mut_ptr(), err.len()) != 1 {
        bail!("{what}: {}", message(&err));
    }
    Ok(())
}

/// Drop `t`'s gradient (Python's `p.grad = None`): after the next backward, a parameter the
/// graph did not reach has an undefined gradient, not a zero one, so optimizers skip it.
pub fn clear_grad(t: &Tensor) -> Result<()> {
    // SAFETY: `t` is a live tensor handle; the call only resets its gradient slot.
    shim_call("cannot clear a gradient", |err, len| unsafe { rak_clear_grad(t.as_ptr() as *mut c_void, err, len) })
}

/// A bf16 autocast region on one device type for the current thread, as
/// `torch.autocast(device, dtype=torch.bfloat16)`: matrix products run in bf16 on float32
/// weights, reductions and softmax stay float32, and gradients reach the float32 weights.
/// Left when dropped; not `Send` (autocast state is per thread).
pub struct Autocast {
    device: i32,
    was_on: i32,
    was_dtype: i32,
    _thread: PhantomData<*const ()>,
}

impl Autocast {
    pub fn bf16(device: Device) -> Result<Self> {
        let device = match device {
            Device::Cpu => 0,
            Device::Cuda(_) => 1,
            other => bail!("bf16 autocast runs on the CPU or CUDA, not {other:?}"),
        };
        let (mut was_on, mut was_dtype) = (0, 0);
        // SAFETY: thread-local flags on the C++ side; the out-pointers are live locals.
        shim_call("cannot enter bf16 autocast", |err, len| unsafe { rak_autocast_enter(device, &mut was_on, &mut was_dtype, err, len) })?;
        Ok(Autocast { device, was_on, was_dtype, _thread: PhantomData })
    }
}

impl Drop for Autocast {
    fn drop(&mut self) {
        let mut err = [0 as c_char; 512];
        // SAFETY: as in `bf16`; restoring flags cannot fail in practice, and a drop cannot
        // report it anyway.
        unsafe { rak_autocast_exit(self.device, self.was_on, self.was_dtype, err.as_mut_ptr(), err.len()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Kind;

    #[test]
    fn a_cleared_gradient_is_undefined_until_the_next_backward() {
        let w = Tensor::from_slice(&[1.0f32, 2.0]).set_requires_grad(true);
        (&w * 3.0).sum(Kind::Float).backward();
        assert!(w.grad().defined());
        clear_grad(&w).unwrap();
        assert!(!w.grad().defined());
        (&w * 2.0).sum(Kind::Float).backward();
        assert_eq!(Vec::<f32>::try_from(w.grad()).unwrap(), vec![2.0, 2.0], "not accumulated onto the old gradient");
    }

    #[test]
    fn cpu_autocast_runs_matrix_products_in_bf16_and_leaves_weights_and_gradients_f32() {
        let w = Tensor::randn([4, 3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let x = Tensor::randn([2, 4], (Kind::Float, Device::Cpu));
        let y = {
            let _a = Autocast::bf16(Device::Cpu).unwrap();
            let inner = {
                let _b = Autocast::bf16(Device::Cpu).unwrap();
                x.matmul(&w)
            };
            assert_eq!(inner.kind(), Kind::BFloat16);
            // Still on after the inner region ends.
            x.matmul(&w)
        };
        assert_eq!(y.kind(), Kind::BFloat16);
        assert_eq!(x.matmul(&w).kind(), Kind::Float, "off after the outer region");
        y.to_kind(Kind::Float).sum(Kind::Float).backward();
        assert_eq!(w.grad().kind(), Kind::Float);
        assert_eq!(w.kind(), Kind::Float);
    }
}
