//! `rak-abi`: the stable plugin ABI, what crosses between `host` and a plugin `.so`. A crate of
//! its own, versioned by [`ABI_VERSION`], because abi_stable compares the package versions of
//! the types it checks: types in rak-core would tie every plugin to rak-core's release.
//! `rak_core::abi` re-exports it.
//!
//! Layering, from the outside in:
//! 1. [`header`]: a pointer-free static the host reads from the file before loading it.
//! 2. One `abi_stable` prefix-type root module per plugin kind ([`modules`]): a table of
//!    `extern "C"` functions. Fields after `last_prefix_field` are optional, so a newer host can
//!    load an older plugin and later versions can append functions without breaking anyone.
//! 3. Values: `abi_stable` strings/vectors/results, JSON strings for settings and requests that
//!    will grow, and libtorch tensor handles ([`TensorPtr`]).
//!
//! Why tensor handles are sound: a `TensorPtr` is a `torch::Tensor*` allocated by the libtorch
//! C++ shim. Host and plugin link the *same* `libtorch_cpu.so` (the header check enforces the
//! same libtorch and tch versions and target), so either side may use or free it.

pub mod header;
pub mod modules;

use abi_stable::std_types::{RResult, RString};
use abi_stable::StableAbi;
use std::ffi::c_void;
use std::mem::ManuallyDrop;
use std::panic::{catch_unwind, AssertUnwindSafe};
use tch::Tensor;

pub use header::{HeaderInfo, PluginHeader, HEADER_SYMBOL};

/// The tch version this toolkit pins (`tch = "=0.24.0"` in the workspace).
pub const TCH_VERSION: &str = "0.24.0";
/// The libtorch version this copy of the crate was compiled against (from `rak-build`).
pub const LIBTORCH_VERSION: &str = env!("RAK_LIBTORCH_VERSION");
/// The target triple this copy of the crate was compiled for.
pub const TARGET: &str = env!("RAK_TARGET");

/// Bump when anything in this crate changes incompatibly, together with the crate's version
/// and [`ABI_VERSION_STRING`]. Plugins built with another number are refused before any of
/// their code runs.
pub const ABI_VERSION: u32 = 2;

/// [`ABI_VERSION`] as the `major.minor.patch` string abi_stable compares when it loads a root
/// module, so that a plugin's compatibility follows the ABI and not rak-core's crate version.
pub const ABI_VERSION_STRING: &str = "2.0.0";

/// The five plugin kinds. The numbers are part of the ABI.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PluginKind {
    Encoder = 1,
    Optimizer = 2,
    Reader = 3,
    Connector = 4,
    Command = 5,
}

impl PluginKind {
    pub const ALL: [PluginKind; 5] = [
        PluginKind::Encoder,
        PluginKind::Optimizer,
        PluginKind::Reader,
        PluginKind::Connector,
        PluginKind::Command,
    ];

    pub fn from_u32(v: u32) -> Option<Self> {
        Self::ALL.into_iter().find(|k| *k as u32 == v)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            PluginKind::Encoder => "encoder",
            PluginKind::Optimizer => "optimizer",
            PluginKind::Reader => "reader",
            PluginKind::Connector => "connector",
            PluginKind::Command => "command",
        }
    }
}

/// A libtorch tensor handle (`torch::Tensor*`). Whether it is borrowed or owned is stated by
/// each function that takes or returns one.
#[repr(transparent)]
#[derive(StableAbi, Clone, Copy)]
pub struct TensorPtr(*mut c_void);

impl TensorPtr {
    /// Lend a tensor for the duration of a call.
    pub fn lend(t: &Tensor) -> Self {
        TensorPtr(t.as_ptr() as *mut c_void)
    }

    /// Hand a tensor over; the receiver must [`TensorPtr::take`] it exactly once.
    pub fn give(t: Tensor) -> Self {
        let t = ManuallyDrop::new(t);
        TensorPtr(t.as_ptr() as *mut c_void)
    }

    /// Use a lent tensor. The result shares the caller's `torch::Tensor` object and must not
    /// be dropped as an owner, hence `ManuallyDrop`.
    ///
    /// # Safety
    /// `self` must come from [`TensorPtr::lend`] on a tensor alive for the whole call.
    pub unsafe fn borrow(self) -> ManuallyDrop<Tensor> {
        ManuallyDrop::new(Tensor::from_ptr(self.0 as *mut _))
    }

    /// Take ownership of a tensor handed over with [`TensorPtr::give`].
    ///
    /// # Safety
    /// `self` must come from [`TensorPtr::give`] and be taken once.
    pub unsafe fn take(self) -> Tensor {
        Tensor::from_ptr(self.0 as *mut _)
    }
}

/// A named tensor; owned or lent as the function says.
#[repr(C)]
#[derive(StableAbi)]
pub struct NamedTensor {
    pub name: RString,
    pub tensor: TensorPtr,
}

/// An opaque plugin-side object (an encoder, optimizer, ... instance), created by the kind's
/// `create` and released by its `destroy`.
#[repr(transparent)]
#[derive(StableAbi, Clone, Copy, Debug)]
pub struct Handle(*mut c_void);

impl Handle {
    /// Box a plugin object into a handle (plugin side).
    pub fn new<T>(obj: T) -> Self {
        Handle(Box::into_raw(Box::new(obj)) as *mut c_void)
    }

    /// # Safety
    /// The handle must come from [`Handle::new::<T>`] and not be destroyed, and no other
    /// reference to the object may be alive.
    pub unsafe fn get<'a, T>(self) -> &'a mut T {
        &mut *(self.0 as *mut T)
    }

    /// A shared reference, for objects that may be used from several threads at once.
    ///
    /// # Safety
    /// The handle must come from [`Handle::new::<T>`] and not be destroyed.
    pub unsafe fn get_ref<'a, T>(self) -> &'a T {
        &*(self.0 as *const T)
    }

    /// # Safety
    /// The handle must come from [`Handle::new::<T>`]; it is invalid afterwards.
    pub unsafe fn destroy<T>(self) {
        drop(Box::from_raw(self.0 as *mut T));
    }
}

/// A callback lent for one streaming call ([`modules::ConnectorMod::stream`]): `chunk(ctx,
/// piece)` hands over one piece, valid for that call only; it returns `false` when the
/// receiver wants no more (its client went away).
#[repr(C)]
#[derive(StableAbi, Clone, Copy)]
pub struct ChunkSink {
    pub ctx: *mut c_void,
    pub chunk: extern "C" fn(ctx: *mut c_void, piece: abi_stable::std_types::RStr<'_>) -> bool,
}

/// Which tower of a dual encoder a text goes through.
#[repr(u8)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Query = 0,
    Passage = 1,
}

impl std::str::FromStr for Role {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "query" => Ok(Role::Query),
            "passage" => Ok(Role::Passage),
            _ => Err(format!("unknown role {s:?}: expected query or passage")),
        }
    }
}

/// Run code at the ABI boundary: errors and panics become an `RErr` message instead of
/// unwinding across `extern "C"` (which would abort the process).
pub fn guard<T>(f: impl FnOnce() -> anyhow::Result<T>) -> RResult<T, RString> {
    match guarded(f) {
        Ok(v) => RResult::ROk(v),
        Err(Failure::Error(e)) | Err(Failure::Panic(e)) => RResult::RErr(e.into()),
    }
}

/// How a guarded call failed.
#[derive(Debug)]
pub enum Failure {
    /// It returned an error (the message, with its causes).
    Error(String),
    /// It panicked: whatever it was changing may be half done.
    Panic(String),
}

/// [`guard`], telling an error from a panic.
pub fn guarded<T>(f: impl FnOnce() -> anyhow::Result<T>) -> Result<T, Failure> {
    quiet_panics_in_guards();
    GUARD_DEPTH.with(|d| d.set(d.get() + 1));
    let result = catch_unwind(AssertUnwindSafe(f));
    GUARD_DEPTH.with(|d| d.set(d.get() - 1));
    match result {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(Failure::Error(format!("{e:#}"))),
        Err(payload) => Err(Failure::Panic(format!("panicked: {}", panic_message(&*payload)))),
    }
}

thread_local! {
    /// How many [`guarded`] calls this thread is inside.
    static GUARD_DEPTH: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Inside a guard, a panic's message travels back in the error, so the default hook (a message
/// and maybe a backtrace on the user's terminal) is silenced there, and only there: the hook
/// installed here hands every panic outside a guard to the hook that was in place before, so
/// the host's own "internal error" hook keeps working after it first calls into a plugin or
/// offers a service. Each cdylib has its own std and so its own hook.
fn quiet_panics_in_guards() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if GUARD_DEPTH.with(|d| d.get()) == 0 {
                previous(info);
            }
        }));
    });
}

/// The text of a panic, cut before libtorch's C++ backtrace.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    let text = payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into());
    let cut = text.find("\nException raised from").unwrap_or(text.len());
    text[..cut].trim_end().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guarded_tells_errors_from_panics() {
        assert!(matches!(guarded(|| -> anyhow::Result<()> { anyhow::bail!("no") }), Err(Failure::Error(m)) if m == "no"));
        let r = guarded(|| -> anyhow::Result<()> { panic!("boom") });
        assert!(matches!(r, Err(Failure::Panic(m)) if m == "panicked: boom"));
        assert_eq!(guarded(|| Ok(3)).unwrap(), 3);
    }

    #[test]
    fn version_string_is_the_abi_version() {
        assert_eq!(ABI_VERSION_STRING, format!("{ABI_VERSION}.0.0"));
        assert_eq!(env!("CARGO_PKG_VERSION"), ABI_VERSION_STRING, "the crate's version is the ABI's");
    }

    #[test]
    fn tch_version_matches_lockfile() {
        let lock = include_str!("../../Cargo.lock");
        let pinned = lock.split("[[package]]").find(|p| p.contains("name = \"tch\"")).unwrap();
        assert!(pinned.contains(&format!("version = \"{TCH_VERSION}\"")));
    }
}
