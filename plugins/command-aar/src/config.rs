//! The command line and the TOML recipe of `host aar-train`, resolved into one [`Config`]:
//! flags override the recipe, then everything is checked before any work starts.

use anyhow::{bail, Context, Result};
use serde::Deserialize;
use serde_json::{json, Map, Value};
use std::path::{Path, PathBuf};

pub const USAGE: &str = "usage: host aar-train --source MODEL|CONNECTOR --encoder E --model MODEL --config FILE.toml --output-dir OUT \
[--max-queries N] [--base-url URL] [--seed N] [--device cpu|cuda] [--overwrite] [--retry-failed] [--compare-with RUN ...]

  --source MODEL      white-box source, whatever the recipe's source.kind: a T5 / Flan-T5 checkpoint read by the `fid` reader,
                      as a folder, a Hugging Face Hub id (google/flan-t5-base) or a known name (flan-t5-base)
  --source openai     black-box source, whatever the recipe's source.kind: a connector plugin (openai: any OpenAI-compatible server)
  --encoder, --model  the starting retriever (encoder plugin and checkpoint: a folder, a Hub id or a known name)
  --config            the recipe: [source], [data], [aar], [train], [model] (configs/aar/)
  --output-dir        the run's folder: the final model, analysis.json, and stages/ (resumable; summary.json)
  --max-queries       a fixed subset of the source task's queries (evenly spaced over the file)
  --base-url          the black-box server (overrides [source].settings.base_url)
  --seed              the run's seed (train.seed and the negatives' draw)
  --device            cpu, cuda or cuda:N for the retriever, the trainer and a white-box source
  --overwrite         redo the stages whose inputs changed (and those after them)
  --retry-failed      ask the source again for the items a finished score stage recorded as failed, then redo the stages after it
  --compare-with RUN  another aar-train run's output folder (repeatable): how often this run's top K LM-preferred passages
                      are also its source's top K, on the queries both scored over the same top N (summary, stages/sources_overlap.json)";

/// The flags as given.
#[derive(Debug, Default)]
pub struct Flags {
    pub source: Option<String>,
    pub encoder: Option<String>,
    pub model: Option<PathBuf>,
    pub config: Option<PathBuf>,
    pub output_dir: Option<PathBuf>,
    pub max_queries: Option<usize>,
    pub base_url: Option<String>,
    pub seed: Option<u64>,
    pub device: Option<String>,
    pub overwrite: bool,
    pub retry_failed: bool,
    pub compare_with: Vec<PathBuf>,
}

/// What the command line asks for.
pub enum Parsed {
    Help,
    Run(Box<Flags>),
}

impl Flags {
    pub fn parse(args: &[String]) -> Result<Parsed> {
        let mut f = Flags::default();
        let mut it = args.iter();
        while let Some(arg) = it.next() {
            if arg == "-h" || arg == "--help" {
                return Ok(Parsed::Help);
            }
            let Some(name) = arg.strip_prefix("--") else { bail!("unexpected argument {arg:?}\n{USAGE}") };
            let (name, inline) = match name.split_once('=') {
                Some((n, v)) => (n, Some(v.to_string())),
                None => (name, None),
            };
            if name == "overwrite" || name == "retry-failed" {
                if inline.is_some() {
                    bail!("--{name} takes no value");
                }
                if name == "overwrite" {
                    f.overwrite = true;
                } else {
                    f.retry_failed = true;
                }
                continue;
            }
            let value = match inline {
                Some(v) => v,
                None => it.next().cloned().with_context(|| format!("--{name} needs a value"))?,
            };
            let number = |what: &str| -> Result<u64> { value.parse().with_context(|| format!("--{what} {value:?}: not a non-negative integer")) };
            match name {
                "source" => f.source = Some(value.clone()),
                "encoder" => f.encoder = Some(value.clone()),
                "model" => f.model = Some(PathBuf::from(&value)),
                "config" => f.config = Some(PathBuf::from(&value)),
                "output-dir" => f.output_dir = Some(PathBuf::from(&value)),
                "max-queries" => f.max_queries = Some(number("max-queries")? as usize),
                "base-url" => f.base_url = Some(value.clone()),
                "seed" => f.seed = Some(number("seed")?),
                "device" => f.device = Some(value.clone()),
                "compare-with" => f.compare_with.push(PathBuf::from(&value)),
                other => bail!(
                    "unknown flag --{other} (known: --source, --encoder, --model, --config, --output-dir, --max-queries, --base-url, --seed, --device, --overwrite, --retry-failed, --compare-with)"
                ),
            }
        }
        Ok(Parsed::Run(Box::new(f)))
    }
}

/// The recipe file (`configs/aar/*.toml`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Recipe {
    #[serde(default)]
    source: SourceSection,
    data: DataSection,
    #[serde(default)]
    aar: AarSection,
    /// A `host train` recipe's [train] section, passed to the host's train service.
    #[serde(default)]
    train: Map<String, Value>,
    #[serde(default)]
    model: ModelSection,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct SourceSection {
    /// `white-box` (a reader over a local checkpoint) or `black-box` (a connector).
    kind: Option<String>,
    /// White-box: the checkpoint (a folder, a Hub id or a known name).
    model: Option<PathBuf>,
    /// White-box: the branch, tag or commit of a Hub model (default: main).
    revision: Option<String>,
    reader: Option<String>,
    connector: Option<String>,
    /// The reader's or the connector's settings.
    #[serde(default)]
    settings: Map<String, Value>,
    /// Black-box prompt: `{passage}`, `{title}`, `{question}`.
    template: Option<String>,
    /// Black-box continuation whose log-likelihood is the score: `{answer}`.
    continuation: Option<String>,
    /// White-box prompt, read after each passage's first `passage_chars` characters: `{question}`.
    reader_template: Option<String>,
    /// Black-box: queries in flight at once.
    workers: Option<usize>,
    /// White-box: queries per reader request.
    batch_size: Option<usize>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct DataSection {
    corpus: PathBuf,
    task_dir: PathBuf,
    task: String,
    #[serde(default = "default_split")]
    split: String,
    max_queries: Option<usize>,
}

fn default_split() -> String {
    "train".into()
}

/// AAR's constants (REFERENCE §6), every one a setting.
#[derive(Debug, Clone, Deserialize, serde::Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct AarSection {
    /// `aar` (the top K LM-preferred passages become positives) or `replug` (REPLUG's
    /// LM-supervised retrieval: the retriever's distribution over each query's scored passages
    /// trained toward the LM's by KL, the trainer's `lm_supervised` loss).
    pub mode: String,
    pub n: usize,
    pub k: usize,
    /// How the LM-preferred passages join the gold: `authors` (the top K, gold or not, less the
    /// gold, as the authors' `merge_qrels.py`) or `top_k_non_gold` (the top K that are not gold).
    pub positives: String,
    pub exactly_three: bool,
    pub negatives_depth: usize,
    pub negatives_sampled: usize,
    pub negatives_per_query: usize,
    pub passage_chars: usize,
}

impl AarSection {
    /// REPLUG's LM-supervised mode rather than AAR's positives.
    pub fn replug(&self) -> bool {
        self.mode == "replug"
    }

    /// The positives rule (checked on load).
    pub fn positives_rule(&self) -> crate::select::PositivesRule {
        crate::select::PositivesRule::parse(&self.positives).expect("checked when the recipe was read")
    }
}

impl Default for AarSection {
    fn default() -> Self {
        AarSection {
            mode: "aar".into(),
            n: 10,
            k: 2,
            positives: "authors".into(),
            exactly_three: false,
            negatives_depth: 200,
            negatives_sampled: 30,
            negatives_per_query: 7,
            passage_chars: 500,
        }
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ModelSection {
    encoder: Option<String>,
    path: Option<PathBuf>,
    revision: Option<String>,
    #[serde(default)]
    settings: Map<String, Value>,
}

/// Where passage scores come from.
#[derive(Debug, Clone, PartialEq)]
pub enum Source {
    /// A reader plugin (`fid`) over a local checkpoint: cross-attention preferences.
    WhiteBox { reader: String, model: PathBuf, prompt: String, batch_size: usize },
    /// A connector plugin (`openai`): log-likelihood of the gold answer.
    BlackBox { connector: String, prompt: String, continuation: String, workers: usize },
}

/// What the flags and the recipe are checked against before any work: the host's plugins, and
/// how a model's name becomes a folder.
pub struct Checks<'a> {
    /// (kind, name) of each plugin the host found.
    pub plugins: Vec<(String, String)>,
    /// The Hugging Face settings (`--source`'s bare names the cache holds are models); `None`
    /// where there are none (no HOME).
    pub hub: Option<rak_hub::HubEnv>,
    /// A model's name (and revision) → its folder (`rak_hub::resolve_in`).
    #[allow(clippy::type_complexity)]
    pub resolve: &'a dyn Fn(&Path, Option<&str>) -> Result<rak_hub::Resolved>,
}

impl Checks<'_> {
    fn has(&self, kind: &str, name: &str) -> bool {
        self.plugins.iter().any(|(k, n)| k == kind && n == name)
    }

    fn kind_of(&self, name: &str) -> Option<&str> {
        self.plugins.iter().find(|(_, n)| n == name).map(|(k, _)| k.as_str())
    }

    fn names(&self, kind: &str) -> Vec<&str> {
        self.plugins.iter().filter(|(k, _)| k == kind).map(|(_, n)| n.as_str()).collect()
    }

    /// Refuse a plugin the host does not have, before any work.
    fn require(&self, kind: &str, name: &str, what: &str) -> Result<()> {
        if self.has(kind, name) {
            return Ok(());
        }
        match self.kind_of(name) {
            Some(other) => bail!("{what} {name:?} is a {other} plugin, not a {kind}"),
            None => bail!("{what}: no {kind} plugin named {name:?} (the host has: {}; see `host plugins list`)", self.names(kind).join(", ")),
        }
    }
}

/// Everything a run needs, flags applied.
#[derive(Debug)]
pub struct Config {
    pub source: Source,
    /// The reader's or connector's settings.
    pub source_settings: Map<String, Value>,
    pub encoder: String,
    pub model: PathBuf,
    /// Where the retriever and a white-box source came from, when from the Hugging Face Hub
    /// (id, revision, commit: `rak_hub::Resolved::record`).
    pub model_hub: Option<Value>,
    pub source_hub: Option<Value>,
    /// What the user should know about how the flags and the recipe were read.
    pub notices: Vec<String>,
    pub encoder_settings: Map<String, Value>,
    pub corpus: PathBuf,
    pub task_dir: PathBuf,
    pub task: String,
    pub split: String,
    pub max_queries: Option<usize>,
    pub aar: AarSection,
    /// The [train] section with AAR's settings applied (loss, hard negatives, seed).
    pub train: Map<String, Value>,
    pub seed: u64,
    pub device: Option<String>,
    pub output_dir: PathBuf,
    pub overwrite: bool,
    pub retry_failed: bool,
    /// Other runs whose sources' preferences this run's are compared with (in no stage's key:
    /// the comparison is redone on every run, and kept under `stages/`).
    pub compare_with: Vec<PathBuf>,
}

pub const DEFAULT_TEMPLATE: &str = "{title}\n{passage}\n\nQ: {question} A:";
pub const DEFAULT_CONTINUATION: &str = " {answer}";
pub const DEFAULT_READER_TEMPLATE: &str = " {question}";

/// The recipe's settings as `host plugins inspect` shows them, and the stages.
pub fn schema() -> Value {
    let d = AarSection::default();
    json!({
        "usage": USAGE,
        "recipe": {
            "source.kind": {"type": "string", "default": null, "help": "white-box (a reader over a T5 checkpoint) or black-box (a connector); --source MODEL (a folder, a Hub id, a known name) means white-box, --source CONNECTOR black-box, whatever this says"},
            "source.model": {"type": "path", "default": null, "help": "white-box: the T5 / Flan-T5 checkpoint: a folder, a Hugging Face Hub id (google/flan-t5-base) or a known name (flan-t5-base) (--source MODEL)"},
            "source.revision": {"type": "string", "default": "main", "help": "white-box: the branch, tag or commit of a Hub model"},
            "source.reader": {"type": "string", "default": "fid", "help": "white-box: the reader plugin (its passage_preferences)"},
            "source.connector": {"type": "string", "default": "openai", "help": "black-box: the connector plugin (its continuation_logprob)"},
            "source.settings": {"type": "object", "default": {}, "help": "the reader's or the connector's settings (host plugins inspect on its file); --base-url sets base_url"},
            "source.template": {"type": "string", "default": DEFAULT_TEMPLATE, "help": "black-box prompt: {passage} (its first passage_chars characters), {title}, {question}"},
            "source.continuation": {"type": "string", "default": DEFAULT_CONTINUATION, "help": "black-box: the text scored after the prompt; {answer} is the query's first answer"},
            "source.reader_template": {"type": "string", "default": DEFAULT_READER_TEMPLATE, "help": "white-box prompt the reader appends to each passage's first passage_chars characters: {question}"},
            "source.workers": {"type": "int", "default": 4, "help": "black-box: queries scored at once (the connector's concurrency caps requests)"},
            "source.batch_size": {"type": "int", "default": 8, "help": "white-box: queries per reader request (also the reader's batch_size unless its settings give one)"},
            "data.corpus": {"type": "path", "required": true, "help": "BEIR corpus.jsonl"},
            "data.task_dir": {"type": "path", "required": true, "help": "folder of <task>/queries.<split>.jsonl (with answers for black-box sources) and qrels.<split>.tsv"},
            "data.task": {"type": "string", "required": true, "help": "the source task"},
            "data.split": {"type": "string", "default": "train"},
            "data.max_queries": {"type": "int", "default": null, "help": "a fixed, evenly spaced subset of the queries with gold (--max-queries)"},
            "aar.mode": {"type": "string", "default": d.mode, "help": "aar (the top K LM-preferred passages become positives; multi-positive loss) or replug (REPLUG's LM-supervised retrieval: KL from the retriever's distribution over each query's scored passages, softmax(score_scale · <q, p>), to the LM's, softmax(log-likelihood / train.lm_temperature), β default 0.1; black-box sources only; K then only feeds the analysis)"},
            "aar.n": {"type": "int", "default": d.n, "help": "passages scored per query (the starting retriever's top N)"},
            "aar.k": {"type": "int", "default": d.k, "help": "the LM's top K passages, of which those not gold are added as positives (see aar.positives); 0: gold only (the human-label baseline, no source asked)"},
            "aar.positives": {"type": "string", "default": d.positives, "help": "authors (the authors' merge_qrels.py: the LM's top K of the N, gold or not, then those that are not gold; a query whose top K holds gold gains fewer) or top_k_non_gold (the top K among the passages that are not gold: K added where N allows)"},
            "aar.exactly_three": {"type": "bool", "default": d.exactly_three, "help": "keep only queries that end with exactly 3 positives (the authors' filter: with aar.positives = authors, K = 2 and one gold passage, the queries whose LM top 2 holds no gold)"},
            "aar.negatives_depth": {"type": "int", "default": d.negatives_depth, "help": "negatives come from the starting retriever's top this many, minus the positives"},
            "aar.negatives_sampled": {"type": "int", "default": d.negatives_sampled, "help": "negatives kept per query, drawn with a seed derived from (seed, \"aar-negatives\")"},
            "aar.negatives_per_query": {"type": "int", "default": d.negatives_per_query, "help": "negatives per query in each training step (the trainer's hard_negatives)"},
            "aar.passage_chars": {"type": "int", "default": d.passage_chars, "help": "characters of each passage the source reads"},
            "train": {"type": "object", "help": "a host train recipe's [train] section (learning_rate, per_device_train_batch_size, max_steps, optim, ...); mode aar: loss multi_positive, hard_negatives aar.negatives_per_query; mode replug: loss lm_supervised, hard_negatives 0, lm_temperature β"},
            "model": {"type": "object", "help": "the retriever's [model] section as host train reads it: encoder, path (a folder, a Hub id or a known name), revision (of a Hub model), settings (max_length, ...)"},
        },
        "stages": [
            {"name": "retrieve", "does": "the starting retriever's top max(N, negatives_depth) per query (top N in replug mode) (encode_corpus, a flat index, search)", "files": "stages/retrieve/retrieved.jsonl"},
            {"name": "score", "does": "the source LM scores the top N: white-box passage_preferences, black-box continuation_logprob of the answer; failures recorded and skipped", "files": "stages/score/scores.jsonl (per query, resumed by query id)"},
            {"name": "select", "does": "aar: positives = gold ∪ top K LM-preferred, negatives sampled from the top negatives_depth minus positives; replug: each query's scored passages with their scores; analysis.json", "files": "stages/select/examples.json"},
            {"name": "train", "does": "the host's train service on those examples with loss multi_positive (aar) or lm_supervised (replug); resumes from its checkpoints", "files": "stages/train/"},
            {"name": "final", "does": "the trained model written into the output folder", "files": "OUT/config.json, OUT/model.safetensors, ..."},
        ],
    })
}

impl Config {
    pub fn resolve(flags: Flags, ctx: &Checks) -> Result<Config> {
        let path = flags.config.clone().context(format!("--config is required\n{USAGE}"))?;
        let text = std::fs::read_to_string(&path).with_context(|| format!("{}: cannot read", path.display()))?;
        let recipe: Recipe = toml::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        Self::from_recipe(recipe, flags, &path, ctx)
    }

    fn from_recipe(r: Recipe, flags: Flags, path: &Path, ctx: &Checks) -> Result<Config> {
        let output_dir = flags.output_dir.clone().context("--output-dir is required")?;
        let aar = r.aar;
        match aar.mode.as_str() {
            "aar" => {}
            "replug" => {
                if aar.k == 0 {
                    bail!("{}: aar.k = 0 is the human-label baseline, which asks no source; aar.mode = \"replug\" trains on the source's scores (K then only sets the analysis's LM-preferred top K)", path.display());
                }
                if aar.exactly_three {
                    bail!("{}: aar.exactly_three filters AAR's merged positives; aar.mode = \"replug\" has none", path.display());
                }
                if aar.n < 2 {
                    bail!("{}: aar.n = {}: REPLUG's KL compares distributions over each query's N passages, so N must be at least 2", path.display(), aar.n);
                }
            }
            other => bail!("{}: aar.mode {other:?}: expected \"aar\" or \"replug\"", path.display()),
        }
        if aar.n == 0 {
            bail!("{}: aar.n must be at least 1", path.display());
        }
        if crate::select::PositivesRule::parse(&aar.positives).is_none() {
            bail!("{}: aar.positives {:?}: expected one of {:?}", path.display(), aar.positives, crate::select::PositivesRule::NAMES);
        }
        // Checked before any work, so a mistyped folder does not end a long run with an error.
        for other in &flags.compare_with {
            if aar.k == 0 {
                bail!("--compare-with compares LM preferences; this run asks no source (aar.k = 0)");
            }
            let scores = other.join("stages/score/scores.jsonl");
            if !scores.exists() {
                bail!("--compare-with {}: not an aar-train run with LM scores ({} is missing)", other.display(), scores.display());
            }
        }
        if aar.k > aar.n {
            bail!("{}: aar.k = {} is more than aar.n = {}: at most the N scored passages can be LM-preferred", path.display(), aar.k, aar.n);
        }
        if !aar.replug() && aar.negatives_per_query > aar.negatives_sampled {
            bail!("{}: aar.negatives_per_query = {} is more than aar.negatives_sampled = {}", path.display(), aar.negatives_per_query, aar.negatives_sampled);
        }
        if !aar.replug() && aar.negatives_sampled > aar.negatives_depth {
            bail!("{}: aar.negatives_sampled = {} is more than aar.negatives_depth = {}", path.display(), aar.negatives_sampled, aar.negatives_depth);
        }
        if aar.passage_chars == 0 {
            bail!("{}: aar.passage_chars must be positive", path.display());
        }

        let mut s = r.source;
        let mut notices = Vec::new();
        let given = flags.source.as_deref();
        // --source decides the kind, whatever the recipe's: a folder, or a model the Hub knows
        // by that name, is white-box; a connector plugin's name black-box.
        let kind = match (given, s.kind.as_deref()) {
            (Some(v), _) if Path::new(v).is_dir() => "white-box",
            (Some(v), _) if ctx.has("connector", v) => "black-box",
            (Some(v), _) if rak_hub::names_a_model(Path::new(v), ctx.hub.as_ref()) => "white-box",
            (Some(v), _) => {
                let as_model = match rak_hub::classify(Path::new(v)) {
                    rak_hub::Name::NotAModel(why) => why,
                    _ => "no model".into(),
                };
                match ctx.kind_of(v) {
                    Some(other) => bail!("--source {v:?}: a {other} plugin; a source is a connector plugin (black-box) or a model (white-box)"),
                    None => bail!(
                        "--source {v:?}: no connector plugin of that name (the host has: {}), and as a model: {as_model}",
                        ctx.names("connector").join(", ")
                    ),
                }
            }
            (None, Some(k @ ("white-box" | "black-box"))) => k,
            (None, Some(other)) => bail!("{}: source.kind {other:?}: expected \"white-box\" or \"black-box\"", path.display()),
            (None, None) => bail!("no source: give --source MODEL (white-box) or --source openai (black-box), or source.kind in {}", path.display()),
        };
        // A --source of the other kind than the recipe's: the recipe's settings for its own kind
        // (a connector's or a reader's) are left out, with a notice.
        if let (Some(v), Some(recipe_kind)) = (given, s.kind.as_deref()) {
            if recipe_kind != kind {
                let mut left = Vec::new();
                let mut drop = |name: &str, present: bool| {
                    if present {
                        left.push(format!("source.{name}"));
                    }
                };
                drop("settings", !s.settings.is_empty());
                if kind == "white-box" {
                    drop("connector", s.connector.take().is_some());
                    drop("template", s.template.take().is_some());
                    drop("continuation", s.continuation.take().is_some());
                    drop("workers", s.workers.take().is_some());
                } else {
                    drop("model", s.model.take().is_some());
                    drop("revision", s.revision.take().is_some());
                    drop("reader", s.reader.take().is_some());
                    drop("reader_template", s.reader_template.take().is_some());
                    drop("batch_size", s.batch_size.take().is_some());
                }
                s.settings.clear();
                notices.push(format!(
                    "--source {v} is a {kind} source and {} says {recipe_kind}: the recipe's {recipe_kind} settings are left out{}",
                    path.display(),
                    if left.is_empty() { String::new() } else { format!(" ({})", left.join(", ")) }
                ));
            }
        }
        let mut source_settings = s.settings;
        if kind == "white-box" && aar.replug() {
            // REPLUG's Q is a softmax of log-likelihoods; a reader's cross-attention preferences
            // are averaged attention weights, not log-likelihoods.
            bail!("{}: aar.mode = \"replug\" needs a black-box source (the log-likelihood of the answer); a white-box source's scores are cross-attention preferences", path.display());
        }
        // The plugins first (cheap), then the models (which may be downloaded).
        let m = r.model;
        let encoder = flags.encoder.clone().or(m.encoder).context("no encoder: give --encoder or model.encoder")?;
        ctx.require("encoder", &encoder, "--encoder")?;
        // The recipe's source.revision goes with its source.model only: a --source model is
        // taken at main (or as the folder it is).
        let mut source_revision = None;
        let mut source = if kind == "white-box" {
            let reader = s.reader.clone().unwrap_or_else(|| "fid".into());
            ctx.require("reader", &reader, "source.reader")?;
            let name = match given {
                Some(v) => {
                    if let Some(pinned) = &s.revision {
                        notices.push(format!("{}'s source.revision {pinned:?} is for its source.model, not for --source {v}: left out", path.display()));
                    }
                    PathBuf::from(v)
                }
                None => {
                    source_revision = s.revision.clone();
                    s.model.clone().with_context(|| format!("{}: a white-box source needs source.model (or --source MODEL)", path.display()))?
                }
            };
            if s.template.is_some() || s.continuation.is_some() {
                bail!("{}: source.template and source.continuation are for black-box sources; a white-box source reads source.reader_template after each passage", path.display());
            }
            if flags.base_url.is_some() {
                bail!("--base-url is for black-box sources; --source {} is a white-box checkpoint", name.display());
            }
            let prompt = s.reader_template.clone().unwrap_or_else(|| DEFAULT_READER_TEMPLATE.into());
            check_template(&prompt, &["question"], "source.reader_template")?;
            let batch_size = s.batch_size.unwrap_or(8);
            if batch_size == 0 {
                bail!("{}: source.batch_size must be positive", path.display());
            }
            // The reader cuts passages itself: it must cut where AAR's setting says.
            match source_settings.get("passage_chars") {
                Some(v) if v.as_u64() != Some(aar.passage_chars as u64) => {
                    bail!("{}: source.settings.passage_chars = {v} differs from aar.passage_chars = {}; set aar.passage_chars only", path.display(), aar.passage_chars)
                }
                _ => {
                    source_settings.insert("passage_chars".into(), json!(aar.passage_chars));
                }
            }
            source_settings.entry("batch_size").or_insert(json!(batch_size));
            if let Some(d) = &flags.device {
                source_settings.insert("device".into(), json!(d));
            }
            // The name is resolved last, after every cheap check (a Hub model may be downloaded).
            Source::WhiteBox { reader, model: name, prompt, batch_size }
        } else {
            if s.reader_template.is_some() {
                bail!("{}: source.reader_template is for white-box sources; a black-box source reads source.template", path.display());
            }
            let prompt = s.template.clone().unwrap_or_else(|| DEFAULT_TEMPLATE.into());
            check_template(&prompt, &["passage", "title", "question"], "source.template")?;
            if !prompt.contains("{passage}") {
                bail!("source.template {prompt:?} has no {{passage}}: the passage is what is scored");
            }
            let continuation = s.continuation.clone().unwrap_or_else(|| DEFAULT_CONTINUATION.into());
            check_template(&continuation, &["answer"], "source.continuation")?;
            if !continuation.contains("{answer}") {
                bail!("source.continuation {continuation:?} has no {{answer}}: the answer's log-likelihood is the score");
            }
            if let Some(url) = &flags.base_url {
                source_settings.insert("base_url".into(), json!(url));
            }
            let workers = s.workers.unwrap_or(4);
            if workers == 0 {
                bail!("{}: source.workers must be positive", path.display());
            }
            let connector = match given {
                Some(name) => name.to_string(),
                None => s.connector.clone().unwrap_or_else(|| "openai".into()),
            };
            ctx.require("connector", &connector, "the black-box source")?;
            Source::BlackBox { connector, prompt, continuation, workers }
        };

        // The recipe's model.revision goes with its model.path only, as host train takes them.
        let (model_name, model_revision) = match &flags.model {
            Some(given) => {
                if let Some(pinned) = &m.revision {
                    notices.push(format!("{}'s model.revision {pinned:?} is for its model.path, not for --model {}: left out", path.display(), given.display()));
                }
                (given.clone(), None)
            }
            None => (m.path.context("no starting retriever: give --model or model.path")?, m.revision),
        };
        let mut encoder_settings = m.settings;
        if let Some(d) = &flags.device {
            encoder_settings.insert("device".into(), json!(d));
        }

        let mut train = r.train;
        let seed = match (flags.seed, train.get("seed")) {
            (Some(s), _) => s,
            (None, Some(v)) => v.as_u64().with_context(|| format!("{}: train.seed {v}: not a non-negative integer", path.display()))?,
            (None, None) => 42,
        };
        train.insert("seed".into(), json!(seed));
        let settled = if aar.replug() {
            [("loss", json!("lm_supervised"), "aar.mode = \"replug\" trains with the lm_supervised loss"), ("hard_negatives", json!(0), "aar.mode = \"replug\" trains on each query's scored passages only")]
        } else {
            [("loss", json!("multi_positive"), "AAR's loss is always multi_positive"), ("hard_negatives", json!(aar.negatives_per_query), "set aar.negatives_per_query")]
        };
        if !aar.replug() && train.contains_key("lm_temperature") {
            bail!("{}: train.lm_temperature is REPLUG's β, for aar.mode = \"replug\"", path.display());
        }
        // The trainer's default scale (1, raw dot products) would make REPLUG's γ 1, nearly flat
        // over unit-length embeddings: the recipe says which it means.
        if aar.replug() && !train.contains_key("score_scale") {
            bail!("{}: aar.mode = \"replug\" needs train.score_scale, REPLUG's 1/γ (e.g. 20 for unit-length embeddings such as MiniLM's, γ = 0.05)", path.display());
        }
        for (key, want, instead) in settled {
            match train.get(key) {
                Some(v) if *v != want => bail!("{}: train.{key} = {v}: {instead}", path.display()),
                _ => {
                    train.insert(key.into(), want);
                }
            }
        }
        train.entry("optim").or_insert(json!("adamw"));

        let d = r.data;
        let max_queries = flags.max_queries.or(d.max_queries);
        if max_queries == Some(0) {
            bail!("max_queries must be at least 1");
        }

        // Last, after every cheap check: the models' names (a Hub model may be downloaded).
        let resolved = (ctx.resolve)(&model_name, model_revision.as_deref()).with_context(|| format!("the starting retriever (--model) {}", model_name.display()))?;
        let model_hub = resolved.hub.is_some().then(|| resolved.record());
        if resolved.hub.is_some() {
            notices.push(format!("retriever: {}", resolved.describe()));
        }
        let model = resolved.path;
        let mut source_hub = None;
        if let Source::WhiteBox { model: source_model, .. } = &mut source {
            let name = source_model.clone();
            let resolved = (ctx.resolve)(&name, source_revision.as_deref()).with_context(|| format!("the white-box source (--source) {}", name.display()))?;
            if resolved.hub.is_some() {
                notices.push(format!("source: {}", resolved.describe()));
                source_hub = Some(resolved.record());
            }
            source_settings.insert("model".into(), json!(resolved.path));
            *source_model = resolved.path;
        }
        Ok(Config {
            source,
            source_settings,
            encoder,
            model,
            model_hub,
            source_hub,
            notices,
            encoder_settings,
            corpus: d.corpus,
            task_dir: d.task_dir,
            task: d.task,
            split: d.split,
            max_queries,
            aar,
            train,
            seed,
            device: flags.device,
            output_dir,
            overwrite: flags.overwrite,
            retry_failed: flags.retry_failed,
            compare_with: flags.compare_with,
        })
    }

    pub fn queries_file(&self) -> PathBuf {
        self.task_dir.join(&self.task).join(format!("queries.{}.jsonl", self.split))
    }

    pub fn qrels_file(&self) -> PathBuf {
        self.task_dir.join(&self.task).join(format!("qrels.{}.tsv", self.split))
    }

    /// How deep the starting retriever searches: the N to score and (AAR's mode) the negatives'
    /// pool.
    pub fn depth(&self) -> usize {
        if self.aar.replug() {
            self.aar.n
        } else {
            self.aar.n.max(self.aar.negatives_depth)
        }
    }

    /// What the source's scores depend on, for the score stage's key (`model_sha256`: a
    /// white-box source's checkpoint digest). A white-box source's device and dtype are in it:
    /// the same checkpoint scores differently on the CPU and on CUDA in bf16, so scores begun
    /// on one are never resumed on the other. A black-box source's connection settings are
    /// not: they decide how requests travel, not what the replies say.
    pub fn source_key(&self, model_sha256: Value) -> Value {
        let without = |keys: &[&str]| -> Value {
            Value::Object(self.source_settings.iter().filter(|(k, _)| !keys.contains(&k.as_str())).map(|(k, v)| (k.clone(), v.clone())).collect())
        };
        match &self.source {
            Source::WhiteBox { reader, prompt, batch_size, .. } => json!({
                "kind": "white-box", "reader": reader, "model_sha256": model_sha256, "prompt": prompt, "batch_size": batch_size,
                // As the reader reads them: the CPU and float32 when not given.
                "device": self.source_settings.get("device").and_then(Value::as_str).unwrap_or("cpu"),
                "dtype": if self.source_settings.get("bf16").and_then(Value::as_bool).unwrap_or(false) { "bf16" } else { "float32" },
                "settings": without(&["model", "device", "bf16"]),
            }),
            Source::BlackBox { connector, prompt, continuation, .. } => json!({
                "kind": "black-box", "connector": connector, "prompt": prompt, "continuation": continuation,
                "settings": without(&CONNECTION_SETTINGS),
            }),
        }
    }

    /// A white-box source key of a run made before device and dtype were in it (its `settings`
    /// then held `bf16` when given, never `device`), in today's shape, so that run's scores
    /// are not "other inputs": its dtype is what its settings said, its device the reader's
    /// default, the CPU. The device was not recorded then: scores such a run made on CUDA are
    /// taken as the CPU's (rerun it with --overwrite after changing a source setting to score
    /// them again). `None` for any other key.
    pub fn upgrade_source_key(old: &Value) -> Option<Value> {
        if old["kind"] != "white-box" || old.get("device").is_some() || old.get("dtype").is_some() {
            return None;
        }
        let mut new = old.clone();
        let bf16 = new.get_mut("settings")?.as_object_mut()?.remove("bf16");
        new["device"] = json!("cpu");
        new["dtype"] = json!(if bf16.and_then(|b| b.as_bool()).unwrap_or(false) { "bf16" } else { "float32" });
        Some(new)
    }

    /// Whether queries are encoded with their task's name (the trainer's `task_names`).
    pub fn task_names(&self) -> bool {
        self.train.get("task_names").and_then(Value::as_bool).unwrap_or(true)
    }

    /// The settings of the retriever's encoder for checkpoint `model`.
    pub fn encoder_settings_for(&self, model: &Path) -> Value {
        let mut s = self.encoder_settings.clone();
        s.insert("model".into(), json!(model));
        Value::Object(s)
    }
}

/// Connector settings that decide how requests travel, not what the replies say: left out of
/// the score stage's key (a server restarted on another port keeps its scores).
const CONNECTION_SETTINGS: [&str; 12] = [
    "base_url",
    "api_key_env",
    "timeout_s",
    "connect_timeout_s",
    "concurrency",
    "max_retries",
    "retry_budget_s",
    "backoff_base_s",
    "backoff_max_s",
    "cache",
    "cache_dir",
    "max_response_bytes",
];

/// Refuse placeholders a template does not know (a misspelt one would silently stay literal).
pub fn check_template(template: &str, known: &[&str], what: &str) -> Result<()> {
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        let after = &rest[open + 1..];
        let Some(close) = after.find('}') else { break };
        let name = &after[..close];
        if !known.contains(&name) {
            let names: Vec<String> = known.iter().map(|k| format!("{{{k}}}")).collect();
            bail!("{what} {template:?}: unknown placeholder {{{name}}} (known: {})", names.join(", "));
        }
        rest = &after[close + 1..];
    }
    Ok(())
}

/// Fill `{name}` placeholders in one pass (a value holding `{question}` stays as it is).
pub fn fill(template: &str, values: &[(&str, &str)]) -> String {
    let mut out = String::with_capacity(template.len() + 256);
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let after = &rest[open + 1..];
        match after.find('}').and_then(|close| values.iter().find(|(k, _)| *k == &after[..close]).map(|(_, v)| (close, v))) {
            Some((close, v)) => {
                out.push_str(v);
                rest = &after[close + 1..];
            }
            None => {
                out.push('{');
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flags(args: &[&str]) -> Flags {
        match Flags::parse(&args.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap() {
            Parsed::Run(f) => *f,
            Parsed::Help => panic!("help"),
        }
    }

    /// Names taken as folders as they are (the models are not read here).
    fn as_given(name: &Path, _: Option<&str>) -> Result<rak_hub::Resolved> {
        Ok(rak_hub::Resolved { path: name.to_path_buf(), hub: None })
    }

    fn ctx() -> Checks<'static> {
        let plugins = [("encoder", "dpr"), ("reader", "fid"), ("connector", "openai")].iter().map(|(k, n)| (k.to_string(), n.to_string())).collect();
        let cache = std::env::temp_dir().join("aar-config-no-hf-cache");
        let hub = rak_hub::HubEnv { cache, cache_from: "test".into(), endpoint: "http://127.0.0.1:9".into(), offline: true, token: None };
        Checks { plugins, hub: Some(hub), resolve: &as_given }
    }

    fn recipe(extra: &str) -> Recipe {
        toml::from_str(&format!("[data]\ncorpus = \"c.jsonl\"\ntask_dir = \"t\"\ntask = \"squad\"\n{extra}")).unwrap()
    }

    #[test]
    fn templates_fill_once_and_refuse_unknown_placeholders() {
        assert_eq!(fill("{title}: {passage} Q: {question}", &[("title", "T"), ("passage", "{question}"), ("question", "q")]), "T: {question} Q: q");
        assert!(check_template("{passage} {questoin}", &["passage", "question"], "t").unwrap_err().to_string().contains("{questoin}"));
        check_template("{passage} {question}", &["passage", "question"], "t").unwrap();
    }

    #[test]
    fn flags_override_the_recipe_and_aar_sets_the_trainer() {
        let f = flags(&["--source", "openai", "--encoder", "dpr", "--model", "m", "--output-dir", "o", "--seed", "7", "--base-url", "http://x:1", "--max-queries=5"]);
        let c = Config::from_recipe(recipe("[source]\nsettings = { base_url = \"http://y\" }\n[train]\nseed = 3\n"), f, Path::new("r.toml"), &ctx()).unwrap();
        assert_eq!(c.seed, 7);
        assert_eq!(c.train["seed"], 7);
        assert_eq!(c.train["loss"], "multi_positive");
        assert_eq!(c.train["hard_negatives"], 7);
        assert_eq!(c.source_settings["base_url"], "http://x:1");
        assert_eq!(c.max_queries, Some(5));
        assert!(matches!(c.source, Source::BlackBox { ref connector, .. } if connector == "openai"));
        // REPLUG's mode: its loss, no hard negatives, β left to the recipe (the trainer's 0.1).
        let f = flags(&["--source", "openai", "--encoder", "dpr", "--model", "m", "--output-dir", "o"]);
        let c = Config::from_recipe(recipe("[aar]\nmode = \"replug\"\n[train]\nlm_temperature = 0.5\nscore_scale = 20.0\n"), f, Path::new("r.toml"), &ctx()).unwrap();
        assert_eq!((c.train["loss"].as_str(), c.train["hard_negatives"].as_u64()), (Some("lm_supervised"), Some(0)));
        assert_eq!(c.train["lm_temperature"], 0.5);
    }

    #[test]
    fn contradictions_are_refused() {
        let f = || flags(&["--source", "openai", "--encoder", "dpr", "--model", "m", "--output-dir", "o"]);
        for (extra, needle) in [
            ("[aar]\nmode = \"replug\"\nk = 0\n", "asks no source"),
            ("[aar]\nmode = \"rplug\"\n", "\"replug\""),
            ("[train]\nlm_temperature = 0.5\n", "REPLUG"),
            ("[aar]\nmode = \"replug\"\n[train]\nloss = \"multi_positive\"\nscore_scale = 20.0\n", "lm_supervised"),
            ("[aar]\nmode = \"replug\"\n", "score_scale"),
            ("[aar]\nmode = \"replug\"\nn = 1\nk = 1\n[train]\nscore_scale = 20.0\n", "at least 2"),
            ("[train]\nloss = \"nce\"\n", "multi_positive"),
            ("[aar]\nk = 11\n", "aar.k"),
            ("[source]\ntemplate = \"{question}\"\n", "{passage}"),
            ("[aar]\npositives = \"top_k\"\n", "aar.positives"),
        ] {
            let e = Config::from_recipe(recipe(extra), f(), Path::new("r.toml"), &ctx()).unwrap_err().to_string();
            assert!(e.contains(needle), "{e}");
        }
    }

    /// A white-box source's scores are keyed on its device and dtype (CPU and CUDA bf16 scores
    /// differ); the reader's defaults (cpu, float32) key as if given.
    #[test]
    fn the_white_box_score_key_holds_the_device_and_dtype() {
        let dir = std::env::temp_dir().join(format!("aar-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let key = |extra: &[&str], settings: &str| {
            let mut args = vec!["--source", dir.to_str().unwrap(), "--encoder", "dpr", "--model", "m", "--output-dir", "o"];
            args.extend_from_slice(extra);
            let c = Config::from_recipe(recipe(&format!("[source]\nsettings = {{ {settings} }}\n")), flags(&args), Path::new("r.toml"), &ctx()).unwrap();
            c.source_key(json!("sha"))
        };
        let cpu = key(&[], "");
        assert_eq!((cpu["device"].as_str(), cpu["dtype"].as_str()), (Some("cpu"), Some("float32")), "{cpu}");
        assert_eq!(key(&["--device", "cpu"], ""), cpu);
        let cuda = key(&["--device", "cuda"], "");
        assert_ne!(cuda, cpu);
        assert_eq!(cuda["device"], "cuda");
        let bf16 = key(&["--device", "cuda"], "bf16 = true");
        assert_ne!(bf16, cuda);
        assert_eq!(bf16["dtype"], "bf16");
        // An older run's key (no device, dtype; bf16 among the settings) is today's on the
        // defaults: the CPU, and the dtype its settings said.
        let old = |new: &Value| {
            let mut old = new.clone();
            let o = old.as_object_mut().unwrap();
            o.remove("device");
            let dtype = o.remove("dtype").unwrap();
            if dtype == "bf16" {
                old["settings"]["bf16"] = json!(true);
            }
            old
        };
        assert_eq!(Config::upgrade_source_key(&old(&cpu)), Some(cpu.clone()));
        let cpu_bf16 = key(&[], "bf16 = true");
        assert_eq!(Config::upgrade_source_key(&old(&cpu_bf16)), Some(cpu_bf16.clone()));
        assert_ne!(Config::upgrade_source_key(&old(&cuda)), Some(cuda.clone()));
        // Today's keys, and black-box ones, are left as they are.
        assert_eq!(Config::upgrade_source_key(&cpu), None);
        assert_eq!(Config::upgrade_source_key(&json!({"kind": "black-box", "settings": {}})), None);
        assert_eq!(Config::upgrade_source_key(&json!([1])), None);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The recipe's revisions go with the recipe's models only: `--source` and `--model` are
    /// resolved at no revision (a folder takes none; a Hub id its main), with a notice that
    /// the recipe's revision was left out; the recipe's own models at their revisions.
    #[test]
    fn the_recipe_s_revisions_are_for_the_recipe_s_models_only() {
        let asked = std::cell::RefCell::new(Vec::new());
        let record = |name: &Path, revision: Option<&str>| -> Result<rak_hub::Resolved> {
            asked.borrow_mut().push((name.display().to_string(), revision.map(String::from)));
            if revision.is_some() && name.is_dir() {
                bail!("revision {revision:?} is for a Hugging Face Hub model; {} is a local folder", name.display());
            }
            Ok(rak_hub::Resolved { path: name.to_path_buf(), hub: None })
        };
        let checks = Checks { resolve: &record, ..ctx() };
        let dir = std::env::temp_dir().join(format!("aar-config-revision-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let pinned = "[source]\nkind = \"white-box\"\nmodel = \"google/flan-t5-base\"\nrevision = \"0123456789abcdef0123456789abcdef01234567\"\n\
                      [model]\npath = \"org/retriever\"\nrevision = \"v1.0\"\n";
        let run = |args: &[&str]| {
            asked.borrow_mut().clear();
            let all = [&["--encoder", "dpr", "--output-dir", "o"][..], args].concat();
            let c = Config::from_recipe(recipe(pinned), flags(&all), Path::new("r.toml"), &checks);
            (c, asked.borrow().clone())
        };
        let own = |n: &str, r: Option<&str>| (n.to_string(), r.map(String::from));
        // The recipe's own models: at the recipe's revisions.
        let (c, got) = run(&[]);
        c.unwrap();
        assert_eq!(got, vec![own("org/retriever", Some("v1.0")), own("google/flan-t5-base", Some("0123456789abcdef0123456789abcdef01234567"))]);
        // A folder and another Hub id on the command line: no revision, and a notice.
        let d = dir.to_str().unwrap();
        let (c, got) = run(&["--source", d, "--model", d]);
        let c = c.unwrap();
        assert_eq!(got, vec![own(d, None), own(d, None)]);
        assert!(c.notices.iter().any(|n| n.contains("source.revision") && n.contains("left out")), "{:?}", c.notices);
        assert!(c.notices.iter().any(|n| n.contains("model.revision") && n.contains("left out")), "{:?}", c.notices);
        let (c, got) = run(&["--source", "google/flan-t5-large", "--model", "org/other"]);
        c.unwrap();
        assert_eq!(got, vec![own("org/other", None), own("google/flan-t5-large", None)]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// `--source` decides the kind whatever the recipe's: a folder or a model name is
    /// white-box (the recipe's black-box settings left out, with a notice), a connector's name
    /// black-box; anything else, and plugins the host lacks, are refused before any work.
    #[test]
    fn the_source_flag_decides_the_kind_and_everything_is_checked_first() {
        let dir = std::env::temp_dir().join(format!("aar-config-source-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let black = "[source]\nkind = \"black-box\"\nconnector = \"openai\"\nsettings = { base_url = \"http://x\" }\ntemplate = \"{passage} {question}\"\nworkers = 2\n";
        let run = |source: &str, extra: &str| Config::from_recipe(recipe(extra), flags(&["--source", source, "--encoder", "dpr", "--model", "m", "--output-dir", "o"]), Path::new("r.toml"), &ctx());
        let c = run(dir.to_str().unwrap(), black).unwrap();
        assert!(matches!(c.source, Source::WhiteBox { ref reader, ref model, .. } if reader == "fid" && model == &dir), "{:?}", c.source);
        assert!(c.source_settings.get("base_url").is_none(), "{:?}", c.source_settings);
        assert!(c.notices.iter().any(|n| n.contains("left out") && n.contains("source.template")), "{:?}", c.notices);
        // A Hub id and a known name are white-box too (resolved by the context's resolver).
        for name in ["google/flan-t5-base", "flan-t5-base"] {
            let c = run(name, black).unwrap();
            assert!(matches!(c.source, Source::WhiteBox { ref model, .. } if model == Path::new(name)), "{name}: {:?}", c.source);
        }
        // A connector's name is black-box under a white-box recipe; its reader settings go.
        let white = format!("[source]\nkind = \"white-box\"\nmodel = {:?}\nbatch_size = 4\nsettings = {{ max_length = 0 }}\n", dir.to_str().unwrap());
        let c = run("openai", &white).unwrap();
        assert!(matches!(c.source, Source::BlackBox { ref connector, .. } if connector == "openai"));
        assert!(c.source_settings.is_empty(), "{:?}", c.source_settings);
        for (source, extra, needle) in [
            ("openia", "", "no connector plugin of that name (the host has: openai)"),
            ("openia", "", "no model name this toolkit knows"),
            ("fid", "", "a reader plugin"),
            ("./no/such", "", "no such folder"),
        ] {
            let e = run(source, extra).unwrap_err().to_string();
            assert!(e.contains(needle), "{source}: {e}");
        }
        let e = Config::from_recipe(recipe(""), flags(&["--source", "openai", "--encoder", "dpx", "--model", "m", "--output-dir", "o"]), Path::new("r.toml"), &ctx()).unwrap_err().to_string();
        assert!(e.contains("no encoder plugin named \"dpx\""), "{e}");
        let e = run(dir.to_str().unwrap(), "[source]\nreader = \"fud\"\n").unwrap_err().to_string();
        assert!(e.contains("no reader plugin named \"fud\""), "{e}");
        let e = run("openai", "[source]\nconnector = \"x\"\n");
        assert!(e.is_ok(), "--source names the connector; the recipe's is not asked for");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
