//! libtorch's multi-tensor operators (`shim/csrc/multi_tensor.cpp`; tch binds no operator on
//! tensor lists): what the optimizer step runs off the CPU's fused loops. On a GPU each call is
//! a few kernel launches for all the tensors it is given, where one tch operator per parameter
//! is a launch each: AdamW's dozen operators, clipping's three and the non-finite check's
//! three, times 101 parameters in a MiniLM, 199 in a BERT-base, came to thousands of launches
//! a step (issue 33). Every list must be on one device and of one dtype; callers group them.

use crate::autograd::shim_call as call;
use anyhow::{ensure, Result};
use std::ffi::{c_char, c_void};
use tch::{Device, Kind, Tensor};

extern "C" {
    fn rak_fused_adamw(
        params: *mut *mut c_void,
        grads: *mut *mut c_void,
        exp_avgs: *mut *mut c_void,
        exp_avg_sqs: *mut *mut c_void,
        steps: *mut *mut c_void,
        n: i32,
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
        err: *mut c_char,
        len: usize,
    ) -> i32;
    fn rak_foreach_add_scalar_(ts: *mut *mut c_void, n: i32, scalar: f64, err: *mut c_char, len: usize) -> i32;
    fn rak_foreach_add_(a: *mut *mut c_void, b: *mut *mut c_void, n: i32, err: *mut c_char, len: usize) -> i32;
    fn rak_foreach_copy_(dst: *mut *mut c_void, src: *mut *mut c_void, n: i32, err: *mut c_char, len: usize) -> i32;
    fn rak_foreach_mul_tensor_(ts: *mut *mut c_void, n: i32, factor: *mut c_void, err: *mut c_char, len: usize) -> i32;
    fn rak_foreach_norm(ts: *mut *mut c_void, n: i32, out: *mut c_void, err: *mut c_char, len: usize) -> i32;
    fn rak_foreach_non_finite(ts: *mut *mut c_void, n: i32, found: *mut c_void, err: *mut c_char, len: usize) -> i32;
}

fn handle(t: &Tensor) -> *mut c_void {
    t.as_ptr() as *mut c_void
}

fn handles(ts: &[&Tensor]) -> Vec<*mut c_void> {
    ts.iter().map(|t| handle(t)).collect()
}

/// `items` grouped by key, groups in the order their keys first appear, items in theirs
/// (the keys are few: a device and a dtype, and for AdamW a learning rate and a decay).
pub fn grouped<K: PartialEq, T>(items: impl IntoIterator<Item = (K, T)>) -> Vec<(K, Vec<T>)> {
    let mut groups: Vec<(K, Vec<T>)> = Vec::new();
    for (key, item) in items {
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, group)) => group.push(item),
            None => groups.push((key, vec![item])),
        }
    }
    groups
}

/// One device and one dtype for a list (what the operators' fast paths need, and what their
/// one-element outputs are made on). `None` for an empty list.
fn placement(ts: &[&Tensor]) -> Result<Option<(Device, Kind)>> {
    let Some(first) = ts.first() else { return Ok(None) };
    let (device, kind) = (first.device(), first.kind());
    ensure!(ts.iter().all(|t| t.device() == device && t.kind() == kind), "a multi-tensor operation over tensors of several devices or dtypes");
    Ok(Some((device, kind)))
}

/// AdamW's update of parameters that share a learning rate and a weight decay, as
/// `torch.optim.AdamW(fused=True)`: `steps` are their step counts as float32 scalars on their
/// device, already advanced to this step.
pub struct FusedAdamW<'a> {
    pub params: Vec<&'a Tensor>,
    pub grads: Vec<&'a Tensor>,
    pub exp_avgs: Vec<&'a Tensor>,
    pub exp_avg_sqs: Vec<&'a Tensor>,
    pub steps: Vec<&'a Tensor>,
}

impl FusedAdamW<'_> {
    pub fn run(&self, lr: f64, beta1: f64, beta2: f64, weight_decay: f64, eps: f64) -> Result<()> {
        let n = self.params.len();
        ensure!([self.grads.len(), self.exp_avgs.len(), self.exp_avg_sqs.len(), self.steps.len()].iter().all(|&m| m == n), "fused AdamW: lists of different lengths");
        placement(&self.params)?;
        let (mut p, mut g, mut m, mut v, mut s) = (handles(&self.params), handles(&self.grads), handles(&self.exp_avgs), handles(&self.exp_avg_sqs), handles(&self.steps));
        // SAFETY: live tensor handles, each list `n` long, for the length of the call.
        call("fused AdamW", |err, len| unsafe {
            rak_fused_adamw(p.as_mut_ptr(), g.as_mut_ptr(), m.as_mut_ptr(), v.as_mut_ptr(), s.as_mut_ptr(), n as i32, lr, beta1, beta2, weight_decay, eps, err, len)
        })
    }
}

/// `t += scalar` for each tensor.
pub fn add_scalar_(ts: &[&Tensor], scalar: f64) -> Result<()> {
    placement(ts)?;
    let mut h = handles(ts);
    // SAFETY: live tensor handles for the length of the call.
    call("foreach add", |err, len| unsafe { rak_foreach_add_scalar_(h.as_mut_ptr(), h.len() as i32, scalar, err, len) })
}

/// `a[i] += b[i]` for each pair.
pub fn add_(a: &[&Tensor], b: &[&Tensor]) -> Result<()> {
    ensure!(a.len() == b.len(), "foreach add: {} tensors and {}", a.len(), b.len());
    placement(a)?;
    placement(b)?;
    let (mut x, mut y) = (handles(a), handles(b));
    // SAFETY: live tensor handles, both lists as long, for the length of the call.
    call("foreach add", |err, len| unsafe { rak_foreach_add_(x.as_mut_ptr(), y.as_mut_ptr(), x.len() as i32, err, len) })
}

/// Copies of `ts` (new tensors of their shapes, filled by one multi-tensor copy).
pub fn copies(ts: &[&Tensor]) -> Result<Vec<Tensor>> {
    placement(ts)?;
    let out: Vec<Tensor> = ts.iter().map(|t| t.empty_like()).collect();
    let (mut dst, mut src) = (out.iter().map(handle).collect::<Vec<_>>(), handles(ts));
    // SAFETY: live tensor handles, both lists as long, for the length of the call.
    call("foreach copy", |err, len| unsafe { rak_foreach_copy_(dst.as_mut_ptr(), src.as_mut_ptr(), dst.len() as i32, err, len) })?;
    Ok(out)
}

/// `t *= factor` for each tensor; `factor` is a one-element tensor on their device.
pub fn mul_(ts: &[&Tensor], factor: &Tensor) -> Result<()> {
    placement(ts)?;
    let mut h = handles(ts);
    // SAFETY: live tensor handles for the length of the call.
    call("foreach mul", |err, len| unsafe { rak_foreach_mul_tensor_(h.as_mut_ptr(), h.len() as i32, handle(factor), err, len) })
}

/// Each tensor's L2 norm, as a float32 vector on their device (`torch._foreach_norm`).
pub fn norms(ts: &[&Tensor]) -> Result<Tensor> {
    let Some((device, _)) = placement(ts)? else { return Ok(Tensor::zeros([0], (Kind::Float, Device::Cpu))) };
    let out = Tensor::empty([ts.len() as i64], (Kind::Float, device));
    let mut h = handles(ts);
    // SAFETY: live tensor handles for the length of the call; `out` holds one slot each.
    call("foreach norm", |err, len| unsafe { rak_foreach_norm(h.as_mut_ptr(), h.len() as i32, handle(&out), err, len) })?;
    Ok(out)
}

/// Whether any of `ts` holds a NaN or an infinity, as a one-element float32 tensor on their
/// device (1 if so): one pass over all of them, read with one copy to the host.
pub fn any_non_finite(ts: &[&Tensor]) -> Result<Tensor> {
    let Some((device, _)) = placement(ts)? else { return Ok(Tensor::zeros([1], (Kind::Float, Device::Cpu))) };
    let found = Tensor::zeros([1], (Kind::Float, device));
    let mut h = handles(ts);
    // SAFETY: live tensor handles for the length of the call.
    call("foreach non-finite check", |err, len| unsafe { rak_foreach_non_finite(h.as_mut_ptr(), h.len() as i32, handle(&found), err, len) })?;
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refs(ts: &[Tensor]) -> Vec<&Tensor> {
        ts.iter().collect()
    }

    #[test]
    fn the_list_operators_do_what_their_per_tensor_forms_do() {
        tch::manual_seed(3);
        let a: Vec<Tensor> = [vec![4i64, 5], vec![7], vec![2, 3, 2]].iter().map(|s| Tensor::randn(s.as_slice(), (Kind::Float, Device::Cpu))).collect();
        let b: Vec<Tensor> = a.iter().map(|t| t.randn_like()).collect();
        let c = copies(&refs(&a)).unwrap();
        assert!(c.iter().zip(&a).all(|(x, y)| x.equal(y) && x.data_ptr() != y.data_ptr()), "copies, not views");
        add_(&refs(&c), &refs(&b)).unwrap();
        assert!(c.iter().zip(a.iter().zip(&b)).all(|(x, (y, z))| x.equal(&(y + z))));
        add_scalar_(&refs(&c), 1.0).unwrap();
        mul_(&refs(&c), &Tensor::from(0.5f32)).unwrap();
        assert!(c.iter().zip(a.iter().zip(&b)).all(|(x, (y, z))| x.allclose(&((y + z + 1.0) * 0.5), 1e-6, 1e-6, false)));
        let n = norms(&refs(&a)).unwrap();
        let want = Tensor::stack(&a.iter().map(|t| t.norm()).collect::<Vec<_>>(), 0);
        assert!(n.allclose(&want, 1e-6, 1e-6, false), "{n:?} {want:?}");
        assert_eq!(any_non_finite(&refs(&a)).unwrap().double_value(&[0]), 0.0);
        for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            let x = copies(&refs(&a)).unwrap();
            let _ = x[2].get(1).get(0).fill_(bad);
            assert_eq!(any_non_finite(&refs(&x)).unwrap().double_value(&[0]), 1.0, "{bad}");
            assert!(x[0].equal(&a[0]) && x[1].equal(&a[1]), "the check leaves the values as they were");
        }
        // Lists over several dtypes are refused, not half done.
        let mixed = [a[0].shallow_clone(), a[1].to_kind(Kind::Double)];
        assert!(norms(&refs(&mixed)).is_err());
    }
}
