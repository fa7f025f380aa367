//! The plugin side of the ABI: generic `extern "C"` functions that adapt the SDK traits to
//! the root modules, and the export macros. Plugin authors use only the macros.

use super::{Command, Connector, Encoder, Host, Optimizer, PluginInfo, Reader};
use crate::abi::modules::*;
use crate::abi::{guard, Handle, NamedTensor, Role, TensorPtr};
use abi_stable::prefix_type::{PrefixTypeTrait, WithMetadata};
use abi_stable::std_types::{ROption, RResult, RSlice, RStr, RString, RVec};
use anyhow::Context;
use serde_json::Value;
use std::path::Path;
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

extern "C" fn create<T: PluginInfo>(settings: RStr<'_>) -> Res<Handle> {
    guard(|| {
        let value = if settings.trim().is_empty() { Value::Object(Default::default()) } else { parse_json(&settings, "settings")? };
        Ok(Handle::new(T::create(value)?))
    })
}

extern "C" fn destroy<T>(h: Handle) {
    let _ = guard(|| {
        unsafe { h.destroy::<T>() };
        Ok(())
    });
}

fn owned_named(list: Vec<(String, Tensor)>) -> RVec<NamedTensor> {
    list.into_iter().map(|(name, t)| NamedTensor { name: name.into(), tensor: TensorPtr::give(t) }).collect()
}

/// Turn lent handles into owned handles on the same `torch::Tensor` storage.
fn lent(ptrs: &[TensorPtr]) -> Vec<Tensor> {
    ptrs.iter().map(|p| unsafe { p.borrow() }.shallow_clone()).collect()
}

// ---------------------------------------------------------------- encoder

extern "C" fn encoder_encode<T: Encoder + PluginInfo>(
    h: Handle,
    texts: RSlice<'_, RStr<'_>>,
    role: Role,
    task: ROption<RStr<'_>>,
    train: bool,
) -> Res<TensorPtr> {
    guard(|| {
        let texts: Vec<&str> = texts.iter().map(|s| s.as_str()).collect();
        let task = task.as_ref().map(|s| s.as_str()).into_option();
        let out = unsafe { h.get::<T>() }.encode(&texts, role, task, train)?;
        Ok(TensorPtr::give(out))
    })
}

extern "C" fn encoder_parameters<T: Encoder + PluginInfo>(h: Handle) -> Res<RVec<NamedTensor>> {
    guard(|| Ok(owned_named(unsafe { h.get::<T>() }.parameters()?)))
}

extern "C" fn encoder_info<T: Encoder + PluginInfo>(h: Handle) -> Res<RString> {
    guard(|| Ok(unsafe { h.get::<T>() }.info()?.to_string().into()))
}

extern "C" fn encoder_save<T: Encoder + PluginInfo>(h: Handle, dir: RStr<'_>) -> Res<()> {
    guard(|| unsafe { h.get::<T>() }.save(Path::new(dir.as_str())))
}

extern "C" fn encoder_token_lengths<T: Encoder + PluginInfo>(
    h: Handle,
    texts: RSlice<'_, RStr<'_>>,
    role: Role,
    task: ROption<RStr<'_>>,
) -> Res<ROption<RVec<u32>>> {
    guard(|| {
        let texts: Vec<&str> = texts.iter().map(|s| s.as_str()).collect();
        let task = task.as_ref().map(|s| s.as_str()).into_option();
        let lengths = unsafe { h.get::<T>() }.token_lengths(&texts, role, task)?;
        Ok(lengths.map(|v| v.into_iter().map(|n| n as u32).collect()).into())
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
        })
        .static_as_prefix(),
    )
}

// ---------------------------------------------------------------- optimizer

extern "C" fn optimizer_step<T: Optimizer + PluginInfo>(
    h: Handle,
    params: RSlice<'_, TensorPtr>,
    grads: RSlice<'_, TensorPtr>,
    num_tasks: u32,
    lr: f64,
) -> Res<()> {
    guard(|| {
        let n = params.len();
        anyhow::ensure!(
            num_tasks as usize * n == grads.len(),
            "optimizer step: {} gradients for {} parameters and {} tasks",
            grads.len(),
            n,
            num_tasks
        );
        let params = lent(&params);
        let grads: Vec<Vec<Tensor>> = grads.chunks(n.max(1)).map(lent).collect();
        unsafe { h.get::<T>() }.step(&params, &grads, lr)
    })
}

extern "C" fn optimizer_state<T: Optimizer + PluginInfo>(h: Handle) -> Res<RVec<NamedTensor>> {
    guard(|| Ok(owned_named(unsafe { h.get::<T>() }.state()?)))
}

extern "C" fn optimizer_load_state<T: Optimizer + PluginInfo>(h: Handle, state: RSlice<'_, NamedTensor>) -> Res<()> {
    guard(|| {
        let state = state.iter().map(|nt| (nt.name.to_string(), unsafe { nt.tensor.borrow() }.shallow_clone())).collect();
        unsafe { h.get::<T>() }.load_state(state)
    })
}

/// The root module of an optimizer plugin.
pub fn optimizer_module<T: Optimizer + PluginInfo>() -> OptimizerModRef {
    OptimizerModRef(
        leak(OptimizerMod {
            settings_schema: settings_schema::<T>,
            create: create::<T>,
            step: optimizer_step::<T>,
            state: optimizer_state::<T>,
            load_state: optimizer_load_state::<T>,
            destroy: destroy::<T>,
        })
        .static_as_prefix(),
    )
}

// ---------------------------------------------------------------- reader

fn json_call<T>(h: Handle, request: RStr<'_>, f: impl FnOnce(&mut T, Value) -> anyhow::Result<Value>) -> Res<RString> {
    guard(|| {
        let request = parse_json(&request, "request")?;
        Ok(f(unsafe { h.get::<T>() }, request)?.to_string().into())
    })
}

extern "C" fn reader_generate<T: Reader + PluginInfo>(h: Handle, r: RStr<'_>) -> Res<RString> {
    json_call(h, r, T::generate)
}
extern "C" fn reader_score_options<T: Reader + PluginInfo>(h: Handle, r: RStr<'_>) -> Res<RString> {
    json_call(h, r, T::score_options)
}
extern "C" fn reader_passage_preferences<T: Reader + PluginInfo>(h: Handle, r: RStr<'_>) -> Res<RString> {
    json_call(h, r, T::passage_preferences)
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
    json_call(h, r, T::complete)
}

/// The root module of a connector plugin.
pub fn connector_module<T: Connector + PluginInfo>() -> ConnectorModRef {
    ConnectorModRef(
        leak(ConnectorMod {
            settings_schema: settings_schema::<T>,
            create: create::<T>,
            complete: connector_complete::<T>,
            destroy: destroy::<T>,
        })
        .static_as_prefix(),
    )
}

// ---------------------------------------------------------------- command

struct HostProxy(HostApi);

impl Host for HostProxy {
    fn call(&self, method: &str, request: Value) -> anyhow::Result<Value> {
        let reply = (self.0.call)(self.0.ctx, method.into(), request.to_string().as_str().into())
            .into_result()
            .map_err(|e| anyhow::anyhow!("host call {method}: {e}"))?;
        parse_json(&reply, "host reply")
    }
}

extern "C" fn command_schema<T: Command>() -> RString {
    schema_or_error(|| T::settings_schema())
}
extern "C" fn command_about<T: Command>() -> RString {
    T::ABOUT.into()
}
extern "C" fn command_run<T: Command>(args: RSlice<'_, RStr<'_>>, host: HostApi) -> Res<i32> {
    guard(|| {
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        T::run(&args, &HostProxy(host))
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
