//! Inference GEMMs through libtorch's oneDNN kernels (see `shim/csrc/onednn.cpp` for why).
//!
//! [`Dense`] is a linear layer's weight packed once for a forward pass; its `forward` fuses the
//! bias and an activation or residual add into the GEMM. Only used where gradients are off,
//! on CPU, in f32: the operators have no backward, and on GPU cuBLAS is the right tool.
//! `RAK_ONEDNN=0` turns the path off (for A/B timing and bug isolation). So does a libtorch
//! whose operators have other signatures than `SCHEMAS` below, with a one-time warning.

use anyhow::{anyhow, Result};
use std::ffi::{c_char, c_void, CStr};
use std::sync::OnceLock;
use tch::{Device, Kind, Tensor};
use torch_sys::C_tensor;

extern "C" {
    fn rak_onednn_available() -> i32;
    fn rak_grad_enabled() -> i32;
    fn rak_onednn_check_schema(
        name: *const c_char,
        overload: *const c_char,
        expected: *const *const c_char,
        n: usize,
        err: *mut c_char,
        len: usize,
    ) -> i32;
    #[cfg(test)]
    fn rak_onednn_test_throw(err: *mut c_char, len: usize) -> i32;
    fn rak_onednn_pack(weight: *const c_void, rows: i64, err: *mut c_char, len: usize) -> *mut c_void;
    fn rak_onednn_linear(
        x: *const c_void,
        packed: *const c_void,
        bias: *const c_void,
        attr: *const c_char,
        algorithm: *const c_char,
        err: *mut c_char,
        len: usize,
    ) -> *mut c_void;
    fn rak_onednn_linear_add(
        x: *const c_void,
        other: *const c_void,
        packed: *const c_void,
        bias: *const c_void,
        err: *mut c_char,
        len: usize,
    ) -> *mut c_void;
}

/// An operator the shim calls and the arguments its hand-built stack supplies, in order, as
/// `type name` the way libtorch writes its schema.
struct Schema {
    name: &'static CStr,
    /// "" for the default overload.
    overload: &'static CStr,
    args: &'static [&'static CStr],
}

/// The signatures the stacks in `shim/csrc/onednn.cpp` are built for (libtorch 2.11). These are
/// private operators, so a libtorch that changes one is caught here rather than handed a
/// stack of the wrong shape.
const SCHEMAS: [Schema; 3] = [
    Schema {
        name: c"mkldnn::_reorder_linear_weight",
        overload: c"",
        args: &[c"Tensor self", c"int? batch_size"],
    },
    Schema {
        name: c"mkldnn::_linear_pointwise",
        overload: c"",
        args: &[c"Tensor X", c"Tensor W", c"Tensor? B", c"str attr", c"Scalar?[] scalars", c"str? algorithm"],
    },
    Schema {
        name: c"mkldnn::_linear_pointwise",
        overload: c"binary",
        args: &[c"Tensor X", c"Tensor other", c"Tensor W", c"Tensor? B", c"str attr"],
    },
];

/// Whether this libtorch's operator `s.name` has the signature `s` describes; if not, the
/// error says what differs.
fn check_schema(s: &Schema) -> Result<()> {
    let expected: Vec<*const c_char> = s.args.iter().map(|a| a.as_ptr()).collect();
    let mut err = [0 as c_char; 1024];
    let ok = unsafe {
        rak_onednn_check_schema(
            s.name.as_ptr(),
            s.overload.as_ptr(),
            expected.as_ptr(),
            expected.len(),
            err.as_mut_ptr(),
            err.len(),
        )
    };
    if ok != 0 {
        return Ok(());
    }
    let msg = unsafe { CStr::from_ptr(err.as_ptr()) }.to_string_lossy();
    Err(anyhow!("oneDNN operator {msg}"))
}

/// All of [`SCHEMAS`] checked, once per process.
fn schemas_checked() -> Result<()> {
    static CHECKED: OnceLock<Result<(), String>> = OnceLock::new();
    CHECKED
        .get_or_init(|| SCHEMAS.iter().try_for_each(check_schema).map_err(|e| format!("{e:#}")))
        .clone()
        .map_err(|e| anyhow!(e))
}

/// Products with fewer input rows stay on libtorch's `linear`: weights are packed per forward
/// pass, and packing only pays for itself on large inputs. all-MiniLM-L6-v2 forward passes
/// on 2 threads (AMD Zen 4), oneDNN vs `linear`: 12-16 vs 6.7 ms at 16 rows, 28-31 vs 21-22
/// at 128, 71-82 vs 75-99 at 512, 265-268 vs 333-352 at 2,048, 1,103-1,167 vs 1,404-1,611
/// at 8,192 (an encoding batch of 64 × 128 tokens).
pub const MIN_ROWS: i64 = 512;

/// What follows the GEMM inside the same kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Epilogue {
    None,
    /// Exact (erf) GELU.
    Gelu,
    /// Tanh-approximated GELU (`gelu_new`).
    GeluTanh,
    Relu,
}

impl Epilogue {
    /// The same function as a separate pass (the general, unfused path).
    pub fn apply(self, t: &Tensor) -> Tensor {
        match self {
            Epilogue::None => t.shallow_clone(),
            Epilogue::Gelu => t.gelu("none"),
            Epilogue::GeluTanh => t.gelu("tanh"),
            Epilogue::Relu => t.relu(),
        }
    }
}

/// Whether the oneDNN path can run a forward pass on `device` in `kind` right now.
pub fn usable(device: Device, kind: Kind) -> bool {
    static ENABLED: OnceLock<bool> = OnceLock::new();
    let enabled = *ENABLED.get_or_init(|| {
        if std::env::var("RAK_ONEDNN").is_ok_and(|v| v == "0") || unsafe { rak_onednn_available() } == 0 {
            return false;
        }
        // A libtorch whose operators changed signature: say so once and use the general path.
        schemas_checked().map_err(|e| warn_once(&e)).is_ok()
    });
    enabled && device == Device::Cpu && kind == Kind::Float && unsafe { rak_grad_enabled() } == 0
}

/// Say once per process that the oneDNN path failed and the general path is used instead.
pub fn warn_once(err: &anyhow::Error) {
    static WARNED: std::sync::Once = std::sync::Once::new();
    FELL_BACK.store(true, std::sync::atomic::Ordering::Relaxed);
    WARNED.call_once(|| eprintln!("warning: {err:#}; using libtorch's general linear layers"));
}

static FELL_BACK: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether the oneDNN path has failed and fallen back in this process (for tests that must
/// know it really ran).
pub fn fell_back() -> bool {
    FELL_BACK.load(std::sync::atomic::Ordering::Relaxed)
}

fn ptr(t: &Tensor) -> *const c_void {
    t.as_ptr() as *const c_void
}

fn take(result: *mut c_void, err: &[c_char], what: &str) -> Result<Tensor> {
    if result.is_null() {
        let msg = unsafe { CStr::from_ptr(err.as_ptr()) }.to_string_lossy();
        return Err(anyhow!("oneDNN {what}: {msg}"));
    }
    // SAFETY: the shim returns a heap `at::Tensor*` that nothing else owns; tch frees it.
    Ok(unsafe { Tensor::from_ptr(result as *mut C_tensor) })
}

/// A linear layer's weight packed for oneDNN, with its bias.
pub struct Dense {
    packed: Tensor,
    bias: Option<Tensor>,
}

impl Dense {
    /// Pack `weight` `[out, in]` for inputs of about `rows` rows.
    pub fn pack(weight: &Tensor, bias: Option<&Tensor>, rows: i64) -> Result<Self> {
        // Callers normally ask `usable` first; this keeps a caller that did not from handing
        // an operator with another signature a stack built for this one.
        schemas_checked()?;
        let mut err = [0 as c_char; 512];
        let packed = unsafe { rak_onednn_pack(ptr(weight), rows, err.as_mut_ptr(), err.len()) };
        Ok(Dense { packed: take(packed, &err, "weight packing")?, bias: bias.map(Tensor::shallow_clone) })
    }

    fn bias_ptr(&self) -> *const c_void {
        self.bias.as_ref().map_or(std::ptr::null(), ptr)
    }

    /// `epilogue(x·Wᵀ + b)` for `x` `[rows, in]`.
    pub fn forward(&self, x: &Tensor, epilogue: Epilogue) -> Result<Tensor> {
        let (attr, algorithm): (&CStr, Option<&CStr>) = match epilogue {
            Epilogue::None => (c"none", None),
            Epilogue::Gelu => (c"gelu", Some(c"none")),
            Epilogue::GeluTanh => (c"gelu", Some(c"tanh")),
            Epilogue::Relu => (c"relu", None),
        };
        let mut err = [0 as c_char; 512];
        let out = unsafe {
            rak_onednn_linear(
                ptr(x),
                ptr(&self.packed),
                self.bias_ptr(),
                attr.as_ptr(),
                algorithm.map_or(std::ptr::null(), CStr::as_ptr),
                err.as_mut_ptr(),
                err.len(),
            )
        };
        take(out, &err, "linear")
    }

    /// `x·Wᵀ + b + residual`, the add fused into the GEMM.
    pub fn forward_add(&self, x: &Tensor, residual: &Tensor) -> Result<Tensor> {
        let mut err = [0 as c_char; 512];
        let out = unsafe {
            rak_onednn_linear_add(ptr(x), ptr(residual), ptr(&self.packed), self.bias_ptr(), err.as_mut_ptr(), err.len())
        };
        take(out, &err, "linear + add")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: &Tensor, b: &Tensor) -> f64 {
        (a - b).abs().max().double_value(&[])
    }

    #[test]
    fn fused_kernels_match_libtorch() {
        let _g = tch::no_grad_guard();
        assert!(usable(Device::Cpu, Kind::Float), "this libtorch ships the oneDNN operators");
        tch::manual_seed(0);
        let opts = (Kind::Float, Device::Cpu);
        let x = Tensor::randn([37, 24], opts);
        let w = Tensor::randn([48, 24], opts);
        let b = Tensor::randn([48], opts);
        let residual = Tensor::randn([37, 48], opts);
        let dense = Dense::pack(&w, Some(&b), 37).unwrap();
        let plain = x.linear(&w, Some(&b));
        assert!(close(&dense.forward(&x, Epilogue::None).unwrap(), &plain) < 1e-4);
        assert!(close(&dense.forward(&x, Epilogue::Gelu).unwrap(), &plain.gelu("none")) < 1e-4);
        assert!(close(&dense.forward(&x, Epilogue::GeluTanh).unwrap(), &plain.gelu("tanh")) < 1e-4);
        assert!(close(&dense.forward(&x, Epilogue::Relu).unwrap(), &plain.relu()) < 1e-4);
        assert!(close(&dense.forward_add(&x, &residual).unwrap(), &(&plain + &residual)) < 1e-4);
        let unbiased = Dense::pack(&w, None, 37).unwrap();
        assert!(close(&unbiased.forward(&x, Epilogue::None).unwrap(), &x.linear::<Tensor>(&w, None)) < 1e-4);
    }

    #[test]
    fn errors_are_reported_not_thrown() {
        let _g = tch::no_grad_guard();
        let opts = (Kind::Float, Device::Cpu);
        let dense = Dense::pack(&Tensor::randn([8, 4], opts), None, 2).unwrap();
        let err = dense.forward(&Tensor::randn([2, 5], opts), Epilogue::None).unwrap_err();
        assert!(err.to_string().starts_with("oneDNN linear"), "{err}");
    }

    /// A signature that differs from what a stack assumes (a renamed, retyped, missing or
    /// extra argument, or an unknown operator) is reported, naming the operator and argument;
    /// the lists the shim really uses match this libtorch.
    #[test]
    fn schema_check_names_what_differs() {
        for s in &SCHEMAS {
            check_schema(s).unwrap();
        }
        let linear = &SCHEMAS[1];
        let check = |args: &'static [&'static CStr]| check_schema(&Schema { args, ..*linear }).unwrap_err().to_string();
        let renamed = check(&[c"Tensor X", c"Tensor W", c"Tensor? bias", c"str attr", c"Scalar?[] scalars", c"str? algorithm"]);
        assert!(renamed.contains("mkldnn::_linear_pointwise"), "{renamed}");
        assert!(renamed.contains("argument 2 is `Tensor? B`, expected `Tensor? bias`"), "{renamed}");
        let retyped = check(&[c"Tensor X", c"Tensor W", c"Tensor? B", c"str attr", c"Scalar?[] scalars", c"str algorithm"]);
        assert!(retyped.contains("argument 5 is `str? algorithm`, expected `str algorithm`"), "{retyped}");
        let short = check(&[c"Tensor X", c"Tensor W", c"Tensor? B", c"str attr", c"Scalar?[] scalars"]);
        assert!(short.contains("takes 6 arguments, expected 5"), "{short}");
        assert!(short.contains("argument 5 is `str? algorithm`, expected `nothing`"), "{short}");
        let binary = check_schema(&Schema { args: linear.args, ..SCHEMAS[2] }).unwrap_err().to_string();
        assert!(binary.contains("mkldnn::_linear_pointwise.binary takes 5 arguments, expected 6"), "{binary}");
        let missing = check_schema(&Schema { name: c"mkldnn::_no_such_op", ..*linear }).unwrap_err().to_string();
        assert!(missing.contains("mkldnn::_no_such_op is not registered"), "{missing}");
    }

    /// An exception that is not a `std::exception` comes back as an error instead of
    /// unwinding into Rust (which aborts the process).
    #[test]
    fn non_std_exceptions_come_back_as_errors() {
        let mut err = [0 as c_char; 512];
        assert_eq!(unsafe { rak_onednn_test_throw(err.as_mut_ptr(), err.len()) }, 0);
        let msg = unsafe { CStr::from_ptr(err.as_ptr()) }.to_string_lossy();
        assert!(msg.contains("not a std::exception"), "{msg}");
    }

    #[test]
    fn off_when_gradients_are_on() {
        assert!(!usable(Device::Cpu, Kind::Float), "gradients are on by default");
        let _g = tch::no_grad_guard();
        assert!(!usable(Device::Cpu, Kind::BFloat16));
    }
}
