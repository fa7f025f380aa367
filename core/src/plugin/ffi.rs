//! The plugin side of the ABI: generic `extern "C"` functions that adapt the SDK traits to
//! the root modules, and the export macros. Plugin authors use only the macros.

use super::{Command, Connector, Encoder, Host, Optimizer, PluginInfo, Reader};
use crate::abi::modules::*;
use crate::abi::{guard, guarded, Failure, Handle, NamedTensor, Role, TensorPtr};
use abi_stable::prefix_type::{PrefixTypeTrait, WithMetadata};
use abi_stable::std_types::{ROption, RResult, RSlice, RStr, RString, RVec};
use anyhow::Context;
use serde_json::Value;
use std::path::Path;
use std::sync::Mutex;
use tch::Tensor;

type Res<T> = RResult<T, RString>;

fn parse_json(text: &str, what: &str) -> anyhow::Result<Value> {
    serde_json::from_str(text).with_context(|| format!("{what} is not valid JSON"))
}

extern "C" fn settings_schema<T: PluginInfo>() -> RString {
    schema_or_error(|| T::settings_schema())
}

/// Settings schemas are plain strings in the ABI; a failure becomes `{"error": ...}`.
fn schema_or_error(f: impl FnOnce() -> Value) -> RString {
    match guard(|| Ok(f())) {
        RResult::ROk(v) => v.to_string().into(),
        RResult::RErr(e) => serde_json::json!({ "error": e.as_str() }).to_string().into(),
    }
}

/// What every call of a poisoned instance says (callers that keep an instance for long, such as
/// `host serve`'s encoder, look for it to report themselves unhealthy).
pub const POISONED: &str = "is unusable since an earlier call panicked";

/// A plugin object behind a handle. A call that panicked may have left it half updated, so it
/// is poisoned: every later call fails with the first panic's message instead of running on.
struct Instance<T> {
    obj: T,
    poisoned: Mutex<Option<String>>,
}

impl<T> Instance<T> {
    fn check(&self) -> anyhow::Result<()> {
        match &*self.poisoned.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(why) => anyhow::bail!("this instance {POISONED} ({why}); create a new one"),
            None => Ok(()),
        }
    }

    fn poison(&self, what: &str, message: &str) {
        let mut p = self.poisoned.lock().unwrap_or_else(|e| e.into_inner());
        p.get_or_insert_with(|| format!("{what}: {message}"));
    }
}

fn settle<R>(inst: &Instance<impl Sized>, what: &str, r: Result<R, Failure>) -> Res<R> {
    match r {
        Ok(v) => RResult::ROk(v),
        Err(Failure::Error(e)) => RResult::RErr(e.into()),
        Err(Failure::Panic(e)) => {
            inst.poison(what, &e);
            RResult::RErr(e.into())
        }
    }
}

/// Run `f` on the object behind `h`, exclusively (the host calls `&mut` methods one at a time).
fn with_mut<T, R>(h: Handle, what: &str, f: impl FnOnce(&mut T) -> anyhow::Result<R>) -> Res<R> {
    let inst = unsafe { h.get::<Instance<T>>() };
    let r = guarded(|| {
        inst.check()?;
        f(&mut inst.obj)
    });
    settle(inst, what, r)
}

/// Run `f` on the object behind `h`, shared (methods that may run on several threads at once).
fn with_ref<T: Sync, R>(h: Handle, what: &str, f: impl FnOnce(&T) -> anyhow::Result<R>) -> Res<R> {
    let inst = unsafe { h.get_ref::<Instance<T>>() };
    let r = guarded(|| {
        inst.check()?;
        f(&inst.obj)
    });
    settle(inst, what, r)
}

extern "C" fn create<T: PluginInfo>(settings: RStr<'_>) -> Res<Handle> {
    guard(|| {
        let value = if settings.trim().is_empty() { Value::Object(Default::default()) } else { parse_json(&settings, "settings")? };
        Ok(Handle::new(Instance { obj: T::create(value)?, poisoned: Mutex::new(None) }))
    })
}

extern "C" fn destroy<T>(h: Handle) {
    let _ = guard(|| {
        unsafe { h.destroy::<Instance<T>>() };
        Ok(())
    });
}

fn owned_named(list: Vec<(String, Tensor)>) -> RVec<NamedTensor> {
    list.into_iter().map(|(name, t)| NamedTensor { name: name.into(), tensor: TensorPtr::give(t) }).collect()
}

// ---------------------------------------------------------------- encoder

extern "C" fn encoder_encode<T: Encoder + PluginInfo>(
    h: Handle,
    texts: RSlice<'_, RStr<'_>>,
    role: Role,
    task: ROption<RStr<'_>>,
    train: bool,
) -> Res<TensorPtr> {
    with_mut(h, "encode", |enc: &mut T| {
        let texts: Vec<&str> = texts.iter().map(|s| s.as_str()).collect();
        let task = task.as_ref().map(|s| s.as_str()).into_option();
        Ok(TensorPtr::give(enc.encode(&texts, role, task, train)?))
    })
}

extern "C" fn encoder_encode_keyed<T: Encoder + PluginInfo>(
    h: Handle,
    texts: RSlice<'_, RStr<'_>>,
    role: Role,
    task: ROption<RStr<'_>>,
    keys: RSlice<'_, u64>,
) -> Res<TensorPtr> {
    with_mut(h, "encode_keyed", |enc: &mut T| {
        let texts: Vec<&str> = texts.iter().map(|s| s.as_str()).collect();
        let task = task.as_ref().map(|s| s.as_str()).into_option();
        Ok(TensorPtr::give(enc.encode_keyed(&texts, role, task, keys.as_slice())?))
    })
}

extern "C" fn encoder_parameters<T: Encoder + PluginInfo>(h: Handle) -> Res<RVec<NamedTensor>> {
    with_mut(h, "parameters", |enc: &mut T| Ok(owned_named(enc.parameters()?)))
}

extern "C" fn encoder_info<T: Encoder + PluginInfo>(h: Handle) -> Res<RString> {
    with_mut(h, "info", |enc: &mut T| Ok(enc.info()?.to_string().into()))
}

extern "C" fn encoder_save<T: Encoder + PluginInfo>(h: Handle, dir: RStr<'_>) -> Res<()> {
    with_mut(h, "save", |enc: &mut T| enc.save(Path::new(dir.as_str())))
}

extern "C" fn encoder_token_lengths<T: Encoder + PluginInfo>(
    h: Handle,
    texts: RSlice<'_, RStr<'_>>,
    role: Role,
    task: ROption<RStr<'_>>,
) -> Res<ROption<RVec<u32>>> {
    with_mut(h, "token_lengths", |enc: &mut T| {
        let texts: Vec<&str> = texts.iter().map(|s| s.as_str()).collect();
        let task = task.as_ref().map(|s| s.as_str()).into_option();
        let lengths = enc.token_lengths(&texts, role, task)?;
        Ok(lengths.map(|v| v.into_iter().map(|n| n as u32).collect()).into())
    })
}

extern "C" fn encoder_prepare<T: Encoder + PluginInfo>(
    h: Handle,
    texts: RSlice<'_, RStr<'_>>,
    role: Role,
    task: ROption<RStr<'_>>,
) -> Res<()> {
    with_mut(h, "prepare", |enc: &mut T| {
        let texts: Vec<&str> = texts.iter().map(|s| s.as_str()).collect();
        let task = task.as_ref().map(|s| s.as_str()).into_option();
        enc.prepare(&texts, role, task)
    })
}

/// The root module of an encoder plugin.
pub fn encoder_module<T: Encoder + PluginInfo>() -> EncoderModRef {
    EncoderModRef(
        leak(EncoderMod {
            settings_schema: settings_schema::<T>,
            create: create::<T>,
            encode: encoder_encode::<T>,
            parameters: encoder_parameters::<T>,
            info: encoder_info::<T>,
            save: encoder_save::<T>,
            destroy: destroy::<T>,
            token_lengths: encoder_token_lengths::<T>,
            encode_keyed: encoder_encode_keyed::<T>,
            prepare: encoder_prepare::<T>,
        })
        .static_as_prefix(),
    )
}

// ---------------------------------------------------------------- optimizer

fn lent_named(list: &[NamedTensor]) -> Vec<(String, Tensor)> {
    list.iter().map(|nt| (nt.name.to_string(), unsafe { nt.tensor.borrow() }.shallow_clone())).collect()
}

extern "C" fn optimizer_begin_step<T: Optimizer + PluginInfo>(h: Handle, params: RSlice<'_, NamedTensor>, context: RStr<'_>) -> Res<()> {
    with_mut(h, "begin_step", |opt: &mut T| {
        let ctx = serde_json::from_str(&context).context("optimizer step context")?;
        opt.begin_step(lent_named(&params), ctx)
    })
}

extern "C" fn optimizer_task_gradients<T: Optimizer + PluginInfo>(
    h: Handle,
    task: RStr<'_>,
    loss: f64,
    grads: RSlice<'_, NamedTensor>,
) -> Res<()> {
    with_mut(h, "task_gradients", |opt: &mut T| opt.task_gradients(&task, loss, lent_named(&grads)))
}

extern "C" fn optimizer_finish_step<T: Optimizer + PluginInfo>(h: Handle) -> Res<RString> {
    with_mut(h, "finish_step", |opt: &mut T| Ok(opt.finish_step()?.to_string().into()))
}

extern "C" fn optimizer_state<T: Optimizer + PluginInfo>(h: Handle) -> Res<RVec<NamedTensor>> {
    with_mut(h, "state", |opt: &mut T| Ok(owned_named(opt.state()?)))
}

extern "C" fn optimizer_load_state<T: Optimizer + PluginInfo>(h: Handle, state: RSlice<'_, NamedTensor>) -> Res<()> {
    with_mut(h, "load_state", |opt: &mut T| opt.load_state(lent_named(&state)))
}

extern "C" fn optimizer_needs_task_gradients<T: Optimizer + PluginInfo>(h: Handle) -> Res<bool> {
    with_mut(h, "needs_task_gradients", |opt: &mut T| opt.needs_task_gradients())
}

/// The root module of an optimizer plugin.
pub fn optimizer_module<T: Optimizer + PluginInfo>() -> OptimizerModRef {
    OptimizerModRef(
        leak(OptimizerMod {
            settings_schema: settings_schema::<T>,
            create: create::<T>,
            begin_step: optimizer_begin_step::<T>,
            task_gradients: optimizer_task_gradients::<T>,
            finish_step: optimizer_finish_step::<T>,
            state: optimizer_state::<T>,
            load_state: optimizer_load_state::<T>,
            destroy: destroy::<T>,
            needs_task_gradients: optimizer_needs_task_gradients::<T>,
        })
        .static_as_prefix(),
    )
}

// ---------------------------------------------------------------- reader

fn json_call<T>(h: Handle, what: &str, request: RStr<'_>, f: impl FnOnce(&mut T, Value) -> anyhow::Result<Value>) -> Res<RString> {
    with_mut(h, what, |obj: &mut T| Ok(f(obj, parse_json(&request, "request")?)?.to_string().into()))
}

extern "C" fn reader_generate<T: Reader + PluginInfo>(h: Handle, r: RStr<'_>) -> Res<RString> {
    json_call(h, "generate", r, T::generate)
}
extern "C" fn reader_score_options<T: Reader + PluginInfo>(h: Handle, r: RStr<'_>) -> Res<RString> {
    json_call(h, "score_options", r, T::score_options)
}
extern "C" fn reader_passage_preferences<T: Reader + PluginInfo>(h: Handle, r: RStr<'_>) -> Res<RString> {
    json_call(h, "passage_preferences", r, T::passage_preferences)
}

/// The root module of a reader plugin.
pub fn reader_module<T: Reader + PluginInfo>() -> ReaderModRef {
    ReaderModRef(
        leak(ReaderMod {
            settings_schema: settings_schema::<T>,
            create: create::<T>,
            generate: reader_generate::<T>,
            score_options: reader_score_options::<T>,
            passage_preferences: reader_passage_preferences::<T>,
            destroy: destroy::<T>,
        })
        .static_as_prefix(),
    )
}

// ---------------------------------------------------------------- connector

extern "C" fn connector_complete<T: Connector + PluginInfo>(h: Handle, r: RStr<'_>) -> Res<RString> {
    with_ref(h, "complete", |c: &T| Ok(c.complete(parse_json(&r, "request")?)?.to_string().into()))
}

extern "C" fn connector_stream<T: Connector + PluginInfo>(h: Handle, r: RStr<'_>, sink: crate::abi::ChunkSink) -> Res<RString> {
    with_ref(h, "stream", |c: &T| {
        let mut send = |piece: &str| (sink.chunk)(sink.ctx, piece.into());
        Ok(c.stream(parse_json(&r, "request")?, &mut send)?.to_string().into())
    })
}

/// The root module of a connector plugin.
pub fn connector_module<T: Connector + PluginInfo>() -> ConnectorModRef {
    ConnectorModRef(
        leak(ConnectorMod {
            settings_schema: settings_schema::<T>,
            create: create::<T>,
            complete: connector_complete::<T>,
            destroy: destroy::<T>,
            stream: connector_stream::<T>,
        })
        .static_as_prefix(),
    )
}

// ---------------------------------------------------------------- command

extern "C" fn command_schema<T: Command>() -> RString {
    schema_or_error(|| T::settings_schema())
}
extern "C" fn command_about<T: Command>() -> RString {
    T::ABOUT.into()
}
extern "C" fn command_run<T: Command>(args: RSlice<'_, RStr<'_>>, host: HostApi) -> Res<i32> {
    guard(|| {
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        T::run(&args, &Host::new(host))
    })
}

/// The root module of a command plugin.
pub fn command_module<T: Command>() -> CommandModRef {
    CommandModRef(
        leak(CommandMod { settings_schema: command_schema::<T>, about: command_about::<T>, run: command_run::<T> })
            .static_as_prefix(),
    )
}

/// Root modules live for the life of the process (plugins are never unloaded).
fn leak<M: PrefixTypeTrait>(m: M) -> &'static WithMetadata<M> {
    Box::leak(Box::new(WithMetadata::new(m)))
}

/// The exported symbol name abi_stable's loader looks for (checked against abi_stable in a test).
#[doc(hidden)]
#[macro_export]
macro_rules! __rak_export_root {
    ($modref:ty, $build:expr) => {
        #[doc(hidden)]
        #[export_name = "_1as_0lib_1header_0root_bmodule_bloader"]
        pub static __RAK_ROOT_MODULE: $crate::abi_stable::library::LibHeader = {
            extern "C" fn erased() -> $crate::abi_stable::library::RootModuleResult {
                fn load() -> $modref {
                    $build
                }
                $crate::abi_stable::library::__call_root_module_loader(load)
            }
            unsafe {
                $crate::abi_stable::library::LibHeader::from_constructor::<$modref>(
                    erased,
                    $crate::abi_stable::library::CheckTypeLayout::Yes,
                )
            }
        };
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __rak_export_header {
    ($kind:ident, $name:expr) => {
        #[doc(hidden)]
        #[no_mangle]
        pub static RAK_PLUGIN_HEADER: $crate::abi::PluginHeader =
            $crate::abi::PluginHeader::new($crate::abi::PluginKind::$kind, $name, env!("CARGO_PKG_VERSION"));
    };
}

/// Export an [`Encoder`](crate::plugin::Encoder) type as this cdylib's plugin.
#[macro_export]
macro_rules! export_encoder {
    ($ty:ty) => {
        $crate::__rak_export_header!(Encoder, <$ty as $crate::plugin::PluginInfo>::NAME);
        $crate::__rak_export_root!($crate::abi::modules::EncoderModRef, $crate::plugin::ffi::encoder_module::<$ty>());
    };
}

/// Export an [`Optimizer`](crate::plugin::Optimizer) type as this cdylib's plugin.
#[macro_export]
macro_rules! export_optimizer {
    ($ty:ty) => {
        $crate::__rak_export_header!(Optimizer, <$ty as $crate::plugin::PluginInfo>::NAME);
        $crate::__rak_export_root!($crate::abi::modules::OptimizerModRef, $crate::plugin::ffi::optimizer_module::<$ty>());
    };
}

/// Export a [`Reader`](crate::plugin::Reader) type as this cdylib's plugin.
#[macro_export]
macro_rules! export_reader {
    ($ty:ty) => {
        $crate::__rak_export_header!(Reader, <$ty as $crate::plugin::PluginInfo>::NAME);
        $crate::__rak_export_root!($crate::abi::modules::ReaderModRef, $crate::plugin::ffi::reader_module::<$ty>());
    };
}

/// Export a [`Connector`](crate::plugin::Connector) type as this cdylib's plugin.
#[macro_export]
macro_rules! export_connector {
    ($ty:ty) => {
        $crate::__rak_export_header!(Connector, <$ty as $crate::plugin::PluginInfo>::NAME);
        $crate::__rak_export_root!($crate::abi::modules::ConnectorModRef, $crate::plugin::ffi::connector_module::<$ty>());
    };
}

/// Export a [`Command`](crate::plugin::Command) type as this cdylib's plugin.
#[macro_export]
macro_rules! export_command {
    ($ty:ty) => {
        $crate::__rak_export_header!(Command, <$ty as $crate::plugin::Command>::NAME);
        $crate::__rak_export_root!($crate::abi::modules::CommandModRef, $crate::plugin::ffi::command_module::<$ty>());
    };
}
