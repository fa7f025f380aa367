//! The training loop: multitask steps of per-task contrastive losses, one optimizer step each,
//! checkpoints an interrupted run resumes from exactly.
//!
//! A step: the sampler picks each task's examples; for each task in turn the encoder embeds
//! the queries (with the task name, for prefixes or markers) and each query's group (its
//! positive, then `h` hard negatives), [`nce_loss`] scores them, backward fills the gradients,
//! and the optimizer receives that task's loss and gradients before they are zeroed for the
//! next task. `finish_step` then combines and updates. Dropout masks are keyed per text by
//! (seed, step, task, row) through [`Encoder::encode_keyed`], so a resumed run draws what the
//! uninterrupted one would, and a data-parallel run what one process would. Encoder plugins
//! without keyed encoding draw from libtorch's global generator, reseeded from (seed, step,
//! rank) at each step.

use crate::data::TaskData;
use crate::loss::{copies_of_any_positive, copies_of_positives, lm_supervised_loss, multi_positive_loss, nce_loss, nce_loss_against};
use rak_core::rng::Rng;
use crate::sampler::{SubBatch, TacoSampler, TacoSamplerState, TaskPerBatchSampler, TaskPerBatchState};
use crate::schedule::linear_warmup_decay;
use anyhow::{bail, Context, Result};
use rak_core::abi::Role;
use rak_core::autograd::Autocast;
use rak_core::dist::ProcessGroup;
use rak_core::plugin::{Encoder, Optimizer, StepContext, ALL_TASKS};
use rak_core::profiler::{Recording, Scope};
use rak_retrieval::pipeline::Progress;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use tch::{Kind, Tensor};

/// How batches are composed.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum SamplerKind {
    /// TACO: every step holds every task, sizes from `(N_t/ΣN)^(1/temperature)`.
    Taco { temperature: f64 },
    /// MT-DPR: one task per batch, batches of all tasks shuffled.
    TaskPerBatch,
}

/// Which passages are a query's in-batch negatives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InBatchNegatives {
    /// Its own task's sub-batch (TACO's code: the loss is computed per task).
    #[default]
    Task,
    /// Every passage of the step, whatever its task (one batch of the union, as
    /// sentence-transformers' MultipleNegativesRankingLoss over mixed data).
    Step,
}

/// How the tasks' losses add up to the step's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TaskLossWeight {
    /// The sum of each task's mean loss (TACO's code): every task weighs the same in every
    /// step, whatever its sub-batch size, so the sampler's temperature sets how often a task's
    /// examples are seen but not how much the task counts.
    #[default]
    Equal,
    /// Each task's mean loss times `T · b_t / B` (its share of the step's `B` queries, times
    /// the number of tasks `T` so that the total keeps the scale of `equal`): the mean over
    /// every query of the step, as one batch of the union; the sampler's temperature then sets
    /// the task mixture (temperature sampling as in multilingual training).
    Queries,
}

/// The contrastive loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LossKind {
    /// NCE with one positive per query (one of its gold passages, drawn each step).
    #[default]
    Nce,
    /// AAR's (REFERENCE §6): every positive of a query in the batch, each scored against every
    /// passage that is not one of the query's positives.
    MultiPositive,
    /// REPLUG's LM-supervised retrieval (REFERENCE §6, its end): each query's distribution over
    /// the passages a language model scored (softmax of `score_scale · <q, p>`, so REPLUG's γ is
    /// `1 / score_scale`) trained toward the LM's (softmax of its scores / `lm_temperature`) by
    /// KL. No in-batch or hard negatives: only the query's own scored passages.
    LmSupervised,
}

/// Everything the loop needs to know (after the command resolved flags over the config).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainerConfig {
    pub learning_rate: f64,
    /// Queries per step, over all tasks.
    pub batch_size: usize,
    /// Hard negatives per query (the group is 1 + this).
    pub hard_negatives: usize,
    pub sampler: SamplerKind,
    pub max_steps: u64,
    pub warmup_ratio: f64,
    pub max_grad_norm: Option<f64>,
    pub seed: u64,
    pub logging_steps: u64,
    pub save_steps: u64,
    /// Keep only the newest this many checkpoints. Not part of the run's identity: a resumed
    /// run may change it.
    #[serde(skip)]
    pub save_total_limit: Option<usize>,
    /// Encode queries with their task's name; the encoder turns it into a prefix, a marker or
    /// a `?`, or ignores it.
    pub task_names: bool,
    /// Scale each parameter's learning rate by the encoder's `lr_scale` (TASER).
    pub layerwise_lr_decay: bool,
    /// Stop after this many steps skipped for a non-finite loss.
    pub max_skipped_steps: u64,
    /// Factor on the query-passage scores in the loss (1: the raw dot product).
    #[serde(default = "one")]
    pub score_scale: f64,
    /// Mixed precision as Hugging Face's Trainer with `bf16=True`: float32 weights and
    /// optimizer state, the encoders' forward (and so their backward) under bf16 autocast.
    #[serde(default)]
    pub bf16: bool,
    #[serde(default)]
    pub in_batch_negatives: InBatchNegatives,
    #[serde(default)]
    pub task_loss_weight: TaskLossWeight,
    #[serde(default)]
    pub loss: LossKind,
    /// REPLUG's β for the `lm_supervised` loss (absent for every other loss, so that runs made
    /// before it existed still resume).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lm_temperature: Option<f64>,
    /// NCE: a passage elsewhere in the batch that is one of the query's gold passages (a copy
    /// of the drawn positive, as another query's positive or another's hard negative, or
    /// another of its gold passages) is left out of its candidates rather than counted a
    /// negative. Written only when set, so that runs made before it existed still resume.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub mask_positive_copies: bool,
}

fn one() -> f64 {
    1.0
}

/// The settings that go with (or only with) a loss: `lm_supervised` takes no hard negatives
/// and a positive `lm_temperature`, which no other loss takes; `mask_positive_copies` is NCE's.
/// `host train` checks them before any work; the trainer again for whoever builds one directly.
pub fn check_loss_settings(loss: LossKind, hard_negatives: usize, lm_temperature: Option<f64>, mask_positive_copies: bool) -> Result<()> {
    if mask_positive_copies && loss != LossKind::Nce {
        bail!(
            "mask_positive_copies is the nce loss's setting (multi_positive always leaves copies of a query's positives out; lm_supervised has no in-batch negatives); this recipe's loss is {}",
            serde_json::to_string(&loss)?
        );
    }
    if loss != LossKind::LmSupervised {
        if lm_temperature.is_some() {
            bail!("lm_temperature is the lm_supervised loss's setting; this recipe's loss is {}", serde_json::to_string(&loss)?);
        }
        return Ok(());
    }
    if hard_negatives > 0 {
        bail!("loss = \"lm_supervised\" trains on each query's LM-scored passages only: set hard_negatives = 0 (it is {hard_negatives})");
    }
    match lm_temperature {
        Some(b) if b > 0.0 && b.is_finite() => Ok(()),
        other => bail!("loss = \"lm_supervised\" needs a positive lm_temperature (REPLUG's β), not {other:?}"),
    }
}

/// The sampler in use.
#[derive(Debug, Clone)]
pub enum Sampler {
    Taco(TacoSampler),
    TaskPerBatch(TaskPerBatchSampler),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum SamplerState {
    Taco(TacoSamplerState),
    TaskPerBatch(TaskPerBatchState),
}

impl Sampler {
    pub fn new(kind: SamplerKind, counts: &[usize], batch_size: usize, seed: u64) -> Result<Self> {
        Ok(match kind {
            SamplerKind::Taco { temperature } => Sampler::Taco(TacoSampler::new(counts, batch_size, temperature, seed)?),
            SamplerKind::TaskPerBatch => Sampler::TaskPerBatch(TaskPerBatchSampler::new(counts, batch_size, seed)?),
        })
    }
    pub fn steps_per_epoch(&self) -> usize {
        match self {
            Sampler::Taco(s) => s.steps_per_epoch(),
            Sampler::TaskPerBatch(s) => s.steps_per_epoch(),
        }
    }
    fn next_step(&mut self) -> Vec<SubBatch> {
        match self {
            Sampler::Taco(s) => s.next_step(),
            Sampler::TaskPerBatch(s) => s.next_step(),
        }
    }
    fn state(&self) -> SamplerState {
        match self {
            Sampler::Taco(s) => SamplerState::Taco(s.state()),
            Sampler::TaskPerBatch(s) => SamplerState::TaskPerBatch(s.state()),
        }
    }
    fn load_state(&mut self, state: &SamplerState) -> Result<()> {
        match (self, state) {
            (Sampler::Taco(s), SamplerState::Taco(st)) => s.load_state(st),
            (Sampler::TaskPerBatch(s), SamplerState::TaskPerBatch(st)) => s.load_state(st),
            _ => bail!("the checkpoint was written with another sampler"),
        }
    }
}

/// The trainer settings a resume may change: they change no weight (how often the run logs
/// and saves, and how many non-finite steps it tolerates), as `run.json`'s recipe identity
/// leaves them out too.
pub const RESUMABLE_SETTINGS: [&str; 3] = ["logging_steps", "save_steps", "max_skipped_steps"];

/// Check that `checkpoint` is one this run can resume from before anything depends on it: a
/// folder holding the trainer's state and the optimizer's, written with `config` (but for
/// [`RESUMABLE_SETTINGS`]) over `world` processes, and of stage `episode` when given. The
/// differing settings are named. Returns the state.
pub fn check_checkpoint(checkpoint: &Path, config: &TrainerConfig, world: usize, episode: Option<u32>) -> Result<TrainerState> {
    if !checkpoint.is_dir() {
        bail!("{}: no such checkpoint folder", checkpoint.display());
    }
    let state_path = checkpoint.join(STATE_FILE);
    let text = std::fs::read_to_string(&state_path).with_context(|| format!("{}: cannot read (not a checkpoint of host train's?)", state_path.display()))?;
    let state: TrainerState = serde_json::from_str(&text).with_context(|| format!("{}: not a trainer state", state_path.display()))?;
    let (then, now) = (serde_json::to_value(&state.config)?, serde_json::to_value(config)?);
    let (then, now) = (then.as_object().cloned().unwrap_or_default(), now.as_object().cloned().unwrap_or_default());
    let keys: BTreeSet<&String> = then.keys().chain(now.keys()).filter(|k| !RESUMABLE_SETTINGS.contains(&k.as_str())).collect();
    let at = |o: &serde_json::Map<String, Value>, k: &str| o.get(k).cloned().unwrap_or(Value::Null);
    let differing: Vec<String> = keys.into_iter().filter(|k| at(&then, k) != at(&now, k)).map(|k| format!("  {k}: {} then, {} now", at(&then, k), at(&now, k))).collect();
    if !differing.is_empty() {
        bail!(
            "{} was written by a run with other trainer settings (resume with the same ones; only {} may change):\n{}",
            checkpoint.display(),
            RESUMABLE_SETTINGS.join(", "),
            differing.join("\n")
        );
    }
    // The settings match, so a step past their max_steps (or more skipped steps than steps)
    // is a state edited or damaged by hand: resuming would train nothing and call it done.
    if state.step > config.max_steps {
        bail!("{}: step {} lies past the run's max_steps = {}; the checkpoint's state is damaged", state_path.display(), state.step, config.max_steps);
    }
    if state.skipped_steps > state.step {
        bail!("{}: {} steps skipped of {} taken; the checkpoint's state is damaged", state_path.display(), state.skipped_steps, state.step);
    }
    if state.world_size != world {
        bail!("{} was written by a run over {} processes and this one has {world}: resume with the same number of processes", checkpoint.display(), state.world_size);
    }
    if let Some(episode) = episode {
        if state.episode != episode {
            bail!("{} is a checkpoint of episode {}, not of episode {episode}", checkpoint.display(), state.episode);
        }
    }
    let opt_path = checkpoint.join(OPTIMIZER_FILE);
    if !opt_path.is_file() {
        bail!("{}: missing (the checkpoint has no optimizer state)", opt_path.display());
    }
    Ok(state)
}

/// What a checkpoint holds besides the model and the optimizer state.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainerState {
    /// Steps taken.
    pub step: u64,
    pub sampler: SamplerState,
    /// Steps skipped for a non-finite loss.
    pub skipped_steps: u64,
    /// ANCE episode (0: BM25 negatives).
    pub episode: u32,
    /// The configuration the run started with (a resume must match it).
    pub config: TrainerConfig,
    /// Processes the run's batches were split over (a resume must match it: each step's
    /// batch is `config.batch_size` queries per process).
    #[serde(default = "one_process")]
    pub world_size: usize,
}

fn one_process() -> usize {
    1
}

/// One task's share of a step, as texts.
#[derive(Debug, Clone)]
pub struct TaskGroup {
    pub task: String,
    pub queries: Vec<String>,
    /// Each query's passages in turn, as [`Targets`] lays them out.
    pub passages: Vec<String>,
    pub targets: Targets,
    /// One dropout key per query and per passage, from (seed, step, task, row), so that a
    /// text's dropout masks do not depend on which process encodes it or with what.
    pub query_keys: Vec<u64>,
    pub passage_keys: Vec<u64>,
    /// NCE with `mask_positive_copies`: each query's gold passages (their texts, the drawn
    /// one's included), so that any of them met elsewhere in the batch is masked rather than
    /// counted a negative. Empty otherwise; a query without a list has its drawn positive only.
    pub positive_texts: Vec<Vec<String>>,
}

/// What a group's passages are to its queries, by loss.
#[derive(Debug, Clone, PartialEq)]
pub enum Targets {
    /// NCE: `queries.len() × (1 + hard_negatives)` passages, each query's positive first.
    OnePositive,
    /// The multi-positive loss: each query's positives then its negatives; these are the rows
    /// of each query's positives in `passages`.
    Positives(Vec<Vec<i64>>),
    /// The LM-supervised loss: each query's scored passages; these are their scores, in order.
    LmScores(Vec<Vec<f64>>),
}

/// What [`Trainer::train_step`] did.
#[derive(Debug)]
pub enum StepOutcome {
    /// The parameters were updated; per-task losses and the optimizer's statistics.
    Updated { losses: Vec<(String, f64)>, stats: Value },
    /// A task's loss or gradient was not finite: no update.
    Skipped { task: String, why: String },
}

impl StepOutcome {
    fn non_finite_loss(task: &str, value: f64) -> Self {
        StepOutcome::Skipped { task: task.to_string(), why: format!("a non-finite loss ({value})") }
    }
}

/// Files of a checkpoint directory (besides the model the encoder saves).
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
pub const STATE_FILE: &str = "trainer_state.json";
pub const LOG_FILE: &str = "trainer_log.jsonl";

/// Seconds of each phase of the steps since the last log line, measured when the environment
/// sets `RAK_STEP_PHASES` (to anything but empty or `0`; logged as `phases_seconds_per_step`): `sample` (the step's texts),
/// `forward` (tokenising and encoding, in the encoder plugin), `loss`, `backward` and
/// `optimizer` (gradient checks and sums, the optimizer's work, clipping, the update). Each
/// phase ends with a wait for the device (CUDA runs asynchronously), so the figures say what
/// each phase costs and the steps run somewhat slower than without: for profiling, not for
/// the step time itself.
struct Phases {
    on: bool,
    last: std::time::Instant,
    seconds: BTreeMap<&'static str, f64>,
    /// libtorch's profiler is recording (`RAK_TORCH_PROFILE`): each phase is a named scope.
    tracing: bool,
}

impl Phases {
    fn from_env() -> Self {
        // Set to anything but empty or 0: `RAK_STEP_PHASES=0` must not slow every step.
        let on = std::env::var_os("RAK_STEP_PHASES").is_some_and(|v| !v.is_empty() && v != "0");
        Phases { on, last: std::time::Instant::now(), seconds: BTreeMap::new(), tracing: false }
    }

    /// A named span of the profiler's trace until dropped, while it records.
    fn scope(&self, name: &str) -> Option<Scope> {
        self.tracing.then(|| Scope::new(name))
    }

    /// A step begins: what came before counts in no phase.
    fn start(&mut self) {
        if self.on {
            self.last = std::time::Instant::now();
        }
    }

    /// The phase `name` ends once `device` has done its work.
    fn end(&mut self, name: &'static str, device: tch::Device) {
        if !self.on {
            return;
        }
        if let tch::Device::Cuda(i) = device {
            tch::Cuda::synchronize(i as i64);
        }
        let now = std::time::Instant::now();
        *self.seconds.entry(name).or_default() += (now - self.last).as_secs_f64();
        self.last = now;
    }

    /// The window's seconds a step, and a new window.
    fn take(&mut self, steps: u64) -> Option<Value> {
        self.on.then(|| json!(std::mem::take(&mut self.seconds).into_iter().map(|(k, v)| (k, v / steps.max(1) as f64)).collect::<BTreeMap<_, _>>()))
    }
}

/// libtorch's profiler over a run's steps, when the environment sets `RAK_TORCH_PROFILE` to a
/// folder: `FOLDER/host-trace.json`, the Chrome trace `torch.profiler` writes, of up to
/// `RAK_TORCH_PROFILE_STEPS` (20) steps after the run's first two (warm-up; from the first in
/// a run of two steps or fewer), each step a `rak::step` scope and its phases `rak::forward`,
/// `rak::loss`, `rak::backward` and `rak::optimizer` (`bench/trace_table.py` reads it beside a
/// PyTorch loop's). Unlike `RAK_STEP_PHASES` it adds no waits for the device. Only the first
/// training run of a process records (an ANCE run's first stage) and, data-parallel, only rank
/// 0. A profiler that cannot start or write is a warning, never the run's failure.
struct TorchTrace {
    file: Option<PathBuf>,
    from_step: u64,
    until_step: u64,
    recording: Option<Recording>,
}

/// Whether this process has recorded a run already (a later stage would overwrite its trace).
static TRACED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

impl TorchTrace {
    fn from_env(first: u64, max_steps: u64, writes: bool) -> Self {
        let file = std::env::var_os("RAK_TORCH_PROFILE")
            .filter(|v| !v.is_empty() && writes)
            .filter(|_| !TRACED.swap(true, std::sync::atomic::Ordering::Relaxed))
            .map(|dir| PathBuf::from(dir).join("host-trace.json"));
        let steps = std::env::var("RAK_TORCH_PROFILE_STEPS").ok().and_then(|v| v.parse::<u64>().ok()).unwrap_or(20);
        let from_step = if max_steps.saturating_sub(first) > 2 { first + 2 } else { first };
        TorchTrace { file, from_step, until_step: from_step.saturating_add(steps), recording: None }
    }

    /// Called as each step begins; whether the profiler records it.
    fn begin_step(&mut self, step: u64, device: tch::Device, progress: &dyn Progress) -> bool {
        if step == self.from_step {
            if let Some(file) = self.file.take() {
                match Recording::start(&file, device) {
                    Ok(r) => self.recording = Some(r),
                    Err(e) => progress.log(&format!("train: warning: RAK_TORCH_PROFILE: {e:#}")),
                }
            }
        }
        if step == self.until_step {
            self.finish(progress);
        }
        self.recording.is_some()
    }

    fn finish(&mut self, progress: &dyn Progress) {
        if let Some(recording) = self.recording.take() {
            match recording.finish() {
                Ok(file) => progress.log(&format!("train: libtorch's profile of the steps: {}", file.display())),
                Err(e) => progress.log(&format!("train: warning: RAK_TORCH_PROFILE: {e:#}")),
            }
        }
    }
}

/// One training run.
pub struct Trainer<'a> {
    pub config: TrainerConfig,
    encoder: &'a mut dyn Encoder,
    optimizer: &'a mut dyn Optimizer,
    tasks: Vec<TaskData>,
    texts: HashMap<String, String>,
    output_dir: PathBuf,
    sampler: Sampler,
    state: TrainerState,
    /// The other processes of a data-parallel run.
    dist: Option<&'a mut ProcessGroup>,
    /// Whether the optimizer takes each task's gradient on its own (else the summed gradient).
    per_task_gradients: bool,
    /// Seconds spent in collectives (gathers and gradient sums) since the last log line.
    communication_s: f64,
    /// Where the steps' time goes, when `RAK_STEP_PHASES` is set (see [`Phases`]).
    phases: Phases,
    /// The checkpoint this run resumed from: the encoder was loaded from it and reads files
    /// from it when it saves (its tokenizer's), so `save_total_limit` leaves it.
    resumed_from: Option<PathBuf>,
    /// The next step's groups, drawn a step ahead so the encoder can tokenise them while this
    /// step runs (the sampler has moved past them; a checkpoint keeps its position before).
    ahead: Option<(u64, Result<Vec<TaskGroup>>)>,
}

impl<'a> Trainer<'a> {
    /// `texts` holds the encoder string of every passage the examples name.
    pub fn new(
        config: TrainerConfig,
        encoder: &'a mut dyn Encoder,
        optimizer: &'a mut dyn Optimizer,
        tasks: Vec<TaskData>,
        texts: HashMap<String, String>,
        output_dir: &Path,
    ) -> Result<Self> {
        Self::data_parallel(config, encoder, optimizer, tasks, texts, output_dir, None)
    }

    /// [`Trainer::new`], data-parallel with the group's other processes when one is given.
    /// Every process draws the same batches of `batch_size` × world queries (the same sampler
    /// and seed) and encodes its own share of each task's queries and their passages; the
    /// embeddings are gathered, so the loss, its in-batch negatives and the gradient are those
    /// of the whole batch, as one process would compute them; the gradients are summed over
    /// the processes before the optimizer sees them, so every process takes the same step.
    /// Only rank 0 writes the log, the checkpoints and the model.
    pub fn data_parallel(
        config: TrainerConfig,
        encoder: &'a mut dyn Encoder,
        optimizer: &'a mut dyn Optimizer,
        tasks: Vec<TaskData>,
        texts: HashMap<String, String>,
        output_dir: &Path,
        group: Option<&'a mut ProcessGroup>,
    ) -> Result<Self> {
        if config.batch_size == 0 || config.max_steps == 0 {
            bail!("the batch size and the number of steps must be positive");
        }
        check_loss_settings(config.loss, config.hard_negatives, config.lm_temperature, config.mask_positive_copies)?;
        if config.loss == LossKind::LmSupervised {
            for t in &tasks {
                for e in &t.examples {
                    if e.lm_scores.is_empty() {
                        bail!("task {:?}: query {:?} has no LM-scored passages, which loss = \"lm_supervised\" trains on", t.name, e.query_id);
                    }
                    if let Some((id, s)) = e.lm_scores.iter().find(|(_, s)| !s.is_finite()) {
                        bail!("task {:?}: query {:?}: passage {id:?} has a non-finite LM score ({s})", t.name, e.query_id);
                    }
                    // Twice the same passage would count twice in both distributions.
                    let mut seen = HashSet::new();
                    if let Some((id, _)) = e.lm_scores.iter().find(|(id, _)| !seen.insert(id.as_str())) {
                        bail!("task {:?}: query {:?}: passage {id:?} is scored twice", t.name, e.query_id);
                    }
                }
            }
        }
        for t in &tasks {
            if config.hard_negatives > 0 {
                if let Some(e) = t.examples.iter().find(|e| e.negatives.is_empty()) {
                    bail!("task {:?}: query {:?} has no hard negatives to draw {} from", t.name, e.query_id, config.hard_negatives);
                }
            }
        }
        let counts: Vec<usize> = tasks.iter().map(|t| t.examples.len()).collect();
        let world = group.as_ref().map_or(1, |g| g.world());
        let sampler = Sampler::new(config.sampler, &counts, config.batch_size * world, config.seed)?;
        let state = TrainerState { step: 0, sampler: sampler.state(), skipped_steps: 0, episode: 0, config: config.clone(), world_size: world };
        let per_task_gradients = optimizer.needs_task_gradients()?;
        Ok(Trainer { config, encoder, optimizer, tasks, texts, output_dir: output_dir.to_path_buf(), sampler, state, dist: group, per_task_gradients, communication_s: 0.0, phases: Phases::from_env(), resumed_from: None, ahead: None })
    }

    /// Whether this process writes the run's files (the only one, or rank 0).
    fn writes(&self) -> bool {
        self.dist.as_ref().is_none_or(|g| g.rank() == 0)
    }

    pub fn step(&self) -> u64 {
        self.state.step
    }

    /// Which stage of an ANCE run this is (0: BM25 negatives), recorded in checkpoints.
    pub fn set_episode(&mut self, episode: u32) {
        self.state.episode = episode;
    }

    pub fn episode(&self) -> u32 {
        self.state.episode
    }

    pub fn steps_per_epoch(&self) -> usize {
        self.sampler.steps_per_epoch()
    }

    /// Continue from a checkpoint directory: the optimizer state, the sampler position and
    /// the step. The encoder must already have been created from the same directory.
    pub fn resume(&mut self, checkpoint: &Path) -> Result<()> {
        let state = check_checkpoint(checkpoint, &self.config, self.state.world_size, None)?;
        let opt_path = checkpoint.join(OPTIMIZER_FILE);
        let tensors = Tensor::read_safetensors(&opt_path).map_err(|e| anyhow::anyhow!("{}: cannot read optimizer state: {e}", opt_path.display()))?;
        self.optimizer.load_state(tensors).with_context(|| format!("{}: optimizer state", opt_path.display()))?;
        self.sampler.load_state(&state.sampler).with_context(|| format!("{}: sampler state", checkpoint.join(STATE_FILE).display()))?;
        // This run's settings from here on (they may differ in what changes no weight:
        // logging and saving), so that its checkpoints record what it ran with.
        self.state = TrainerState { config: self.config.clone(), ..state };
        self.resumed_from = Some(checkpoint.to_path_buf());
        self.ahead = None;
        if self.writes() {
            truncate_log(&self.output_dir.join(LOG_FILE), self.state.step)?;
        }
        Ok(())
    }

    fn params(&self) -> Result<Vec<(String, Tensor)>> {
        self.encoder.parameters()
    }

    /// The query and passage strings of one task's sub-batch: each query's positive (one of
    /// its gold passages) then `h` of its hard negatives, drawn from (seed, step, task, row).
    fn group_texts(&self, sub: &SubBatch, step: u64) -> Result<TaskGroup> {
        let task = &self.tasks[sub.task];
        let h = self.config.hard_negatives;
        let multi = self.config.loss == LossKind::MultiPositive;
        let mut queries = Vec::with_capacity(sub.examples.len());
        let mut passages = Vec::with_capacity(sub.examples.len() * (1 + h));
        let mut positive_rows = Vec::new();
        let mut positive_texts = Vec::new();
        let mut lm_scores = Vec::new();
        for (row, &i) in sub.examples.iter().enumerate() {
            let ex = &task.examples[i];
            queries.push(ex.query.clone());
            if self.config.loss == LossKind::LmSupervised {
                for (id, _) in &ex.lm_scores {
                    passages.push(self.texts.get(id).with_context(|| format!("passage {id:?} has no text loaded"))?.clone());
                }
                lm_scores.push(ex.lm_scores.iter().map(|(_, s)| *s).collect());
                continue;
            }
            let mut rng = Rng::derive(self.config.seed, &[3, step, sub.task as u64, row as u64]);
            // Drawn whatever the loss, so the negatives drawn next do not depend on it.
            let pick = rng.below(ex.positives.len() as u64) as usize;
            if self.config.mask_positive_copies {
                let texts: Result<Vec<String>> =
                    ex.positives.iter().map(|id| self.texts.get(id).cloned().with_context(|| format!("passage {id:?} has no text loaded"))).collect();
                positive_texts.push(texts?);
            }
            let mut group = if multi {
                let first = passages.len() as i64;
                positive_rows.push((first..first + ex.positives.len() as i64).collect());
                ex.positives.clone()
            } else {
                vec![ex.positives[pick].clone()]
            };
            // With fewer negatives than asked, draw with replacement (the group size is fixed).
            let negs = if ex.negatives.len() >= h {
                rng.sample(&ex.negatives, h)
            } else {
                (0..h).map(|_| ex.negatives[rng.below(ex.negatives.len() as u64) as usize].clone()).collect()
            };
            group.extend(negs);
            for id in group {
                let text = self.texts.get(&id).with_context(|| format!("passage {id:?} has no text loaded"))?;
                passages.push(text.clone());
            }
        }
        let targets = match self.config.loss {
            LossKind::Nce => Targets::OnePositive,
            LossKind::MultiPositive => Targets::Positives(positive_rows),
            LossKind::LmSupervised => Targets::LmScores(lm_scores),
        };
        let key = |role: u64, row: usize| Rng::derive(self.config.seed, &[7, step, sub.task as u64, role, row as u64]).next_u64();
        let query_keys = (0..queries.len()).map(|row| key(0, row)).collect();
        let passage_keys = (0..passages.len()).map(|row| key(1, row)).collect();
        Ok(TaskGroup { task: task.name.clone(), queries, passages, targets, query_keys, passage_keys, positive_texts })
    }

    /// Step `step`'s groups, the sampler moved past them.
    fn draw(&mut self, step: u64) -> Result<Vec<TaskGroup>> {
        let subs = self.sampler.next_step();
        subs.iter().map(|sub| self.group_texts(sub, step)).collect()
    }

    /// This process's share of a group in a data-parallel run, as rows of its queries and
    /// passages: rank `r` of `w` takes queries `n·r/w .. n·(r+1)/w` and their passages.
    /// `None` in one process (all of it).
    fn share(&self, g: &TaskGroup) -> Option<(std::ops::Range<usize>, std::ops::Range<usize>)> {
        let (rank, world) = self.dist.as_ref().map(|d| (d.rank(), d.world()))?;
        let n = g.queries.len();
        let (lo, hi) = (n * rank / world, n * (rank + 1) / world);
        let bounds = passage_bounds(g, 1 + self.config.hard_negatives);
        Some((lo..hi, bounds[lo]..bounds[hi]))
    }

    /// Tells the encoder the texts it will encode for these groups, exactly as
    /// [`Trainer::encode_group`] will ask, so it can tokenise them while the device works.
    fn prepare(&mut self, groups: &[TaskGroup]) -> Result<()> {
        for g in groups {
            let (queries, passages) = self.share(g).unwrap_or((0..g.queries.len(), 0..g.passages.len()));
            if queries.is_empty() {
                continue;
            }
            let task = self.config.task_names.then_some(g.task.as_str());
            let queries: Vec<&str> = g.queries[queries].iter().map(String::as_str).collect();
            let passages: Vec<&str> = g.passages[passages].iter().map(String::as_str).collect();
            self.encoder.prepare(&queries, Role::Query, task)?;
            self.encoder.prepare(&passages, Role::Passage, None)?;
        }
        Ok(())
    }

    /// A group's query and passage embeddings, with autograd, in float32 for the loss (under
    /// the caller's autocast, if any).
    fn encode_group(&mut self, g: &TaskGroup) -> Result<(Tensor, Tensor)> {
        let queries: Vec<&str> = g.queries.iter().map(String::as_str).collect();
        let passages: Vec<&str> = g.passages.iter().map(String::as_str).collect();
        let task = self.config.task_names.then_some(g.task.as_str());
        let q = self.encoder.encode_keyed(&queries, Role::Query, task, &g.query_keys)?;
        let p = self.encoder.encode_keyed(&passages, Role::Passage, None, &g.passage_keys)?;
        Ok((q.to_kind(Kind::Float), p.to_kind(Kind::Float)))
    }

    /// A group's query and passage embeddings for the loss: this process's own, or in a
    /// data-parallel run every process's share gathered in rank order (rank `r` of `w` encodes
    /// queries `n·r/w .. n·(r+1)/w` and their passages; its rows keep their graph).
    fn encode_for_loss(&mut self, g: &TaskGroup, device: tch::Device) -> Result<(Tensor, Tensor)> {
        let Some((queries, passages)) = self.share(g) else { return self.encode_group(g) };
        let n = g.queries.len();
        let (q, p) = if !queries.is_empty() {
            let share = TaskGroup {
                task: g.task.clone(),
                queries: g.queries[queries.clone()].to_vec(),
                passages: g.passages[passages.clone()].to_vec(),
                targets: Targets::OnePositive,
                query_keys: g.query_keys[queries].to_vec(),
                passage_keys: g.passage_keys[passages].to_vec(),
                // Only encoded: the loss is taken over the gathered batch with `g`'s own.
                positive_texts: Vec::new(),
            };
            self.encode_group(&share)?
        } else {
            // On the device the others' rows are, so the loss runs there on every process.
            let none = Tensor::zeros([0, 0], (Kind::Float, device));
            (none.shallow_clone(), none)
        };
        let dist = self.dist.as_deref_mut().context("no process group")?;
        let started = std::time::Instant::now();
        let (q, _) = dist.gather_rows(&q)?;
        let (p, _) = dist.gather_rows(&p)?;
        self.communication_s += started.elapsed().as_secs_f64();
        if q.size()[0] != n as i64 || p.size()[0] != g.passages.len() as i64 {
            bail!("gathered {} queries and {} passages for a batch of {n} and {}", q.size()[0], p.size()[0], g.passages.len());
        }
        Ok((q, p))
    }

    /// Sums the gradients over the processes of a data-parallel run (in one process, as they are).
    fn reduce_gradients(&mut self, params: &[(String, Tensor)], grads: Vec<(String, Tensor)>) -> Result<Vec<(String, Tensor)>> {
        let Some(dist) = self.dist.as_deref_mut() else { return Ok(grads) };
        let tensors: Vec<&Tensor> = params.iter().map(|(_, t)| t).collect();
        let local: Vec<Tensor> = grads.iter().map(|(_, g)| g.shallow_clone()).collect();
        let started = std::time::Instant::now();
        let summed = dist.all_reduce_gradients(&tensors, &local)?;
        self.communication_s += started.elapsed().as_secs_f64();
        Ok(grads.into_iter().map(|(n, _)| n).zip(summed).collect())
    }

    /// One task's loss: its queries against its own passages or, with `step = (all, first)`,
    /// against every passage of the step (its own starting at row `first`).
    /// With the multi-positive loss, `step_texts` are the step's passages (every group's, in
    /// order), which tell copies of a query's positives apart from its negatives.
    fn task_loss(&self, g: &TaskGroup, q: &Tensor, own: &Tensor, step: Option<(&Tensor, i64)>, step_texts: &[&str]) -> Result<Tensor> {
        let (n, scale) = (1 + self.config.hard_negatives, self.config.score_scale);
        // NCE's drawn positives are each query's first passage; with the mask, the rows that
        // hold any of the query's gold passages (the drawn one's copies and its other
        // positives) are left out of its candidates, as the multi-positive loss does.
        let copies = |texts: &[&str], first: i64| -> Vec<Vec<i64>> {
            if !self.config.mask_positive_copies {
                return Vec::new();
            }
            let positives: Vec<Vec<i64>> = (0..g.queries.len() as i64).map(|i| vec![first + i * n as i64]).collect();
            let also: Vec<Vec<&str>> = g.positive_texts.iter().map(|ts| ts.iter().map(String::as_str).collect()).collect();
            copies_of_any_positive(texts, &positives, &also)
        };
        match (&g.targets, step) {
            (Targets::OnePositive, None) => {
                let texts: Vec<&str> = g.passages.iter().map(String::as_str).collect();
                nce_loss(q, own, n, scale, &copies(&texts, 0))
            }
            (Targets::OnePositive, Some((all, first))) => nce_loss_against(q, all, first, n, scale, &copies(step_texts, first)),
            (Targets::Positives(rows), None) => {
                let texts: Vec<&str> = g.passages.iter().map(String::as_str).collect();
                multi_positive_loss(q, own, rows, &copies_of_positives(&texts, rows), scale)
            }
            (Targets::Positives(rows), Some((all, first))) => {
                let rows: Vec<Vec<i64>> = rows.iter().map(|r| r.iter().map(|x| x + first).collect()).collect();
                multi_positive_loss(q, all, &rows, &copies_of_positives(step_texts, &rows), scale)
            }
            // Each query against its own scored passages only, so neither the step's passages
            // nor other processes' enter.
            (Targets::LmScores(scores), _) => {
                let beta = self.config.lm_temperature.context("the lm_supervised loss without an lm_temperature")?;
                lm_supervised_loss(q, own, scores, scale, beta)
            }
        }
    }

    /// The factor on `g`'s loss in its step (see [`TaskLossWeight`]); the losses logged and
    /// handed to the optimizer stay each task's own mean.
    fn task_weight(&self, g: &TaskGroup, groups: &[TaskGroup]) -> f64 {
        match self.config.task_loss_weight {
            TaskLossWeight::Equal => 1.0,
            TaskLossWeight::Queries => {
                let total: usize = groups.iter().map(|g| g.queries.len()).sum();
                (groups.len() * g.queries.len()) as f64 / total as f64
            }
        }
    }

    /// One optimizer step on the given per-task groups: for each task, embed its queries (with
    /// the task name when `task_names` is on) and passages (query `i`'s group at rows
    /// `i·n..(i+1)·n`, positive first), take the NCE loss, backward, and hand the loss and the
    /// gradients to the optimizer; then `finish_step`. An optimizer that takes the summed
    /// gradient gets it once, after the last task: each task's backward adds into the
    /// parameters' gradients, so one task's graph is held at a time (one backward pass over
    /// the summed losses gives the same sum, holding every graph at once: 0.4 GB more for
    /// MiniLM on the taco recipe's 16 queries over 4 tasks). A non-finite loss skips the step
    /// (no update). This is the seam the parity tests drive with fixed inputs.
    pub fn train_step(&mut self, params: &[(String, Tensor)], groups: &[TaskGroup], ctx: StepContext) -> Result<StepOutcome> {
        if groups.is_empty() {
            bail!("a step with no task");
        }
        let scope = self.phases.scope("rak::optimizer");
        self.optimizer.begin_step(shallow(params), ctx)?;
        let device = params.first().map_or(tch::Device::Cpu, |(_, p)| p.device());
        self.phases.end("optimizer", device);
        drop(scope);
        if self.config.in_batch_negatives == InBatchNegatives::Step {
            return self.whole_step(params, groups);
        }
        let mut losses = Vec::with_capacity(groups.len());
        // The summed gradient's tasks, whose losses are read together once every backward
        // pass is queued: read one by one, each read would wait for its task's backward pass
        // before the next task's forward pass could be queued.
        let mut unread = Vec::new();
        for g in groups {
            let (q, p) = {
                let _scope = self.phases.scope("rak::forward");
                let _autocast = self.config.bf16.then(|| Autocast::bf16(device)).transpose()?;
                let encoded = self.encode_for_loss(g, device)?;
                self.phases.end("forward", device);
                encoded
            };
            let loss = {
                let _scope = self.phases.scope("rak::loss");
                let loss = self.task_loss(g, &q, &p, None, &[])?;
                self.phases.end("loss", device);
                loss
            };
            // A process with none of this task's rows has no graph to go back through.
            {
                let _scope = self.phases.scope("rak::backward");
                if loss.requires_grad() {
                    (&loss * self.task_weight(g, groups)).backward();
                }
                self.phases.end("backward", device);
            }
            let _scope = self.phases.scope("rak::optimizer");
            if !self.per_task_gradients {
                unread.push((g.task.clone(), loss.detach()));
                continue;
            }
            // Read once the backward pass is queued (reading before it left a GPU idle while
            // the host queued its first kernels); handing the gradients over waits for them
            // anyway. A non-finite loss wastes one backward pass, whose gradients are dropped.
            let value = loss.double_value(&[]);
            if !value.is_finite() {
                clear_grads(params)?;
                return Ok(StepOutcome::non_finite_loss(&g.task, value));
            }
            losses.push((g.task.clone(), value));
            if let Some(skip) = self.hand_gradients(params, &g.task, value)? {
                return Ok(skip);
            }
        }
        let _scope = self.phases.scope("rak::optimizer");
        if !self.per_task_gradients {
            let stacked = Tensor::stack(&unread.iter().map(|(_, l)| l.to_kind(Kind::Double)).collect::<Vec<_>>(), 0);
            let values = Vec::<f64>::try_from(stacked.to_device(tch::Device::Cpu)).context("reading the step's losses")?;
            for ((task, _), value) in unread.into_iter().zip(values) {
                if !value.is_finite() {
                    clear_grads(params)?;
                    return Ok(StepOutcome::non_finite_loss(&task, value));
                }
                losses.push((task, value));
            }
            let value = losses.iter().map(|(_, v)| v).sum::<f64>();
            if let Some(skip) = self.hand_gradients(params, ALL_TASKS, value)? {
                return Ok(skip);
            }
        }
        let stats = self.optimizer.finish_step()?;
        self.phases.end("optimizer", device);
        Ok(StepOutcome::Updated { losses, stats })
    }

    /// Hands the parameters' gradients (one task's, or under [`ALL_TASKS`] the sum of every
    /// task's) to the optimizer after the data-parallel sum, and clears them. A non-finite
    /// gradient skips the step instead (returned).
    fn hand_gradients(&mut self, params: &[(String, Tensor)], task: &str, loss: f64) -> Result<Option<StepOutcome>> {
        let device = params.first().map_or(tch::Device::Cpu, |(_, p)| p.device());
        let grads: Vec<(String, Tensor)> = params.iter().map(|(n, t)| (n.clone(), t.grad())).collect();
        let grads = self.reduce_gradients(params, grads)?;
        if let Some(skip) = non_finite(&grads, task, loss) {
            clear_grads(params)?;
            return Ok(Some(skip));
        }
        self.optimizer.task_gradients(task, loss, grads)?;
        // Cleared, not zeroed: a parameter the next task's graph does not reach then has no
        // gradient, and the optimizer leaves it alone (as torch's `zero_grad()` does).
        clear_grads(params)?;
        self.phases.end("optimizer", device);
        Ok(None)
    }

    /// [`Trainer::train_step`] with every task's sub-batch encoded before any loss, for the
    /// in-batch negatives of the whole step. Every task's graph is held at once, as in one
    /// batch of the union.
    fn whole_step(&mut self, params: &[(String, Tensor)], groups: &[TaskGroup]) -> Result<StepOutcome> {
        let device = params.first().map_or(tch::Device::Cpu, |(_, p)| p.device());
        let mut encoded = Vec::with_capacity(groups.len());
        {
            let _scope = self.phases.scope("rak::forward");
            let _autocast = self.config.bf16.then(|| Autocast::bf16(device)).transpose()?;
            for g in groups {
                encoded.push(self.encode_for_loss(g, device)?);
            }
            self.phases.end("forward", device);
        }
        let loss_scope = self.phases.scope("rak::loss");
        let step_passages = Tensor::cat(&encoded.iter().map(|(_, p)| p).collect::<Vec<_>>(), 0);
        let step_texts: Vec<&str> = groups.iter().flat_map(|g| g.passages.iter().map(String::as_str)).collect();
        let mut losses = Vec::with_capacity(groups.len());
        let mut first = 0;
        for (g, (q, p)) in groups.iter().zip(&encoded) {
            let loss = self.task_loss(g, q, p, Some((&step_passages, first)), &step_texts)?;
            first += p.size()[0];
            let value = loss.double_value(&[]);
            if !value.is_finite() {
                return Ok(StepOutcome::non_finite_loss(&g.task, value));
            }
            losses.push((g.task.clone(), value, loss * self.task_weight(g, groups)));
        }
        self.phases.end("loss", device);
        drop(loss_scope);
        let tensors: Vec<&Tensor> = params.iter().map(|(_, t)| t).collect();
        let backward = |loss: &Tensor, keep_graph: bool| -> Result<Vec<(String, Tensor)>> {
            // A process with none of the batch's rows has no graph to go back through.
            let grads = if loss.requires_grad() { Tensor::f_run_backward(&[loss], &tensors, keep_graph, false)? } else { tensors.iter().map(|_| Tensor::new()).collect() };
            Ok(params.iter().map(|(n, _)| n.clone()).zip(grads).collect())
        };
        if self.per_task_gradients {
            // Each task's gradient on its own; the graph is kept until the last task's.
            for (i, (task, value, loss)) in losses.iter().enumerate() {
                let grads = {
                    let _scope = self.phases.scope("rak::backward");
                    let grads = backward(loss, i + 1 < losses.len())?;
                    self.phases.end("backward", device);
                    grads
                };
                let _scope = self.phases.scope("rak::optimizer");
                let grads = self.reduce_gradients(params, grads)?;
                if let Some(skip) = non_finite(&grads, task, *value) {
                    return Ok(skip);
                }
                self.optimizer.task_gradients(task, *value, grads)?;
                self.phases.end("optimizer", device);
            }
        } else {
            let total = losses.iter().map(|(_, _, l)| l.shallow_clone()).reduce(|a, b| a + b).context("a step with no task")?;
            let value = losses.iter().map(|(_, v, _)| v).sum::<f64>();
            let grads = {
                let _scope = self.phases.scope("rak::backward");
                let grads = backward(&total, false)?;
                self.phases.end("backward", device);
                grads
            };
            let _scope = self.phases.scope("rak::optimizer");
            let grads = self.reduce_gradients(params, grads)?;
            if let Some(skip) = non_finite(&grads, ALL_TASKS, value) {
                return Ok(skip);
            }
            self.optimizer.task_gradients(ALL_TASKS, value, grads)?;
        }
        let _scope = self.phases.scope("rak::optimizer");
        let stats = self.optimizer.finish_step()?;
        self.phases.end("optimizer", device);
        Ok(StepOutcome::Updated { losses: losses.into_iter().map(|(t, v, _)| (t, v)).collect(), stats })
    }

    /// Train until `max_steps`, checkpointing every `save_steps` and at the end; the final
    /// model goes to the output directory itself.
    pub fn train(&mut self, progress: &dyn Progress) -> Result<()> {
        std::fs::create_dir_all(&self.output_dir).with_context(|| format!("{}: cannot create", self.output_dir.display()))?;
        let writes = self.writes();
        if writes {
            remove_stale_checkpoint_temporaries(&self.output_dir);
        }
        if self.state.step == 0 && writes {
            // A fresh run: no log lines of an earlier one (the command refuses to start over an
            // earlier run's checkpoints unless told to overwrite them).
            truncate_log(&self.output_dir.join(LOG_FILE), 0)?;
        }
        let params = self.params()?;
        let info = self.encoder.info()?;
        let lr_scale: BTreeMap<String, f64> = if self.config.layerwise_lr_decay {
            serde_json::from_value(info["lr_scale"].clone()).context("the encoder gives no lr_scale for layer-wise decay")?
        } else {
            BTreeMap::new()
        };
        let no_weight_decay: BTreeSet<String> = params.iter().map(|(n, _)| n).filter(|n| exempt_from_decay(n)).cloned().collect();
        let task_names: Vec<String> = self.tasks.iter().map(|t| t.name.clone()).collect();
        // As transformers' `get_warmup_steps`: ceil(ratio × steps).
        let warmup = (self.config.warmup_ratio * self.config.max_steps as f64).ceil() as u64;
        let mut log = if writes { Some(open_log(&self.output_dir.join(LOG_FILE))?) } else { None };
        let mut window: BTreeMap<String, (f64, u64)> = BTreeMap::new();
        let mut last_logged = self.state.step;
        // The optimizer's statistics of the last step taken (task weights, clipping), for the log.
        let mut last_stats = Value::Null;
        let optimizer_seed = Rng::derive(self.config.seed, &[5]).next_u64();
        let started = std::time::Instant::now();
        let first = self.state.step;
        progress.start("train", self.config.max_steps);
        progress.inc(first);
        let device = params.first().map_or(tch::Device::Cpu, |(_, p)| p.device());
        let mut trace = TorchTrace::from_env(first, self.config.max_steps, self.writes());
        while self.state.step < self.config.max_steps {
            let step = self.state.step;
            self.phases.tracing = trace.begin_step(step, device, progress);
            let step_scope = self.phases.scope("rak::step");
            // Dropout: each process its own stream (one process keeps the stream it always had).
            let mut dropout = match self.dist.as_ref() {
                Some(d) => Rng::derive(self.config.seed, &[4, step, 1 + d.rank() as u64]),
                None => Rng::derive(self.config.seed, &[4, step]),
            };
            tch::manual_seed(dropout.next_u64() as i64);
            let lr = self.config.learning_rate * linear_warmup_decay(step, self.config.max_steps, warmup);
            let ctx = StepContext {
                step,
                total_steps: self.config.max_steps,
                warmup_steps: warmup,
                lr,
                tasks: task_names.clone(),
                // As Hugging Face's Trainer: a limit of 0 or less (or none) clips nothing.
                max_grad_norm: self.config.max_grad_norm.filter(|m| *m > 0.0),
                lr_scale: lr_scale.clone(),
                no_weight_decay: no_weight_decay.clone(),
                seed: optimizer_seed,
            };
            self.phases.start();
            let groups = match self.ahead.take() {
                Some((drawn, groups)) if drawn == step => groups?,
                _ => self.draw(step)?,
            };
            // Where a checkpoint after this step resumes the sampler: before the next draw.
            let sampler = self.sampler.state();
            if step + 1 < self.config.max_steps {
                // A draw that fails fails its own step, not this one.
                let next = self.draw(step + 1);
                if let Ok(next) = &next {
                    self.prepare(next)?;
                }
                self.ahead = Some((step + 1, next));
            }
            self.phases.end("sample", tch::Device::Cpu);
            let outcome = self.train_step(&params, &groups, ctx);
            // The optimizer checks a loaded state against the model's parameters in its first
            // step: an error there names the file it came from.
            let outcome = match (&self.resumed_from, step == first) {
                (Some(ckpt), true) => outcome.with_context(|| format!("step {}, the first after resuming from {} (its {OPTIMIZER_FILE} is checked against the model here)", step + 1, ckpt.display())),
                _ => outcome,
            };
            let losses = match outcome? {
                StepOutcome::Updated { losses, stats } => {
                    last_stats = stats;
                    losses
                }
                StepOutcome::Skipped { task, why } => {
                    progress.log(&format!("warning: step {}: task {task:?} has {why}; the step is skipped", step + 1));
                    self.state.skipped_steps += 1;
                    if self.state.skipped_steps > self.config.max_skipped_steps {
                        bail!(
                            "{} steps had a non-finite loss or gradient (more than max_skipped_steps = {}); stopping. Lower the learning rate or check the data",
                            self.state.skipped_steps,
                            self.config.max_skipped_steps
                        );
                    }
                    Vec::new()
                }
            };
            drop(step_scope);
            self.state.step += 1;
            self.state.sampler = sampler;
            progress.inc(1);
            for (name, v) in &losses {
                let w = window.entry(name.clone()).or_default();
                w.0 += v;
                w.1 += 1;
            }
            let step = self.state.step;
            if step.is_multiple_of(self.config.logging_steps.max(1)) || step == self.config.max_steps {
                let loss: BTreeMap<&str, f64> = window.iter().map(|(n, (s, c))| (n.as_str(), s / *c as f64)).collect();
                let per_step = started.elapsed().as_secs_f64() / (step - first) as f64;
                let mut line = json!({
                    "step": step, "epoch": step as f64 / self.sampler.steps_per_epoch().max(1) as f64,
                    "learning_rate": lr, "loss": loss, "skipped_steps": self.state.skipped_steps,
                    "seconds_per_step": per_step, "optimizer": last_stats,
                });
                if self.dist.is_some() {
                    // Rank 0's time in gathers and gradient sums, a step, over the window.
                    line["communication_seconds_per_step"] = json!(self.communication_s / (step - last_logged).max(1) as f64);
                }
                self.communication_s = 0.0;
                if let Some(phases) = self.phases.take(step - last_logged) {
                    line["phases_seconds_per_step"] = phases;
                }
                if let Some(log) = log.as_mut() {
                    writeln!(log, "{line}")?;
                    log.flush()?;
                }
                let text: Vec<String> = loss.iter().map(|(n, l)| format!("{n} {l:.4}")).collect();
                progress.message(&format!("lr {lr:.2e} | {}", text.join(" | ")));
                window.clear();
                last_logged = step;
            }
            if step.is_multiple_of(self.config.save_steps.max(1)) && step < self.config.max_steps && writes {
                self.save_checkpoint(progress)?;
            }
        }
        progress.finish();
        self.phases.tracing = false;
        trace.finish(progress);
        if writes {
            self.save_checkpoint(progress)?;
            self.encoder.save(&self.output_dir)?;
        }
        // The others wait until the model is written: a run is over when its files are.
        if let Some(dist) = self.dist.as_deref_mut() {
            dist.barrier()?;
        }
        Ok(())
    }

    /// `OUTPUT/checkpoint-STEP/`: the model as the encoder saves it, the optimizer state and
    /// the trainer state, built under a temporary name and renamed (a kill never leaves a
    /// half-written checkpoint that looks whole).
    pub fn save_checkpoint(&self, progress: &dyn Progress) -> Result<PathBuf> {
        let dir = self.output_dir.join(format!("checkpoint-{}", self.state.step));
        rak_retrieval::index::write_dir_atomically(&dir, |tmp| {
            self.encoder.save(tmp)?;
            rak_core::models::weights::save_safetensors(&tmp.join(OPTIMIZER_FILE), &self.optimizer.state()?)?;
            rak_core::fsutil::write_bytes(&tmp.join(STATE_FILE), serde_json::to_string_pretty(&self.state)?.as_bytes())
        })?;
        if let Some(limit) = self.config.save_total_limit {
            for kept in remove_old_checkpoints(&self.output_dir, self.state.step, limit, self.resumed_from.as_deref())? {
                progress.log(&format!("train: warning: {kept}"));
            }
        }
        Ok(dir)
    }
}

/// Where each query's passages start in `g.passages` (and, last, where the passages end):
/// `group` each for NCE, each query's positives and negatives for the multi-positive loss,
/// each query's scored passages for the LM-supervised one.
fn passage_bounds(g: &TaskGroup, group: usize) -> Vec<usize> {
    let n = g.queries.len();
    let mut bounds: Vec<usize> = match &g.targets {
        Targets::OnePositive => (0..n).map(|i| i * group).collect(),
        // Each query's positives, then `group - 1` negatives.
        Targets::Positives(rows) => rows.iter().scan(0, |at, r| {
            let start = *at;
            *at += r.len() + group - 1;
            Some(start)
        }).collect(),
        Targets::LmScores(scores) => scores.iter().scan(0, |at, s| {
            let start = *at;
            *at += s.len();
            Some(start)
        }).collect(),
    };
    bounds.push(g.passages.len());
    bounds
}

fn shallow(params: &[(String, Tensor)]) -> Vec<(String, Tensor)> {
    params.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect()
}

fn clear_grads(params: &[(String, Tensor)]) -> Result<()> {
    params.iter().try_for_each(|(_, t)| rak_core::autograd::clear_grad(t))
}

/// A skipped step if a task's gradient holds a NaN or an infinity. Checked before the
/// optimizer sees them: one would reach every later step through its state.
fn non_finite(grads: &[(String, Tensor)], task: &str, loss: f64) -> Option<StepOutcome> {
    let name = rak_core::optim::first_non_finite(grads.iter().map(|(n, g)| (n.as_str(), g)))?;
    Some(StepOutcome::Skipped { task: task.to_string(), why: format!("a non-finite gradient of {name} (loss {loss})") })
}

/// No weight decay, by the name rule of transformers' `Trainer.get_decay_parameter_names`:
/// the lower-cased name contains `bias` (T5's `relative_attention_bias.weight` too),
/// `layernorm` or `rmsnorm`, or has a component `norm` or ending in `_norm`. (Its other rule,
/// parameters of `nn.LayerNorm` modules, names BERT's `LayerNorm`, which the first covers.)
/// The training fixture checks this against transformers' own function.
pub fn exempt_from_decay(name: &str) -> bool {
    let lower = name.to_lowercase();
    ["bias", "layernorm", "rmsnorm"].iter().any(|p| lower.contains(p)) || lower.split('.').any(|c| c == "norm" || c.ends_with("_norm"))
}

fn open_log(path: &Path) -> Result<std::fs::File> {
    std::fs::OpenOptions::new().create(true).append(true).open(path).with_context(|| format!("{}: cannot open", path.display()))
}

/// Drop log lines past `step` (written after the checkpoint a run resumes from).
fn truncate_log(path: &Path, step: u64) -> Result<()> {
    let Ok(text) = std::fs::read_to_string(path) else { return Ok(()) };
    let kept: Vec<&str> = text
        .lines()
        .filter(|l| serde_json::from_str::<Value>(l).ok().and_then(|v| v["step"].as_u64()).is_some_and(|s| s <= step))
        .collect();
    let mut out = kept.join("\n");
    if !out.is_empty() {
        out.push('\n');
    }
    rak_core::fsutil::write_bytes(path, out.as_bytes())
}

/// Remove `.checkpoint-N.tmp-PID` folders left by killed runs (the PID no longer running).
fn remove_stale_checkpoint_temporaries(output_dir: &Path) {
    let Ok(entries) = std::fs::read_dir(output_dir) else { return };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name.strip_prefix(".checkpoint-").and_then(|r| r.rsplit_once(".tmp-")).map(|(_, pid)| pid.to_string()) else { continue };
        let alive = pid.parse::<u32>().is_ok_and(|p| p == std::process::id() || Path::new(&format!("/proc/{p}")).exists());
        if !alive {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// Remove all but the newest `keep` checkpoints of `output_dir` up to `step` (the one just
/// written), the oldest first, so that a kill in between leaves the newest ones; returns why
/// each that was kept over the limit was kept. Checkpoints after `step` (left by a run this one
/// resumed before their step) are not counted or removed: the one just written is never the
/// one to go. Nor is `resumed_from`, whose files the encoder still reads. Only a checkpoint that
/// holds nothing but what the trainer wrote is removed: one the user put files into is kept,
/// with its files, and named (the run goes on: a checkpoint too many is no reason to lose hours
/// of training).
fn remove_old_checkpoints(output_dir: &Path, step: u64, keep: usize, resumed_from: Option<&Path>) -> Result<Vec<String>> {
    let same = |a: &Path, b: &Path| a.canonicalize().ok().is_some_and(|a| b.canonicalize().ok().is_some_and(|b| a == b));
    let mut steps: Vec<(u64, PathBuf)> = checkpoints(output_dir)
        .into_iter()
        .filter_map(|p| Some((checkpoint_step(&p)?, p)))
        .filter(|(s, p)| *s <= step && !resumed_from.is_some_and(|r| same(r, p)))
        .collect();
    steps.sort();
    let mut kept = Vec::new();
    for (_, dir) in steps.iter().take(steps.len().saturating_sub(keep.max(1))) {
        if let Err(e) = rak_retrieval::index::remove_written(dir) {
            kept.push(format!("{e:#} (save_total_limit: the checkpoint is kept)"));
        }
    }
    Ok(kept)
}

/// The step of a `checkpoint-N` folder.
fn checkpoint_step(dir: &Path) -> Option<u64> {
    dir.file_name()?.to_str()?.strip_prefix("checkpoint-")?.parse().ok()
}

/// Earlier runs' checkpoints in `output_dir` (`checkpoint-N` folders).
pub fn checkpoints(output_dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(output_dir) else { return Vec::new() };
    entries.flatten().map(|e| e.path()).filter(|p| checkpoint_step(p).is_some()).collect()
}

/// The checkpoint with the highest step in `output_dir`, if any.
pub fn latest_checkpoint(output_dir: &Path) -> Option<PathBuf> {
    checkpoints(output_dir)
        .into_iter()
        .filter(|p| p.join(STATE_FILE).exists())
        .filter_map(|p| Some((checkpoint_step(&p)?, p)))
        .max_by_key(|(s, _)| *s)
        .map(|(_, p)| p)
}

#[cfg(test)]
mod decay_tests {
    use super::exempt_from_decay;

    #[test]
    fn decay_exemptions_follow_transformers_names() {
        for name in [
            "encoder.layer.0.attention.self.query.bias",
            "embeddings.LayerNorm.weight",
            "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
            "encoder.block.0.layer.1.layer_norm.weight",
            "decoder.final_layer_norm.weight",
            "model.norm.weight",
            "layers.0.input_rmsnorm.weight",
        ] {
            assert!(exempt_from_decay(name), "{name}");
        }
        for name in ["encoder.layer.0.attention.self.query.weight", "shared.weight", "encoder.normalizer.weight", "norms_table"] {
            assert!(!exempt_from_decay(name), "{name}");
        }
    }
}

#[cfg(test)]
mod checkpoint_tests {
    use super::*;

    #[test]
    fn save_total_limit_keeps_the_newest_checkpoints_by_step() {
        let dir = std::env::temp_dir().join(format!("rak-limit-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        // Step 10 sorts before step 9 as text; the limit goes by number.
        for step in [1, 9, 10, 2] {
            std::fs::create_dir_all(dir.join(format!("checkpoint-{step}"))).unwrap();
        }
        std::fs::create_dir_all(dir.join("checkpoint-final-notes")).unwrap();
        let left = |dir: &Path| {
            let mut left: Vec<String> = std::fs::read_dir(dir).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
            left.sort();
            left
        };
        remove_old_checkpoints(&dir, 10, 2, None).unwrap();
        assert_eq!(left(&dir), ["checkpoint-10", "checkpoint-9", "checkpoint-final-notes"]);
        // Resumed from step 2 beside stale checkpoints 9 and 10, a run writes step 3: the later
        // ones neither count nor push step 3 out; step 1 goes; step 2, which it resumed from
        // (the encoder reads its tokenizer files there), stays.
        for step in [1, 2, 3] {
            std::fs::create_dir_all(dir.join(format!("checkpoint-{step}"))).unwrap();
        }
        remove_old_checkpoints(&dir, 3, 1, Some(&dir.join("checkpoint-2"))).unwrap();
        assert_eq!(left(&dir), ["checkpoint-10", "checkpoint-2", "checkpoint-3", "checkpoint-9", "checkpoint-final-notes"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn save_total_limit_keeps_a_checkpoint_the_user_put_files_into() {
        let dir = std::env::temp_dir().join(format!("rak-limit-own-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for step in [1, 2, 3] {
            rak_retrieval::index::write_dir_atomically(&dir.join(format!("checkpoint-{step}")), |tmp| Ok(std::fs::write(tmp.join(STATE_FILE), "{}")?)).unwrap();
        }
        std::fs::write(dir.join("checkpoint-1/my-eval.json"), "mine").unwrap();
        let kept = remove_old_checkpoints(&dir, 3, 1, None).unwrap();
        assert_eq!(kept.len(), 1, "{kept:?}");
        assert!(kept[0].contains("checkpoint-1") && kept[0].contains("my-eval.json") && kept[0].contains("kept"), "{}", kept[0]);
        assert_eq!(std::fs::read_to_string(dir.join("checkpoint-1/my-eval.json")).unwrap(), "mine");
        assert!(dir.join("checkpoint-1").join(STATE_FILE).exists() && !dir.join("checkpoint-2").exists() && dir.join("checkpoint-3").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[cfg(test)]
mod group_tests {
    use super::*;
    use crate::data::Example;

    /// Neither encodes nor steps: [`Trainer::group_texts`] only reads the examples and texts.
    struct NoEncoder;
    impl Encoder for NoEncoder {
        fn encode(&mut self, _: &[&str], _: Role, _: Option<&str>, _: bool) -> Result<Tensor> {
            bail!("not used")
        }
        fn parameters(&self) -> Result<Vec<(String, Tensor)>> {
            Ok(Vec::new())
        }
        fn info(&self) -> Result<Value> {
            Ok(Value::Null)
        }
        fn save(&self, _: &Path) -> Result<()> {
            bail!("not used")
        }
    }
    struct NoOptimizer;
    impl Optimizer for NoOptimizer {
        fn begin_step(&mut self, _: Vec<(String, Tensor)>, _: StepContext) -> Result<()> {
            bail!("not used")
        }
        fn task_gradients(&mut self, _: &str, _: f64, _: Vec<(String, Tensor)>) -> Result<()> {
            bail!("not used")
        }
        fn finish_step(&mut self) -> Result<Value> {
            bail!("not used")
        }
        fn state(&self) -> Result<Vec<(String, Tensor)>> {
            Ok(Vec::new())
        }
        fn load_state(&mut self, _: Vec<(String, Tensor)>) -> Result<()> {
            Ok(())
        }
    }

    fn config(mask_positive_copies: bool) -> TrainerConfig {
        TrainerConfig {
            learning_rate: 1e-5,
            batch_size: 1,
            hard_negatives: 1,
            sampler: SamplerKind::Taco { temperature: 1.0 },
            max_steps: 1,
            warmup_ratio: 0.0,
            max_grad_norm: None,
            seed: 3,
            logging_steps: 1,
            save_steps: 1,
            save_total_limit: None,
            task_names: false,
            layerwise_lr_decay: false,
            max_skipped_steps: 0,
            score_scale: 1.0,
            bf16: false,
            in_batch_negatives: Default::default(),
            task_loss_weight: Default::default(),
            loss: LossKind::Nce,
            lm_temperature: None,
            mask_positive_copies,
        }
    }

    /// With `mask_positive_copies`, a query's group carries the texts of all its gold passages
    /// (the one drawn and the other), so that either met elsewhere in the batch is masked; the
    /// parity test hands these lists in by hand, this checks the trainer fills them.
    #[test]
    fn a_group_lists_every_positive_s_text_when_copies_are_masked() {
        let ex = Example { query_id: "q".into(), query: "query".into(), positives: vec!["p1".into(), "p2".into()], negatives: vec!["n".into()], answers: vec![], lm_scores: vec![] };
        let texts: HashMap<String, String> = [("p1", "first gold"), ("p2", "second gold"), ("n", "negative")].iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let tasks = vec![TaskData { name: "t".into(), examples: vec![ex] }];
        let out = std::env::temp_dir().join(format!("rak-group-{}", std::process::id()));
        for mask in [true, false] {
            let (mut enc, mut opt) = (NoEncoder, NoOptimizer);
            let trainer = Trainer::new(config(mask), &mut enc, &mut opt, tasks.clone(), texts.clone(), &out).unwrap();
            let g = trainer.group_texts(&SubBatch { task: 0, examples: vec![0] }, 0).unwrap();
            assert_eq!(g.passages.len(), 2);
            assert!(["first gold", "second gold"].contains(&g.passages[0].as_str()) && g.passages[1] == "negative", "{:?}", g.passages);
            if mask {
                assert_eq!(g.positive_texts, vec![vec!["first gold".to_string(), "second gold".to_string()]]);
            } else {
                assert!(g.positive_texts.is_empty(), "{:?}", g.positive_texts);
            }
        }
    }

    /// What the trainer writes as its state is what `is_trainer_state` takes for one (it is how
    /// an older checkpoint, or a run's folder, is told from Hugging Face's, which has a file of
    /// the same name).
    #[test]
    fn the_trainer_s_state_is_recognised_as_its_own() {
        let (mut enc, mut opt) = (NoEncoder, NoOptimizer);
        let ex = Example { query_id: "q".into(), query: "query".into(), positives: vec!["p".into()], negatives: vec!["n".into()], answers: vec![], lm_scores: vec![] };
        let trainer = Trainer::new(config(false), &mut enc, &mut opt, vec![TaskData { name: "t".into(), examples: vec![ex] }], HashMap::new(), Path::new(".")).unwrap();
        let dir = std::env::temp_dir().join(format!("rak-state-shape-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(STATE_FILE);
        std::fs::write(&path, serde_json::to_string_pretty(&trainer.state).unwrap()).unwrap();
        assert!(rak_retrieval::index::is_trainer_state(&path));
        std::fs::write(&path, r#"{"global_step":10,"log_history":[]}"#).unwrap();
        assert!(!rak_retrieval::index::is_trainer_state(&path));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A resume may change how often the run logs and saves (no weight changes), not a
    /// setting that does; the refusal names the settings that differ, one line each.
    #[test]
    fn a_checkpoint_resumes_with_other_logging_and_saving_only() {
        let (mut enc, mut opt) = (NoEncoder, NoOptimizer);
        let ex = Example { query_id: "q".into(), query: "query".into(), positives: vec!["p".into()], negatives: vec!["n".into()], answers: vec![], lm_scores: vec![] };
        let mut trainer = Trainer::new(config(false), &mut enc, &mut opt, vec![TaskData { name: "t".into(), examples: vec![ex] }], HashMap::new(), Path::new(".")).unwrap();
        trainer.set_episode(2);
        let dir = std::env::temp_dir().join(format!("rak-resumable-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let e = format!("{:#}", check_checkpoint(&dir, &config(false), 1, None).unwrap_err());
        assert!(e.contains("no such checkpoint folder"), "{e}");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(STATE_FILE), serde_json::to_string_pretty(&trainer.state).unwrap()).unwrap();
        let e = format!("{:#}", check_checkpoint(&dir, &config(false), 1, None).unwrap_err());
        assert!(e.contains(OPTIMIZER_FILE), "{e}");
        std::fs::write(dir.join(OPTIMIZER_FILE), "").unwrap();
        let changed = TrainerConfig { logging_steps: 7, save_steps: 9, max_skipped_steps: 4, ..config(false) };
        assert_eq!(check_checkpoint(&dir, &changed, 1, Some(2)).unwrap().episode, 2);
        let e = format!("{:#}", check_checkpoint(&dir, &changed, 1, Some(1)).unwrap_err());
        assert!(e.contains("a checkpoint of episode 2, not of episode 1"), "{e}");
        let e = format!("{:#}", check_checkpoint(&dir, &changed, 2, None).unwrap_err());
        assert!(e.contains("over 1 processes and this one has 2"), "{e}");
        let other = TrainerConfig { learning_rate: 2e-5, seed: 4, save_steps: 9, ..config(false) };
        let e = format!("{:#}", check_checkpoint(&dir, &other, 1, None).unwrap_err());
        assert!(e.contains("  learning_rate: 0.00001 then, 0.00002 now") && e.contains("  seed: 3 then, 4 now"), "{e}");
        assert!(!e.contains("save_steps:") && !e.contains('{'), "only the differing settings: {e}");
        // A state whose step lies past the run's end is damaged, not finished.
        let mut past = trainer.state.clone();
        past.step = config(false).max_steps + 1;
        std::fs::write(dir.join(STATE_FILE), serde_json::to_string_pretty(&past).unwrap()).unwrap();
        let e = format!("{:#}", check_checkpoint(&dir, &config(false), 1, Some(2)).unwrap_err());
        assert!(e.contains(&format!("step {} lies past the run's max_steps = {}", past.step, past.step - 1)), "{e}");
        let skipped = TrainerState { step: 1, skipped_steps: 2, ..trainer.state.clone() };
        std::fs::write(dir.join(STATE_FILE), serde_json::to_string_pretty(&skipped).unwrap()).unwrap();
        let e = format!("{:#}", check_checkpoint(&dir, &config(false), 1, Some(2)).unwrap_err());
        assert!(e.contains("2 steps skipped of 1 taken"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
