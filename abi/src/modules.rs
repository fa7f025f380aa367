//! One prefix-type root module per plugin kind.
//!
//! Every module starts with `settings_schema` (a JSON description of the plugin's settings),
//! then `create` / kind-specific calls / `destroy`. Every call that runs plugin code returns
//! `RResult<_, RString>`; the plugin side wraps each in [`super::guard`], so errors and panics
//! come back as messages. Add new functions only at the end, after the current last field:
//! hosts see them as `Option`s and old plugins keep loading.

use super::{ChunkSink, Handle, NamedTensor, Role, TensorPtr};
use abi_stable::library::RootModule;
use abi_stable::sabi_types::VersionStrings;
use abi_stable::std_types::{ROption, RResult, RSlice, RStr, RString, RVec};
use abi_stable::{declare_root_module_statics, StableAbi};

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
    /// Optional (added after the first release; the host falls back to `encode` with `train`):
    /// a training pass whose dropout masks come from one key per text (`keys.len() ==
    /// texts.len()`), so that a text's masks do not depend on the batch it shares.
    pub encode_keyed: extern "C" fn(
        h: Handle,
        texts: RSlice<'_, RStr<'_>>,
        role: Role,
        task: ROption<RStr<'_>>,
        keys: RSlice<'_, u64>,
    ) -> Res<TensorPtr>,
    /// Optional (added in ABI 2.0's lifetime; the host skips it for plugins without it): a
    /// hint that these texts come next in an `encode` or `encode_keyed` call of the same
    /// role and task, so the encoder may tokenise them ahead. Must not change any result.
    pub prepare: extern "C" fn(h: Handle, texts: RSlice<'_, RStr<'_>>, role: Role, task: ROption<RStr<'_>>) -> Res<()>,
}

/// Optimizers, step by step in a streaming form: `begin_step` names the parameters and
/// carries the step's JSON context (step, total steps, learning rate, task names, clipping,
/// per-parameter learning-rate factors and weight-decay exclusions); `task_gradients` hands
/// over one task's loss and gradients as the task finishes, so an optimizer can fold each in
/// and never hold every task's gradient at once; `finish_step` combines and updates the
/// parameters in place, returning JSON statistics. All tensors are lent for the call: copy
/// what you keep. State is keyed by name.
#[repr(C)]
#[derive(StableAbi)]
#[sabi(kind(Prefix(prefix_ref = OptimizerModRef)))]
#[sabi(missing_field(option))]
pub struct OptimizerMod {
    pub settings_schema: extern "C" fn() -> RString,
    pub create: extern "C" fn(settings: RStr<'_>) -> Res<Handle>,
    pub begin_step: extern "C" fn(h: Handle, params: RSlice<'_, NamedTensor>, context: RStr<'_>) -> Res<()>,
    /// Gradients by parameter name; a parameter the task did not reach may be missing or
    /// undefined.
    pub task_gradients: extern "C" fn(h: Handle, task: RStr<'_>, loss: f64, grads: RSlice<'_, NamedTensor>) -> Res<()>,
    pub finish_step: extern "C" fn(h: Handle) -> Res<RString>,
    /// The optimizer state, for checkpoints: owned handles that may share storage with the
    /// live state, valid until the next call that changes it (the host writes them out at once).
    pub state: extern "C" fn(h: Handle) -> Res<RVec<NamedTensor>>,
    /// Lent tensors; the plugin copies what it keeps.
    pub load_state: extern "C" fn(h: Handle, state: RSlice<'_, NamedTensor>) -> Res<()>,
    #[sabi(last_prefix_field)]
    pub destroy: extern "C" fn(h: Handle),
    /// Optional (added after the first release; a plugin without it is taken to need them):
    /// whether the optimizer needs each task's gradient on its own. One that does not (plain
    /// AdamW on the sum) gets one `task_gradients` call per step, named `*`, with the gradient
    /// of the sum of the tasks' losses.
    pub needs_task_gradients: extern "C" fn(h: Handle) -> Res<bool>,
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
/// `complete` may be called from several threads at once on one instance.
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
    /// Optional (added after the first release; older plugins lack it): `complete` for a
    /// request whose reply comes in pieces (a streamed completion). Each piece goes to `sink`
    /// as it arrives, on the calling thread, in order; a sink that returns `false` asks the
    /// plugin to stop reading. Returns the JSON summary `complete` would (status, error).
    pub stream: extern "C" fn(h: Handle, request: RStr<'_>, sink: ChunkSink) -> Res<RString>,
}

/// The services the host offers a command plugin: a prefix-type module, so services can be
/// appended without breaking command plugins built earlier (they see `None` for what their host
/// lacks, and a newer plugin sees `None` for what an older host lacks). Every function is safe to
/// call from several threads at once. Objects (encoders, readers, connectors, open indexes) are
/// named by ids the host hands out; see `docs/plugins.md` for the JSON methods.
#[repr(C)]
#[derive(StableAbi)]
#[sabi(kind(Prefix(prefix_ref = HostModRef)))]
#[sabi(missing_field(option))]
pub struct HostMod {
    /// JSON services by name: `version`, `plugins`, `log`, `progress`, `encode_corpus`,
    /// `build_index`, `search`, `eval`.
    pub call: extern "C" fn(ctx: Handle, method: RStr<'_>, request: RStr<'_>) -> Res<RString>,
    /// Make an object: `kind` `encoder`, `reader` or `connector` from the plugin `name` with the
    /// JSON `settings`, or `index` from the directory `name`. Returns its id.
    pub create: extern "C" fn(ctx: Handle, kind: RStr<'_>, name: RStr<'_>, settings: RStr<'_>) -> Res<u64>,
    /// A JSON method of an object (encoder: `info`, `save`, `token_lengths`; reader:
    /// `generate`, `score_options`, `passage_preferences`; connector: `complete`; index: `info`,
    /// `search`).
    pub object_call: extern "C" fn(ctx: Handle, id: u64, method: RStr<'_>, request: RStr<'_>) -> Res<RString>,
    /// Encoder object: an owned `[texts.len(), dim]` tensor; with `train`, it carries autograd
    /// back to the encoder's parameters.
    pub encode: extern "C" fn(
        ctx: Handle,
        id: u64,
        texts: RSlice<'_, RStr<'_>>,
        role: Role,
        task: ROption<RStr<'_>>,
        train: bool,
    ) -> Res<TensorPtr>,
    /// Encoder object: its trainable parameters, owned handles sharing storage and `.grad`.
    pub parameters: extern "C" fn(ctx: Handle, id: u64) -> Res<RVec<NamedTensor>>,
    /// Dense index object: the top `k` passages of each row of the lent `[n, dim]` query
    /// tensor, as JSON `[[[id, score], ...], ...]`.
    pub search_vectors: extern "C" fn(ctx: Handle, id: u64, queries: TensorPtr, k: u32) -> Res<RString>,
    /// Drop an object.
    #[sabi(last_prefix_field)]
    pub release: extern "C" fn(ctx: Handle, id: u64) -> Res<()>,
}

/// What a command's `run` receives: the host's context and its service module. Both fields
/// are fixed forever; growth happens inside [`HostMod`].
#[repr(C)]
#[derive(StableAbi, Clone, Copy)]
pub struct HostApi {
    pub ctx: Handle,
    pub services: HostModRef,
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
    /// `args` excludes the subcommand name. Returns the process exit code (0 to 255; anything
    /// else makes `host` fail).
    #[sabi(last_prefix_field)]
    pub run: extern "C" fn(args: RSlice<'_, RStr<'_>>, host: HostApi) -> Res<i32>,
}

macro_rules! root_module {
    ($($ty:ident => $name:literal),* $(,)?) => {$(
        impl RootModule for $ty {
            declare_root_module_statics! {$ty}
            const BASE_NAME: &'static str = $name;
            const NAME: &'static str = $name;
            // The ABI's version, not rak-core's: a plugin built against another release of the
            // crate with the same ABI must load.
            const VERSION_STRINGS: VersionStrings = VersionStrings::new(super::ABI_VERSION_STRING);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// abi_stable refuses a root module whose version string is incompatible (for 0.x: another
    /// minor); it must carry the ABI version, never the crate's.
    #[test]
    fn root_modules_carry_the_abi_version() {
        let want = format!("{}.0.0", crate::ABI_VERSION);
        for v in [
            <EncoderModRef as RootModule>::VERSION_STRINGS,
            <OptimizerModRef as RootModule>::VERSION_STRINGS,
            <ReaderModRef as RootModule>::VERSION_STRINGS,
            <ConnectorModRef as RootModule>::VERSION_STRINGS,
            <CommandModRef as RootModule>::VERSION_STRINGS,
        ] {
            assert_eq!(v.version.as_str(), want);
        }
    }
}
