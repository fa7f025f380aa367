//! `host analyze`: the TACO paper's task-specialisation analysis of a trained model
//! (`rak_train::analyze`), as JSON plus PNG plots: the density of each task's sensitivities
//! (the paper's Fig. 2) and the histogram of task entropy (Fig. 3a); with `--compare`, the task
//! commitment rate between two checkpoints.
//!
//! Sensitivities come from T-SAGE's momentum when the checkpoint holds it (what the
//! optimizer itself weighed tasks by), or else from fresh gradients: `--batches` batches of
//! each task's training queries, NCE with in-batch negatives, dropout on as in training.

use rak_train::recipe::{read_recipe, Recipe};
use super::Bar;
use crate::registry::Registry;
use anyhow::{bail, Context, Result};
use rak_core::abi::Role;
use rak_retrieval::pipeline::Progress;
use rak_train::analyze::{analyze, commitment_rate, AnalysisConfig, Sensitivities, SensitivityAccumulator};
use rak_train::data::{corpus_ids, load_task, passage_texts, task_sources, LoadReport};
use rak_train::loss::nce_loss;
use rak_core::rng::Rng;
use rak_train::trainer::{latest_checkpoint, OPTIMIZER_FILE};
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use tch::Tensor;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Source {
    /// T-SAGE's momentum if the checkpoint has it, else gradients.
    Auto,
    Momentum,
    Gradients,
}

#[derive(Debug, Clone, clap::Args)]
pub struct AnalyzeArgs {
    /// A trained model: a `host train` output folder or one of its `checkpoint-STEP` folders.
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// The recipe it was trained with (tasks, data, encoder settings).
    #[arg(long)]
    pub config: PathBuf,
    /// A later (or earlier) checkpoint of the same run: report the task commitment rate.
    #[arg(long)]
    pub compare: Option<PathBuf>,
    /// Where analysis.json and the plots go (default: CHECKPOINT/analysis).
    #[arg(long)]
    pub output: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = Source::Auto)]
    pub source: Source,
    /// Gradient source: batches per task and queries per batch.
    #[arg(long, default_value_t = 8)]
    pub batches: usize,
    #[arg(long, default_value_t = 16)]
    pub batch_size: usize,
    /// Softmax temperature of the task entropy.
    #[arg(long, default_value_t = 2.0)]
    pub tau: f64,
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    #[arg(long, default_value = "cpu")]
    pub device: String,
}

/// The checkpoint folder behind `dir`: itself, its newest checkpoint, or (an ANCE run's
/// output) the newest checkpoint of its last episode.
fn checkpoint_of(dir: &Path) -> Option<PathBuf> {
    if dir.join(OPTIMIZER_FILE).exists() {
        return Some(dir.to_path_buf());
    }
    if let Some(c) = latest_checkpoint(dir) {
        return Some(c);
    }
    let last_episode = std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .filter_map(|e| e.file_name().to_string_lossy().strip_prefix("episode-")?.parse::<u32>().ok().map(|n| (n, e.path())))
        .max_by_key(|(n, _)| *n)?;
    latest_checkpoint(&last_episode.1)
}

/// (episode, step) of the checkpoint behind `dir`, from its trainer state.
fn position(dir: &Path) -> Option<(u64, u64)> {
    let state: Value = serde_json::from_str(&std::fs::read_to_string(checkpoint_of(dir)?.join(rak_train::trainer::STATE_FILE)).ok()?).ok()?;
    Some((state["episode"].as_u64().unwrap_or(0), state["step"].as_u64()?))
}

fn optimizer_state(dir: &Path) -> Option<PathBuf> {
    checkpoint_of(dir).map(|c| c.join(OPTIMIZER_FILE)).filter(|p| p.exists())
}

/// T-SAGE's momentum by parameter name, if the state has it.
fn momentum(path: &Path) -> Result<Option<BTreeMap<String, Tensor>>> {
    let tensors = Tensor::read_safetensors(path).map_err(|e| anyhow::anyhow!("{}: cannot read: {e}", path.display()))?;
    let m: BTreeMap<String, Tensor> = tensors.into_iter().filter_map(|(n, t)| n.strip_prefix("momentum/").map(|n| (n.to_string(), t))).collect();
    Ok((!m.is_empty()).then_some(m))
}

fn sensitivities(registry: &Registry, recipe: &Recipe, dir: &Path, args: &AnalyzeArgs, progress: &dyn Progress) -> Result<(Sensitivities, String)> {
    let tasks = recipe.data.tasks.clone();
    if args.source != Source::Gradients {
        if let Some(state) = optimizer_state(dir) {
            if let Some(m) = momentum(&state)? {
                let s = Sensitivities::from_named(tasks, &m).with_context(|| format!("{}: T-SAGE momentum", state.display()))?;
                return Ok((s, format!("T-SAGE momentum in {}", state.display())));
            }
        }
        if args.source == Source::Momentum {
            bail!("{}: no T-SAGE momentum found (trained with another optimizer?); use --source gradients", dir.display());
        }
    }
    gradient_sensitivities(registry, recipe, dir, args, progress)
}

fn gradient_sensitivities(registry: &Registry, recipe: &Recipe, dir: &Path, args: &AnalyzeArgs, progress: &dyn Progress) -> Result<(Sensitivities, String)> {
    let d = &recipe.data;
    let encoder_name = recipe.model.encoder.clone().context("the recipe names no encoder (model.encoder)")?;
    let known = corpus_ids(&d.corpus)?;
    let mut report = LoadReport::default();
    let mut tasks = Vec::new();
    for src in task_sources(&d.task_dir, &d.tasks, &d.split)? {
        tasks.push(load_task(&src, &|id| known.contains(id), &mut report)?);
    }
    drop(known);
    // Which examples each batch holds, drawn once so the texts can be loaded together.
    let batches: Vec<Vec<Vec<usize>>> = tasks
        .iter()
        .enumerate()
        .map(|(t, task)| {
            let mut order: Vec<usize> = (0..task.examples.len()).collect();
            Rng::derive(args.seed, &[0xA7A1, t as u64]).shuffle(&mut order);
            let per = args.batch_size.clamp(2, order.len().max(2));
            order.chunks(per).filter(|c| c.len() >= 2).take(args.batches.max(1)).map(<[usize]>::to_vec).collect()
        })
        .collect();
    let wanted: HashSet<&str> = batches
        .iter()
        .zip(&tasks)
        .flat_map(|(bs, task)| bs.iter().flatten().map(move |&i| task.examples[i].positives[0].as_str()))
        .collect();
    let texts = passage_texts(&d.corpus, &wanted)?;

    // Not the settings a stage override changes: the checkpoint saved its stage's own.
    let mut settings = Value::Object(recipe.shared_model_settings());
    settings["model"] = json!(dir);
    settings["device"] = json!(args.device);
    let mut encoder = registry.encoder(&encoder_name, &settings)?;
    let params = encoder.parameters()?;
    let task_names = recipe.train.task_names;
    let mut acc = SensitivityAccumulator::new(tasks.iter().map(|t| t.name.clone()).collect());
    progress.start("gradients", batches.iter().map(Vec::len).sum::<usize>() as u64);
    tch::manual_seed(args.seed as i64);
    for (task, task_batches) in tasks.iter().zip(&batches) {
        for batch in task_batches {
            let queries: Vec<&str> = batch.iter().map(|&i| task.examples[i].query.as_str()).collect();
            let passages: Vec<&str> = batch.iter().map(|&i| texts[&task.examples[i].positives[0]].as_str()).collect();
            let q = encoder.encode(&queries, Role::Query, task_names.then_some(task.name.as_str()), true)?;
            let p = encoder.encode(&passages, Role::Passage, None, true)?;
            let loss = nce_loss(&q, &p, 1, recipe.train.score_scale, &[])?;
            loss.backward();
            let grads: Vec<(String, Tensor)> = params.iter().map(|(n, t)| (n.clone(), t.grad())).collect();
            acc.add(&task.name, &params, &grads)?;
            for (_, t) in &params {
                let mut g = t.grad();
                if g.defined() {
                    let _ = g.zero_();
                }
            }
            progress.inc(1);
        }
    }
    progress.finish();
    let how = format!("gradients of {} batches of up to {} queries per task (in-batch negatives)", args.batches, args.batch_size);
    Ok((acc.finish(&params)?, how))
}

pub fn run(registry: &Registry, args: &AnalyzeArgs) -> Result<Value> {
    let recipe = read_recipe(&args.config)?;
    if recipe.data.tasks.len() < 2 {
        bail!("{}: task specialisation needs at least two tasks", args.config.display());
    }
    let progress = Bar::default();
    let config = AnalysisConfig { tau: args.tau, ..Default::default() };
    let (sens, source) = sensitivities(registry, &recipe, &args.checkpoint, args, &progress)?;
    let analysis = analyze(&sens, &config)?;
    let mut out = serde_json::to_value(&analysis)?;
    out["checkpoint"] = json!(args.checkpoint);
    out["source"] = json!(source);
    if let Some(other) = &args.compare {
        let (other_sens, other_source) = sensitivities(registry, &recipe, other, args, &progress)?;
        // The rate runs from the earlier checkpoint to the later, whichever was named first.
        let swapped = matches!((position(&args.checkpoint), position(other)), (Some(a), Some(b)) if b < a);
        let (before, after, before_dir, after_dir) =
            if swapped { (&other_sens, &sens, other, &args.checkpoint) } else { (&sens, &other_sens, &args.checkpoint, other) };
        let (rate, specific) = commitment_rate(before, after, &config)?;
        out["commitment"] = json!({
            "before": before_dir, "after": after_dir, "compare_source": other_source,
            "rate": rate, "task_specific_parameters": specific,
        });
    }
    let dir = args.output.clone().unwrap_or_else(|| args.checkpoint.join("analysis"));
    std::fs::create_dir_all(&dir).with_context(|| format!("{}: cannot create", dir.display()))?;
    rak_core::fsutil::write_bytes(&dir.join("analysis.json"), serde_json::to_string_pretty(&out)?.as_bytes())?;

    let (lo, hi) = config.log_sensitivity_range;
    let width = (hi - lo) / config.sensitivity_bins as f64;
    let xs: Vec<f64> = (0..config.sensitivity_bins).map(|i| lo + (i as f64 + 0.5) * width).collect();
    let series: Vec<(String, Vec<f64>)> =
        analysis.per_task.iter().map(|(t, s)| (format!("{t} ({:.1}% zero)", 100.0 * s.zero), s.log_sensitivity_density.clone())).collect();
    crate::plot::lines(&dir.join("sensitivity_density.png"), "Task sensitivity of each parameter", "log10 sensitivity (median-normalised; nonzero ones)", "density", &xs, &series)?;
    let total = analysis.parameters as f64;
    let shares: Vec<f64> = analysis.entropy_histogram.iter().map(|&c| c as f64 / total).collect();
    let title = format!("Task entropy (tau = {}): {:.1}% task-specific", config.tau, 100.0 * analysis.task_specific);
    crate::plot::histogram(
        &dir.join("entropy_histogram.png"),
        &title,
        "entropy of softmax(I / tau) over tasks (nats)",
        "share of parameters",
        0.0,
        analysis.max_entropy,
        &shares,
        Some((config.specific_below, "task-specific below")),
    )?;
    progress.log(&format!("analyze: wrote {}", dir.display()));
    Ok(json!({
        "output": dir,
        "source": out["source"],
        "task_specific": analysis.task_specific,
        "not_activated": analysis.not_activated,
        "commitment": out.get("commitment"),
    }))
}
