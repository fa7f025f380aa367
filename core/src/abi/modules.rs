//! One prefix-type root module per plugin kind.
//!
//! Every module starts with `settings_schema` (a JSON description of the plugin's settings),
//! then `create` / kind-specific calls / `destroy`. Every call that runs plugin code returns
//! `RResult<_, RString>`; the plugin side wraps each in [`super::guard`], so errors and panics
//! come back as messages. Add new functions only at the end, after the current last field:
//! hosts see them as `Option`s and old plugins keep loading.

use super::{Handle, NamedTensor, Role, TensorPtr};
use abi_stable::library::RootModule;
use abi_stable::sabi_types::VersionStrings;
use abi_stable::std_types::{ROption, RResult, RSlice, RStr, RString, RVec};
use abi_stable::{declare_root_module_statics, package_version_strings, StableAbi};

type Res<T> = RResult<T, RString>;

/// Text encoders (DPR, TASER, TACO, ...): text in, embedding tensor out, with autograd.
#[repr(C)]
#[derive(StableAbi)]
#[sabi(kind(Prefix(prefix_ref = EncoderModRef)))]
#[sabi(missing_field(option))]
pub struct EncoderMod {
    pub settings_schema: extern "C" fn() -> RString,
    /// `settings`: JSON object.
    pub create: extern "C" fn(settings: RStr<'_>) -> Res<Handle>,
    /// Returns an owned `[texts.len(), dim]` tensor. `train` enables dropout and autograd.
    pub encode: extern "C" fn(
        h: Handle,
        texts: RSlice<'_, RStr<'_>>,
        role: Role,
        task: ROption<RStr<'_>>,
        train: bool,
    ) -> Res<TensorPtr>,
    /// Owned handles sharing storage (and `.grad`) with the trainable parameters.
    pub parameters: extern "C" fn(h: Handle) -> Res<RVec<NamedTensor>>,
    /// JSON: at least `{"dim": n, "parameters": n}`; optionally `"lr_scale": {name: factor}`.
    pub info: extern "C" fn(h: Handle) -> Res<RString>,
    /// Write a Hugging Face-style checkpoint directory.
    pub save: extern "C" fn(h: Handle, dir: RStr<'_>) -> Res<()>,
    #[sabi(last_prefix_field)]
    pub destroy: extern "C" fn(h: Handle),
    /// Optional (added after the first release, so older plugins lack it): the number of
    /// tokens each text becomes, so callers can batch by token length. `RNone` when the
    /// encoder cannot tell.
    pub token_lengths:
        extern "C" fn(h: Handle, texts: RSlice<'_, RStr<'_>>, role: Role, task: ROption<RStr<'_>>) -> Res<ROption<RVec<u32>>>,
}

/// Optimizers. `grads` is task-major: `grads[t * params.len() + i]` is task `t`'s gradient of
/// `params[i]` (an undefined tensor when the task gave none). Everything is lent for the call.
#[repr(C)]
#[derive(StableAbi)]
#[sabi(kind(Prefix(prefix_ref = OptimizerModRef)))]
#[sabi(missing_field(option))]
pub struct OptimizerMod {
    pub settings_schema: extern "C" fn() -> RString,
    pub create: extern "C" fn(settings: RStr<'_>) -> Res<Handle>,
    pub step: extern "C" fn(
        h: Handle,
        params: RSlice<'_, TensorPtr>,
        grads: RSlice<'_, TensorPtr>,
        num_tasks: u32,
        lr: f64,
    ) -> Res<()>,
    /// Owned copies of the optimizer state, for checkpoints.
    pub state: extern "C" fn(h: Handle) -> Res<RVec<NamedTensor>>,
    /// Lent tensors; the plugin copies what it keeps.
    pub load_state: extern "C" fn(h: Handle, state: RSlice<'_, NamedTensor>) -> Res<()>,
    #[sabi(last_prefix_field)]
    pub destroy: extern "C" fn(h: Handle),
}

/// Readers: local LMs that read passages. Requests and replies are JSON.
#[repr(C)]
#[derive(StableAbi)]
#[sabi(kind(Prefix(prefix_ref = ReaderModRef)))]
#[sabi(missing_field(option))]
pub struct ReaderMod {
    pub settings_schema: extern "C" fn() -> RString,
    pub create: extern "C" fn(settings: RStr<'_>) -> Res<Handle>,
    pub generate: extern "C" fn(h: Handle, request: RStr<'_>) -> Res<RString>,
    pub score_options: extern "C" fn(h: Handle, request: RStr<'_>) -> Res<RString>,
    pub passage_preferences: extern "C" fn(h: Handle, request: RStr<'_>) -> Res<RString>,
    #[sabi(last_prefix_field)]
    pub destroy: extern "C" fn(h: Handle),
}

/// Connectors: black-box target LMs reached over HTTP. Requests and replies are JSON.
#[repr(C)]
#[derive(StableAbi)]
#[sabi(kind(Prefix(prefix_ref = ConnectorModRef)))]
#[sabi(missing_field(option))]
pub struct ConnectorMod {
    pub settings_schema: extern "C" fn() -> RString,
    pub create: extern "C" fn(settings: RStr<'_>) -> Res<Handle>,
    pub complete: extern "C" fn(h: Handle, request: RStr<'_>) -> Res<RString>,
    #[sabi(last_prefix_field)]
    pub destroy: extern "C" fn(h: Handle),
}

/// What the host offers a command plugin: one JSON call (`method`, `request`) -> JSON reply,
/// so the set of services can grow without an ABI change.
#[repr(C)]
#[derive(StableAbi, Clone, Copy)]
pub struct HostApi {
    pub ctx: Handle,
    pub call: extern "C" fn(ctx: Handle, method: RStr<'_>, request: RStr<'_>) -> Res<RString>,
}

/// Commands: add a `host <name>` subcommand.
#[repr(C)]
#[derive(StableAbi)]
#[sabi(kind(Prefix(prefix_ref = CommandModRef)))]
#[sabi(missing_field(option))]
pub struct CommandMod {
    pub settings_schema: extern "C" fn() -> RString,
    /// One-line help shown by `host --help`-style listings.
    pub about: extern "C" fn() -> RString,
    /// `args` excludes the subcommand name. Returns the process exit code.
    #[sabi(last_prefix_field)]
    pub run: extern "C" fn(args: RSlice<'_, RStr<'_>>, host: HostApi) -> Res<i32>,
}

macro_rules! root_module {
    ($($ty:ident => $name:literal),* $(,)?) => {$(
        impl RootModule for $ty {
            declare_root_module_statics! {$ty}
            const BASE_NAME: &'static str = $name;
            const NAME: &'static str = $name;
            const VERSION_STRINGS: VersionStrings = package_version_strings!();
        }
    )*};
}

root_module! {
    EncoderModRef => "rak_encoder",
    OptimizerModRef => "rak_optimizer",
    ReaderModRef => "rak_reader",
    ConnectorModRef => "rak_connector",
    CommandModRef => "rak_command",
}
