//! The plugin SDK: the Rust traits a plugin implements, and the macros that export them.
//!
//! A plugin author writes ordinary Rust (`impl Optimizer for MyOpt`) and ends the crate with
//! one macro call, e.g. `rak_core::export_optimizer!(MyOpt);`. The macro emits the
//! compatibility header and the kind's root module, whose `extern "C"` functions (in
//! [`ffi`]) catch errors and panics at the boundary. The host wraps the same root modules in
//! types implementing these same traits, so toolkit code cannot tell a built-in from a
//! third-party plugin.

pub mod ffi;
mod host;

pub use host::{Host, HostConnector, HostEncoder, HostIndex, HostProgress, HostReader};

use crate::abi::Role;
use anyhow::Result;
use serde_json::Value;
use std::path::Path;
use tch::Tensor;

/// What every plugin type states about itself.
pub trait PluginInfo: Sized + Send + 'static {
    /// The name users select it by (`--encoder NAME`, `--optim NAME`).
    const NAME: &'static str;
    /// A JSON description of the settings `create` accepts (names, types, defaults, help).
    fn settings_schema() -> Value;
    /// Build an instance from a JSON object of settings.
    fn create(settings: Value) -> Result<Self>;
}

/// Text → embedding. Implementations keep their parameters on the device they were created on.
pub trait Encoder: Send {
    /// `[texts.len(), dim]` f32 (or bf16) embeddings. With `train`, dropout is on and the
    /// result carries gradients back to [`Encoder::parameters`].
    fn encode(&mut self, texts: &[&str], role: Role, task: Option<&str>, train: bool) -> Result<Tensor>;
    /// Trainable parameters (shallow clones: they share storage and `.grad`).
    fn parameters(&self) -> Result<Vec<(String, Tensor)>>;
    /// At least `{"dim": n, "parameters": n}`.
    fn info(&self) -> Result<Value>;
    /// Write a Hugging Face-style checkpoint directory.
    fn save(&self, dir: &Path) -> Result<()>;
    /// How many tokens each text becomes (after truncation), if the encoder can tell; callers
    /// sort by it so batches pad little. Characters are a poor proxy: on mini-KILT, batches
    /// sorted by characters carry 26% padding.
    fn token_lengths(&mut self, _texts: &[&str], _role: Role, _task: Option<&str>) -> Result<Option<Vec<usize>>> {
        Ok(None)
    }
}

/// Implement [`Encoder`] for a newtype `struct Name(Inner)` by delegating every method to
/// `Inner` (how the built-in plugins wrap the encoders in `rak_core::encoders`).
#[macro_export]
macro_rules! delegate_encoder {
    ($ty:ty) => {
        impl $crate::plugin::Encoder for $ty {
            fn encode(
                &mut self,
                texts: &[&str],
                role: $crate::abi::Role,
                task: Option<&str>,
                train: bool,
            ) -> $crate::anyhow::Result<$crate::tch::Tensor> {
                self.0.encode(texts, role, task, train)
            }
            fn parameters(&self) -> $crate::anyhow::Result<Vec<(String, $crate::tch::Tensor)>> {
                self.0.parameters()
            }
            fn info(&self) -> $crate::anyhow::Result<serde_json::Value> {
                self.0.info()
            }
            fn save(&self, dir: &std::path::Path) -> $crate::anyhow::Result<()> {
                self.0.save(dir)
            }
            fn token_lengths(
                &mut self,
                texts: &[&str],
                role: $crate::abi::Role,
                task: Option<&str>,
            ) -> $crate::anyhow::Result<Option<Vec<usize>>> {
                self.0.token_lengths(texts, role, task)
            }
        }
    };
}

/// Updates parameters from per-task gradients.
pub trait Optimizer: Send {
    /// `grads[t][i]` is task `t`'s gradient for `params[i]` (undefined when the task has none).
    /// Single-task optimizers sum over tasks.
    fn step(&mut self, params: &[Tensor], grads: &[Vec<Tensor>], lr: f64) -> Result<()>;
    /// Named copies of the state, for checkpoints.
    fn state(&self) -> Result<Vec<(String, Tensor)>>;
    /// Restore what [`Optimizer::state`] returned.
    fn load_state(&mut self, state: Vec<(String, Tensor)>) -> Result<()>;
}

/// A local LM that reads passages (FiD). JSON requests so the protocol can grow.
pub trait Reader: Send {
    fn generate(&mut self, request: Value) -> Result<Value>;
    fn score_options(&mut self, request: Value) -> Result<Value>;
    fn passage_preferences(&mut self, request: Value) -> Result<Value>;
}

/// A black-box target LM behind an HTTP API. `complete` takes `&self`: callers issue requests
/// from several threads at once.
pub trait Connector: Send + Sync {
    fn complete(&self, request: Value) -> Result<Value>;
}

/// A `host <name>` subcommand. `host` offers the toolkit's services (encoders, indexes,
/// search, evaluation, readers, connectors, progress); it may be shared across threads.
pub trait Command: Sized + 'static {
    const NAME: &'static str;
    const ABOUT: &'static str;
    fn settings_schema() -> Value;
    fn run(args: &[String], host: &Host) -> Result<i32>;
}

/// Sum per-task gradients into one tensor per parameter (`None` where no task has one).
pub fn sum_task_grads(grads: &[Vec<Tensor>], n_params: usize) -> Vec<Option<Tensor>> {
    (0..n_params)
        .map(|i| {
            grads.iter().map(|g| &g[i]).filter(|g| g.defined()).fold(None, |acc: Option<Tensor>, g| {
                Some(match acc {
                    None => g.shallow_clone(),
                    Some(a) => a + g,
                })
            })
        })
        .collect()
}
