//! `host train`: multitask dense-retriever training in the style of Hugging Face's Trainer.
//! A TOML recipe (`--config`) gives the data, model and hyper-parameters; flags override it.
//! Relative paths in the recipe are taken from the current folder.

use super::Bar;
use crate::registry::Registry;
use anyhow::{bail, Context, Result};
use rak_retrieval::index::{Bm25Index, Bm25Params};
use rak_retrieval::pipeline::index::{build_index, IndexSpec};
use rak_retrieval::pipeline::Progress;
use rak_train::data::{corpus_ids, load_task, passage_texts, task_sources, LoadReport};
use rak_train::negatives;
use rak_train::trainer::{latest_checkpoint, Sampler, SamplerKind, Trainer, TrainerConfig};
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::HashSet;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, clap::Args)]
pub struct TrainArgs {
    /// Encoder plugin (dpr, taser, taco, ...); default: the recipe's.
    #[arg(long)]
    pub encoder: Option<String>,
    /// Starting checkpoint directory; default: the recipe's.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Optimizer plugin (adamw, tsage, ...); default: the recipe's.
    #[arg(long)]
    pub optim: Option<String>,
    /// The TOML recipe.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Where checkpoints, the log and the final model go.
    #[arg(long)]
    pub output_dir: PathBuf,
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop after this many optimizer steps (overrides the number of epochs).
    #[arg(long)]
    pub max_steps: Option<u64>,
    #[arg(long)]
    pub num_train_epochs: Option<f64>,
    #[arg(long)]
    pub learning_rate: Option<f64>,
    /// Queries per step over all tasks (one process).
    #[arg(long)]
    pub per_device_train_batch_size: Option<usize>,
    /// A checkpoint directory, or `latest` (the newest under --output-dir).
    #[arg(long)]
    pub resume_from_checkpoint: Option<String>,
    /// Start afresh in an --output-dir that holds an earlier run's checkpoints (they are removed).
    #[arg(long)]
    pub overwrite_output_dir: bool,
    /// `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Run the model in bfloat16 (GPU).
    #[arg(long)]
    pub bf16: bool,
    /// After the BM25-negative stage, this many ANCE episodes: mine negatives with the model
    /// so far over the whole corpus, then train again (default: the recipe's, else 0).
    #[arg(long)]
    pub ance_episodes: Option<u32>,
}

/// The recipe file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Recipe {
    #[serde(default)]
    pub model: ModelSection,
    pub data: DataSection,
    #[serde(default)]
    pub train: TrainSection,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    pub encoder: Option<String>,
    pub path: Option<PathBuf>,
    /// Extra encoder settings (e.g. `task_markers`, `max_length`).
    #[serde(default)]
    pub settings: serde_json::Map<String, Value>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataSection {
    /// BEIR corpus.jsonl shared by every task.
    pub corpus: PathBuf,
    /// Folder holding `<task>/queries.<split>.jsonl` and `<task>/qrels.<split>.tsv`.
    pub task_dir: PathBuf,
    pub tasks: Vec<String>,
    #[serde(default = "default_split")]
    pub split: String,
    /// A BM25 index of the corpus for hard negatives (built under the output folder if absent).
    pub bm25_index: Option<PathBuf>,
}

fn default_split() -> String {
    "train".into()
}

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainSection {
    pub optim: Option<String>,
    pub optim_settings: serde_json::Map<String, Value>,
    pub learning_rate: f64,
    pub per_device_train_batch_size: usize,
    pub num_train_epochs: f64,
    pub max_steps: Option<u64>,
    pub warmup_ratio: f64,
    pub max_grad_norm: Option<f64>,
    pub seed: u64,
    pub logging_steps: u64,
    pub save_steps: u64,
    /// `taco` (every task in every step) or `task_per_batch` (MT-DPR).
    pub sampler: String,
    /// TACO's c in `(N_t/ΣN)^(1/c)`.
    pub temperature: f64,
    /// Hard negatives per query (BM25 top-k minus gold).
    pub hard_negatives: usize,
    /// How deep in BM25's ranking negatives are drawn from.
    pub negative_depth: usize,
    /// BM25's constants for the negatives (Pyserini's defaults).
    pub bm25_k1: f32,
    pub bm25_b: f32,
    /// Factor on the scores in the loss (1: REFERENCE §1's raw dot product).
    pub score_scale: f64,
    /// ANCE episodes after the BM25 stage, and how deep in the model's ranking their
    /// negatives are drawn from.
    pub ance_episodes: u32,
    pub ance_depth: usize,
    /// Length of each ANCE stage in epochs (TACO: 20 warm-up epochs, then 3 per episode);
    /// default: the same length as the BM25 stage (`max_steps` or `num_train_epochs`).
    pub ance_num_train_epochs: Option<f64>,
    /// Encode queries with their task's name (the encoder makes it a prefix, a marker or a
    /// `?`, or ignores it).
    pub task_names: bool,
    pub layerwise_lr_decay: bool,
    pub max_skipped_steps: u64,
}

impl Default for TrainSection {
    fn default() -> Self {
        TrainSection {
            optim: None,
            optim_settings: Default::default(),
            learning_rate: 2e-5,
            per_device_train_batch_size: 32,
            num_train_epochs: 1.0,
            max_steps: None,
            warmup_ratio: 0.1,
            max_grad_norm: Some(1.0),
            seed: 42,
            logging_steps: 10,
            save_steps: 500,
            sampler: "taco".into(),
            temperature: 4.0,
            hard_negatives: 1,
            negative_depth: 100,
            bm25_k1: Bm25Params::default().k1,
            bm25_b: Bm25Params::default().b,
            score_scale: 1.0,
            ance_episodes: 0,
            ance_depth: 200,
            ance_num_train_epochs: None,
            task_names: true,
            layerwise_lr_decay: false,
            max_skipped_steps: 10,
        }
    }
}

pub fn read_recipe(path: &Path) -> Result<Recipe> {
    let text = std::fs::read_to_string(path).with_context(|| format!("{}: cannot read", path.display()))?;
    toml::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}

fn sampler_kind(t: &TrainSection) -> Result<SamplerKind> {
    Ok(match t.sampler.as_str() {
        "taco" => SamplerKind::Taco { temperature: t.temperature },
        "task_per_batch" => SamplerKind::TaskPerBatch,
        other => bail!("sampler {other:?}: expected taco or task_per_batch"),
    })
}

pub fn run(registry: &Registry, args: &TrainArgs) -> Result<Value> {
    let Some(config_path) = &args.config else { bail!("--config FILE.toml is required (see configs/minikilt/)") };
    let mut recipe = read_recipe(config_path)?;
    let t = &mut recipe.train;
    if let Some(v) = args.seed {
        t.seed = v;
    }
    if let Some(v) = args.learning_rate {
        t.learning_rate = v;
    }
    if let Some(v) = args.per_device_train_batch_size {
        t.per_device_train_batch_size = v;
    }
    if let Some(v) = args.num_train_epochs {
        t.num_train_epochs = v;
    }
    if args.max_steps.is_some() {
        t.max_steps = args.max_steps;
    }
    let encoder_name = args.encoder.clone().or(recipe.model.encoder.clone()).context("no encoder: give --encoder or model.encoder")?;
    let optim_name = args.optim.clone().or(recipe.train.optim.clone()).context("no optimizer: give --optim or train.optim")?;
    if let Some(v) = args.ance_episodes {
        recipe.train.ance_episodes = v;
    }
    let episodes = recipe.train.ance_episodes;
    let out = &args.output_dir;
    std::fs::create_dir_all(out).with_context(|| format!("{}: cannot create", out.display()))?;
    let progress = Bar::default();
    // Where each stage trains: the output folder itself, or with ANCE one folder per stage
    // (`episode-0` on BM25 negatives, then `episode-E`), the final model copied to the top.
    let stages: Vec<PathBuf> = if episodes == 0 { vec![out.clone()] } else { (0..=episodes).map(|e| out.join(format!("episode-{e}"))).collect() };

    let resume = match args.resume_from_checkpoint.as_deref() {
        None => Resume::No,
        Some("latest") => Resume::Latest,
        Some(dir) => {
            let dir = PathBuf::from(dir);
            let parent = dir.parent().map(Path::to_path_buf).unwrap_or_default();
            let Some(stage) = stages.iter().position(|s| same_dir(s, &parent)) else {
                bail!("--resume-from-checkpoint {}: not a checkpoint of {} (or of one of its episodes)", dir.display(), out.display());
            };
            Resume::At(stage, dir)
        }
    };
    let base_model = args.model.clone().or(recipe.model.path.clone()).context("no model: give --model or model.path")?;
    let identity = recipe_identity(&recipe, &encoder_name, &optim_name, &base_model, args.bf16);
    let layout = RunLayout { out: out.clone() };
    match &resume {
        Resume::No => {
            if layout.has_earlier_run() && !args.overwrite_output_dir {
                bail!(
                    "{} holds checkpoints of an earlier run; continue it with --resume-from-checkpoint latest, or start over with --overwrite-output-dir",
                    out.display()
                );
            }
            layout.clear_from(0)?;
        }
        Resume::Latest | Resume::At(..) => {
            if let Some(earlier) = layout.recorded_episodes()? {
                if earlier != episodes {
                    bail!("{} was started with {earlier} ANCE episodes, this run asks for {episodes}; resume with --ance-episodes {earlier}", out.display());
                }
            }
            layout.check_recipe(&identity)?;
            // Resuming inside a stage makes everything after it stale.
            if let Resume::At(stage, _) = &resume {
                layout.clear_after(*stage, episodes)?;
            }
        }
    }
    layout.record(episodes, &identity)?;

    // Data: every task's examples, then hard negatives, then the texts they name.
    let d = &recipe.data;
    let known = corpus_ids(&d.corpus)?;
    let mut report = LoadReport::default();
    let mut tasks = Vec::new();
    for src in task_sources(&d.task_dir, &d.tasks, &d.split)? {
        tasks.push(load_task(&src, &|id| known.contains(id), &mut report)?);
    }
    if report != LoadReport::default() {
        progress.log(&format!(
            "train: dropped {} queries without a relevant corpus passage; ignored {} judgements naming passages not in {}",
            report.queries_without_gold,
            report.judgements_naming_unknown_passages,
            d.corpus.display()
        ));
    }
    drop(known);
    let t = &recipe.train;
    if t.hard_negatives > 0 {
        let saved = out.join("negatives-episode-0.json");
        let bm25 = Bm25Params { k1: t.bm25_k1, b: t.bm25_b };
        bm25.validate()?;
        let source = format!("bm25 k1={} b={}", bm25.k1, bm25.b);
        if !negatives::load(&saved, &mut tasks, t.negative_depth, &source)? {
            let index_dir = match &d.bm25_index {
                Some(dir) => dir.clone(),
                None => {
                    let dir = out.join("bm25-index");
                    if !dir.join("index.json").exists() {
                        build_index(&IndexSpec::Bm25 { corpus: d.corpus.clone(), params: bm25 }, &dir, &progress)?;
                    }
                    dir
                }
            };
            let mut index = match Bm25Index::open(&index_dir) {
                // The run's own cached index, written by an older version: rebuild it.
                Err(e) if d.bm25_index.is_none() => {
                    progress.log(&format!("train: rebuilding {} ({e:#})", index_dir.display()));
                    build_index(&IndexSpec::Bm25 { corpus: d.corpus.clone(), params: bm25 }, &index_dir, &progress)?;
                    Bm25Index::open(&index_dir)?
                }
                other => other?,
            };
            index.set_params(bm25)?;
            negatives::bm25_negatives(&index, &mut tasks, t.negative_depth, &progress)?;
            report_filled(negatives::fill_empty(&mut tasks, t.hard_negatives, t.seed), "BM25", &progress);
            negatives::save(&saved, &tasks, t.negative_depth, &source)?;
        }
    }
    let kind = sampler_kind(t)?;
    let counts: Vec<usize> = tasks.iter().map(|t| t.examples.len()).collect();
    let steps_per_epoch = Sampler::new(kind, &counts, t.per_device_train_batch_size, t.seed)?.steps_per_epoch() as u64;
    let max_steps = t.max_steps.unwrap_or(((t.num_train_epochs * steps_per_epoch as f64).ceil() as u64).max(1));
    let episode_steps = match t.ance_num_train_epochs {
        Some(epochs) => ((epochs * steps_per_epoch as f64).ceil() as u64).max(1),
        None => max_steps,
    };
    let config = TrainerConfig {
        learning_rate: t.learning_rate,
        batch_size: t.per_device_train_batch_size,
        hard_negatives: t.hard_negatives,
        sampler: kind,
        max_steps,
        warmup_ratio: t.warmup_ratio,
        max_grad_norm: t.max_grad_norm,
        seed: t.seed,
        logging_steps: t.logging_steps,
        save_steps: t.save_steps,
        task_names: t.task_names,
        layerwise_lr_decay: t.layerwise_lr_decay,
        max_skipped_steps: t.max_skipped_steps,
        score_scale: t.score_scale,
    };
    let settings_for = |model: &Path| {
        let mut settings = Value::Object(recipe.model.settings.clone());
        settings["model"] = json!(model);
        settings["device"] = json!(args.device);
        if args.bf16 {
            settings["bf16"] = json!(true);
        }
        settings
    };
    let names: Vec<String> = tasks.iter().map(|t| format!("{} ({} queries)", t.name, t.examples.len())).collect();
    let episodes_text = if episodes > 0 { format!(", then {episodes} ANCE episodes of {episode_steps} steps") } else { String::new() };
    progress.log(&format!(
        "train: {encoder_name} with {optim_name}, {max_steps} steps ({steps_per_epoch} per epoch){episodes_text}, tasks: {}",
        names.join(", ")
    ));

    let mut model = base_model;
    for (episode, stage) in stages.iter().enumerate() {
        if episodes > 0 && stage.join(STAGE_DONE).exists() {
            model = stage.clone();
            continue;
        }
        if episode > 0 && t.hard_negatives == 0 {
            progress.log("warning: ANCE episodes with hard_negatives = 0 only repeat training: no negatives are drawn");
        }
        if episode > 0 && t.hard_negatives > 0 {
            // ANCE: negatives from the previous stage's model over the whole corpus.
            let saved = out.join(format!("negatives-episode-{episode}.json"));
            // Keyed on the stage, not on the path: a stage retrained removes the later negatives.
            let source = format!("ance episode {episode}, mined with the model of episode-{}", episode - 1);
            let work = stage.join("ance");
            if negatives::load(&saved, &mut tasks, t.ance_depth, &source)? {
                // A run killed between saving the negatives and removing the work folder.
                let _ = std::fs::remove_dir_all(&work);
            } else {
                let settings = settings_for(&model);
                let mut miner = registry.encoder(&encoder_name, &settings)?;
                let identity = super::encode::encoder_identity(&encoder_name, &settings)?;
                progress.log(&format!("train: episode {episode}: mining negatives with {}", model.display()));
                negatives::ance_negatives(miner.as_mut(), identity, &d.corpus, &work, &mut tasks, t.ance_depth, t.task_names, &progress)?;
                report_filled(negatives::fill_empty(&mut tasks, t.hard_negatives, t.seed), "the model", &progress);
                negatives::save(&saved, &tasks, t.ance_depth, &source)?;
                // The corpus embeddings and index are as large as the corpus; the negatives are kept.
                std::fs::remove_dir_all(&work).with_context(|| format!("{}: cannot remove", work.display()))?;
            }
        }
        let wanted: HashSet<&str> =
            tasks.iter().flat_map(|t| &t.examples).flat_map(|e| e.positives.iter().chain(&e.negatives)).map(String::as_str).collect();
        let texts = passage_texts(&d.corpus, &wanted)?;
        let checkpoint = match &resume {
            Resume::No => None,
            Resume::Latest => {
                let found = latest_checkpoint(stage);
                if found.is_none() && (episode == 0 || episodes == 0) {
                    progress.log(&format!("train: no checkpoint under {} yet; starting from the beginning", stage.display()));
                }
                found
            }
            Resume::At(s, dir) => (*s == episode).then(|| dir.clone()),
        };
        let start = checkpoint.clone().unwrap_or_else(|| model.clone());
        let mut encoder = registry.encoder(&encoder_name, &settings_for(&start))?;
        let mut optimizer = registry.optimizer(&optim_name, &Value::Object(t.optim_settings.clone()))?;
        if episodes > 0 {
            progress.log(&format!("train: stage {episode} of {episodes} ({}) in {}", if episode == 0 { "BM25 negatives" } else { "ANCE negatives" }, stage.display()));
        }
        // Each stage draws its own batch order and dropout (a stage is a new run, as in ANCE).
        let stage_config = TrainerConfig {
            max_steps: if episode == 0 { max_steps } else { episode_steps },
            seed: config.seed.wrapping_add(episode as u64),
            ..config.clone()
        };
        let mut trainer = Trainer::new(stage_config, encoder.as_mut(), optimizer.as_mut(), tasks.clone(), texts, stage)?;
        trainer.set_episode(episode as u32);
        if let Some(ckpt) = &checkpoint {
            trainer.resume(ckpt)?;
            if trainer.episode() != episode as u32 {
                bail!("{} is a checkpoint of episode {}, not of episode {episode}", ckpt.display(), trainer.episode());
            }
            progress.log(&format!("train: resumed from {} at step {}", ckpt.display(), trainer.step()));
        }
        trainer.train(&progress)?;
        drop(trainer);
        if episodes > 0 {
            if episode == episodes as usize {
                // Before the stage is marked done, so a kill in between redoes the copy.
                encoder.save(out)?;
            }
            rak_core::fsutil::write_bytes(&stage.join(STAGE_DONE), b"")?;
        }
        model = stage.clone();
    }
    if episodes > 0 && !out.join(FINAL_MARK).exists() {
        // Every stage was done already but the copy never finished: make it from the last stage.
        registry.encoder(&encoder_name, &settings_for(&model))?.save(out)?;
    }
    if episodes > 0 {
        rak_core::fsutil::write_bytes(&out.join(FINAL_MARK), b"")?;
    }
    let total_steps = max_steps + episodes as u64 * episode_steps;
    Ok(json!({"output_dir": out, "steps": total_steps, "episodes": episodes, "log": stages.last().map(|s| s.join(rak_train::trainer::LOG_FILE))}))
}

/// What decides a run besides the trainer's own settings (which every checkpoint records and
/// checks): encoder, optimizer, their settings, the starting model, the data and how negatives
/// are mined. Kept in `run.json`, so a resume with another recipe is refused instead of
/// continuing a checkpoint under settings it was not trained with.
fn recipe_identity(recipe: &Recipe, encoder: &str, optim: &str, base_model: &Path, bf16: bool) -> Value {
    let path = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf()).display().to_string();
    let (d, t) = (&recipe.data, &recipe.train);
    json!({
        "encoder": encoder,
        "encoder_settings": recipe.model.settings,
        "bf16": bf16,
        "optim": optim,
        "optim_settings": t.optim_settings,
        "model": path(base_model),
        "data": {"corpus": path(&d.corpus), "task_dir": path(&d.task_dir), "tasks": d.tasks, "split": d.split, "bm25_index": d.bm25_index.as_deref().map(path)},
        "negatives": {"bm25_k1": t.bm25_k1, "bm25_b": t.bm25_b, "negative_depth": t.negative_depth, "ance_depth": t.ance_depth, "ance_num_train_epochs": t.ance_num_train_epochs},
    })
}

fn report_filled(filled: usize, retriever: &str, progress: &dyn Progress) {
    if filled > 0 {
        progress.log(&format!("train: {retriever} found no negative for {filled} queries; they get gold passages of other queries instead"));
    }
}

/// Marks a finished stage of an ANCE run (its model is complete in its folder).
const STAGE_DONE: &str = "stage_done";
/// Marks an ANCE run's final model as copied to the output folder.
const FINAL_MARK: &str = "final_model_done";
/// Records how many ANCE episodes a run was started with.
const RUN_FILE: &str = "run.json";

/// The files of a `host train` output folder, whichever number of episodes made them.
struct RunLayout {
    out: PathBuf,
}

impl RunLayout {
    /// `episode-E` folders present, by episode.
    fn episode_dirs(&self) -> Vec<(u32, PathBuf)> {
        let Ok(entries) = std::fs::read_dir(&self.out) else { return Vec::new() };
        let mut dirs: Vec<(u32, PathBuf)> = entries
            .flatten()
            .filter_map(|e| e.file_name().to_string_lossy().strip_prefix("episode-")?.parse().ok().map(|n| (n, e.path())))
            .filter(|(_, p): &(u32, PathBuf)| p.is_dir())
            .collect();
        dirs.sort();
        dirs
    }

    fn has_earlier_run(&self) -> bool {
        !rak_train::trainer::checkpoints(&self.out).is_empty()
            || self.episode_dirs().iter().any(|(_, d)| d.join(STAGE_DONE).exists() || !rak_train::trainer::checkpoints(d).is_empty())
    }

    /// Remove what stages `from..` left (checkpoints, marks, mined negatives); with 0, every
    /// trace of an earlier run, whatever its number of episodes.
    fn clear_from(&self, from: u32) -> Result<()> {
        let remove_dir = |d: &Path| std::fs::remove_dir_all(d).with_context(|| format!("{}: cannot remove", d.display()));
        if from == 0 {
            for ckpt in rak_train::trainer::checkpoints(&self.out) {
                remove_dir(&ckpt)?;
            }
            let _ = std::fs::remove_file(self.out.join(RUN_FILE));
        }
        let _ = std::fs::remove_file(self.out.join(FINAL_MARK));
        for (e, dir) in self.episode_dirs() {
            if e >= from {
                let _ = std::fs::remove_file(dir.join(STAGE_DONE));
                for ckpt in rak_train::trainer::checkpoints(&dir) {
                    remove_dir(&ckpt)?;
                }
            }
        }
        if let Ok(entries) = std::fs::read_dir(&self.out) {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                let mined = name.strip_prefix("negatives-episode-").and_then(|n| n.strip_suffix(".json")).and_then(|n| n.parse::<u32>().ok());
                // Episode 0's negatives are BM25's: they do not depend on any stage.
                if mined.is_some_and(|n| n > 0 && n >= from.max(1)) {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        Ok(())
    }

    /// Resuming in `stage`: it is not done, and later stages and their negatives are stale.
    fn clear_after(&self, stage: usize, episodes: u32) -> Result<()> {
        if episodes == 0 {
            return Ok(());
        }
        let _ = std::fs::remove_file(self.out.join(format!("episode-{stage}")).join(STAGE_DONE));
        self.clear_from(stage as u32 + 1)
    }

    fn recorded_episodes(&self) -> Result<Option<u32>> {
        let path = self.out.join(RUN_FILE);
        match std::fs::read_to_string(&path) {
            Ok(text) => {
                let v: Value = serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", path.display()))?;
                Ok(v["ance_episodes"].as_u64().map(|n| n as u32))
            }
            Err(_) if rak_train::trainer::checkpoints(&self.out).is_empty() && self.episode_dirs().is_empty() => Ok(None),
            // Written before run.json existed: a run without episodes, or unknown.
            Err(_) => Ok(self.episode_dirs().is_empty().then_some(0)),
        }
    }

    fn record(&self, episodes: u32, recipe: &Value) -> Result<()> {
        rak_core::fsutil::write_bytes(&self.out.join(RUN_FILE), json!({"ance_episodes": episodes, "recipe": recipe}).to_string().as_bytes())
    }

    /// Refuse to resume a run recorded with another recipe (a `run.json` from before recipes
    /// were recorded has none to compare).
    fn check_recipe(&self, recipe: &Value) -> Result<()> {
        let path = self.out.join(RUN_FILE);
        let Ok(text) = std::fs::read_to_string(&path) else { return Ok(()) };
        let recorded: Value = serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", path.display()))?;
        let Some(earlier) = recorded.get("recipe").and_then(Value::as_object) else { return Ok(()) };
        let differences: Vec<String> = recipe
            .as_object()
            .into_iter()
            .flatten()
            .filter(|(k, v)| earlier.get(k.as_str()) != Some(v))
            .map(|(k, v)| format!("  {k}: {} then, {v} now", earlier.get(k.as_str()).unwrap_or(&Value::Null)))
            .collect();
        if !differences.is_empty() {
            bail!(
                "{} was started with another recipe; resume it with the same one, or start over with --overwrite-output-dir:\n{}",
                self.out.display(),
                differences.join("\n")
            );
        }
        Ok(())
    }
}

enum Resume {
    No,
    Latest,
    /// A checkpoint of this stage.
    At(usize, PathBuf),
}

fn same_dir(a: &Path, b: &Path) -> bool {
    match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}
