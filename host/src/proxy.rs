//! Host-side wrappers that make a loaded plugin look like any `rak_core::plugin` trait object.
//! Each call goes through the root module; errors come back naming the plugin.

use crate::loader::Plugin;
use abi_stable::std_types::{ROption, RResult, RStr, RString, RVec};
use anyhow::{anyhow, bail, Result};
use rak_core::abi::modules::*;
use rak_core::abi::{Handle, NamedTensor, Role, TensorPtr};
use rak_core::plugin::{Connector, Encoder, Optimizer, Reader, StepContext};
use serde_json::Value;
use std::path::Path;
use tch::Tensor;

/// Names the plugin in every error that crosses back.
#[derive(Clone)]
struct Origin(String);

impl Origin {
    fn of(p: &Plugin) -> Self {
        Origin(format!("plugin {:?} ({})", p.header.name, p.path.display()))
    }
    fn check<T>(&self, what: &str, r: RResult<T, RString>) -> Result<T> {
        r.into_result().map_err(|e| anyhow!("{} failed in {what}: {e}", self.0))
    }
    fn json(&self, what: &str, r: RResult<RString, RString>) -> Result<Value> {
        let text = self.check(what, r)?;
        serde_json::from_str(&text).map_err(|e| anyhow!("{} returned invalid JSON from {what}: {e}", self.0))
    }
}

fn take_named(list: RVec<NamedTensor>) -> Vec<(String, Tensor)> {
    list.into_iter().map(|nt| (nt.name.into_string(), unsafe { nt.tensor.take() })).collect()
}

macro_rules! proxy {
    ($name:ident, $modref:ty) => {
        pub struct $name {
            module: $modref,
            handle: Handle,
            origin: Origin,
        }

        // The plugin object is owned by this proxy alone and may move between threads.
        unsafe impl Send for $name {}

        impl $name {
            pub fn create(p: &Plugin, module: $modref, settings: &Value) -> Result<Self> {
                let origin = Origin::of(p);
                check_settings(p, settings)?;
                let handle = origin.check("create", (module.create())(settings.to_string().as_str().into()))?;
                Ok(Self { module, handle, origin })
            }
        }

        impl Drop for $name {
            fn drop(&mut self) {
                (self.module.destroy())(self.handle);
            }
        }
    };
}

proxy!(EncoderProxy, EncoderModRef);
proxy!(OptimizerProxy, OptimizerModRef);
proxy!(ReaderProxy, ReaderModRef);
proxy!(ConnectorProxy, ConnectorModRef);

// Only a connector may be shared: its `complete` is `&self` on the plugin side too (the
// `Connector` trait requires `Sync`). The other kinds' `&self` methods reach `&mut` plugin
// objects and must not run concurrently.
unsafe impl Sync for ConnectorProxy {}

impl EncoderProxy {
    /// The tensor an encode call returned, checked here once for every caller: an undefined
    /// tensor would be an internal error further on, and a wrong row count would silently drop
    /// or misalign texts.
    fn checked_rows(&self, what: &str, out: RResult<TensorPtr, RString>, n: usize) -> Result<Tensor> {
        let out = unsafe { self.origin.check(what, out)?.take() };
        if !out.defined() {
            return Err(anyhow!("{} returned an undefined tensor from {what} for {n} texts", self.origin.0));
        }
        let size = out.size();
        if size.len() != 2 || size[0] != n as i64 {
            return Err(anyhow!("{} returned a tensor of shape {size:?} from {what} for {n} texts (expected [{n}, dim])", self.origin.0));
        }
        Ok(out)
    }
}

impl Encoder for EncoderProxy {
    fn encode(&mut self, texts: &[&str], role: Role, task: Option<&str>, train: bool) -> Result<Tensor> {
        let texts: Vec<RStr<'_>> = texts.iter().map(|s| (*s).into()).collect();
        let task: ROption<RStr<'_>> = task.map(RStr::from).into();
        let n = texts.len();
        let out = (self.module.encode())(self.handle, texts.as_slice().into(), role, task, train);
        self.checked_rows("encode", out, n)
    }

    fn encode_keyed(&mut self, texts: &[&str], role: Role, task: Option<&str>, keys: &[u64]) -> Result<Tensor> {
        if keys.len() != texts.len() {
            return Err(anyhow!("{} keys for {} texts", keys.len(), texts.len()));
        }
        // Plugins built before this function existed draw their masks from torch's generator.
        let Some(f) = self.module.encode_keyed() else { return self.encode(texts, role, task, true) };
        let texts: Vec<RStr<'_>> = texts.iter().map(|s| (*s).into()).collect();
        let task: ROption<RStr<'_>> = task.map(RStr::from).into();
        let n = texts.len();
        let out = f(self.handle, texts.as_slice().into(), role, task, keys.into());
        self.checked_rows("encode_keyed", out, n)
    }

    fn parameters(&self) -> Result<Vec<(String, Tensor)>> {
        Ok(take_named(self.origin.check("parameters", (self.module.parameters())(self.handle))?))
    }

    fn info(&self) -> Result<Value> {
        self.origin.json("info", (self.module.info())(self.handle))
    }

    fn save(&self, dir: &Path) -> Result<()> {
        let dir = dir.to_string_lossy();
        self.origin.check("save", (self.module.save())(self.handle, dir.as_ref().into()))
    }

    fn token_lengths(&mut self, texts: &[&str], role: Role, task: Option<&str>) -> Result<Option<Vec<usize>>> {
        // Plugins built before this function existed simply lack it.
        let Some(f) = self.module.token_lengths() else { return Ok(None) };
        let texts: Vec<RStr<'_>> = texts.iter().map(|s| (*s).into()).collect();
        let task: ROption<RStr<'_>> = task.map(RStr::from).into();
        let out = self.origin.check("token_lengths", f(self.handle, texts.as_slice().into(), role, task))?;
        Ok(out.into_option().map(|v| v.into_iter().map(|n| n as usize).collect()))
    }

    fn prepare(&mut self, texts: &[&str], role: Role, task: Option<&str>) -> Result<()> {
        // A hint: plugins built before this function existed tokenise when they encode.
        let Some(f) = self.module.prepare() else { return Ok(()) };
        let texts: Vec<RStr<'_>> = texts.iter().map(|s| (*s).into()).collect();
        let task: ROption<RStr<'_>> = task.map(RStr::from).into();
        self.origin.check("prepare", f(self.handle, texts.as_slice().into(), role, task))
    }
}

fn lend_named(list: &[(String, Tensor)]) -> Vec<NamedTensor> {
    list.iter().map(|(n, t)| NamedTensor { name: n.as_str().into(), tensor: TensorPtr::lend(t) }).collect()
}

impl Optimizer for OptimizerProxy {
    fn begin_step(&mut self, params: Vec<(String, Tensor)>, ctx: StepContext) -> Result<()> {
        let lent = lend_named(&params);
        let ctx = serde_json::to_string(&ctx)?;
        self.origin.check("begin_step", (self.module.begin_step())(self.handle, lent.as_slice().into(), ctx.as_str().into()))
    }

    fn task_gradients(&mut self, task: &str, loss: f64, grads: Vec<(String, Tensor)>) -> Result<()> {
        let lent = lend_named(&grads);
        let r = (self.module.task_gradients())(self.handle, task.into(), loss, lent.as_slice().into());
        self.origin.check("task_gradients", r)
    }

    fn finish_step(&mut self) -> Result<Value> {
        self.origin.json("finish_step", (self.module.finish_step())(self.handle))
    }

    fn state(&self) -> Result<Vec<(String, Tensor)>> {
        Ok(take_named(self.origin.check("state", (self.module.state())(self.handle))?))
    }

    fn load_state(&mut self, state: Vec<(String, Tensor)>) -> Result<()> {
        let lent = lend_named(&state);
        self.origin.check("load_state", (self.module.load_state())(self.handle, lent.as_slice().into()))
    }

    fn needs_task_gradients(&self) -> Result<bool> {
        // A plugin built before the function existed needs them, as every optimizer did.
        let Some(f) = self.module.needs_task_gradients() else { return Ok(true) };
        self.origin.check("needs_task_gradients", f(self.handle))
    }
}

impl Reader for ReaderProxy {
    fn generate(&mut self, request: Value) -> Result<Value> {
        self.origin.json("generate", (self.module.generate())(self.handle, request.to_string().as_str().into()))
    }
    fn score_options(&mut self, request: Value) -> Result<Value> {
        self.origin.json("score_options", (self.module.score_options())(self.handle, request.to_string().as_str().into()))
    }
    fn passage_preferences(&mut self, request: Value) -> Result<Value> {
        let r = (self.module.passage_preferences())(self.handle, request.to_string().as_str().into());
        self.origin.json("passage_preferences", r)
    }
}

impl Connector for ConnectorProxy {
    fn complete(&self, request: Value) -> Result<Value> {
        self.origin.json("complete", (self.module.complete())(self.handle, request.to_string().as_str().into()))
    }

    fn stream(&self, request: Value, sink: &mut dyn FnMut(&str) -> bool) -> Result<Value> {
        let Some(stream) = self.module.stream() else {
            bail!("{} cannot stream replies (built before streaming was added to the connector ABI)", self.origin.0)
        };
        // The sink crosses as a pointer to this frame's `&mut dyn FnMut`, used only during the call.
        extern "C" fn piece(ctx: *mut std::ffi::c_void, data: RStr<'_>) -> bool {
            let sink = unsafe { &mut *(ctx as *mut &mut dyn FnMut(&str) -> bool) };
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| sink(data.as_str()))).unwrap_or(false)
        }
        let mut sink = sink;
        let ctx = &mut sink as *mut &mut dyn FnMut(&str) -> bool as *mut std::ffi::c_void;
        let r = stream(self.handle, request.to_string().as_str().into(), rak_core::abi::ChunkSink { ctx, chunk: piece });
        self.origin.json("stream", r)
    }
}

/// Settings the host's commands fill in for every encoder or reader (`--model`, `--device`,
/// `--bf16`, `--max-length`); a plugin may ignore them without declaring them.
const HOST_SETTINGS: [&str; 5] = ["model", "device", "bf16", "max_length", "query_max_length"];

/// Refuse settings the plugin does not declare, naming the ones it does, before the plugin
/// sees them (so a typo is an error even in a plugin that ignores unknown keys).
fn check_settings(p: &Plugin, settings: &Value) -> Result<()> {
    let (Some(given), Value::Object(known)) = (settings.as_object(), settings_schema(p)) else { return Ok(()) };
    for key in given.keys() {
        if !known.contains_key(key) && !HOST_SETTINGS.contains(&key.as_str()) {
            let names: Vec<&str> = known.keys().map(String::as_str).collect();
            let known = if names.is_empty() { "none".to_string() } else { names.join(", ") };
            bail!("{} {:?} ({}) has no setting {key:?} (known: {known})", p.header.kind, p.header.name, p.path.display());
        }
    }
    Ok(())
}

/// The plugin's settings description, for `plugins inspect`.
pub fn settings_schema(p: &Plugin) -> Value {
    use crate::loader::Module::*;
    let text: RString = match p.module {
        Encoder(m) => (m.settings_schema())(),
        Optimizer(m) => (m.settings_schema())(),
        Reader(m) => (m.settings_schema())(),
        Connector(m) => (m.settings_schema())(),
        Command(m) => (m.settings_schema())(),
    };
    serde_json::from_str(&text).unwrap_or(Value::String(text.into_string()))
}
