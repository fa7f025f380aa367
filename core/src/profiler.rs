//! libtorch's profiler from Rust (`shim/csrc/profiler.cpp`): what `torch.profiler.profile` records
//! in Python (every operator, and on CUDA every kernel and runtime call), written as the same
//! Chrome trace, so a run of ours and a PyTorch loop profiled beside it read alike
//! (`bench/trace_table.py`). For measurement: `host train` records its steps when
//! `RAK_TORCH_PROFILE` names a folder.

use anyhow::{Context, Result};
use std::ffi::{c_char, c_void, CString};
use std::marker::PhantomData;
use std::path::{Path, PathBuf};
use tch::Device;

extern "C" {
    fn rak_profiler_start(cuda: i32, err: *mut c_char, len: usize) -> i32;
    fn rak_profiler_stop(path: *const c_char, err: *mut c_char, len: usize) -> i32;
    fn rak_scope_begin(name: *const c_char) -> *mut c_void;
    fn rak_scope_end(scope: *mut c_void);
}

/// A recording in progress, started by [`Recording::start`] and written by
/// [`Recording::finish`]; dropped unfinished, it stops without writing. One at a time per
/// process (libtorch's rule); not `Send`: it ends on the thread that began it.
pub struct Recording {
    trace: PathBuf,
    device: Device,
    /// Whether libtorch's profiler is still on (this value turns it off once).
    on: bool,
    _thread: PhantomData<*const ()>,
}

impl Recording {
    /// Starts recording operators (and kernels, when `device` is CUDA); the trace goes to
    /// `trace` when finished. Its folder is made first, so that a path that cannot be written
    /// fails here rather than after the work it was to record.
    pub fn start(trace: &Path, device: Device) -> Result<Self> {
        if let Some(dir) = trace.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).with_context(|| format!("{}: cannot create", dir.display()))?;
        }
        let cuda = i32::from(device.is_cuda());
        // SAFETY: the call only switches libtorch's profiler on; errors come back as text.
        crate::autograd::shim_call("cannot start libtorch's profiler", |err, len| unsafe { rak_profiler_start(cuda, err, len) })?;
        Ok(Recording { trace: trace.to_path_buf(), device, on: true, _thread: PhantomData })
    }

    /// Stops recording and writes the Chrome trace (to a temporary name, then renamed). On
    /// CUDA the device finishes its queued work first, as Python's profiler does on leaving
    /// its block, so the last step's kernels are in the trace.
    pub fn finish(mut self) -> Result<PathBuf> {
        if let Device::Cuda(i) = self.device {
            tch::Cuda::synchronize(i as i64);
        }
        let written = crate::fsutil::write_atomically(&self.trace, |tmp| {
            let c = CString::new(tmp.as_os_str().as_encoded_bytes()).context("a trace path with a NUL byte")?;
            self.on = false;
            // SAFETY: `c` outlives the call, which writes what libtorch's profiler collected.
            crate::autograd::shim_call("cannot write libtorch's profile", |err, len| unsafe { rak_profiler_stop(c.as_ptr(), err, len) })
                .with_context(|| tmp.display().to_string())
        });
        self.stop();
        written.map(|()| self.trace.clone())
    }

    /// Turns the profiler off without writing, unless that is done already.
    fn stop(&mut self) {
        if std::mem::take(&mut self.on) {
            // SAFETY: stops the profiler this value started; nothing is written.
            let _ = crate::autograd::shim_call("", |err, len| unsafe { rak_profiler_stop(std::ptr::null(), err, len) });
        }
    }
}

impl Drop for Recording {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A named span in the trace (`torch.profiler.record_function`), from here to its drop, on
/// this thread. Costs one allocation when nothing records.
pub struct Scope {
    handle: *mut c_void,
}

impl Scope {
    pub fn new(name: &str) -> Self {
        let name = CString::new(name.replace('\0', " ")).expect("NUL bytes replaced");
        // SAFETY: `name` is copied by the callee; the handle is closed once, in `drop`.
        Scope { handle: unsafe { rak_scope_begin(name.as_ptr()) } }
    }
}

impl Drop for Scope {
    fn drop(&mut self) {
        if !self.handle.is_null() {
            // SAFETY: a handle `rak_scope_begin` returned, closed only here.
            unsafe { rak_scope_end(self.handle) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Kind, Tensor};

    /// A recording names the operators run inside it and the scopes around them, in the
    /// trace format torch.profiler writes (JSON with `traceEvents`).
    #[test]
    fn a_recording_writes_the_operators_and_scopes_it_saw() {
        let dir = std::env::temp_dir().join(format!("rak-profile-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let trace = dir.join("trace.json");
        let recording = Recording::start(&trace, Device::Cpu).unwrap();
        {
            let _scope = Scope::new("rak::test-scope");
            let a = Tensor::ones([8, 8], (Kind::Float, Device::Cpu));
            let _ = a.matmul(&a).sum(Kind::Float);
        }
        assert_eq!(recording.finish().unwrap(), trace);
        let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
        let names: Vec<&str> = json["traceEvents"].as_array().unwrap().iter().filter_map(|e| e["name"].as_str()).collect();
        for want in ["rak::test-scope", "aten::matmul", "aten::sum"] {
            assert!(names.contains(&want), "{want} missing from {names:?}");
        }
        assert!(!crate::fsutil::temp_path(&trace).exists());
        // A folder that cannot be made fails at the start; the profiler stays off, so the
        // next recording starts.
        let blocked = dir.join("a-file");
        std::fs::write(&blocked, "").unwrap();
        assert!(Recording::start(&blocked.join("trace.json"), Device::Cpu).is_err());
        let again = Recording::start(&trace, Device::Cpu).unwrap();
        again.finish().unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
