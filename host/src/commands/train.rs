//! `host train`: multitask dense-retriever training in the style of Hugging Face's Trainer.
//! A TOML recipe (`--config`) gives the data, model and hyper-parameters; flags override it.
//! Relative paths in the recipe are taken from the current folder.

use super::Bar;
use crate::registry::Registry;
use anyhow::{bail, Context, Result};
use rak_retrieval::index::Bm25Index;
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
            task_names: true,
            layerwise_lr_decay: false,
            max_skipped_steps: 10,
        }
    }
}

fn read_recipe(path: &Path) -> Result<Recipe> {
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
    let out = &args.output_dir;
    std::fs::create_dir_all(out).with_context(|| format!("{}: cannot create", out.display()))?;
    let progress = Bar::default();

    let resume = match args.resume_from_checkpoint.as_deref() {
        None => None,
        Some("latest") => {
            let found = latest_checkpoint(out);
            if found.is_none() {
                progress.log(&format!("train: no checkpoint under {} yet; starting from the beginning", out.display()));
            }
            found
        }
        Some(dir) => Some(PathBuf::from(dir)),
    };
    if resume.is_none() {
        let earlier = rak_train::trainer::checkpoints(out);
        if !earlier.is_empty() && !args.overwrite_output_dir {
            bail!(
                "{} holds checkpoints of an earlier run; continue it with --resume-from-checkpoint latest, or start over with --overwrite-output-dir",
                out.display()
            );
        }
        for dir in earlier {
            std::fs::remove_dir_all(&dir).with_context(|| format!("{}: cannot remove", dir.display()))?;
        }
    }
    let start_model = match &resume {
        Some(ckpt) => ckpt.clone(),
        None => args.model.clone().or(recipe.model.path.clone()).context("no model: give --model or model.path")?,
    };

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
        if !negatives::load(&saved, &mut tasks, t.negative_depth)? {
            let index_dir = match &d.bm25_index {
                Some(dir) => dir.clone(),
                None => {
                    let dir = out.join("bm25-index");
                    if !dir.join("index.json").exists() {
                        build_index(&IndexSpec::Bm25 { corpus: d.corpus.clone() }, &dir, &progress)?;
                    }
                    dir
                }
            };
            let index = Bm25Index::open(&index_dir)?;
            negatives::bm25_negatives(&index, &mut tasks, t.negative_depth, &progress)?;
            negatives::save(&saved, &tasks, t.negative_depth)?;
        }
    }
    let wanted: HashSet<&str> =
        tasks.iter().flat_map(|t| &t.examples).flat_map(|e| e.positives.iter().chain(&e.negatives)).map(String::as_str).collect();
    let texts = passage_texts(&d.corpus, &wanted)?;

    let counts: Vec<usize> = tasks.iter().map(|t| t.examples.len()).collect();
    let kind = sampler_kind(t)?;
    let steps_per_epoch = Sampler::new(kind, &counts, t.per_device_train_batch_size, t.seed)?.steps_per_epoch() as u64;
    let max_steps = t.max_steps.unwrap_or(((t.num_train_epochs * steps_per_epoch as f64).ceil() as u64).max(1));
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
    };

    let mut settings = Value::Object(recipe.model.settings.clone());
    settings["model"] = json!(start_model);
    settings["device"] = json!(args.device);
    if args.bf16 {
        settings["bf16"] = json!(true);
    }
    let mut encoder = registry.encoder(&encoder_name, &settings)?;
    let mut optimizer = registry.optimizer(&optim_name, &Value::Object(t.optim_settings.clone()))?;
    let names: Vec<String> = tasks.iter().map(|t| format!("{} ({} queries)", t.name, t.examples.len())).collect();
    progress.log(&format!(
        "train: {encoder_name} with {optim_name}, {max_steps} steps ({steps_per_epoch} per epoch), tasks: {}",
        names.join(", ")
    ));
    let mut trainer = Trainer::new(config, encoder.as_mut(), optimizer.as_mut(), tasks, texts, out)?;
    if let Some(ckpt) = &resume {
        trainer.resume(ckpt)?;
        progress.log(&format!("train: resumed from {} at step {}", ckpt.display(), trainer.step()));
    }
    trainer.train(&progress)?;
    Ok(json!({"output_dir": out, "steps": max_steps, "log": out.join(rak_train::trainer::LOG_FILE)}))
}
