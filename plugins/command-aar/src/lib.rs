//! `host aar-train`: an augmentation-adapted retriever (AAR, REFERENCE §6), trained on the
//! passages a source LM prefers, done entirely through the host's services (encoders,
//! `encode_corpus`, `build_index`, `search`, readers, connectors, `train`), as a third party's
//! command would.
//!
//! ```text
//! host aar-train --source MODEL|openai --encoder E --model MODEL --config FILE.toml --output-dir OUT
//!     [--max-queries N] [--base-url URL] [--seed N] [--device D] [--overwrite] [--retry-failed]
//! ```
//!
//! Stages, each persisted under `OUT/stages/` ([`stages`]): a rerun skips the finished ones and
//! resumes the first unfinished one, so a kill anywhere loses nothing; the stages after a
//! resumed or redone one are redone. `--retry-failed` asks the source again for the items a
//! finished score stage recorded as failed, then redoes the stages after it. Each stage's key
//! holds what its output depends on; the score stage's is what it scores by content (each
//! query's top N and answers, the corpus, the source), so a deeper retrieval for more
//! negatives keeps the scores. The retriever's device is in no key (a run begun on the CPU may
//! resume its training on CUDA); a white-box source's device and dtype are in the score key
//! (the same checkpoint scores differently on the CPU and on CUDA in bf16), so scores begun on
//! one device are not resumed on another: refused as other inputs, or redone with --overwrite.
//! A white-box run from before they were there keeps its stages when it ran on today's
//! defaults: its recorded keys, the score key inside the later stages' ones included, are
//! upgraded (`score::keep_older_white_box_scores`).
//! 1. `retrieve` ([`retrieve`]): the source task's queries with gold; the starting retriever's
//!    top `max(N, negatives_depth)` for each (top N in REPLUG's mode, which has no negatives).
//! 2. `score` ([`score`]): the source LM scores the top N: white-box (`--source MODEL`, the `fid`
//!    reader's cross-attention `passage_preferences`) or black-box (`--source openai`, the
//!    connector's `continuation_logprob` of the gold answer).
//! 3. `select` ([`select`]): positives = gold ∪ the LM-preferred passages that are not gold: by
//!    default the authors' rule (`aar.positives = "authors"`: the LM's top K, gold or not, less
//!    the gold), or the top K among the non-gold passages (`"top_k_non_gold"`); optionally only
//!    queries with exactly three (`aar.exactly_three`, the authors' filter); negatives = the
//!    retriever's top `negatives_depth` minus the positives, `negatives_sampled` drawn with a
//!    seed derived from (seed, "aar-negatives"). Then `OUT/analysis.json` (LM-preferred vs
//!    human positives, the authors' overlap among them), redone on every run. With
//!    K > 0, queries the source scored nothing of (every item failed, or no answer) are
//!    dropped, never trained on gold only, and counted (`queries_without_scores`).
//!    With `aar.mode = "replug"` (REPLUG's LM-supervised retrieval, REFERENCE §6's end) each
//!    example carries its scored passages and their log-likelihoods instead (queries with fewer
//!    than two scored are dropped and counted the same way); the analysis is the same, and K,
//!    which only it reads, is in no key.
//! 4. `train`: the host's `train` service on those examples, `loss = "multi_positive"` (or
//!    `"lm_supervised"`, the KL of REPLUG, in its mode), in `OUT/stages/train` (resumed from
//!    its checkpoints). The `[model]` setting `bf16` (bf16 weights, which the retrieve stage
//!    may encode with) is left out of the training recipe, with a notice: training keeps
//!    float32 weights, and the train service refuses bf16 ones.
//! 5. `final`: the trained model saved into `OUT` itself, which `host search --model OUT` and
//!    `host augment --encoder-model OUT` use directly: saved under `stages/final/model/`, then
//!    moved in over the last final stage's entries only (recorded in `stages/model_files.json`),
//!    which stay until then.
//!
//! `OUT` must be new, empty or an `aar-train` run's folder, and must not be, hold or lie inside
//! `--model` or a white-box `--source` (checked before any work; [`stages::check_output_dir`]).
//! Started as one of several processes (torchrun's `WORLD_SIZE` > 1) it refuses to run.
//!
//! The summary (queries, scored, failed, queries without scores, positives added, the authors'
//! overlap and the LM picks' gold share, the scoring session's passages per second) is printed
//! on stdout as JSON and kept in `OUT/stages/summary.json`.
//!
//! `OUT` is also a model folder (`host encode --model OUT`), so everything else the run keeps
//! lives under `OUT/stages/`: the host's checkpoint digest leaves out a subfolder that holds an
//! `analysis.json`, so the run writes one there too, and rewriting the summary or the
//! lock on a rerun never changes the model's identity (embeddings made from it stay valid).
//!
//! REPLUG's mode differs from its paper in two ways. The paper retrieves each query's passages
//! again from an index whose embeddings it refreshes now and then as the retriever changes; here
//! the passages D′ are the starting retriever's top N, scored once (so the LM is asked once).
//! And the trainer encodes them afresh every step with the shared encoder, which also learns
//! (as in AAR's mode).

mod config;
mod data;
mod retrieve;
mod score;
mod select;
mod stages;

use anyhow::{bail, Context, Result};
use config::{Config, Flags, Parsed, Source};
use rak_core::plugin::{Command, Encoder, Host};
use serde_json::{json, Value};
use stages::{RunLock, Stages, Start};
use std::path::Path;

pub struct AarTrain;

impl Command for AarTrain {
    const NAME: &'static str = "aar-train";
    const ABOUT: &'static str = "Train an augmentation-adapted retriever (AAR) on the passages a source LM prefers";

    fn settings_schema() -> Value {
        config::schema()
    }

    fn run(args: &[String], host: &Host) -> Result<i32> {
        let flags = match Flags::parse(args)? {
            Parsed::Help => {
                eprintln!("{}", config::USAGE);
                return Ok(0);
            }
            Parsed::Run(f) => *f,
        };
        refuse_under_torchrun()?;
        let cfg = resolve_config(flags, host)?;
        let summary = train(&cfg, host)?;
        println!("{}", serde_json::to_string_pretty(&summary)?);
        Ok(0)
    }
}

rak_core::export_command!(AarTrain);

/// The flags and the recipe, checked before any work against the host's plugins, with every
/// model's name resolved (a folder, a Hugging Face Hub id or a known name: `rak_hub`).
fn resolve_config(flags: Flags, host: &Host) -> Result<Config> {
    let plugins = host
        .call("plugins", json!({}))?
        .as_array()
        .context("the host's plugins service answered no list")?
        .iter()
        .filter_map(|p| Some((p["kind"].as_str()?.to_string(), p["name"].as_str()?.to_string())))
        .collect();
    // Without Hub settings (no HOME), folders still resolve; any other name says why not.
    let hub = rak_hub::HubEnv::from_env();
    let resolve = |name: &Path, revision: Option<&str>| -> Result<rak_hub::Resolved> {
        let r = match &hub {
            Ok(env) => rak_hub::resolve_in(name, revision, env)?,
            Err(_) if revision.is_none() && name.is_dir() => rak_hub::Resolved { path: name.to_path_buf(), hub: None },
            Err(e) => bail!("{}: {e}", name.display()),
        };
        for note in r.hub.iter().flat_map(|h| &h.notes) {
            host.log(&format!("aar-train: note: {note}"))?;
        }
        Ok(r)
    };
    let ctx = config::Checks { plugins, hub: hub.as_ref().ok().cloned(), resolve: &resolve };
    let cfg = Config::resolve(flags, &ctx)?;
    for notice in &cfg.notices {
        host.log(&format!("aar-train: {notice}"))?;
    }
    Ok(cfg)
}

/// `host aar-train` is one process: started by torchrun (or `--nproc`) as one of several, each
/// copy would run every stage into the same folder at once. Refused before anything is read.
fn refuse_under_torchrun() -> Result<()> {
    check_world_size(std::env::var("WORLD_SIZE").ok(), std::env::var("RANK").ok())
}

/// [`refuse_under_torchrun`]'s check of `WORLD_SIZE` and `RANK` (`None`: unset).
fn check_world_size(world: Option<String>, rank: Option<String>) -> Result<()> {
    // Empty is unset, as `Rendezvous::from_env` (the training's own reading) takes it.
    let (world, rank) = (world.filter(|v| !v.is_empty()), rank.filter(|v| !v.is_empty()));
    if let Some(world) = world {
        match world.trim().parse::<u64>() {
            Ok(n) if n > 1 => bail!(
                "host aar-train runs as one process, but WORLD_SIZE={n} (RANK={}) says it was started as one of {n} (torchrun, --nproc): \
                 the copies would all run every stage into one output folder. Run it once, without torchrun; its training runs in this one process",
                rank.unwrap_or_else(|| "unset".into())
            ),
            Ok(_) => {}
            Err(_) => bail!("WORLD_SIZE={world:?}: not a number (host aar-train runs as one process; unset it)"),
        }
    }
    Ok(())
}

/// The whole run; the summary.
fn train(cfg: &Config, host: &Host) -> Result<Value> {
    let out = &cfg.output_dir;
    // Before anything is written: the output folder is the run's own (see `stages`).
    let mut inputs = vec![("--model", cfg.model.as_path())];
    if let Source::WhiteBox { model, .. } = &cfg.source {
        inputs.push(("--source", model.as_path()));
    }
    stages::check_output_dir(out, &inputs)?;
    let stages_dir = out.join("stages");
    std::fs::create_dir_all(&stages_dir).with_context(|| format!("{}: cannot create", stages_dir.display()))?;
    let _lock = RunLock::take(&stages_dir.join("lock"))?;
    let stages = Stages::new(stages_dir, cfg.overwrite)?;
    let (source_kind, source_name) = match &cfg.source {
        Source::WhiteBox { reader, model, .. } => ("white-box", format!("{reader}:{}", model.display())),
        Source::BlackBox { connector, .. } => ("black-box", connector.clone()),
    };
    host.log(&format!("aar-train: source {source_kind} {source_name}; retriever {} from {}; task {} ({})", cfg.encoder, cfg.model.display(), cfg.task, cfg.split))?;

    // Keys: everything each stage's output depends on, by content, each including the last.
    let retrieve_key = json!({
        "encoder": cfg.encoder,
        "encoder_settings": without(&cfg.encoder_settings, &["device"]),
        "model_sha256": model_digest(host, &cfg.model)?,
        "corpus_sha256": data::file_sha256(&cfg.corpus)?,
        "queries_sha256": data::file_sha256(&cfg.queries_file())?,
        "qrels_sha256": data::file_sha256(&cfg.qrels_file())?,
        "task": cfg.task,
        "split": cfg.split,
        "task_names": cfg.task_names(),
        "max_queries": cfg.max_queries,
        "depth": cfg.depth(),
    });
    let source_model_sha256 = match &cfg.source {
        Source::WhiteBox { model, .. } => model_digest(host, model)?,
        Source::BlackBox { .. } => Value::Null,
    };
    let source_key = cfg.source_key(source_model_sha256);
    let a = &cfg.aar;

    let (queries, retrieve_report, retrieve_how) = retrieve::run(cfg, host, &stages, &retrieve_key)?;
    log_stage(host, "retrieve", retrieve_how)?;
    // The score stage's key is what it scores, by content (each query's text, answers and top
    // N, the passages' text), not how the retrieval was asked for: a deeper retrieval for more
    // negatives keeps the scores.
    let score_key = json!({
        "top_n_sha256": data::top_n_sha256(&queries, a.n), "corpus_sha256": retrieve_key["corpus_sha256"], "n": a.n,
        "passage_chars": a.passage_chars, "asked": a.k > 0, "source": if a.k > 0 { source_key } else { Value::Null },
    });
    let select_key = if a.replug() {
        // No negatives in this mode, and no K: it only sets the analysis, which is redone on
        // every run and kept in no stage.
        json!({"retrieve": retrieve_key, "score": score_key, "seed": cfg.seed, "mode": "replug"})
    } else {
        json!({
            "retrieve": retrieve_key, "score": score_key, "k": a.k, "positives": a.positives, "exactly_three": a.exactly_three,
            "negatives_depth": a.negatives_depth, "negatives_sampled": a.negatives_sampled, "negatives_per_query": a.negatives_per_query, "seed": cfg.seed,
        })
    };
    // The retriever's device is no part of any key (as in the host's own identities): a run
    // begun on the CPU may resume its training on CUDA. A white-box source's device and dtype
    // are in the score key (see the module docs).
    let train_key = json!({"select": select_key, "train": cfg.train});
    let final_key = json!({"train": train_key});
    score::keep_older_white_box_scores(&stages, &[("score", &score_key), ("select", &select_key), ("train", &train_key), ("final", &final_key)])?;
    let (scores, score_report, score_how) = score::run(cfg, host, &stages, &score_key, &queries)?;
    log_stage(host, "score", score_how)?;
    // Before the long stages, so a run that cannot be compared says so early.
    let sources_overlap = compare_sources(cfg, &queries, &scores)?;
    let (examples, select_report, select_how) = select_stage(cfg, host, &stages, &select_key, &queries, &scores)?;
    log_stage(host, "select", select_how)?;
    let analysis = write_analysis(cfg, &stages, &queries, &scores, &select_report)?;
    let (train_report, train_how) = train_stage(cfg, host, &stages, &train_key, examples)?;
    log_stage(host, "train", train_how)?;
    let final_how = final_stage(cfg, host, &stages, &final_key)?;
    log_stage(host, "final", final_how)?;
    if !cfg.compare_with.is_empty() {
        rak_core::fsutil::write_bytes(&stages.file("sources_overlap.json"), serde_json::to_string_pretty(&sources_overlap)?.as_bytes())?;
    }

    let mut source_record = json!({"kind": source_kind, "name": source_name});
    if let Some(hub) = &cfg.source_hub {
        source_record["hub"] = hub.clone();
    }
    let summary = json!({
        "output_dir": out,
        "source": source_record,
        "retriever": {"encoder": cfg.encoder, "model": cfg.model, "hub": cfg.model_hub},
        "queries": retrieve_report["queries"],
        "queries_read": retrieve_report["queries_read"],
        "dropped_without_gold": retrieve_report["dropped_without_gold"].as_u64().unwrap_or(0) + retrieve_report["dropped_gold_not_in_corpus"].as_u64().unwrap_or(0),
        "fewer_than_n_retrieved": retrieve_report["fewer_than_n_retrieved"],
        "scored": score_report["scored"].as_u64().unwrap_or(0),
        "failed": score_report["failed"].as_u64().unwrap_or(0),
        "skipped_without_answer": score_report["skipped_without_answer"].as_u64().unwrap_or(0),
        // The score stage's last session: passages recorded and scored, seconds, scored per second.
        "scoring": score_report["this_session"],
        "positives_added": select_report["positives_added"],
        "examples": select_report["examples"],
        "dropped_not_exactly_three": select_report["dropped_not_exactly_three"],
        "dropped_without_negatives": select_report["dropped_without_negatives"],
        "queries_without_scores": select_report["queries_without_scores"].as_u64().unwrap_or(0),
        "dropped_fewer_than_two_scored": select_report["dropped_fewer_than_two_scored"].as_u64().unwrap_or(0),
        "overlap_authors": analysis["overlap_authors"],
        "lm_preferred_gold_share": analysis["lm_preferred_gold_share"],
        "sources_overlap": sources_overlap,
        "train": {"steps": train_report["steps"], "output_dir": train_report["output_dir"]},
        "stages": {"retrieve": retrieve_how, "score": score_how, "select": select_how, "train": train_how, "final": final_how},
        "model": out,
    });
    rak_core::fsutil::write_bytes(&stages.file("summary.json"), serde_json::to_string_pretty(&summary)?.as_bytes())?;
    let short = retrieve_report["fewer_than_n_retrieved"].as_u64().unwrap_or(0);
    if short > 0 {
        host.log(&format!(
            "aar-train: {short} queries have fewer than N = {} retrieved passages (the corpus has {}); they were scored on what there is",
            a.n, retrieve_report["corpus_passages"]
        ))?;
    }
    if summary["failed"].as_u64().unwrap_or(0) > 0 {
        host.log(&format!(
            "aar-train: {} of the source's items failed and were skipped (their passages are left out of the LM's preferences); see {}",
            summary["failed"],
            stages.folder("score").join("scores.jsonl").display()
        ))?;
    }
    Ok(summary)
}

/// Item 5's second analysis: for each `--compare-with` run, how often this run's top K
/// LM-preferred passages are also the other source's top K. Both rank only the passages both
/// scored (a failure is no disagreement), on the queries both scored over the same top N; every
/// query is counted in one of the counts.
fn compare_sources(cfg: &Config, queries: &[data::Retrieved], scores: &std::collections::HashMap<String, score::Scores>) -> Result<Value> {
    let mut out = Vec::new();
    for other in &cfg.compare_with {
        let (theirs, finished) = score::load_run(other)?;
        let source = std::fs::read_to_string(other.join("stages/summary.json")).ok().and_then(|t| serde_json::from_str::<Value>(&t).ok()).map(|s| s["source"].clone());
        let (mut compared, mut not_in_other, mut other_passages, mut unscored, mut shared, mut picked) = (0usize, 0usize, 0usize, 0usize, 0usize, 0usize);
        for q in queries {
            let Some(b) = theirs.get(&q.id) else {
                not_in_other += 1;
                continue;
            };
            let a = scores.get(&q.id);
            if a.is_some_and(|a| a.passages != b.passages) {
                other_passages += 1;
                continue;
            }
            // Each side over the passages both scored.
            let both = |x: &[Option<f64>], y: &[Option<f64>]| -> Vec<Option<f64>> { x.iter().zip(y).map(|(x, y)| y.and(*x)).collect() };
            // Scored as the selection counts it: a NaN is no score.
            let scored = |v: &Option<f64>| v.is_some_and(f64::is_finite);
            let Some(a) = a.filter(|a| a.scores.iter().zip(&b.scores).any(|(x, y)| scored(x) && scored(y))) else {
                unscored += 1;
                continue;
            };
            let (s, n) = select::shared_top_k(&both(&a.scores, &b.scores), &both(&b.scores, &a.scores), cfg.aar.k);
            compared += 1;
            shared += s;
            picked += n;
        }
        out.push(json!({
            "run": other, "source": source, "k": cfg.aar.k, "other_score_stage_finished": finished,
            "queries_compared": compared, "queries_not_in_other": not_in_other, "queries_with_other_passages": other_passages,
            "queries_not_scored_by_both": unscored,
            "overlap": if picked == 0 { Value::Null } else { json!(shared as f64 / picked as f64) },
            "overlap_help": "share of this run's top K LM-preferred passages that are also the other source's top K, both ranking only the passages both scored, over the queries both scored on the same top N",
        }));
        if cfg.aar.k >= cfg.aar.n {
            out.last_mut().expect("pushed")["note"] = json!("K >= N: every scored passage is in both top K, so the overlap is 1 by construction");
        }
    }
    Ok(Value::Array(out))
}

/// A model folder's identity by the host's checkpoint-digest rules: its model files, whatever
/// its path, not its run's records (an AAR output's `stages/`, checkpoints, logs).
fn model_digest(host: &Host, dir: &std::path::Path) -> Result<Value> {
    Ok(host.call("checkpoint_digest", json!({"path": dir}))?["sha256"].clone())
}

fn log_stage(host: &Host, name: &str, how: &str) -> Result<()> {
    host.log(&format!("aar-train: stage {name}: {how}"))
}

fn without(settings: &serde_json::Map<String, Value>, keys: &[&str]) -> Value {
    Value::Object(settings.iter().filter(|(k, _)| !keys.contains(&k.as_str())).map(|(k, v)| (k.clone(), v.clone())).collect())
}

/// The analysis of LM vs human positives ([`select::analyse`]) with the select stage's counts,
/// into `OUT/analysis.json` and `OUT/stages/analysis.json` (where it also marks that folder as
/// no part of the model for the host's checkpoint digest: see the module docs). Redone on every
/// run from the scores, so it is in no stage's key (REPLUG's mode keeps K out of its keys).
fn write_analysis(
    cfg: &Config,
    stages: &Stages,
    queries: &[data::Retrieved],
    scores: &std::collections::HashMap<String, score::Scores>,
    select_report: &Value,
) -> Result<Value> {
    let a = &cfg.aar;
    let unscored: Vec<Vec<Option<f64>>> = queries.iter().map(|q| vec![None; q.top_n(a.n).len()]).collect();
    let scored = queries.iter().zip(&unscored).map(|(q, none)| {
        let top = q.top_n(a.n);
        let s = scores.get(&q.id).filter(|s| s.passages == top).map_or(none.as_slice(), |s| s.scores.as_slice());
        select::Scored { gold: &q.gold, top, scores: s }
    });
    let mut analysis = select::analyse(scored, a.k);
    let (examples, added) = (select_report["examples"].as_u64().unwrap_or(0), select_report["positives_added"].as_u64().unwrap_or(0));
    let extra = json!({
        "n": a.n,
        "mode": a.mode,
        "positives_rule": if a.replug() { Value::Null } else { json!(a.positives) },
        "positives_added": added,
        "positives_added_per_example": if examples == 0 { Value::Null } else { json!(added as f64 / examples as f64) },
        "examples": examples,
    });
    for (k, v) in extra.as_object().expect("an object") {
        analysis[k] = v.clone();
    }
    let text = serde_json::to_string_pretty(&analysis)?;
    rak_core::fsutil::write_bytes(&stages.file("analysis.json"), text.as_bytes())?;
    rak_core::fsutil::write_bytes(&cfg.output_dir.join("analysis.json"), text.as_bytes())?;
    Ok(analysis)
}

/// Stage (c): the training examples.
fn select_stage(
    cfg: &Config,
    host: &Host,
    stages: &Stages,
    key: &Value,
    queries: &[data::Retrieved],
    scores: &std::collections::HashMap<String, score::Scores>,
) -> Result<(Value, Value, &'static str)> {
    let file = stages.folder("select").join("examples.json");
    let how = match stages.begin("select", key)? {
        Start::Done(report) => {
            let text = std::fs::read_to_string(&file).with_context(|| format!("{}: cannot read", file.display()))?;
            let saved: Value = serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", file.display()))?;
            return Ok((saved["examples"].clone(), report, "done earlier"));
        }
        Start::Resume => "resumed",
        Start::Fresh => "ran",
    };
    let a = &cfg.aar;
    let bar = host.progress("aar: select", queries.len() as u64)?;
    let negatives_seed = select::named_stream(cfg.seed, &["aar-negatives"]).next_u64();
    let mut examples = Vec::new();
    let (mut added_total, mut not_three, mut no_negatives, mut without_scores, mut one_scored) = (0usize, 0usize, 0usize, 0usize, 0usize);
    for q in queries {
        let top = q.top_n(a.n);
        let s: Vec<Option<f64>> = match scores.get(&q.id) {
            Some(s) if s.passages == top => s.scores.clone(),
            Some(_) => bail!("the scores of query {:?} name other passages than its retrieval; rerun with --overwrite to redo the stages", q.id),
            None if a.k > 0 => bail!("query {:?} has no score record in {}; rerun with --retry-failed or --overwrite", q.id, stages.folder("score").display()),
            None => vec![None; top.len()],
        };
        // A query the source scored nothing of (every item failed, or no answer to score) would
        // be a gold-only example among LM-supervised ones: dropped, and counted. REPLUG's KL
        // over one passage is 0 whatever the retriever does: dropped too, and counted apart.
        let scored: Vec<(String, f64)> = top.iter().zip(&s).filter_map(|(p, s)| s.filter(|v| v.is_finite()).map(|v| (p.clone(), v))).collect();
        if a.k > 0 && scored.is_empty() {
            without_scores += 1;
            bar.inc(1)?;
            continue;
        }
        let sel = select::select_positives(&q.gold, top, &s, a.k, a.positives_rule());
        bar.inc(1)?;
        if a.replug() && scored.len() < 2 {
            one_scored += 1;
            continue;
        }
        if a.exactly_three && sel.positives.len() != 3 {
            not_three += 1;
            continue;
        }
        if a.replug() {
            // The retriever learns the LM's distribution over these; positives stay the gold
            // (the trainer wants one per example; this loss does not read them).
            examples.push(json!({
                "query_id": q.id, "query": q.query, "answers": q.answers, "positives": q.gold, "negatives": [],
                "lm_scores": scored, "gold": q.gold, "lm_preferred": sel.lm_top,
            }));
            continue;
        }
        let mut rng = select::named_stream(negatives_seed, &[&q.id]);
        let negatives = select::select_negatives(&q.hits, &sel.positives, a.negatives_depth, a.negatives_sampled, &mut rng);
        if a.negatives_per_query > 0 && negatives.is_empty() {
            no_negatives += 1;
            continue;
        }
        added_total += sel.added.len();
        examples.push(json!({
            "query_id": q.id, "query": q.query, "answers": q.answers, "positives": sel.positives, "negatives": negatives,
            "gold": q.gold, "lm_preferred": sel.added,
        }));
    }
    drop(bar);
    if not_three > 0 {
        host.log(&format!("aar-train: exactly_three: dropped {not_three} queries that do not end with exactly 3 positives"))?;
    }
    if without_scores > 0 {
        host.log(&format!("aar-train: dropped {without_scores} queries the source scored nothing of (every item failed, or no answer); --retry-failed asks the failed items again"))?;
    }
    if one_scored > 0 {
        host.log(&format!("aar-train: dropped {one_scored} queries the source scored only one passage of (REPLUG's KL needs two: failed items, non-finite scores or a corpus too small); --retry-failed asks failed items again"))?;
    }
    if no_negatives > 0 {
        host.log(&format!("aar-train: dropped {no_negatives} queries without a negative (every retrieved passage is a positive)"))?;
    }
    if examples.is_empty() {
        bail!(
            "no training example is left ({} queries: {without_scores} without LM scores, {one_scored} with one scored passage, {not_three} without exactly 3 positives, {no_negatives} without negatives)",
            queries.len()
        );
    }
    let saved = json!({"seed": cfg.seed, "negatives_seed": negatives_seed, "negatives_seed_from": "(seed, \"aar-negatives\"), then per query (negatives_seed, query_id)", "examples": examples});
    rak_core::fsutil::write_bytes(&file, serde_json::to_string(&saved)?.as_bytes())?;
    let report = json!({
        "examples": examples.len(),
        "positives_added": added_total,
        "dropped_not_exactly_three": not_three,
        "dropped_without_negatives": no_negatives,
        "queries_without_scores": without_scores,
        "dropped_fewer_than_two_scored": one_scored,
        "negatives_seed": negatives_seed,
    });
    stages.finish("select", &report)?;
    Ok((saved["examples"].clone(), report, how))
}

/// Stage (e): the host's train service on the selected examples.
fn train_stage(cfg: &Config, host: &Host, stages: &Stages, key: &Value, examples: Value) -> Result<(Value, &'static str)> {
    let folder = stages.folder("train");
    let how = match stages.begin("train", key)? {
        Start::Done(report) => return Ok((report, "done earlier")),
        Start::Resume => "resumed",
        Start::Fresh => "ran",
    };
    let given: Vec<Value> = examples
        .as_array()
        .context("examples")?
        .iter()
        .map(|e| {
            let mut given = json!({"query_id": e["query_id"], "query": e["query"], "positives": e["positives"], "negatives": e["negatives"], "answers": e["answers"]});
            if e.get("lm_scores").is_some() {
                given["lm_scores"] = e["lm_scores"].clone();
            }
            given
        })
        .collect();
    let earlier = has_checkpoint(&folder);
    let (settings, bf16_left_out) = training_settings(&cfg.encoder_settings);
    if bf16_left_out {
        host.log(
            "aar-train: train: the [model] setting bf16 (bf16 weights) is for encoding, as the retrieve stage did; \
             training keeps float32 weights, so it is left out of the training recipe",
        )?;
    }
    let mut request = json!({
        "recipe": {
            "model": {"encoder": cfg.encoder, "path": cfg.model, "settings": settings},
            "data": {"corpus": cfg.corpus, "task_dir": cfg.task_dir, "tasks": [cfg.task], "split": cfg.split},
            "train": cfg.train,
        },
        "output_dir": folder,
        "encoder": cfg.encoder,
        "model": cfg.model,
        "examples": [{"name": cfg.task, "examples": given}],
    });
    if let Some(d) = &cfg.device {
        request["device"] = json!(d);
    }
    if earlier {
        request["resume"] = json!("latest");
    } else {
        request["overwrite"] = json!(true);
    }
    let reply = host.train(request)?;
    stages.finish("train", &reply)?;
    Ok((reply, how))
}

/// The encoder settings the training recipe gets: `[model] settings` less `bf16`, and whether
/// it held one. That setting casts the weights themselves, fine for encoding the corpus but not
/// for training (bf16 weights and AdamW moments lose updates; the train service refuses it),
/// which would otherwise fail only after retrieve, score and select had run.
fn training_settings(settings: &serde_json::Map<String, Value>) -> (Value, bool) {
    (without(settings, &["bf16"]), settings.contains_key("bf16"))
}

fn has_checkpoint(dir: &Path) -> bool {
    std::fs::read_dir(dir).map(|d| d.flatten().any(|e| e.file_name().to_string_lossy().starts_with("checkpoint-") && e.path().is_dir())).unwrap_or(false)
}

/// Stage (f): the trained model, as its encoder saves it, into the output folder.
fn final_stage(cfg: &Config, host: &Host, stages: &Stages, key: &Value) -> Result<&'static str> {
    let how = match stages.begin("final", key)? {
        Start::Done(_) => return Ok("done earlier"),
        Start::Resume => "resumed",
        Start::Fresh => "ran",
    };
    let trained = stages.folder("train");
    // Loaded as it was trained, in float32: a `bf16` setting (for retrieval's encoding) would
    // cast the trained weights and save them in bf16.
    let (mut settings, _) = training_settings(&cfg.encoder_settings);
    settings["model"] = json!(trained);
    let encoder = host.encoder(&cfg.encoder, &settings)?;
    // Saved whole beside the stages first, then moved into OUT over the last model's entries
    // (which stay until then: a redo that fails leaves the last complete model).
    let saved = stages.folder("final").join("model");
    if saved.exists() {
        std::fs::remove_dir_all(&saved).with_context(|| format!("{}: cannot remove a killed save's leftovers", saved.display()))?;
    }
    std::fs::create_dir_all(&saved).with_context(|| format!("{}: cannot create", saved.display()))?;
    encoder.save(&saved)?;
    stages.install_model(&saved)?;
    stages.finish("final", &json!({"model": cfg.output_dir, "from": trained}))?;
    Ok(how)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `bf16` in `[model] settings` (encoding in bf16) stays out of the training recipe, which
    /// refuses it; the other settings go through.
    #[test]
    fn bf16_is_left_out_of_the_training_settings() {
        let settings = json!({"bf16": true, "max_length": 64, "device": "cuda"}).as_object().unwrap().clone();
        let (sent, left_out) = training_settings(&settings);
        assert!(left_out);
        assert_eq!(sent, json!({"max_length": 64, "device": "cuda"}));
        let (sent, left_out) = training_settings(json!({"max_length": 64}).as_object().unwrap());
        assert!(!left_out);
        assert_eq!(sent, json!({"max_length": 64}));
    }

    /// torchrun's WORLD_SIZE > 1 is refused; unset, empty (as the trainer's rendezvous reads
    /// it) or 1 is one process.
    #[test]
    fn world_size_empty_is_unset() {
        check_world_size(None, None).unwrap();
        check_world_size(Some(String::new()), Some(String::new())).unwrap();
        check_world_size(Some("1".into()), Some("0".into())).unwrap();
        let e = check_world_size(Some("2".into()), Some("1".into())).unwrap_err().to_string();
        assert!(e.contains("WORLD_SIZE=2") && e.contains("RANK=1"), "{e}");
        assert!(check_world_size(Some("two".into()), None).unwrap_err().to_string().contains("not a number"));
    }
}
