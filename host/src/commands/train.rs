//! `host train`: multitask dense-retriever training in the style of Hugging Face's Trainer.
//! A TOML recipe (`--config`, `rak_train::recipe`) gives the data, model and
//! hyper-parameters; flags override it; `rak_train::run` does the rest.

use super::Bar;
use crate::registry::Registry;
use anyhow::{bail, Context, Result};
use rak_core::plugin::{Encoder, Optimizer};
use rak_train::recipe::read_recipe;
use rak_train::run::{Plugins, Resume, RunSpec};
use serde_json::Value;
use std::path::PathBuf;

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
    /// Mixed precision: float32 weights and optimizer state, the forward pass under bf16
    /// autocast (as Hugging Face's Trainer with `bf16=True`), on the CPU or a GPU.
    #[arg(long)]
    pub bf16: bool,
    /// After the BM25-negative stage, this many ANCE episodes: mine negatives with the model
    /// so far over the whole corpus, then train again (default: the recipe's, else 0).
    #[arg(long)]
    pub ance_episodes: Option<u32>,
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
    if let Some(v) = args.ance_episodes {
        t.ance_episodes = v;
    }
    let spec = RunSpec {
        encoder: args.encoder.clone().or(recipe.model.encoder.clone()).context("no encoder: give --encoder or model.encoder")?,
        optim: args.optim.clone().or(recipe.train.optim.clone()).context("no optimizer: give --optim or train.optim")?,
        model: args.model.clone().or(recipe.model.path.clone()).context("no model: give --model or model.path")?,
        recipe,
        output_dir: args.output_dir.clone(),
        device: args.device.clone(),
        bf16: args.bf16,
        resume: Resume::parse(args.resume_from_checkpoint.as_deref()),
        overwrite: args.overwrite_output_dir,
        examples: None,
    };
    rak_train::run::run(&spec, registry, &Bar::default())
}

impl Plugins for Registry {
    fn encoder(&self, name: &str, settings: &Value) -> Result<Box<dyn Encoder>> {
        Registry::encoder(self, name, settings)
    }
    fn optimizer(&self, name: &str, settings: &Value) -> Result<Box<dyn Optimizer>> {
        Registry::optimizer(self, name, settings)
    }
}
