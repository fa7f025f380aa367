//! One training run from recipe to final model: the output folder's layout, a fresh start or
//! a resume (and the checks that a resume continues the same recipe), the data, BM25 and ANCE
//! hard negatives (cached, each cache keyed on everything it depends on), every stage's
//! trainer and its checkpoints, and the final model in the output folder. `host train` is a
//! thin command over [`run`]; a command plugin reaches it through the host's services.
//!
//! Layout of `OUT`: without ANCE, checkpoints (`checkpoint-STEP/`), `trainer_log.jsonl` and the
//! final model in `OUT` itself; with ANCE episodes, one folder per stage (`OUT/episode-E/`,
//! marked `stage_done` when finished) and the last stage's model copied to `OUT`. Beside them:
//! `negatives-episode-E.json` (each stage's mined negatives; while they are mined,
//! `.negatives-episode-E.parts/` holds them a block of queries at a time; hidden, so that no
//! digest of `OUT` as a model counts it), `bm25-index/` (when the recipe
//! names none) and `run.json` (the episode count and the recipe a resume must match).

use crate::data::{corpus_ids, corpus_pages, corpus_texts, load_task, passage_texts, task_sources, LoadReport, TaskData};
use crate::negatives;
use crate::recipe::{sampler_kind, Recipe, StagePlan, TrainSection};
use rak_core::rng::Rng;
use crate::trainer::{check_checkpoint, check_loss_settings, checkpoints, latest_checkpoint, LossKind, Sampler, TaskLossWeight, Trainer, TrainerConfig, LOG_FILE};
use anyhow::{bail, Context, Result};
use rak_core::dist::{ProcessGroup, Rendezvous};
use rak_core::plugin::{Encoder, Optimizer};
use rak_retrieval::digest::{encoder_identity, file_digest};
use rak_retrieval::index::{Bm25Index, Bm25Params};
use rak_retrieval::pipeline::index::{build_index, IndexSpec};
use rak_retrieval::pipeline::Progress;
use serde_json::{json, Value};
use std::collections::HashSet;
use std::path::{Path, PathBuf};

/// Where the run gets its plugins (the host's registry, or its services).
pub trait Plugins {
    fn encoder(&self, name: &str, settings: &Value) -> Result<Box<dyn Encoder>>;
    fn optimizer(&self, name: &str, settings: &Value) -> Result<Box<dyn Optimizer>>;
}

/// A run as the command line resolved it over the recipe.
#[derive(Debug)]
pub struct RunSpec {
    /// The recipe with every flag already applied.
    pub recipe: Recipe,
    pub encoder: String,
    pub optim: String,
    /// The starting checkpoint.
    pub model: PathBuf,
    pub output_dir: PathBuf,
    /// `cpu`, `cuda` or `cuda:N`.
    pub device: String,
    /// float32 weights, bf16 autocast (the trainer's `bf16`).
    pub bf16: bool,
    pub resume: Resume,
    /// Start afresh over an earlier run's checkpoints (they are removed).
    pub overwrite: bool,
    /// The examples to train on, with their positives and negatives, instead of the recipe's
    /// task files and mined negatives (a command plugin's own, as AAR's LM-preferred
    /// positives). The recipe's corpus still gives the passage texts.
    pub examples: Option<Vec<TaskData>>,
    /// Train data-parallel: this process's place in a group (`host train --nproc`, or the
    /// launch variables of torchrun and the like).
    pub rendezvous: Option<Rendezvous>,
}

/// Where a run starts.
#[derive(Debug, Clone, PartialEq)]
pub enum Resume {
    No,
    /// The newest checkpoint of the unfinished stage, if any.
    Latest,
    /// This checkpoint directory (of the output folder or one of its stages).
    At(PathBuf),
}

impl Resume {
    /// `--resume-from-checkpoint`'s value: `latest` or a directory.
    pub fn parse(flag: Option<&str>) -> Resume {
        match flag {
            None => Resume::No,
            Some("latest") => Resume::Latest,
            Some(dir) => Resume::At(PathBuf::from(dir)),
        }
    }
}

/// The seed of stage `episode` of a run seeded with `seed`: the run's own for the BM25 stage,
/// then one derived from (seed, "stage", episode), so no stage of one seed replays a stage of
/// another (with `seed + episode`, seed 42's first ANCE stage was seed 43's BM25 stage).
pub fn stage_seed(seed: u64, episode: u32) -> u64 {
    if episode == 0 {
        seed
    } else {
        Rng::derive(seed, &[STAGE_SEED, episode as u64]).next_u64()
    }
}

/// Purposes of the streams derived here (the trainer's own use 1-5).
const STAGE_SEED: u64 = 10;
const FILL_SEED: u64 = 11;

/// The seed that fills stage `episode`'s empty negative lists.
fn fill_seed(seed: u64, episode: u32) -> u64 {
    Rng::derive(seed, &[FILL_SEED, episode as u64]).next_u64()
}

/// Train as `spec` says; returns a summary (output folder, steps, episodes, log file).
pub fn run(spec: &RunSpec, plugins: &dyn Plugins, progress: &dyn Progress) -> Result<Value> {
    let (recipe, t) = (&spec.recipe, &spec.recipe.train);
    recipe.validate()?;
    // GradNorm and CGD weigh tasks from their gradients' sizes: they would undo the queries'
    // weights (GradNorm) or apply them twice (CGD's gradient products, then its weighted sum).
    let plans: Vec<StagePlan> = (0..=t.ance_episodes).map(|stage| t.stage_plan(&recipe.model.settings, &spec.optim, stage)).collect();
    if let Some(plan) = plans.iter().find(|p| matches!(p.optim.as_str(), "gradnorm" | "cgd")) {
        if t.task_loss_weight == TaskLossWeight::Queries {
            bail!("task_loss_weight = \"queries\" scales the task gradients, which {} weighs itself; use \"equal\" with it", plan.optim);
        }
    }
    // Every stage's optimizer made once now: a misspelt setting of the last stage's is an
    // error before the first stage trains, not after.
    for (stage, plan) in plans.iter().enumerate() {
        if plans[..stage].iter().all(|p| (&p.optim, &p.optim_settings) != (&plan.optim, &plan.optim_settings)) {
            plugins
                .optimizer(&plan.optim, &Value::Object(plan.optim_settings.clone()))
                .map_err(|e| if plans.len() > 1 { e.context(format!("stage {stage}'s optimizer")) } else { e })?;
        }
    }
    if t.save_total_limit == Some(0) {
        bail!("save_total_limit = 0 would keep no checkpoint: give at least 1, or leave it out to keep all");
    }
    // The loss's own settings, checked before any negatives are mined or models loaded.
    if t.loss == LossKind::LmSupervised && spec.examples.is_none() {
        bail!("loss = \"lm_supervised\" trains on a language model's scores of each query's passages, which task files do not hold; `host aar-train` with aar.mode = \"replug\" gives them");
    }
    let lm_temperature = match (t.loss, t.lm_temperature) {
        // REFERENCE §6's common choice where the recipe gives none.
        (LossKind::LmSupervised, None) => Some(0.1),
        (_, given) => given,
    };
    check_loss_settings(t.loss, t.hard_negatives, lm_temperature, t.mask_positive_copies)?;
    // The encoder setting `bf16` casts the weights themselves: trained so, the weights and
    // AdamW's moments would be bf16 (an update of about lr rounds to nothing on a weight above
    // 0.01) and every checkpoint would pass it on. Refused rather than turned into autocast, so
    // that a recipe never means something else than it says.
    if spec.recipe.model.settings.get("bf16").is_some_and(|v| v != &Value::Bool(false)) {
        bail!(
            "[model] settings has bf16 = {}: training keeps float32 weights (the encoder's bf16 would make the weights and the optimizer's moments bf16); \
             use --bf16 for bf16 autocast on float32 weights, and leave bf16 out of the recipe's encoder settings",
            spec.recipe.model.settings["bf16"]
        );
    }
    let out = &spec.output_dir;
    let episodes = t.ance_episodes;
    let world = spec.rendezvous.as_ref().map_or(1, |r| r.world);
    let mut group = spec.rendezvous.as_ref().map(ProcessGroup::join).transpose()?;
    // Rank 0 prepares the output folder and mines the negatives while the others wait; they
    // then read what it wrote (the negatives' cache is keyed on everything they depend on).
    let lead = group.as_ref().is_none_or(|g| g.rank() == 0);
    if !lead {
        group.as_mut().context("no process group")?.after_lead(PREPARE, &mut still_waiting(PREPARE))?;
    } else {
        check_output_dir(out, &spec.model)?;
    }
    std::fs::create_dir_all(out).with_context(|| format!("{}: cannot create", out.display()))?;
    let layout = RunLayout { out: out.clone(), episodes };
    let stages = layout.stages();
    let resume_at = match &spec.resume {
        Resume::At(dir) => {
            let parent = dir.parent().map(Path::to_path_buf).unwrap_or_default();
            let Some(stage) = stages.iter().position(|s| same_dir(s, &parent)) else {
                bail!("--resume-from-checkpoint {}: not a checkpoint of {} (or of one of its episodes)", dir.display(), out.display());
            };
            Some((stage, dir.clone()))
        }
        _ => None,
    };
    let corpus_sha256 = file_digest(&recipe.data.corpus)?;
    let identity = recipe_identity(spec, &corpus_sha256)?;
    // A resume is checked whole (the recipe here, the checkpoint once the trainer's settings
    // are known, below) before anything of the earlier run is removed or run.json rewritten:
    // a resume refused must leave the run as it was.
    match &spec.resume {
        _ if !lead => layout.check_recipe(&identity)?,
        Resume::No => {
            if layout.has_earlier_run() && !spec.overwrite {
                bail!(
                    "{} holds an earlier run (its checkpoints or its model); continue it with --resume-from-checkpoint latest, or start over with --overwrite-output-dir",
                    out.display()
                );
            }
            layout.clear_from(0, progress)?;
            layout.record(&identity, world)?;
        }
        Resume::Latest | Resume::At(_) => {
            if let Some(earlier) = layout.recorded_episodes()? {
                if earlier != episodes {
                    bail!("{} was started with {earlier} ANCE episodes, this run asks for {episodes}; resume with --ance-episodes {earlier}", out.display());
                }
            }
            // Checked here, before any stage: an ANCE stage resumed by another number of
            // processes would first meet the corpus parts its shards left, and fail over
            // that internal folder instead of saying why.
            if let Some(earlier) = layout.recorded_world()? {
                if earlier != world && layout.has_earlier_run() {
                    bail!("{} was started over {earlier} processes and this one has {world}: resume with the same number of processes (--nproc {earlier})", out.display());
                }
            }
            layout.check_recipe(&identity)?;
        }
    }

    let mut tasks = match &spec.examples {
        Some(given) => given_examples(given, t.hard_negatives)?,
        None => load_tasks(recipe, progress)?,
    };
    let kind = sampler_kind(t)?;
    let counts: Vec<usize> = tasks.iter().map(|t| t.examples.len()).collect();
    // A data-parallel step takes the batch of every process.
    let steps_per_epoch = Sampler::new(kind, &counts, t.per_device_train_batch_size * world, t.seed)?.steps_per_epoch() as u64;
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
        save_total_limit: t.save_total_limit,
        task_names: t.task_names,
        layerwise_lr_decay: t.layerwise_lr_decay,
        max_skipped_steps: t.max_skipped_steps,
        score_scale: t.score_scale,
        bf16: spec.bf16,
        in_batch_negatives: t.in_batch_negatives,
        task_loss_weight: t.task_loss_weight,
        loss: t.loss,
        lm_temperature,
        mask_positive_copies: t.mask_positive_copies,
    };
    // Each stage draws its own batch order and dropout (a stage is a new run, as in ANCE).
    let stage_config = |episode: u32| TrainerConfig {
        max_steps: if episode == 0 { max_steps } else { episode_steps },
        seed: stage_seed(config.seed, episode),
        ..config.clone()
    };
    if lead && spec.resume != Resume::No {
        if let Some((stage, dir)) = &resume_at {
            // The checkpoint asked for, checked as the trainer will take it (it is there, the
            // trainer's, of this stage and these settings), before anything is cleared.
            check_checkpoint(dir, &stage_config(*stage as u32), world, Some(*stage as u32)).with_context(|| format!("--resume-from-checkpoint {}", dir.display()))?;
            // Resuming inside a stage makes everything after it stale.
            layout.clear_after(*stage, progress)?;
        } else if let Some(ckpt) = layout.first_unfinished().and_then(|e| latest_checkpoint(&layout.stage(e)).map(|c| (e, c))) {
            // `latest`: the checkpoint the unfinished stage will resume from, checked before
            // run.json is written again.
            let (episode, dir) = ckpt;
            check_checkpoint(&dir, &stage_config(episode), world, Some(episode))?;
        }
        layout.record(&identity, world)?;
    }
    if t.hard_negatives > 0 && spec.examples.is_none() {
        bm25_negatives(spec, &layout, &corpus_sha256, &mut tasks, lead, progress)?;
    }
    if lead {
        if let Some(g) = group.as_mut() {
            g.after_lead(PREPARE, &mut still_waiting(PREPARE))?;
        }
    }
    let names: Vec<String> = tasks.iter().map(|t| format!("{} ({} queries)", t.name, t.examples.len())).collect();
    let episodes_text = if episodes > 0 { format!(", then {episodes} ANCE episodes of {episode_steps} steps") } else { String::new() };
    progress.log(&format!(
        "train: {} with {}, {max_steps} steps ({steps_per_epoch} per epoch){episodes_text}{}, tasks: {}",
        spec.encoder,
        spec.optim,
        if spec.bf16 { ", bf16 autocast" } else { "" },
        names.join(", ")
    ));

    let mut model = spec.model.clone();
    // Whether this process saved the last stage's model into OUT (then it is not copied again).
    let mut final_saved = false;
    for (episode, stage) in stages.iter().enumerate() {
        let episode = episode as u32;
        if episodes > 0 && stage.join(STAGE_DONE).exists() {
            model = stage.clone();
            continue;
        }
        if episode > 0 && t.hard_negatives == 0 {
            progress.log("warning: ANCE episodes with hard_negatives = 0 only repeat training: no negatives are drawn");
        }
        if episode > 0 && t.hard_negatives > 0 {
            ance_negatives(spec, &layout, episode, &plans[episode as usize], &model, &corpus_sha256, &mut tasks, plugins, group.as_mut(), progress)?;
        }
        let wanted: HashSet<&str> =
            tasks.iter().flat_map(|t| &t.examples).flat_map(|e| e.positives.iter().chain(&e.negatives).chain(e.lm_scores.iter().map(|(id, _)| id))).map(String::as_str).collect();
        let texts = passage_texts(&recipe.data.corpus, &wanted)?;
        let checkpoint = match &spec.resume {
            Resume::No => None,
            Resume::Latest => {
                let found = latest_checkpoint(stage);
                if found.is_none() && (episode == 0 || episodes == 0) {
                    progress.log(&format!("train: no checkpoint under {} yet; starting from the beginning", stage.display()));
                }
                found
            }
            Resume::At(_) => resume_at.as_ref().filter(|(s, _)| *s == episode as usize).map(|(_, dir)| dir.clone()),
        };
        let start = checkpoint.clone().unwrap_or_else(|| model.clone());
        if saved_bf16(&start) {
            progress.log(&format!(
                "train: {} says bf16 = true in its encoder settings (an older version's training saved it); training loads it with float32 weights{}",
                start.display(),
                if spec.bf16 { "" } else { " (--bf16 gives bf16 autocast)" }
            ));
        }
        let plan = &plans[episode as usize];
        let mut encoder = plugins.encoder(&spec.encoder, &encoder_settings(spec, plan, &start, false))?;
        let mut optimizer = plugins.optimizer(&plan.optim, &Value::Object(plan.optim_settings.clone()))?;
        if episodes > 0 || !t.stage_overrides.is_empty() {
            let negatives = match episode {
                _ if t.hard_negatives == 0 => "no hard negatives",
                0 if spec.examples.is_some() => "the given negatives",
                0 => "BM25 negatives",
                _ => "ANCE negatives",
            };
            // With overrides the stage says what it trains with.
            let with = if t.stage_overrides.is_empty() { String::new() } else { format!(", {} with {}", plan.optim, Value::Object(plan.model_settings.clone())) };
            progress.log(&format!("train: stage {episode} of {episodes} ({negatives}{with}) in {}", stage.display()));
        }
        let mut trainer = Trainer::data_parallel(stage_config(episode), encoder.as_mut(), optimizer.as_mut(), tasks.clone(), texts, stage, group.as_mut())?;
        trainer.set_episode(episode);
        if let Some(ckpt) = &checkpoint {
            trainer.resume(ckpt)?;
            if trainer.episode() != episode {
                bail!("{} is a checkpoint of episode {}, not of episode {episode}", ckpt.display(), trainer.episode());
            }
            progress.log(&format!("train: resumed from {} at step {}", ckpt.display(), trainer.step()));
        }
        trainer.train(progress)?;
        drop(trainer);
        if episodes > 0 && lead {
            if episode == episodes {
                // Before the stage is marked done, so a kill in between redoes the copy.
                encoder.save(out)?;
                final_saved = true;
            }
            rak_core::fsutil::write_bytes(&stage.join(STAGE_DONE), b"")?;
        }
        if episodes > 0 {
            // The next stage's miner loads the model rank 0 has just written.
            if let Some(g) = group.as_mut() {
                let what = "save the stage's model";
                g.after_lead(what, &mut still_waiting(what))?;
            }
        }
        model = stage.clone();
    }
    if episodes > 0 && lead {
        if !final_saved && !out.join(FINAL_MARK).exists() {
            // Every stage was done already but the copy never finished: make it from the last stage.
            progress.log(&format!("train: copying the last stage's model from {} to {}", model.display(), out.display()));
            plugins.encoder(&spec.encoder, &encoder_settings(spec, &plans[episodes as usize], &model, false))?.save(out)?;
        }
        rak_core::fsutil::write_bytes(&out.join(FINAL_MARK), b"")?;
    }
    let total_steps = max_steps + episodes as u64 * episode_steps;
    Ok(json!({"output_dir": out, "steps": total_steps, "episodes": episodes, "log": stages.last().map(|s| s.join(LOG_FILE))}))
}

/// Encoder settings for checkpoint `model`: the stage's (the recipe's, with the stage's
/// overrides), the model and the device. The encoder trained keeps float32 weights (the
/// trainer runs autocast); only the one that mines ANCE negatives, which never trains, holds
/// bf16 weights (`bf16_weights`). A checkpoint an older version's training saved with
/// `bf16 = true` (its encoder settings file) is loaded in float32 all the same: settings given
/// override the saved ones.
fn encoder_settings(spec: &RunSpec, plan: &StagePlan, model: &Path, bf16_weights: bool) -> Value {
    let mut settings = Value::Object(plan.model_settings.clone());
    settings["model"] = json!(model);
    settings["device"] = json!(spec.device);
    if bf16_weights {
        settings["bf16"] = json!(true);
    } else if saved_bf16(model) {
        settings["bf16"] = json!(false);
    }
    settings
}

/// Whether checkpoint `model`'s saved encoder settings say `bf16 = true` (what training saved
/// before issue 32, when a recipe's encoder settings held it).
fn saved_bf16(model: &Path) -> bool {
    let read = std::fs::read_to_string(model.join(rak_core::encoders::bert::SETTINGS_FILE)).ok();
    read.and_then(|text| serde_json::from_str::<Value>(&text).ok()).is_some_and(|v| v["bf16"] == json!(true))
}

/// Examples a caller hands over: every task named once, every example with a positive.
fn given_examples(given: &[TaskData], hard_negatives: usize) -> Result<Vec<TaskData>> {
    let mut names = HashSet::new();
    for t in given {
        if !names.insert(t.name.as_str()) {
            bail!("the examples name task {:?} twice", t.name);
        }
        if t.examples.is_empty() {
            bail!("task {:?} has no training examples", t.name);
        }
        if let Some(e) = t.examples.iter().find(|e| e.positives.is_empty()) {
            bail!("task {:?}: query {:?} has no positive passage", t.name, e.query_id);
        }
        if let Some(e) = t.examples.iter().find(|e| hard_negatives > 0 && e.negatives.is_empty()) {
            bail!("task {:?}: query {:?} has no negatives, and the recipe asks for {hard_negatives} hard negatives per query (give some, or set hard_negatives = 0)", t.name, e.query_id);
        }
    }
    if given.is_empty() {
        bail!("no examples to train on");
    }
    Ok(given.to_vec())
}

/// Every task's training examples (queries with a gold passage in the corpus).
fn load_tasks(recipe: &Recipe, progress: &dyn Progress) -> Result<Vec<TaskData>> {
    let d = &recipe.data;
    if d.tasks.is_empty() {
        bail!("the recipe names no tasks (data.tasks)");
    }
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
    Ok(tasks)
}

/// What a stage's negatives depend on besides the miner: the corpus, the examples (queries and
/// gold, which are left out of the negatives), and how empty lists are filled.
fn negatives_key(spec: &RunSpec, episode: u32, corpus_sha256: &str, tasks: &[TaskData], miner: Value) -> String {
    let t = &spec.recipe.train;
    let mut key = json!({
        "miner": miner,
        "corpus_sha256": corpus_sha256,
        "examples_sha256": negatives::examples_digest(tasks),
        "fill": {"count": t.hard_negatives, "seed": fill_seed(t.seed, episode)},
        "exclude_gold_pages": t.exclude_gold_pages,
    });
    // Only when on, so the negatives that runs without it saved stay valid.
    if t.exclude_answer_negatives {
        key["exclude_answer_negatives"] = json!({"margin": ANSWER_FILTER_MARGIN, "answers_sha256": negatives::answers_digest(tasks)});
    }
    key.to_string()
}

/// How much deeper than its depth a miner searches when `exclude_answer_negatives` may drop
/// hits, so that a query still gets its top `depth` passages without an answer (DPR's rule:
/// the highest-ranked BM25 passage that does not hold the answer).
const ANSWER_FILTER_MARGIN: usize = 100;

/// How deep a miner searches for negatives that are then cut to `depth`.
fn mining_depth(t: &TrainSection, depth: usize) -> usize {
    if t.exclude_answer_negatives {
        depth + ANSWER_FILTER_MARGIN
    } else {
        depth
    }
}

/// Episode 0's negatives: BM25's top `negative_depth` minus gold, loaded from
/// `negatives-episode-0.json` when it was made from the same inputs.
/// `mines`: this process may mine them itself (the only one, or rank 0); the other processes
/// of a data-parallel run only read what rank 0 saved.
fn bm25_negatives(spec: &RunSpec, layout: &RunLayout, corpus_sha256: &str, tasks: &mut [TaskData], mines: bool, progress: &dyn Progress) -> Result<()> {
    let (d, t) = (&spec.recipe.data, &spec.recipe.train);
    let bm25 = Bm25Params { k1: t.bm25_k1, b: t.bm25_b };
    bm25.validate()?;
    let saved = layout.negatives_file(0);
    let key = negatives_key(spec, 0, corpus_sha256, tasks, json!({"bm25": {"k1": bm25.k1, "b": bm25.b}}));
    if negatives::load(&saved, tasks, t.negative_depth, &key)? {
        progress.log(&format!("train: BM25 negatives from {} (made from the same corpus, examples and settings)", saved.display()));
        // A run killed between saving the negatives and removing their blocks.
        if mines {
            remove_parts(&layout.negatives_parts(0))?;
        }
        return Ok(());
    }
    if !mines {
        bail!("{}: rank 0's BM25 negatives are missing or were made from other inputs than this process's", saved.display());
    }
    let index_dir = match &d.bm25_index {
        Some(dir) => dir.clone(),
        None => cached_bm25_index(&layout.out.join("bm25-index"), &d.corpus, corpus_sha256, bm25, progress)?,
    };
    let mut index = Bm25Index::open(&index_dir)?;
    index.set_params(bm25)?;
    let depth = mining_depth(t, t.negative_depth);
    let parts_dir = layout.negatives_parts(0);
    let parts_key = format!("{key} mined to depth {depth}");
    negatives::bm25_negatives(&index, tasks, depth, &negatives::Parts { dir: &parts_dir, key: &parts_key }, progress)?;
    exclude_gold_pages(spec, tasks, "BM25", progress)?;
    exclude_answer_holders(spec, tasks, t.negative_depth, "BM25", progress)?;
    report_filled(negatives::fill_empty(tasks, t.hard_negatives, fill_seed(t.seed, 0)), "BM25", progress);
    negatives::save(&saved, tasks, t.negative_depth, &key)?;
    remove_parts(&parts_dir)
}

/// What rank 0 does alone before training while the others wait: the output folder, the data
/// and the BM25 negatives.
const PREPARE: &str = "prepare the run";

/// What a process that waits for rank 0 to do `what` says once a minute (to stderr: the
/// progress of ranks other than 0 is not shown).
fn still_waiting(what: &str) -> impl FnMut(std::time::Duration) + '_ {
    move |waited| eprintln!("train: still waiting for rank 0 to {what} ({} min)", waited.as_secs() / 60)
}

/// A mining pass's saved blocks, once its negatives are saved whole; and those an earlier
/// version's run left under the name without the leading dot (`negatives-episode-E.parts/`),
/// which would otherwise stay in OUT, counted in its model's digest.
fn remove_parts(dir: &Path) -> Result<()> {
    let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let older = dir.with_file_name(name.trim_start_matches('.'));
    for dir in [dir, older.as_path()] {
        match std::fs::remove_dir_all(dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e).with_context(|| format!("{}: cannot remove", dir.display())),
            _ => {}
        }
    }
    Ok(())
}

/// The run's own BM25 index of the corpus, rebuilt when the corpus it was built from (its
/// SHA-256, kept beside it) is not this one, or an older version wrote it.
fn cached_bm25_index(dir: &Path, corpus: &Path, corpus_sha256: &str, params: Bm25Params, progress: &dyn Progress) -> Result<PathBuf> {
    let source = dir.join(BM25_SOURCE);
    let built_from = std::fs::read_to_string(&source).ok();
    let usable = built_from.as_deref() == Some(corpus_sha256) && Bm25Index::open(dir).is_ok();
    if !usable {
        if dir.exists() {
            progress.log(&format!("train: rebuilding {} (made from another corpus or by an older version)", dir.display()));
            // Written into the index folder after it was built, so not in its list of files.
            let _ = std::fs::remove_file(&source);
            rak_retrieval::index::remove_written(dir)?;
        }
        build_index(&IndexSpec::Bm25 { corpus: corpus.to_path_buf(), params }, dir, progress)?;
        rak_core::fsutil::write_bytes(&source, corpus_sha256.as_bytes())?;
    }
    Ok(dir.to_path_buf())
}

/// Stage `episode`'s negatives (ANCE): the previous stage's model over the whole corpus. In a
/// data-parallel run every process encodes its shard of the corpus; rank 0 then indexes it and
/// mines while the others wait (however long it takes: [`ProcessGroup::after_lead`]), and they
/// read what it saved.
#[allow(clippy::too_many_arguments)]
fn ance_negatives(
    spec: &RunSpec,
    layout: &RunLayout,
    episode: u32,
    plan: &StagePlan,
    model: &Path,
    corpus_sha256: &str,
    tasks: &mut [TaskData],
    plugins: &dyn Plugins,
    mut group: Option<&mut ProcessGroup>,
    progress: &dyn Progress,
) -> Result<()> {
    let t = &spec.recipe.train;
    let saved = layout.negatives_file(episode);
    // The miner encodes as the stage it mines for (`plan`) will train: its task prefix, say.
    let settings = encoder_settings(spec, plan, model, spec.bf16);
    let identity = encoder_identity(&spec.encoder, &settings)?;
    // Keyed on the miner's weights (their digest), not on the stage's path.
    let mut miner_key = json!({"ance": identity, "task_names": t.task_names});
    // Only for a Milvus index (its ANN may answer otherwise than exact search), so the
    // negatives that runs with the in-memory index saved stay valid.
    if let Some(params) = t.ance_index.milvus() {
        miner_key["index"] = json!({"milvus": params.ann});
    }
    let key = negatives_key(spec, episode, corpus_sha256, tasks, miner_key);
    let work = layout.stage(episode).join(ANCE_WORK);
    let (rank, world) = group.as_ref().map_or((0, 1), |g| (g.rank(), g.world()));
    // Every process finds the same file: rank 0 saves it only after they all met below.
    if negatives::load(&saved, tasks, t.ance_depth, &key)? {
        // A run killed between saving the negatives and removing the work folder.
        if rank == 0 {
            remove_ance_work(&work, progress);
            remove_parts(&layout.negatives_parts(episode))?;
        }
        return Ok(());
    }
    let mut miner = plugins.encoder(&spec.encoder, &settings)?;
    progress.log(&format!("train: episode {episode}: mining negatives with {}", model.display()));
    negatives::ance_encode_corpus(miner.as_mut(), identity, &spec.recipe.data.corpus, &work, (rank, world), progress)?;
    if let Some(g) = group.as_deref_mut() {
        g.barrier().context("waiting for the other processes to encode their shards of the corpus")?;
    }
    if rank == 0 {
        let depth = mining_depth(t, t.ance_depth);
        let parts_key = format!("{key} mined to depth {depth}");
        let parts_dir = layout.negatives_parts(episode);
        let parts = negatives::Parts { dir: &parts_dir, key: &parts_key };
        negatives::ance_negatives(miner.as_mut(), &work, tasks, depth, t.task_names, t.ance_index.milvus(), &parts, progress)?;
        exclude_gold_pages(spec, tasks, "the model", progress)?;
        exclude_answer_holders(spec, tasks, t.ance_depth, "the model", progress)?;
        report_filled(negatives::fill_empty(tasks, t.hard_negatives, fill_seed(t.seed, episode)), "the model", progress);
        negatives::save(&saved, tasks, t.ance_depth, &key)?;
    }
    if let Some(g) = group {
        let what = "mine the ANCE negatives";
        g.after_lead(what, &mut still_waiting(what))?;
    }
    if rank != 0 {
        if !negatives::load(&saved, tasks, t.ance_depth, &key)? {
            bail!("{}: rank 0's ANCE negatives are missing or were made from other inputs than this process's", saved.display());
        }
        return Ok(());
    }
    // The corpus embeddings and index are as large as the corpus; the negatives are kept.
    remove_ance_work(&work, progress);
    if work.exists() {
        // What is left there the toolkit did not name: not ours to remove.
        progress.log(&format!("train: warning: {} is kept: it holds files the run did not write there", work.display()));
    }
    remove_parts(&layout.negatives_parts(episode))
}

/// An ANCE episode's work folder in `episode-E/`: the corpus embeddings (`corpus/`) and their
/// index (`index/`), removed once the negatives are mined.
const ANCE_WORK: &str = "ance";

/// Remove an ANCE stage's work folder (the corpus embeddings and index) and, when the index
/// is a Milvus one, its collection (each build has its own, so two runs of one recipe never
/// share one; best effort: a server that is gone costs a warning). Only what the toolkit wrote
/// there goes: the index as [`rak_retrieval::index::remove_written`] removes one, the files
/// `encode` writes in `corpus/`, and their temporaries; a file of the user's in either is kept
/// and named in a warning, and so is the folder.
fn remove_ance_work(work: &Path, progress: &dyn Progress) {
    use rak_retrieval::index;
    let built = work.join("index");
    match index::check_replaceable(&built) {
        Ok(()) => {
            // Dropped only with the folder: a kept folder still names its collection.
            if index::IndexMeta::read(&built).is_ok_and(|m| m.kind == "milvus") {
                if let Err(e) = index::MilvusIndex::drop_collection(&built) {
                    progress.log(&format!("train: warning: the ANCE index's Milvus collection was not dropped: {e:#}"));
                }
            }
            if let Err(e) = index::remove_written(&built) {
                progress.log(&format!("train: warning: {e:#}"));
            }
        }
        Err(e) => progress.log(&format!("train: warning: the ANCE index is kept: {e:#}")),
    }
    let corpus = work.join("corpus");
    let kept = rak_retrieval::pipeline::encode::remove_output(&corpus);
    if !kept.is_empty() {
        progress.log(&format!("train: warning: {} is kept: it holds files the run did not write there ({})", corpus.display(), kept.join(", ")));
    }
    // What killed atomic writes of ours leave, ours by name.
    let temporary = |n: &str| ["corpus", "index"].iter().any(|w| n.strip_prefix('.').and_then(|t| t.strip_prefix(*w)).is_some_and(|t| t.starts_with(".tmp-") || t.starts_with(".old-")));
    for entry in std::fs::read_dir(work).into_iter().flatten().flatten() {
        if temporary(&entry.file_name().to_string_lossy()) {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
    let _ = std::fs::remove_dir(work);
}

/// With `exclude_gold_pages`, drop the mined negatives that lie on a gold page.
fn exclude_gold_pages(spec: &RunSpec, tasks: &mut [TaskData], retriever: &str, progress: &dyn Progress) -> Result<()> {
    if spec.recipe.train.exclude_gold_pages {
        let pages = corpus_pages(&spec.recipe.data.corpus)?;
        let dropped = negatives::drop_gold_pages(tasks, &pages);
        progress.log(&format!("train: dropped {dropped} {retriever} negatives that lie on a gold page"));
    }
    Ok(())
}

/// With `exclude_answer_negatives`, drop the mined negatives whose text holds one of the
/// query's answers and cut the rest to `depth`.
fn exclude_answer_holders(spec: &RunSpec, tasks: &mut [TaskData], depth: usize, retriever: &str, progress: &dyn Progress) -> Result<()> {
    if spec.recipe.train.exclude_answer_negatives {
        let wanted: HashSet<&str> = tasks.iter().flat_map(|t| &t.examples).flat_map(|e| &e.negatives).map(String::as_str).collect();
        let texts = corpus_texts(&spec.recipe.data.corpus, &wanted)?;
        let changed = negatives::drop_answer_holders(tasks, &texts, depth);
        progress.log(&format!("train: {changed} queries had {retriever} negatives that hold one of their answers; deeper passages without one replace them"));
    }
    Ok(())
}

/// What decides a run besides the trainer's own settings (which every checkpoint records and
/// checks): encoder, optimizer, their settings, the starting model, the data and how negatives
/// are mined. Kept in `run.json`, so a resume with another recipe is refused instead of
/// continuing a checkpoint under settings it was not trained with.
fn recipe_identity(spec: &RunSpec, corpus_sha256: &str) -> Result<Value> {
    let path = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf()).display().to_string();
    let (d, t) = (&spec.recipe.data, &spec.recipe.train);
    let mut identity = json!({
        "encoder": spec.encoder,
        "encoder_settings": spec.recipe.model.settings,
        "bf16": spec.bf16,
        "optim": spec.optim,
        "optim_settings": t.optim_settings,
        "model": path(&spec.model),
        "data": {"corpus": path(&d.corpus), "corpus_sha256": corpus_sha256, "task_dir": path(&d.task_dir), "tasks": d.tasks, "split": d.split, "bm25_index": d.bm25_index.as_deref().map(path)},
        "negatives": {"bm25_k1": t.bm25_k1, "bm25_b": t.bm25_b, "negative_depth": t.negative_depth, "ance_depth": t.ance_depth, "ance_num_train_epochs": t.ance_num_train_epochs, "exclude_gold_pages": t.exclude_gold_pages},
        "examples": spec.examples.as_deref().map(negatives::examples_and_negatives_digest),
        // Every trainer setting that changes the result. A checkpoint records them too, but a
        // stage resumed at its start (the episode boundary of an ANCE run) has no checkpoint
        // to compare with. Not logging, saving or `max_skipped_steps`, which change no weight.
        "train": {
            "learning_rate": t.learning_rate,
            "per_device_train_batch_size": t.per_device_train_batch_size,
            "num_train_epochs": t.num_train_epochs,
            "max_steps": t.max_steps,
            "warmup_ratio": t.warmup_ratio,
            "max_grad_norm": t.max_grad_norm,
            "seed": t.seed,
            "sampler": t.sampler,
            "temperature": t.temperature,
            "hard_negatives": t.hard_negatives,
            "score_scale": t.score_scale,
            "task_names": t.task_names,
            "layerwise_lr_decay": t.layerwise_lr_decay,
            "in_batch_negatives": t.in_batch_negatives,
            "task_loss_weight": t.task_loss_weight,
            "loss": t.loss,
            "lm_temperature": t.lm_temperature,
            "mask_positive_copies": t.mask_positive_copies,
            "ance_ann": t.ance_index.milvus().map(|m| m.ann),
        },
    });
    // Only when given, so that runs made before the setting existed still resume; in the
    // trainer's section, whose keys are compared both ways (a resume without them is refused).
    if !t.stage_overrides.is_empty() {
        identity["train"]["stage_overrides"] = json!(t.stage_overrides);
    }
    // Only when on, so that runs made before the setting existed still resume.
    if t.exclude_answer_negatives {
        identity["negatives"]["exclude_answer_negatives"] = json!(true);
    }
    // The task files' content: a resume after queries or judgements were edited would train
    // the rest of the run on other data under the same name.
    if spec.examples.is_none() {
        identity[TASK_FILES] = task_files_digest(d)?;
    }
    Ok(identity)
}

/// The key of the task files' digests in the recorded recipe (absent in runs recorded before
/// it, which then resume unchecked on it).
const TASK_FILES: &str = "task_files_sha256";

/// `{"TASK/FILE": sha256}` for the recipe's tasks' queries and qrels files, named under the
/// task folder (`squad/queries.train.jsonl`).
fn task_files_digest(d: &crate::recipe::DataSection) -> Result<Value> {
    let mut files = serde_json::Map::new();
    for src in task_sources(&d.task_dir, &d.tasks, &d.split)? {
        for path in [&src.queries, &src.qrels] {
            let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            files.insert(format!("{}/{name}", src.name), json!(file_digest(path)?));
        }
    }
    Ok(Value::Object(files))
}

/// The task files (`squad/queries.train.jsonl`) whose digest differs between two records, or
/// that only one holds (a task added or dropped is refused before, as a recipe change).
fn changed_task_files(then: &Value, now: &Value) -> Vec<String> {
    let (Some(a), Some(b)) = (then.as_object(), now.as_object()) else { return vec![TASK_FILES.to_string()] };
    let names: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    names.into_iter().filter(|n| a.get(*n) != b.get(*n)).cloned().collect()
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
/// Records how many ANCE episodes a run was started with, and its recipe.
const RUN_FILE: &str = "run.json";
/// Beside the run's own BM25 index: the SHA-256 of the corpus it was built from.
const BM25_SOURCE: &str = "corpus.sha256";

/// The files of a training output folder.
struct RunLayout {
    out: PathBuf,
    episodes: u32,
}

impl RunLayout {
    /// Where each stage trains: the output folder itself, or with ANCE one folder per stage
    /// (`episode-0` on BM25 negatives, then `episode-E`).
    fn stages(&self) -> Vec<PathBuf> {
        (0..=self.episodes).map(|e| self.stage(e)).collect()
    }

    fn stage(&self, episode: u32) -> PathBuf {
        if self.episodes == 0 {
            self.out.clone()
        } else {
            self.out.join(format!("episode-{episode}"))
        }
    }

    fn negatives_file(&self, episode: u32) -> PathBuf {
        self.out.join(format!("negatives-episode-{episode}.json"))
    }

    /// Where the negatives of `episode` are saved a block of queries at a time while they are
    /// mined (`negatives::Parts`), so a rerun resumes the mining; removed once they are saved.
    fn negatives_parts(&self, episode: u32) -> PathBuf {
        // A leading dot: `checkpoint_digest` of OUT (its final model) skips hidden entries, and
        // this folder comes and goes while the model in OUT stays the same.
        self.out.join(format!(".negatives-episode-{episode}.parts"))
    }

    /// The first stage a resume trains in (none when every stage is done).
    fn first_unfinished(&self) -> Option<u32> {
        if self.episodes == 0 {
            return Some(0);
        }
        (0..=self.episodes).find(|e| !self.stage(*e).join(STAGE_DONE).exists())
    }

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

    /// Whether the folder holds a checkpoint of ours (see [`own_checkpoint`]), a stage's mark,
    /// or our own `run.json` beside a model (a finished run whose checkpoints were deleted).
    fn has_earlier_run(&self) -> bool {
        let own = |dir: &Path| checkpoints(dir).iter().any(|c| own_checkpoint(c));
        let model = || std::fs::read_dir(&self.out).into_iter().flatten().flatten().any(|e| e.file_name().to_string_lossy().ends_with(".safetensors"));
        own(&self.out) || self.episode_dirs().iter().any(|(_, d)| d.join(STAGE_DONE).exists() || own(d)) || (own_run_file(&self.out.join(RUN_FILE)) && model())
    }

    /// Remove what stages `from..` left (checkpoints, marks, mined negatives); with 0, every
    /// trace of an earlier run, whatever its number of episodes, except what does not depend
    /// on any stage and is keyed on all it does depend on: the BM25 index (on the corpus) and
    /// episode 0's BM25 negatives (on the corpus, examples and settings).
    fn clear_from(&self, from: u32, progress: &dyn Progress) -> Result<()> {
        // Only a checkpoint that holds nothing but what the trainer wrote into it.
        let remove_dir = rak_retrieval::index::remove_written;
        if from == 0 {
            for ckpt in checkpoints(&self.out) {
                remove_dir(&ckpt)?;
            }
            let _ = std::fs::remove_file(self.out.join(RUN_FILE));
        }
        let _ = std::fs::remove_file(self.out.join(FINAL_MARK));
        for (e, dir) in self.episode_dirs() {
            if e >= from {
                let _ = std::fs::remove_file(dir.join(STAGE_DONE));
                for ckpt in checkpoints(&dir) {
                    remove_dir(&ckpt)?;
                }
                // The corpus embeddings of a run killed while mining: made by another
                // checkpoint than the one this run will mine with, they would stop it.
                remove_ance_work(&dir.join(ANCE_WORK), progress);
            }
        }
        if let Ok(entries) = std::fs::read_dir(&self.out) {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                let mined = name.strip_prefix("negatives-episode-").and_then(|n| n.strip_suffix(".json")).and_then(|n| n.parse::<u32>().ok());
                if mined.is_some_and(|n| n > 0 && n >= from) {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        Ok(())
    }

    /// Resuming in `stage`: it is not done, and later stages and their negatives are stale.
    fn clear_after(&self, stage: usize, progress: &dyn Progress) -> Result<()> {
        if self.episodes == 0 {
            return Ok(());
        }
        let _ = std::fs::remove_file(self.stage(stage as u32).join(STAGE_DONE));
        self.clear_from(stage as u32 + 1, progress)
    }

    fn recorded_episodes(&self) -> Result<Option<u32>> {
        let path = self.out.join(RUN_FILE);
        match std::fs::read_to_string(&path) {
            Ok(text) => {
                let v: Value = serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", path.display()))?;
                Ok(v["ance_episodes"].as_u64().map(|n| n as u32))
            }
            Err(_) if checkpoints(&self.out).is_empty() && self.episode_dirs().is_empty() => Ok(None),
            // Written before run.json existed: a run without episodes, or unknown.
            Err(_) => Ok(self.episode_dirs().is_empty().then_some(0)),
        }
    }

    /// The number of processes the run was started over (`None` in a `run.json` from before
    /// it was recorded, or without one).
    fn recorded_world(&self) -> Result<Option<usize>> {
        let path = self.out.join(RUN_FILE);
        let Ok(text) = std::fs::read_to_string(&path) else { return Ok(None) };
        let v: Value = serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", path.display()))?;
        Ok(v["world_size"].as_u64().map(|n| n as usize))
    }

    fn record(&self, recipe: &Value, world: usize) -> Result<()> {
        let run = json!({"ance_episodes": self.episodes, "world_size": world, "recipe": recipe});
        rak_core::fsutil::write_bytes(&self.out.join(RUN_FILE), run.to_string().as_bytes())
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
            // The trainer's settings, recorded since issue 32 (a run recorded before has its
            // checkpoints' check only); the task files, compared below.
            .filter(|(k, _)| k.as_str() != TASK_FILES && (k.as_str() != "train" || earlier.contains_key("train")))
            // A key an older version did not record counts as absent (null), not as changed
            // (inside a section too: see `differing`).
            .flat_map(|(k, v)| differing(k, earlier.get(k.as_str()).unwrap_or(&Value::Null), v))
            .collect();
        if !differences.is_empty() {
            bail!(
                "{} was started with another recipe; resume it with the same one, or start over with --overwrite-output-dir:\n{}",
                self.out.display(),
                differences.join("\n")
            );
        }
        // Recorded later still: a run recorded before has no digests to compare.
        if let (Some(then), Some(now)) = (earlier.get(TASK_FILES), recipe.get(TASK_FILES)) {
            let changed = changed_task_files(then, now);
            if !changed.is_empty() {
                bail!(
                    "{} was started on other task data: under data.task_dir, {} changed since the run began; put back what the run trained on, or start over with --overwrite-output-dir",
                    self.out.display(),
                    changed.join(", ")
                );
            }
        }
        Ok(())
    }
}

/// Refuse an output folder where the run would write over, or start over by removing, what it
/// did not write: the starting model's folder, a folder inside it or one that holds it, and a
/// folder that holds files but is no run of `host train`'s (no `run.json`, no checkpoints of an
/// earlier version's run), such as a parent folder of other runs. A new or empty folder is
/// fine, as are the temporary files a killed run of ours left.
fn check_output_dir(out: &Path, model: &Path) -> Result<()> {
    let (o, m) = (resolved(out), resolved(model));
    if o == m {
        bail!("the output folder {} is the starting model's folder (--model): training would write over the model it starts from; choose another output folder", out.display());
    }
    if o.starts_with(&m) {
        bail!("the output folder {} lies inside the starting model's folder {} (--model): choose an output folder outside it", out.display(), model.display());
    }
    if m.starts_with(&o) {
        bail!("the starting model {} (--model) lies inside the output folder {}: starting over there would remove or overwrite it; choose another output folder", model.display(), out.display());
    }
    let entries = match std::fs::read_dir(out) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).with_context(|| format!("{}: cannot list the output folder", out.display())),
    };
    let layout = RunLayout { out: out.to_path_buf(), episodes: 0 };
    if own_run_file(&out.join(RUN_FILE)) || layout.has_earlier_run() {
        return Ok(());
    }
    // `.NAME.tmp-PID`: what a killed atomic write of ours leaves.
    let leftover = |n: &str| n.starts_with('.') && n.rsplit_once(".tmp-").is_some_and(|(_, pid)| !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()));
    let foreign: Vec<String> = entries.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).filter(|n| !leftover(n)).collect();
    if !foreign.is_empty() {
        let mut shown: Vec<&str> = foreign.iter().take(5).map(String::as_str).collect();
        if foreign.len() > shown.len() {
            shown.push("...");
        }
        bail!(
            "the output folder {} holds files that no run of host train wrote ({}; it has no {RUN_FILE} of host train's): a run writes its checkpoints and model there and starting over removes them, so it takes only an empty or new folder, or a run's own folder; choose another output folder",
            out.display(),
            shown.join(", ")
        );
    }
    Ok(())
}

/// Whether `path` is a `run.json` this toolkit wrote: a JSON object with the keys every version
/// recorded (`ance_episodes`, a number, and `recipe`, an object). Any file of that name would
/// otherwise make a folder pass for a run's own, and starting over there write over the rest.
fn own_run_file(path: &Path) -> bool {
    let Ok(text) = std::fs::read_to_string(path) else { return false };
    serde_json::from_str::<Value>(&text).is_ok_and(|v| v["ance_episodes"].is_u64() && v["recipe"].is_object())
}

/// Whether a `checkpoint-N` folder is the trainer's: it holds the record of what was written
/// there, or (written before that record) this trainer's state file, by its keys: Hugging
/// Face's trainer writes a `trainer_state.json` into its `checkpoint-N` folders too. A folder
/// of that name alone proves nothing.
fn own_checkpoint(dir: &Path) -> bool {
    dir.join(rak_retrieval::index::WRITTEN_FILE).is_file() || rak_retrieval::index::is_trainer_state(&dir.join(crate::trainer::STATE_FILE))
}

/// `path` made absolute with its links resolved, as far as it exists (the rest taken by text),
/// so that two spellings of one folder compare equal even before it is made. Each component is
/// resolved in turn: `std::path::absolute` keeps `..`, and `new/../model` (with `new` not made
/// yet) must come out as `model`, not as itself, or it would pass for another folder than the
/// starting model's. A `..` after a folder that exists is taken after that folder's links are
/// resolved, as the kernel takes it; after one that does not, by text (it cannot be a link).
fn resolved(path: &Path) -> PathBuf {
    let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let mut at = PathBuf::new();
    for c in absolute.components() {
        match c {
            std::path::Component::CurDir => continue,
            std::path::Component::ParentDir => {
                at.pop();
            }
            other => at.push(other),
        }
        if let Ok(real) = std::fs::canonicalize(&at) {
            at = real;
        }
    }
    at
}

/// How `then` and `now` differ, as lines `  key: THEN then, NOW now` (none when they are the
/// same); two objects by the keys that differ (`train.learning_rate`), so that one changed
/// setting is not lost in a section. A key missing on one side counts as null there, as at the
/// top level: a setting added in a later version (recorded as null when unset) does not make
/// the runs recorded before it unresumable.
fn differing(key: &str, then: &Value, now: &Value) -> Vec<String> {
    match (then.as_object(), now.as_object()) {
        (Some(a), Some(b)) => {
            let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
            let at = |o: &serde_json::Map<String, Value>, k: &str| o.get(k).cloned().unwrap_or(Value::Null);
            keys.into_iter()
                .filter(|k| at(a, k) != at(b, k))
                .map(|k| format!("  {key}.{k}: {} then, {} now", at(a, k), at(b, k)))
                .collect()
        }
        _ if then == now => Vec::new(),
        _ => vec![format!("  {key}: {then} then, {now} now")],
    }
}

fn same_dir(a: &Path, b: &Path) -> bool {
    match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn negatives_parts_do_not_change_the_digest_of_out() {
        let out = std::env::temp_dir().join(format!("rak-parts-digest-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&out);
        std::fs::create_dir_all(&out).unwrap();
        std::fs::write(out.join("model.safetensors"), "weights").unwrap();
        let before = rak_retrieval::digest::checkpoint_digest(&out).unwrap();
        let parts = RunLayout { out: out.clone(), episodes: 1 }.negatives_parts(1);
        std::fs::create_dir_all(&parts).unwrap();
        std::fs::write(parts.join("0-0.json"), "{}").unwrap();
        assert_eq!(rak_retrieval::digest::checkpoint_digest(&out).unwrap(), before, "{} counts as part of the model", parts.display());
        // An earlier version's blocks, under the name without the dot, go with the hidden ones.
        let older = out.join("negatives-episode-1.parts");
        std::fs::create_dir_all(&older).unwrap();
        std::fs::write(older.join("0-0.json"), "{}").unwrap();
        remove_parts(&parts).unwrap();
        assert!(!parts.exists() && !older.exists());
        assert_eq!(rak_retrieval::digest::checkpoint_digest(&out).unwrap(), before);
        std::fs::remove_dir_all(&out).unwrap();
    }

    #[test]
    fn a_key_missing_in_a_recorded_section_counts_as_null() {
        let out = std::env::temp_dir().join(format!("rak-recipe-null-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&out);
        std::fs::create_dir_all(&out).unwrap();
        std::fs::write(out.join(RUN_FILE), json!({"ance_episodes": 0, "recipe": {"train": {"seed": 7}, "data": "d"}}).to_string()).unwrap();
        let layout = RunLayout { out: out.clone(), episodes: 0 };
        // A setting recorded later, unset (null), is no change; a set one, or a changed one, is.
        layout.check_recipe(&json!({"train": {"seed": 7, "added_later": null}, "data": "d"})).unwrap();
        let e = format!("{:#}", layout.check_recipe(&json!({"train": {"seed": 7, "added_later": true}, "data": "d"})).unwrap_err());
        assert!(e.contains("train.added_later: null then, true now"), "{e}");
        let e = format!("{:#}", layout.check_recipe(&json!({"train": {"seed": 8}, "data": "e"})).unwrap_err());
        assert!(e.contains("train.seed: 7 then, 8 now") && e.contains("data: \"d\" then, \"e\" now"), "{e}");
        std::fs::remove_dir_all(&out).unwrap();
    }

    /// A finished run whose checkpoints were deleted (our run.json and the model left) is an
    /// earlier run all the same; our run.json alone (a run killed before its first checkpoint)
    /// or a model alone is not.
    #[test]
    fn a_finished_run_without_checkpoints_is_an_earlier_run() {
        let out = std::env::temp_dir().join(format!("rak-earlier-run-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&out);
        std::fs::create_dir_all(&out).unwrap();
        let layout = RunLayout { out: out.clone(), episodes: 0 };
        std::fs::write(out.join("model.safetensors"), "weights").unwrap();
        assert!(!layout.has_earlier_run());
        std::fs::write(out.join(RUN_FILE), json!({"ance_episodes": 0, "recipe": {}}).to_string()).unwrap();
        assert!(layout.has_earlier_run());
        std::fs::remove_file(out.join("model.safetensors")).unwrap();
        assert!(!layout.has_earlier_run());
        std::fs::remove_dir_all(&out).unwrap();
    }

    #[test]
    fn stage_seeds_never_replay_another_seed_s_stage() {
        assert_eq!(stage_seed(42, 0), 42, "the BM25 stage keeps the run's seed");
        let mut seen = std::collections::HashSet::new();
        for seed in 40..50 {
            for episode in 0..4 {
                assert!(seen.insert(stage_seed(seed, episode)), "seed {seed} episode {episode} collides");
            }
        }
        // The old rule's collision: seed 42's episode 1 was seed 43's episode 0.
        assert_ne!(stage_seed(42, 1), stage_seed(43, 0));
    }
}
