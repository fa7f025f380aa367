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
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
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
    /// A training pass ([`Encoder::encode`] with `train`) whose dropout masks come from one key
    /// per text, so that a text's masks depend on its key alone, not on the batch it shares
    /// (what keeps a data-parallel run equal to one process, dropout on). The default, for
    /// encoders that cannot key their masks, draws them from torch's generator as `encode`
    /// does.
    fn encode_keyed(&mut self, texts: &[&str], role: Role, task: Option<&str>, keys: &[u64]) -> Result<Tensor> {
        let _ = keys;
        self.encode(texts, role, task, true)
    }
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
    /// A hint: these texts come next, in an [`Encoder::encode`] or [`Encoder::encode_keyed`]
    /// call of the same texts, role and task, so the encoder may tokenise them now, on a
    /// thread of its own, while the caller's device is busy (the trainer hands each step the
    /// next step's texts, `host encode` each batch the next batch). It must never change what
    /// an encode call returns. The default does nothing.
    fn prepare(&mut self, _texts: &[&str], _role: Role, _task: Option<&str>) -> Result<()> {
        Ok(())
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
            fn encode_keyed(
                &mut self,
                texts: &[&str],
                role: $crate::abi::Role,
                task: Option<&str>,
                keys: &[u64],
            ) -> $crate::anyhow::Result<$crate::tch::Tensor> {
                self.0.encode_keyed(texts, role, task, keys)
            }
            fn parameters(&self) -> $crate::anyhow::Result<Vec<(String, $crate::tch::Tensor)>> {
                self.0.parameters()
            }
            fn info(&self) -> $crate::anyhow::Result<$crate::serde_json::Value> {
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
            fn prepare(&mut self, texts: &[&str], role: $crate::abi::Role, task: Option<&str>) -> $crate::anyhow::Result<()> {
                self.0.prepare(texts, role, task)
            }
        }
    };
}

/// What an optimizer is told at the start of a step (it crosses the ABI as JSON).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct StepContext {
    /// Steps already taken (0 for the first).
    pub step: u64,
    /// Steps the run will take in all.
    pub total_steps: u64,
    /// Warm-up steps of the learning-rate schedule (T-SAGE's burn-in uses the same span).
    pub warmup_steps: u64,
    /// This step's learning rate, schedule applied.
    pub lr: f64,
    /// The run's task names, in the order their gradients come.
    pub tasks: Vec<String>,
    /// Clip the combined gradient to this global L2 norm.
    pub max_grad_norm: Option<f64>,
    /// Per-parameter learning-rate factors (TASER's layer-wise decay); absent means 1.
    pub lr_scale: BTreeMap<String, f64>,
    /// Parameters exempt from weight decay (biases and LayerNorm weights, by convention).
    pub no_weight_decay: BTreeSet<String>,
    /// A random stream for the optimizer's own draws (PCGrad's projection orders), derived
    /// by the trainer from the run's seed, the optimizer's purpose and the stage: another
    /// seed, another stream.
    pub seed: u64,
}

/// Updates parameters from per-task gradients, one step at a time (see
/// [`OptimizerMod`](crate::abi::modules::OptimizerMod)): `begin_step`, then
/// `task_gradients` once per task, then `finish_step`.
pub trait Optimizer: Send {
    /// The parameters to update (shallow clones sharing storage with the model's) and the
    /// step's context. A step that was begun and not finished (the trainer skips a step whose
    /// loss is not finite) is discarded: no update, and no state it accumulated for that step
    /// may carry over (T-SAGE's momentum is the documented exception: it folds each task in
    /// as it arrives).
    fn begin_step(&mut self, params: Vec<(String, Tensor)>, ctx: StepContext) -> Result<()>;
    /// One task's loss and gradients. The tensors are lent: copy or fold in what you keep,
    /// the caller reuses their storage after the call.
    fn task_gradients(&mut self, task: &str, loss: f64, grads: Vec<(String, Tensor)>) -> Result<()>;
    /// Combine, clip, update the parameters in place; statistics for the log.
    fn finish_step(&mut self) -> Result<Value>;
    /// The state by name, for checkpoints (keyed by parameter name). The tensors may share
    /// storage with the live state (the host writes them out before the next step); a caller
    /// that keeps them across steps copies them.
    fn state(&self) -> Result<Vec<(String, Tensor)>>;
    /// Restore what [`Optimizer::state`] returned.
    fn load_state(&mut self, state: Vec<(String, Tensor)>) -> Result<()>;
    /// Whether each task's gradient must come on its own (T-SAGE, PCGrad, CGD, GradNorm). One
    /// that returns false is handed the gradient of the summed losses once per step, as task
    /// [`ALL_TASKS`] (each task's backward adding into it, so one task's graph is held at a
    /// time; with the whole step's passages as in-batch negatives, from one backward pass over
    /// every task's graph).
    fn needs_task_gradients(&self) -> Result<bool> {
        Ok(true)
    }
}

/// The task name of a gradient that sums every task's (see
/// [`Optimizer::needs_task_gradients`]).
pub const ALL_TASKS: &str = "*";

/// One whole step: the common case outside the trainer (tests, simple loops). `task_grads`
/// holds `(task, loss, gradients by name)`.
pub fn optimizer_step(
    opt: &mut dyn Optimizer,
    params: &[(String, Tensor)],
    task_grads: Vec<(String, f64, Vec<(String, Tensor)>)>,
    ctx: StepContext,
) -> Result<Value> {
    opt.begin_step(params.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect(), ctx)?;
    for (task, loss, grads) in task_grads {
        opt.task_gradients(&task, loss, grads)?;
    }
    opt.finish_step()
}

/// `impl Optimizer for $wrapper` by forwarding every method to its field `.0`, itself an
/// [`Optimizer`]: a plugin crate wraps an optimizer of this crate in a newtype (to implement
/// [`PluginInfo`] for it) and forwards the rest.
#[macro_export]
macro_rules! forward_optimizer {
    ($wrapper:ty) => {
        impl $crate::plugin::Optimizer for $wrapper {
            fn begin_step(&mut self, params: Vec<(String, $crate::tch::Tensor)>, ctx: $crate::plugin::StepContext) -> $crate::anyhow::Result<()> {
                $crate::plugin::Optimizer::begin_step(&mut self.0, params, ctx)
            }
            fn task_gradients(&mut self, task: &str, loss: f64, grads: Vec<(String, $crate::tch::Tensor)>) -> $crate::anyhow::Result<()> {
                $crate::plugin::Optimizer::task_gradients(&mut self.0, task, loss, grads)
            }
            fn finish_step(&mut self) -> $crate::anyhow::Result<$crate::serde_json::Value> {
                $crate::plugin::Optimizer::finish_step(&mut self.0)
            }
            fn state(&self) -> $crate::anyhow::Result<Vec<(String, $crate::tch::Tensor)>> {
                $crate::plugin::Optimizer::state(&self.0)
            }
            fn load_state(&mut self, state: Vec<(String, $crate::tch::Tensor)>) -> $crate::anyhow::Result<()> {
                $crate::plugin::Optimizer::load_state(&mut self.0, state)
            }
            fn needs_task_gradients(&self) -> $crate::anyhow::Result<bool> {
                $crate::plugin::Optimizer::needs_task_gradients(&self.0)
            }
        }
    };
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
    /// A request whose reply comes in pieces (`"stream": true`): each piece goes to `sink` as
    /// it arrives; `sink` returns `false` to stop early. Returns what `complete` would (a
    /// status, or `{"error": ...}`). Connectors that cannot stream refuse.
    fn stream(&self, request: Value, sink: &mut dyn FnMut(&str) -> bool) -> Result<Value> {
        let _ = (request, sink);
        anyhow::bail!("this connector cannot stream replies")
    }
}

/// A `host <name>` subcommand. `host` offers the toolkit's services (encoders, indexes,
/// search, evaluation, readers, connectors, progress); it may be shared across threads.
pub trait Command: Sized + 'static {
    const NAME: &'static str;
    const ABOUT: &'static str;
    fn settings_schema() -> Value;
    fn run(args: &[String], host: &Host) -> Result<i32>;
}
