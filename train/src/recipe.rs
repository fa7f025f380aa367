//! The TOML recipe of a training run (`host train --config`, `configs/minikilt/*.toml`): the
//! model, the data and the hyper-parameters, in Hugging Face's names where it has them.
//! Relative paths are taken from the current folder.

use crate::trainer::{InBatchNegatives, LossKind, SamplerKind, TaskLossWeight};
use anyhow::{bail, Context, Result};
use rak_retrieval::index::{Bm25Params, MilvusAnn, MilvusParams};
use serde::Deserialize;
use serde_json::Value;
use std::path::{Path, PathBuf};

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
    /// A checkpoint folder, a Hugging Face Hub id or a known bare name (`rak_hub`).
    pub path: Option<PathBuf>,
    /// The branch, tag or commit of a Hub model (default: main).
    pub revision: Option<String>,
    /// Extra encoder settings (e.g. `task_markers`, `max_length`).
    #[serde(default)]
    pub settings: serde_json::Map<String, Value>,
}

impl ModelSection {
    /// The model to start from and its revision. A model given on the command line (or in a
    /// request), `given`, takes `given_revision` or none: the recipe's `revision` is for the
    /// recipe's `path` only (a commit pinned for one Hub model is no revision of a folder or of
    /// another model). Without `given`, the recipe's `path` with `given_revision`, else the
    /// recipe's `revision`. `None`: no model anywhere.
    pub fn choose(&self, given: Option<&Path>, given_revision: Option<&str>) -> Option<(PathBuf, Option<String>)> {
        match given {
            // The recipe's own model named again keeps the recipe's pin.
            Some(m) if self.path.as_deref() == Some(m) => Some((m.to_path_buf(), given_revision.or(self.revision.as_deref()).map(String::from))),
            Some(m) => Some((m.to_path_buf(), given_revision.map(String::from))),
            None => self.path.clone().map(|p| (p, given_revision.or(self.revision.as_deref()).map(String::from))),
        }
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataSection {
    /// BEIR corpus.jsonl shared by every task.
    pub corpus: PathBuf,
    /// Folder holding `<task>/queries.<split>.jsonl` and `<task>/qrels.<split>.tsv` (not
    /// needed when a command plugin hands the run its own examples).
    #[serde(default)]
    pub task_dir: PathBuf,
    #[serde(default)]
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
    /// Keep only this many checkpoints, the newest (Hugging Face's `save_total_limit`); all
    /// when unset. A MiniLM checkpoint with AdamW's state is about 260 MB.
    pub save_total_limit: Option<usize>,
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
    /// Where each ANCE episode indexes the re-encoded corpus: exactly, in memory (`flat`), or
    /// in a Milvus collection, for corpora that outgrow one machine's memory.
    pub ance_index: AnceIndex,
    /// Encode queries with their task's name (the encoder makes it a prefix, a marker or a
    /// `?`, or ignores it).
    pub task_names: bool,
    pub layerwise_lr_decay: bool,
    pub max_skipped_steps: u64,
    /// A query's in-batch negatives: its own task's sub-batch (`task`, TACO's code) or every
    /// passage of the step (`step`, one batch of the union).
    pub in_batch_negatives: InBatchNegatives,
    /// How task losses add up: `equal` (each task's mean, summed: TACO's code) or `queries`
    /// (weighted by the task's share of the step's queries: the mean over every query).
    pub task_loss_weight: TaskLossWeight,
    /// Hard negatives never come from a page of the query's gold passages (where pages are
    /// judged, as in KILT, those passages are relevant).
    pub exclude_gold_pages: bool,
    /// Hard negatives never hold one of the query's answers (DPR's rule, its `has_answer`):
    /// the miner searches deeper and keeps its top passages whose text holds no gold answer
    /// string. Answers that are labels (FEVER's SUPPORTS) are matched as words too: on
    /// mini-KILT 1 of fever's 392 top BM25 negatives held one.
    pub exclude_answer_negatives: bool,
    /// NCE: a passage elsewhere in the batch that is one of the query's gold passages (a copy
    /// of the drawn positive: another query on the same passage, or another's hard negative
    /// that is it; or another of its gold passages) is left out of its candidates instead of
    /// counting as a negative (the multi-positive loss always does this).
    pub mask_positive_copies: bool,
    /// `nce` (one positive per query), `multi_positive` (AAR's: every positive of a query) or
    /// `lm_supervised` (REPLUG's KL toward a language model's scores of each query's passages;
    /// only for examples that carry them, as `host aar-train` gives).
    pub loss: LossKind,
    /// REPLUG's β: the temperature on the LM's scores of the `lm_supervised` loss (default 0.1,
    /// REFERENCE §6's common choice); its γ is `1 / score_scale`.
    pub lm_temperature: Option<f64>,
    /// Settings that differ in some stages of an ANCE run (`[[train.stage_overrides]]`), in
    /// order: a later entry's settings win over an earlier one's.
    pub stage_overrides: Vec<StageOverride>,
}

/// Other settings for some stages of a run: the TACO authors' schedule switches the task
/// prefix on only after the BM25 warm-up, and weighs tasks with T-SAGE in the last episode
/// only (plain summed gradients before).
#[derive(Debug, Clone, Default, PartialEq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct StageOverride {
    /// The stages it applies to: 0 is the BM25 stage, E the E-th ANCE episode, -1 the last
    /// stage; or ranges of them (`"0..-2"`: every stage but the last).
    pub stages: Vec<StageRef>,
    /// Encoder settings over `[model] settings` (e.g. `{ task_prefix = false }`).
    #[serde(default)]
    pub model_settings: serde_json::Map<String, Value>,
    /// The optimizer of these stages. Another than the stage's so far starts from this
    /// entry's `optim_settings` alone (the other optimizer's would not fit it).
    pub optim: Option<String>,
    /// Optimizer settings, over the stage's so far (unless `optim` switched optimizer).
    pub optim_settings: Option<serde_json::Map<String, Value>>,
}

/// Stages an override names: one stage, by its number from the first (0, the BM25 stage; E,
/// the E-th ANCE episode) or, negative, from the last (-1); or a range `"A..B"` of them, both
/// ends included, so that a recipe's schedule follows `--ance-episodes` (`"0..-2"`: every
/// stage but the last). A stage counted from the first must be in the run. A range counted
/// from the last is cut to the run's stages, and may name none: every stage but the last of
/// a one-stage run is no stage.
#[derive(Debug, Clone, PartialEq, Deserialize, serde::Serialize)]
#[serde(untagged, expecting = "a stage number (0: the BM25 stage, -1: the last stage) or a range such as \"0..-2\"")]
pub enum StageRef {
    One(i64),
    Range(String),
}

impl StageRef {
    /// The stages it names in a run of stages 0 to `last` (a range that is empty names none),
    /// or why it names stages the run does not have.
    pub fn resolve(&self, last: u32) -> std::result::Result<std::ops::RangeInclusive<i64>, String> {
        let last = i64::from(last);
        let stages = format!("the run has stages 0 to {last} (ance_episodes = {last}, from train.ance_episodes or --ance-episodes)");
        let index = |n: i64| if n < 0 { last + 1 + n } else { n };
        match self {
            StageRef::One(n) => {
                let i = index(*n);
                if !(0..=last).contains(&i) {
                    let counted = if *n < 0 { " (counted back from the last, -1)" } else { "" };
                    return Err(format!("names stage {n}{counted}, but {stages}; entries are counted from 0"));
                }
                Ok(i..=i)
            }
            StageRef::Range(text) => {
                let ends = text.split_once("..").map(|(a, b)| (a.trim().parse::<i64>(), b.trim().parse::<i64>()));
                let Some((Ok(a), Ok(b))) = ends else {
                    return Err(format!("names {text:?}, which is neither a stage number nor a range \"A..B\" of them (e.g. \"0..-2\": every stage but the last)"));
                };
                if let Some(n) = [a, b].into_iter().find(|&n| n > last) {
                    return Err(format!("names stage {n} in {text:?}, but {stages}"));
                }
                if a >= 0 && b >= 0 && a > b {
                    return Err(format!("names {text:?}, a range that runs backwards (both ends are included: \"{b}..{a}\"?)"));
                }
                Ok(index(a).max(0)..=index(b))
            }
        }
    }
}

impl StageOverride {
    /// Whether it applies to `stage` of a run of stages 0 to `last` (checked by `validate`).
    pub fn names(&self, stage: u32, last: u32) -> bool {
        self.stages.iter().any(|r| r.resolve(last).is_ok_and(|stages| stages.contains(&i64::from(stage))))
    }
}

/// What one stage trains with, once the overrides that name it are applied.
#[derive(Debug, Clone, PartialEq)]
pub struct StagePlan {
    pub model_settings: serde_json::Map<String, Value>,
    pub optim: String,
    pub optim_settings: serde_json::Map<String, Value>,
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
            save_total_limit: None,
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
            ance_index: AnceIndex::Flat,
            task_names: true,
            layerwise_lr_decay: false,
            max_skipped_steps: 10,
            in_batch_negatives: InBatchNegatives::Task,
            task_loss_weight: TaskLossWeight::Equal,
            exclude_gold_pages: false,
            exclude_answer_negatives: false,
            mask_positive_copies: false,
            loss: LossKind::Nce,
            lm_temperature: None,
            stage_overrides: Vec::new(),
        }
    }
}

impl TrainSection {
    /// Stage `stage`'s settings: `model_settings` and `optim` (the run's, from the recipe or
    /// the command line) with every override that names the stage applied in order.
    pub fn stage_plan(&self, model_settings: &serde_json::Map<String, Value>, optim: &str, stage: u32) -> StagePlan {
        let mut plan = StagePlan { model_settings: model_settings.clone(), optim: optim.to_string(), optim_settings: self.optim_settings.clone() };
        // The optimizer the settings so far are for: `train.optim_settings` are the recipe's
        // optimizer's, even where --optim runs another.
        let mut settings_of = self.optim.clone().unwrap_or_else(|| optim.to_string());
        for o in self.stage_overrides.iter().filter(|o| o.names(stage, self.ance_episodes)) {
            plan.model_settings.extend(o.model_settings.clone());
            if let Some(name) = &o.optim {
                plan.optim = name.clone();
                if *name != settings_of {
                    plan.optim_settings.clear();
                    settings_of = name.clone();
                }
            }
            if let Some(settings) = &o.optim_settings {
                plan.optim_settings.extend(settings.clone());
            }
        }
        plan
    }
}

impl Recipe {
    /// The checks that need no file: every number in its range (a NaN is in none), each named
    /// by its key, and no task named twice in `data.tasks`. `host train` runs them before any
    /// work (before a model is fetched); [`crate::run::run`] again for every other caller.
    pub fn validate(&self) -> Result<()> {
        let mut seen = std::collections::HashSet::new();
        if let Some(name) = self.data.tasks.iter().find(|n| !seen.insert(n.as_str())) {
            bail!("data.tasks names task {name:?} twice: list each task once");
        }
        self.train.validate()?;
        // A stage's model saves its settings and the next stage loads them where none is
        // given: a key only an override sets would carry its value on into later stages.
        for (i, o) in self.train.stage_overrides.iter().enumerate() {
            if let Some(k) = o.model_settings.keys().find(|k| !self.model.settings.contains_key(*k)) {
                bail!(
                    "train.stage_overrides[{i}].model_settings sets {k:?}, which [model] settings does not: give there the value the other stages train with (otherwise a stage's saved value carries on into the next)"
                );
            }
        }
        Ok(())
    }

    /// The encoder settings every stage trains with: `[model] settings` without the keys a
    /// stage override sets (for those, a stage's checkpoint holds its own, saved with it).
    pub fn shared_model_settings(&self) -> serde_json::Map<String, Value> {
        let mut settings = self.model.settings.clone();
        for o in &self.train.stage_overrides {
            settings.retain(|k, _| !o.model_settings.contains_key(k));
        }
        settings
    }
}

impl TrainSection {
    /// Every number of the section in its range, a clear error naming the key otherwise.
    pub fn validate(&self) -> Result<()> {
        let t = self;
        let check = |key: &str, v: f64, ok: bool, range: &str| -> Result<()> {
            if v.is_nan() {
                bail!("train.{key} is NaN: give a number {range}");
            }
            if !ok {
                bail!("train.{key} = {v}: it must be {range}");
            }
            Ok(())
        };
        check("learning_rate", t.learning_rate, t.learning_rate.is_finite() && t.learning_rate > 0.0, "finite and above 0")?;
        check("num_train_epochs", t.num_train_epochs, t.num_train_epochs.is_finite() && t.num_train_epochs > 0.0, "finite and above 0")?;
        check("warmup_ratio", t.warmup_ratio, (0.0..=1.0).contains(&t.warmup_ratio), "in [0, 1]")?;
        if let Some(m) = t.max_grad_norm {
            // As Hugging Face's Trainer: 0 or less clips nothing.
            check("max_grad_norm", m, !m.is_nan(), "(0 or less: no clipping)")?;
        }
        check("score_scale", t.score_scale, t.score_scale.is_finite() && t.score_scale > 0.0, "finite and above 0")?;
        if t.sampler == "taco" {
            check("temperature", t.temperature, t.temperature.is_finite() && t.temperature > 0.0, "finite and above 0")?;
        } else if t.temperature.is_nan() {
            check("temperature", t.temperature, false, "finite and above 0")?;
        }
        check("bm25_k1", t.bm25_k1 as f64, t.bm25_k1.is_finite() && t.bm25_k1 >= 0.0, "finite and at least 0")?;
        check("bm25_b", t.bm25_b as f64, (0.0..=1.0).contains(&t.bm25_b), "in [0, 1]")?;
        if let Some(e) = t.ance_num_train_epochs {
            check("ance_num_train_epochs", e, e.is_finite() && e > 0.0, "finite and above 0")?;
        }
        if let Some(b) = t.lm_temperature {
            check("lm_temperature", b, b.is_finite() && b > 0.0, "finite and above 0")?;
        }
        if t.max_steps == Some(0) {
            bail!("train.max_steps = 0: give at least 1, or leave it out to train num_train_epochs");
        }
        if t.per_device_train_batch_size == 0 {
            bail!("train.per_device_train_batch_size = 0: give at least 1");
        }
        if t.save_steps == 0 {
            bail!("train.save_steps = 0: give at least 1 (a checkpoint every that many steps)");
        }
        for (i, o) in t.stage_overrides.iter().enumerate() {
            let key = format!("train.stage_overrides[{i}]");
            if o.stages.is_empty() {
                bail!("{key}.stages is empty (entries are counted from 0): name the stages it is for (0: the BM25 stage, E: the E-th ANCE episode, -1: the last stage, \"0..-2\": every stage but the last)");
            }
            if let Some(why) = o.stages.iter().find_map(|r| r.resolve(t.ance_episodes).err()) {
                bail!("{key}.stages {why}");
            }
            if let Some(k) = ["model", "device", "bf16"].iter().find(|k| o.model_settings.contains_key(**k)) {
                bail!("{key}.model_settings sets {k:?}, which the run decides for every stage (the model and --device on the command line, --bf16)");
            }
        }
        Ok(())
    }
}

pub fn read_recipe(path: &Path) -> Result<Recipe> {
    let text = std::fs::read_to_string(path).with_context(|| format!("{}: cannot read", path.display()))?;
    toml::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}

pub fn sampler_kind(t: &TrainSection) -> Result<SamplerKind> {
    Ok(match t.sampler.as_str() {
        "taco" => SamplerKind::Taco { temperature: t.temperature },
        "task_per_batch" => SamplerKind::TaskPerBatch,
        other => bail!("sampler {other:?}: expected taco or task_per_batch"),
    })
}

/// `ance_index`: `{ kind = "flat" }` (the default) or `{ kind = "milvus", uri = "...",
/// collection = "...", ann = { type = "ivf_flat", nlist = 1024, nprobe = 32 } }` (`ann`
/// defaults to exact search). The collection is replaced by each episode; two runs must not
/// share one.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum AnceIndex {
    #[default]
    Flat,
    Milvus {
        uri: String,
        collection: String,
        #[serde(default = "exact")]
        ann: MilvusAnn,
    },
}

fn exact() -> MilvusAnn {
    MilvusAnn::Flat
}

impl AnceIndex {
    /// Where the vectors go, for a Milvus index.
    pub fn milvus(&self) -> Option<MilvusParams> {
        match self {
            AnceIndex::Flat => None,
            AnceIndex::Milvus { uri, collection, ann } => Some(MilvusParams { uri: uri.clone(), collection: collection.clone(), ann: *ann, build: String::new() }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Numbers out of range (a NaN is in none) and a task named twice: one error naming the key.
    #[test]
    fn recipe_numbers_are_checked_by_key() {
        let fails = |edit: &dyn Fn(&mut TrainSection), needle: &str| {
            let mut t = TrainSection::default();
            edit(&mut t);
            let e = format!("{:#}", t.validate().unwrap_err());
            assert!(e.contains(needle), "expected {needle:?} in {e:?}");
        };
        TrainSection::default().validate().unwrap();
        fails(&|t| t.warmup_ratio = 1.5, "train.warmup_ratio = 1.5: it must be in [0, 1]");
        fails(&|t| t.warmup_ratio = -0.1, "train.warmup_ratio");
        fails(&|t| t.warmup_ratio = f64::NAN, "train.warmup_ratio is NaN");
        fails(&|t| t.score_scale = 0.0, "train.score_scale = 0");
        fails(&|t| t.score_scale = f64::INFINITY, "train.score_scale = inf");
        fails(&|t| t.learning_rate = -1e-5, "train.learning_rate");
        fails(&|t| t.learning_rate = f64::NAN, "train.learning_rate is NaN");
        fails(&|t| t.num_train_epochs = 0.0, "train.num_train_epochs = 0");
        fails(&|t| t.save_steps = 0, "train.save_steps = 0");
        fails(&|t| t.max_steps = Some(0), "train.max_steps = 0");
        fails(&|t| t.max_grad_norm = Some(f64::NAN), "train.max_grad_norm is NaN");
        fails(&|t| t.temperature = f64::NAN, "train.temperature is NaN");
        fails(&|t| t.ance_num_train_epochs = Some(f64::NAN), "train.ance_num_train_epochs is NaN");
        fails(&|t| t.lm_temperature = Some(f64::NAN), "train.lm_temperature is NaN");
        fails(&|t| t.bm25_b = f32::NAN, "train.bm25_b is NaN");
        // As Hugging Face's Trainer: 0 or less means no clipping, not an error.
        for m in [0.0, -1.0] {
            TrainSection { max_grad_norm: Some(m), ..Default::default() }.validate().unwrap();
        }
        let twice = Recipe { data: DataSection { tasks: vec!["nq".into(), "fever".into(), "nq".into()], ..Default::default() }, ..Default::default() };
        let e = format!("{:#}", twice.validate().unwrap_err());
        assert!(e.contains("data.tasks") && e.contains("\"nq\" twice"), "{e}");
    }

    /// Stage overrides apply in order to the stages they name; an override naming another
    /// optimizer brings its own settings, one naming none adds to the recipe's.
    #[test]
    fn stage_overrides_apply_in_order_to_the_stages_they_name() {
        let recipe: Recipe = toml::from_str(
            r#"
            [model]
            settings = { task_prefix = true, max_length = 64 }
            [data]
            corpus = "c.jsonl"
            [train]
            optim = "tsage"
            optim_settings = { tau = 2.0, beta = 0.999 }
            ance_episodes = 2
            [[train.stage_overrides]]
            stages = [0]
            model_settings = { task_prefix = false }
            [[train.stage_overrides]]
            stages = [0, 1]
            optim = "adamw"
            optim_settings = { weight_decay = 0.0 }
            [[train.stage_overrides]]
            stages = [1, 2]
            optim_settings = { beta = 0.9 }
            [[train.stage_overrides]]
            stages = [2]
            optim = "tsage"
            optim_settings = { tau = 1.0 }
            "#,
        )
        .unwrap();
        recipe.validate().unwrap();
        let t = &recipe.train;
        let plan = |stage| t.stage_plan(&recipe.model.settings, "tsage", stage);
        let map = |v: Value| v.as_object().unwrap().clone();
        assert_eq!(plan(0), StagePlan { model_settings: map(json!({"task_prefix": false, "max_length": 64})), optim: "adamw".into(), optim_settings: map(json!({"weight_decay": 0.0})) });
        // The third entry's settings add to the second's optimizer's.
        assert_eq!(plan(1), StagePlan { model_settings: map(json!({"task_prefix": true, "max_length": 64})), optim: "adamw".into(), optim_settings: map(json!({"weight_decay": 0.0, "beta": 0.9})) });
        // Naming the stage's own optimizer again keeps its settings so far.
        assert_eq!(plan(2), StagePlan { model_settings: map(json!({"task_prefix": true, "max_length": 64})), optim: "tsage".into(), optim_settings: map(json!({"tau": 1.0, "beta": 0.9})) });
        assert_eq!(recipe.shared_model_settings(), map(json!({"max_length": 64})), "task_prefix differs by stage");
        // --optim adamw over the recipe's tsage: the entries naming adamw still start afresh
        // (the recipe's settings are tsage's), the stage without one keeps the recipe's.
        let cli = |stage| t.stage_plan(&recipe.model.settings, "adamw", stage);
        assert_eq!(cli(0).optim_settings, map(json!({"weight_decay": 0.0})));
        assert_eq!((cli(2).optim.as_str(), cli(2).optim_settings), ("tsage", map(json!({"tau": 1.0, "beta": 0.9}))));
        // A key only an override sets would carry over from a stage's saved settings.
        let mut lone = recipe;
        lone.model.settings.remove("task_prefix");
        let e = format!("{:#}", lone.validate().unwrap_err());
        assert!(e.contains("train.stage_overrides[0].model_settings sets \"task_prefix\", which [model] settings does not"), "{e}");

        let fails = |o: StageOverride, episodes: u32, needle: &str| {
            // The first entry is fine: the error names the second by its place.
            let first = StageOverride { stages: vec![StageRef::One(0)], ..Default::default() };
            let t = TrainSection { ance_episodes: episodes, stage_overrides: vec![first, o], ..Default::default() };
            let e = format!("{:#}", t.validate().unwrap_err());
            assert!(e.contains(needle), "expected {needle:?} in {e:?}");
        };
        fails(StageOverride::default(), 1, "train.stage_overrides[1].stages is empty");
        fails(StageOverride { stages: vec![StageRef::One(0), StageRef::One(3)], ..Default::default() }, 2, "train.stage_overrides[1].stages names stage 3, but the run has stages 0 to 2 (ance_episodes = 2, from train.ance_episodes or --ance-episodes)");
        let bf16 = StageOverride { stages: vec![StageRef::One(1)], model_settings: map(json!({"bf16": true})), ..Default::default() };
        fails(bf16, 1, "model_settings sets \"bf16\"");
        let range = |r: &str| StageOverride { stages: vec![StageRef::Range(r.into())], ..Default::default() };
        fails(StageOverride { stages: vec![StageRef::One(-4)], ..Default::default() }, 2, "stages names stage -4 (counted back from the last, -1), but the run has stages 0 to 2");
        fails(range("0..3"), 2, "stages names stage 3 in \"0..3\", but the run has stages 0 to 2");
        fails(range("2..1"), 2, "a range that runs backwards");
        fails(range("0-2"), 2, "neither a stage number nor a range");
    }

    /// Stages counted back from the last follow --ance-episodes: the TACO schedule's "T-SAGE
    /// in the last episode only" is one recipe for any number of episodes.
    #[test]
    fn stages_counted_from_the_last_follow_the_number_of_episodes() {
        let recipe = |episodes: u32| -> Recipe {
            let text = format!(
                r#"
                [model]
                settings = {{ task_prefix = true }}
                [data]
                corpus = "c.jsonl"
                [train]
                optim = "tsage"
                ance_episodes = {episodes}
                [[train.stage_overrides]]
                stages = ["0..-2"]
                optim = "adamw"
                [[train.stage_overrides]]
                stages = [0, -1]
                model_settings = {{ task_prefix = false }}
                "#
            );
            let r: Recipe = toml::from_str(&text).unwrap();
            r.validate().unwrap();
            r
        };
        let plans = |episodes: u32| -> Vec<(String, Value)> {
            let r = recipe(episodes);
            (0..=episodes).map(|s| r.train.stage_plan(&r.model.settings, "tsage", s)).map(|p| (p.optim, p.model_settings["task_prefix"].clone())).collect()
        };
        let (adam, tsage) = ("adamw".to_string(), "tsage".to_string());
        assert_eq!(plans(3), vec![(adam.clone(), json!(false)), (adam.clone(), json!(true)), (adam.clone(), json!(true)), (tsage.clone(), json!(false))]);
        assert_eq!(plans(1), vec![(adam, json!(false)), (tsage.clone(), json!(false))]);
        // One stage: it is the last, so "every stage but the last" names none.
        assert_eq!(plans(0), vec![(tsage, json!(false))]);
        // As written, so a resume compares the recipe's own words.
        let saved = serde_json::to_value(&recipe(3).train.stage_overrides[0].stages).unwrap();
        assert_eq!(saved, json!(["0..-2"]));
        let e = toml::from_str::<Recipe>("[data]\ncorpus = \"c\"\n[[train.stage_overrides]]\nstages = [1.5]\n").unwrap_err().to_string();
        assert!(e.contains("a stage number (0: the BM25 stage, -1: the last stage) or a range"), "{e}");
    }

    /// The recipe's revision goes with the recipe's model only: a model given on the command
    /// line takes the command line's revision or none.
    #[test]
    fn the_recipe_s_revision_is_for_the_recipe_s_model_only() {
        let commit = "0123456789abcdef0123456789abcdef01234567";
        let m = ModelSection { path: Some("org/pinned".into()), revision: Some(commit.into()), ..Default::default() };
        let own = |p: &str, r: Option<&str>| Some((PathBuf::from(p), r.map(String::from)));
        assert_eq!(m.choose(None, None), own("org/pinned", Some(commit)));
        assert_eq!(m.choose(None, Some("v2")), own("org/pinned", Some("v2")));
        assert_eq!(m.choose(Some(Path::new("./ckpt")), None), own("./ckpt", None));
        assert_eq!(m.choose(Some(Path::new("org/other")), None), own("org/other", None));
        assert_eq!(m.choose(Some(Path::new("org/other")), Some("dev")), own("org/other", Some("dev")));
        // The recipe's own model named again on the command line keeps its pin.
        assert_eq!(m.choose(Some(Path::new("org/pinned")), None), own("org/pinned", Some(commit)));
        assert_eq!(ModelSection::default().choose(None, Some("v2")), None);
    }
}
