//! `host augment`: retrieve passages for each question, put them in a prompt, ask a target LM
//! (a connector plugin over HTTP, or a local reader plugin), and measure accuracy.
//!
//! Results stream to `--output` (JSONL, one line per item as it finishes, see
//! `crate::augment::results`); a rerun asks only for what is missing, and a second run on the
//! same output is refused while the first goes. The summary on stdout is JSON: `accuracy`
//! counts failed items wrong (the headline), `accuracy_answered` leaves them out; the exit
//! code is 0 when every item was answered and 3 when some failed (their error records say
//! why; rerunning asks them again). Accuracy covers the questions of this invocation (the
//! output may hold records of others: a larger `--limit` before), kept or asked; the request
//! counts (`target_stats`) and `timing` cover this invocation only, and
//! `timing.kept_from_earlier_runs` says how many answers a resumed run found already written.
//! A target whose server goes away stops the run (exit 1) once every worker's last item found
//! no server, the answers so far kept.

use super::encode::{encoder_settings, resolve_model, ModelArgs};
use crate::augment::config::{AugmentConfig, Task, TaskPrompts};
use crate::augment::results::{OutputLock, Results};
use crate::augment::{self, ask_connector, ask_reader, render_demos, Passage, Prepared, Probe};
use crate::registry::Registry;
use anyhow::{bail, Context, Result};
use rak_core::plugin::Connector;
use rak_retrieval::data::{beir, probes, Query, Run};
use rak_retrieval::index::{self, Index};
use rak_retrieval::pipeline::search::{search_queries, SearchOptions};
use rak_retrieval::pipeline::Quiet;
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;

/// The exit code of a run that finished with some items unanswered.
pub const SOME_FAILED: u8 = 3;

#[derive(Debug, Clone, clap::Args)]
pub struct AugmentArgs {
    /// The target LM: a connector plugin (`openai`) or a local reader plugin (`fid`).
    #[arg(long)]
    pub target: Option<String>,
    /// The recipe (TOML): target settings, retrieval, prompt templates.
    #[arg(long)]
    pub config: PathBuf,
    /// `mc` (multiple choice) or `shortqa` (short answers).
    #[arg(long)]
    pub task: String,
    /// The questions (mini-KILT `mc/*.jsonl` or `shortqa/*.jsonl`).
    #[arg(long)]
    pub input: PathBuf,
    /// Where the records go (JSONL); an existing file is resumed.
    #[arg(long)]
    pub output: PathBuf,
    /// The server's base URL (connector targets).
    #[arg(long)]
    pub base_url: Option<String>,
    /// The model: a name for connectors, a checkpoint directory for readers.
    #[arg(long)]
    pub model: Option<String>,
    /// Passages per question.
    #[arg(long)]
    pub k: Option<usize>,
    /// `none` (closed book), `bm25:INDEX_DIR`, `dense:INDEX_DIR` or `run:TREC_FILE` (a fixed
    /// ranking of the questions' ids, e.g. another system's: no index or model needed; its top
    /// k by the rank column, whose scores must not rise along it).
    #[arg(long)]
    pub retriever: Option<String>,
    /// Encoder plugin for a dense retriever.
    #[arg(long)]
    pub encoder: Option<String>,
    /// Encoder checkpoint for a dense retriever: a folder, a Hugging Face Hub id or a known bare name.
    #[arg(long)]
    pub encoder_model: Option<PathBuf>,
    /// The corpus passages are read from.
    #[arg(long)]
    pub corpus: Option<PathBuf>,
    /// Items asked at once (connector targets).
    #[arg(long)]
    pub workers: Option<usize>,
    /// Only the first N questions.
    #[arg(long)]
    pub limit: Option<usize>,
    /// Start the output afresh instead of resuming it.
    #[arg(long)]
    pub overwrite: bool,
    /// `cpu`, `cuda` or `cuda:N`, for the encoder and a local reader.
    #[arg(long, default_value = "cpu")]
    pub device: String,
}

enum Target {
    Connector(Box<dyn Connector>),
    Reader(Box<dyn rak_core::plugin::Reader>),
}

pub fn run(registry: &Registry, args: &AugmentArgs) -> Result<(Value, bool)> {
    let cfg = AugmentConfig::read(&args.config)?;
    let task = Task::parse(&args.task)?;
    let prompts = TaskPrompts::new(&cfg, task)?;
    // Before any work: a second run on this output is refused at once.
    let lock = OutputLock::take(&args.output)?;
    let name = args.target.clone().or(cfg.target.name.clone()).context("no target: give --target or target.name in the recipe")?;
    let mut settings = cfg.target_settings()?;
    let kind = registry.kind_of(&name).with_context(|| format!("no plugin named {name:?} (see `host plugins list`)"))?;
    let reader = match kind {
        "connector" => false,
        "reader" => true,
        other => bail!("--target {name}: a {other} plugin; a target is a connector or a reader"),
    };
    if let Some(url) = &args.base_url {
        if reader {
            bail!("--base-url is for connector targets; {name} is a local reader");
        }
        settings["base_url"] = json!(url);
    }
    if let Some(model) = &args.model {
        settings["model"] = json!(model);
    }
    if reader {
        settings["device"] = json!(args.device);
        // A reader's checkpoint, as every model the toolkit takes: a folder, a Hub id or a
        // known bare name (a connector's `model` is the name its server knows, left as is).
        if let Some(m) = settings["model"].as_str().map(String::from) {
            settings["model"] = json!(resolve_model(Path::new(&m), None, "host augment")?);
        }
    }

    let mut items = load_probes(task, &args.input)?;
    if let Some(n) = args.limit {
        items.truncate(n);
    }
    let demos = match (&prompts.demonstrations_file, prompts.demonstrations) {
        (Some(path), n) if n > 0 => load_probes(task, path)?,
        _ => Vec::new(),
    };
    let retriever = args.retriever.clone().or(cfg.retrieval.retriever.clone()).unwrap_or_else(|| "none".into());
    let k = args.k.or(cfg.retrieval.k).unwrap_or(3);
    if retriever != "none" && !reader && !prompts.template.uses("passages") {
        bail!("{}.template has no {{passages}}: the retrieved passages would never reach the target", task.name());
    }
    let passages = retrieve(registry, args, &cfg, &retriever, k, &items)?;

    let prepared: Vec<Prepared> = items
        .into_iter()
        .zip(passages)
        .map(|(probe, ps)| {
            let d = render_demos(task, &prompts, &demos, &probe.id, reader);
            Prepared::new(&prompts, probe, ps, d, reader)
        })
        .collect();
    let expected: HashMap<String, String> = prepared.iter().map(|p| (p.probe.id.clone(), p.prompt_sha256.clone())).collect();
    // The target first: a target that cannot start must not cost an --overwrite its file.
    let target = if reader {
        Target::Reader(registry.reader(&name, &settings)?)
    } else {
        Target::Connector(registry.connector(&name, &settings)?)
    };
    // What the connector says it asks (the model the server serves when none is named, the
    // server without its port) decides answers; a connector that cannot say is taken at its
    // settings.
    let described = match &target {
        Target::Connector(conn) => conn.complete(json!({"op": "describe"})).ok().filter(|d| d.is_object() && d.get("error").is_none()),
        Target::Reader(_) => None,
    };
    let mut identity = settings.clone();
    if reader {
        // A reader's answers follow its weights, not its folder's name: a checkpoint
        // retrained in place must not resume with the old model's answers.
        if let Some(m) = settings["model"].as_str() {
            identity["model_sha256"] = json!(rak_retrieval::digest::checkpoint_digest(Path::new(m))?);
        }
    }
    if let Some(d) = &described {
        if let Some(m) = d["model"].as_str() {
            identity["model"] = json!(m);
        }
        if let Some(s) = d["server"].as_str() {
            identity["server"] = json!(s);
        }
    }
    let setup = setup_sha256(&name, &identity, &prompts);
    let by_id: HashMap<&str, &Prepared> = prepared.iter().map(|p| (p.probe.id.as_str(), p)).collect();
    let rejudge = |id: &str, rec: &mut Value| by_id.get(id).is_some_and(|item| augment::rejudge(task, &prompts, item, rec));
    let (mut out, done) = Results::open(&args.output, lock, &expected, &setup, args.overwrite, &rejudge)?;
    let pending: Vec<&Prepared> = prepared.iter().filter(|p| !done.contains_key(&p.probe.id)).collect();
    eprintln!(
        "augment: {} {} questions, {} answered before, {} to ask; target {name}, passages {retriever}{}",
        prepared.len(),
        task.name(),
        done.len(),
        pending.len(),
        if retriever == "none" { String::new() } else { format!(" (k = {k})") }
    );

    let kept = done.len();
    let mut records: Vec<Value> = done.into_values().collect();
    let bar = super::progress(pending.len() as u64, "augment");
    let mut tally = Tally::default();
    let started = std::time::Instant::now();
    let mut write = |mut rec: Value, in_flight: Option<u64>| -> Result<()> {
        rec["setup_sha256"] = json!(setup);
        out.append(&rec)?;
        if let Some(w) = rec["warning"].as_str() {
            bar.suspend(|| eprintln!("augment: {}: {w}", rec["_id"].as_str().unwrap_or("")));
        }
        tally.add(&rec);
        bar.inc(1);
        bar.set_message(match in_flight {
            Some(n) => format!("acc {:.3} (failed = wrong) · failed {} · in flight {n}", tally.accuracy(), tally.failed),
            None => format!("acc {:.3} (failed = wrong) · failed {}", tally.accuracy(), tally.failed),
        });
        records.push(rec);
        Ok(())
    };
    let stats = match target {
        Target::Connector(conn) => {
            let workers = args.workers.or(cfg.run.workers).unwrap_or(8).max(1);
            let conn: &dyn Connector = conn.as_ref();
            let next = AtomicUsize::new(0);
            let (tx, rx) = mpsc::channel::<Value>();
            // Items that found no server, in a row: once every worker's last item did, the
            // server is gone, and asking the rest would only fail each after its retries.
            let mut in_a_row: (usize, String) = (0, String::new());
            let gone_after = workers.min(pending.len()).max(1);
            // Latched when it trips (how many in a row, the first error): an item still in
            // flight that then succeeds (a cached reply) must not undo the stop.
            let mut gone: Option<(usize, String)> = None;
            std::thread::scope(|s| -> Result<()> {
                for _ in 0..workers.min(pending.len()) {
                    let (tx, next, pending, prompts) = (tx.clone(), &next, &pending, &prompts);
                    s.spawn(move || loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(item) = pending.get(i) else { break };
                        if tx.send(ask_connector(conn, task, prompts, item)).is_err() {
                            break;
                        }
                    });
                }
                drop(tx);
                for rec in rx {
                    let in_flight = conn.complete(json!({"op": "stats"})).ok().and_then(|s| s["in_flight"].as_u64());
                    match rec["error"].as_str() {
                        Some(e) if e.starts_with("unreachable:") => {
                            if in_a_row.0 == 0 {
                                in_a_row.1 = e.to_string();
                            }
                            in_a_row.0 += 1;
                        }
                        _ => in_a_row.0 = 0,
                    }
                    if let Err(e) = write(rec, in_flight) {
                        // Stop handing out work; the workers finish what they hold.
                        next.store(usize::MAX / 2, Ordering::Relaxed);
                        return Err(e);
                    }
                    if gone.is_none() && in_a_row.0 >= gone_after {
                        gone = Some(in_a_row.clone());
                        next.store(usize::MAX / 2, Ordering::Relaxed);
                    }
                }
                Ok(())
            })?;
            if let Some((count, first)) = gone {
                bar.finish_and_clear();
                out.sync()?;
                bail!(
                    "the target stopped answering: {count} items in a row found no server ({first}); every answer so far is kept in {}, and a rerun asks only the rest",
                    args.output.display()
                );
            }
            conn.complete(json!({"op": "stats"})).unwrap_or(Value::Null)
        }
        Target::Reader(mut reader) => {
            for batch in pending.chunks(8) {
                for rec in ask_reader(reader.as_mut(), task, &prompts, batch) {
                    write(rec, None)?;
                }
            }
            Value::Null
        }
    };
    bar.finish_and_clear();
    let asked = (pending.len(), started.elapsed().as_secs_f64());
    out.sync()?;
    let mut summary = summarize(&records, task, &name, &retriever, k, &args.output, stats);
    summary["model"] = identity["model"].clone();
    if !reader {
        summary["base_url"] = settings["base_url"].clone();
    }
    // `target_stats` and `timing` are this invocation's: a resumed run says how many answers
    // it kept from earlier ones, whose requests and seconds are not counted again.
    summary["timing"] = json!({
        "asked": asked.0,
        "kept_from_earlier_runs": kept,
        "seconds": asked.1,
        "items_per_second": if asked.1 > 0.0 { asked.0 as f64 / asked.1 } else { 0.0 },
    });
    let failed = summary["failed"].as_u64().unwrap_or(0) > 0;
    Ok((summary, failed))
}

/// What, besides the prompt's digest, decides an answer: the target, its settings that change
/// replies (with the model the connector says it asks, named or served, and the server
/// without its port), everything that shapes prompts (templates, the passage template,
/// separator and header, the passage cut: a reader's prompt digest covers the passages uncut; the
/// demonstration template and separator), and the
/// answering settings. Connection settings (base URL, timeouts, retries, cache) are left out,
/// so a local server restarted on another port keeps its answers.
fn setup_sha256(target: &str, settings: &Value, p: &TaskPrompts) -> String {
    const CONNECTION: [&str; 14] = [
        "base_url", "api_key_env", "timeout_s", "connect_timeout_s", "concurrency", "max_retries", "retry_budget_s",
        "backoff_base_s", "backoff_max_s", "cache", "cache_dir", "max_response_bytes", "device", "batch_size",
    ];
    let mut kept = settings.as_object().cloned().unwrap_or_default();
    kept.retain(|k, _| !CONNECTION.contains(&k.as_str()));
    let answering = json!({"by_logprobs": p.by_logprobs, "max_tokens": p.max_tokens, "stop": p.stop});
    let mut prompt = json!({
        "template": p.template.source(),
        "reader_template": p.reader_template.source(),
        "choice": p.choice.source(),
        "passage": p.passage.source(),
        "separator": p.separator,
        "passage_chars": p.passage_chars,
    });
    // Keyed only when set, so results made since the prompt settings entered the digest
    // (2026-11-26) still resume; results files from before it are refused (rerun them with
    // --overwrite or into a new output). The demonstrations themselves are in each item's
    // prompt digest.
    if let Some(d) = &p.demonstration {
        prompt["demonstration"] = json!(d.source());
    }
    if let Some(s) = &p.demonstration_separator {
        prompt["demonstration_separator"] = json!(s);
    }
    if !p.passages_header.is_empty() {
        prompt["passages_header"] = json!(p.passages_header);
    }
    // Keyed only when not PopQA's (the rule before the setting existed), so earlier results
    // still resume; answers judged by another rule are never mixed in one file.
    let mut answering = answering;
    if p.answer_match != crate::augment::answer::AnswerMatch::PopQa {
        answering["match"] = json!(p.answer_match.name());
    }
    crate::augment::sha256(&json!({"target": target, "settings": kept, "prompt": prompt, "answering": answering}).to_string())
}

fn load_probes(task: Task, path: &Path) -> Result<Vec<Probe>> {
    Ok(match task {
        Task::Mc => probes::load_mc(path)?
            .into_iter()
            .map(|m| Probe { id: m.id, subject: m.subject, question: m.question, choices: m.choices, answer: m.answer, aliases: Vec::new() })
            .collect(),
        Task::ShortQa => probes::load_shortqa(path)?
            .into_iter()
            .map(|s| Probe { id: s.id, subject: "shortqa".into(), question: s.question, choices: Vec::new(), answer: 0, aliases: s.answers })
            .collect(),
    })
}

/// The top-k passages of every question (none for a closed book), texts read from the corpus.
fn retrieve(registry: &Registry, args: &AugmentArgs, cfg: &AugmentConfig, spec: &str, k: usize, items: &[Probe]) -> Result<Vec<Vec<Passage>>> {
    if spec == "none" {
        return Ok(vec![Vec::new(); items.len()]);
    }
    if k == 0 {
        bail!("--k must be positive with a retriever (or use --retriever none)");
    }
    let (kind, dir) = spec.split_once(':').with_context(|| format!("--retriever {spec:?}: expected none, bm25:INDEX_DIR, dense:INDEX_DIR or run:TREC_FILE"))?;
    // Each question's top k passage ids, best first.
    let top: HashMap<String, Vec<String>> = if kind == "run" {
        top_k_from_run_file(Path::new(dir), items, k)?
    } else {
        let run = search_index(registry, args, cfg, spec, kind, dir, k, items)?;
        run.iter().map(|(q, docs)| (q.to_string(), docs.iter().take(k).map(|(id, _)| id.clone()).collect())).collect()
    };
    let corpus = args.corpus.clone().or(cfg.retrieval.corpus.clone()).context("retrieved passages need --corpus (or retrieval.corpus) for their texts")?;
    let ids: Vec<Vec<String>> = items.iter().map(|p| top.get(&p.id).cloned().unwrap_or_default()).collect();
    let wanted: HashSet<&str> = ids.iter().flatten().map(String::as_str).collect();
    let mut texts: HashMap<String, (String, String)> = HashMap::new();
    for p in beir::read_corpus(&corpus)? {
        let p = p?;
        if wanted.contains(p.id.as_str()) {
            texts.insert(p.id, (p.title, p.text));
        }
    }
    items
        .iter()
        .zip(ids)
        .map(|(question, row)| {
            row.into_iter()
                .map(|id| {
                    let (title, text) = texts.get(&id).cloned().with_context(|| {
                        format!(
                            "passage {id:?}, retrieved by --retriever {spec} for question {:?}, is not in {}; is it the corpus the index or run was made from?",
                            question.id,
                            corpus.display()
                        )
                    })?;
                    Ok(Passage { id, title, text })
                })
                .collect()
        })
        .collect()
}

/// The top-k of every question from an index (BM25, or dense with the encoder the recipe names).
#[allow(clippy::too_many_arguments)]
fn search_index(registry: &Registry, args: &AugmentArgs, cfg: &AugmentConfig, spec: &str, kind: &str, dir: &str, k: usize, items: &[Probe]) -> Result<Run> {
    if !matches!(kind, "bm25" | "dense") {
        bail!("--retriever {kind}:...: expected bm25, dense or run");
    }
    let index = index::open(Path::new(dir))?;
    let queries: Vec<Query> = items
        .iter()
        .map(|p| Query { id: p.id.clone(), text: p.question.clone(), answers: Vec::new(), pages: Vec::new(), page_sets: Vec::new() })
        .collect();
    let opts = SearchOptions { k, task: cfg.retrieval.task.clone(), batch_size: 64 };
    Ok(match (kind, &index) {
        ("bm25", Index::Bm25(_)) => search_queries(&index, None, &queries, &opts, &Quiet)?,
        ("dense", Index::Bm25(_)) | ("bm25", _) => bail!("--retriever {spec}: the index at {dir} is a {} index", index.meta().kind),
        ("dense", _) => {
            let enc = args.encoder.clone().or(cfg.retrieval.encoder.clone()).context("a dense retriever needs --encoder (or retrieval.encoder)")?;
            let model = args
                .encoder_model
                .clone()
                .or(cfg.retrieval.encoder_model.clone())
                .context("a dense retriever needs --encoder-model (or retrieval.encoder_model)")?;
            let margs = ModelArgs { batch_size: 64, max_length: None, device: args.device.clone(), bf16: false, encoder_settings: None, revision: None };
            let mut encoder = registry.encoder(&enc, &encoder_settings(&model, &margs)?)?;
            search_queries(&index, Some(encoder.as_mut()), &queries, &opts, &Quiet)?
        }
        (other, _) => unreachable!("{other}: checked above"),
    })
}

/// Passages another system retrieved, from its TREC run file (`qid Q0 docid rank score tag`):
/// judging a fixed ranking needs no index or model. Each question's top `k` by the rank column
/// (equal ranks in file order), whose scores must not rise along it down to rank k + 1: scores
/// that order the run otherwise (distances, where lower is better) would mean the system and
/// trec_eval disagree on what it ranked first, and are refused; tied scores are fine, and keep
/// the system's order. Every question must have at least `k` passages: a missing or shorter
/// ranking would silently become a closed book or fewer passages.
fn top_k_from_run_file(path: &Path, items: &[Probe], k: usize) -> Result<HashMap<String, Vec<String>>> {
    use rak_retrieval::data::trec;
    // Reads the whole file once for its checks (a passage listed twice for a question, bad lines).
    let questions = trec::read_run(path)?.len();
    let wanted: HashSet<&str> = items.iter().map(|p| p.id.as_str()).collect();
    let mut by_question: HashMap<String, Vec<trec::RunLine>> = HashMap::new();
    for line in trec::read_lines(path)? {
        let l = line?;
        if wanted.contains(l.qid.as_str()) {
            by_question.entry(l.qid.clone()).or_default().push(l);
        }
    }
    let mut top = HashMap::new();
    for p in items {
        let Some(mut lines) = by_question.remove(&p.id) else {
            bail!("--retriever run:{}: question {:?} has no ranking in the run ({questions} questions have one)", path.display(), p.id);
        };
        if lines.len() < k {
            bail!("--retriever run:{}: question {:?} has {} ranked passages, fewer than --k {k}", path.display(), p.id, lines.len());
        }
        lines.sort_by_key(|l| l.rank); // stable: equal ranks keep the file's order
        for w in lines[..lines.len().min(k + 1)].windows(2) {
            if w[1].score > w[0].score {
                bail!(
                    "--retriever run:{}: question {:?}: the passage at rank {} ({}, line {}) scores {}, above rank {}'s {}: the scores do not order the run as its ranks do (trec_eval ranks by score); give scores that fall with rank",
                    path.display(),
                    p.id,
                    w[1].rank,
                    w[1].docid,
                    w[1].line,
                    w[1].score,
                    w[0].rank,
                    w[0].score
                );
            }
        }
        top.insert(p.id.clone(), lines.into_iter().take(k).map(|l| l.docid).collect());
    }
    Ok(top)
}

#[derive(Default)]
struct Tally {
    answered: usize,
    correct: usize,
    failed: usize,
}

impl Tally {
    fn add(&mut self, rec: &Value) {
        if rec["error"].is_null() {
            self.answered += 1;
            self.correct += rec["correct"].as_bool().unwrap_or(false) as usize;
        } else {
            self.failed += 1;
        }
    }

    /// Over every item, a failed one counted wrong: what a reader of the headline expects,
    /// and what a run whose failures fall on hard items cannot inflate.
    fn accuracy(&self) -> f64 {
        ratio(self.correct, self.answered + self.failed)
    }

    /// Over the answered items only.
    fn accuracy_answered(&self) -> f64 {
        ratio(self.correct, self.answered)
    }
}

fn ratio(n: usize, d: usize) -> f64 {
    if d == 0 {
        0.0
    } else {
        n as f64 / d as f64
    }
}

fn mean(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        0.0
    } else {
        xs.iter().sum::<f64>() / xs.len() as f64
    }
}

/// Accuracy per subject and its macro (over subjects) and micro (over items) averages, twice:
/// `accuracy` counts failed items wrong, `accuracy_answered` leaves them out (subjects with no
/// answered item out of its macro average); and the target's request and token totals.
fn summarize(records: &[Value], task: Task, target: &str, retriever: &str, k: usize, output: &Path, stats: Value) -> Value {
    let mut by_subject: BTreeMap<String, Tally> = BTreeMap::new();
    let mut all = Tally::default();
    let mut methods: BTreeMap<String, usize> = BTreeMap::new();
    for r in records {
        by_subject.entry(r["subject"].as_str().unwrap_or("").to_string()).or_default().add(r);
        all.add(r);
        if r["error"].is_null() {
            *methods.entry(r["method"].as_str().unwrap_or("").to_string()).or_default() += 1;
        }
    }
    let per_subject: BTreeMap<&String, Value> = by_subject
        .iter()
        .map(|(s, t)| (s, json!({"accuracy": t.accuracy(), "items": t.answered + t.failed, "answered": t.answered, "failed": t.failed})))
        .collect();
    let per_subject_answered: BTreeMap<&String, Value> =
        by_subject.iter().filter(|(_, t)| t.answered > 0).map(|(s, t)| (s, json!({"accuracy": t.accuracy_answered(), "answered": t.answered}))).collect();
    let macro_all = mean(&by_subject.values().map(Tally::accuracy).collect::<Vec<_>>());
    let macro_answered = mean(&by_subject.values().filter(|t| t.answered > 0).map(Tally::accuracy_answered).collect::<Vec<_>>());
    json!({
        "task": task.name(),
        "target": target,
        "retriever": retriever,
        "k": if retriever == "none" { json!(0) } else { json!(k) },
        "items": records.len(),
        "answered": all.answered,
        "failed": all.failed,
        "accuracy": {"macro": macro_all, "micro": all.accuracy(), "per_subject": per_subject},
        "accuracy_answered": {"macro": macro_answered, "micro": all.accuracy_answered(), "per_subject": per_subject_answered},
        "methods": methods,
        "target_stats": stats,
        "output": output,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_setup_hash_covers_what_shapes_the_prompt() {
        let base = TaskPrompts::new(&AugmentConfig::default(), Task::Mc).unwrap();
        let settings = json!({"base_url": "http://127.0.0.1:8080", "model": "m"});
        let h = setup_sha256("fid", &settings, &base);
        for recipe in [
            "[passages]\nmax_chars = 100\n",
            "[passages]\nseparator = \"\\n\"\n",
            "[passages]\ntemplate = \"{text}\"\n",
            "[mc]\nreader_template = \"{question}\"\n",
            "[mc]\ntemplate = \"{passages}{question}\"\n",
            "[mc]\nchoice = \"{letter}) {choice}\"\n",
            "[mc]\ndemonstration = \"{question} {answer}\"\n",
            "[mc]\ndemonstration_separator = \"\\n\"\n",
            "[mc]\ntemplate = \"{demonstrations}{passages}{question}\"\n",
        ] {
            let p = TaskPrompts::new(&toml::from_str(recipe).unwrap(), Task::Mc).unwrap();
            assert_ne!(setup_sha256("fid", &settings, &p), h, "{recipe}");
        }
        // How short answers are judged; PopQA's rule named is the default's setup.
        let short = |recipe: &str| setup_sha256("fid", &settings, &TaskPrompts::new(&toml::from_str(recipe).unwrap(), Task::ShortQa).unwrap());
        assert_ne!(short("[answers]\nmatch = \"squad\"\n"), short(""));
        assert_eq!(short("[answers]\nmatch = \"popqa\"\n"), short(""));
        // Two demonstration templates are two setups, even when the demonstrations' count is 0.
        let demo = |d: &str| TaskPrompts::new(&toml::from_str(&format!("[mc]\ndemonstration = {d:?}\n")).unwrap(), Task::Mc).unwrap();
        assert_ne!(setup_sha256("fid", &settings, &demo("Q: {question} A: {answer}")), setup_sha256("fid", &settings, &demo("{question} {answer}")));
        // A local server restarted on another port is the same target; another model is not.
        assert_eq!(setup_sha256("fid", &json!({"base_url": "http://127.0.0.1:9999", "model": "m"}), &base), h);
        assert_ne!(setup_sha256("fid", &json!({"base_url": "http://127.0.0.1:8080", "model": "n"}), &base), h);
    }

    #[test]
    fn failed_items_count_wrong_in_the_headline() {
        let recs = vec![
            json!({"subject": "a", "error": null, "correct": true, "method": "text"}),
            json!({"subject": "a", "error": "boom", "correct": false}),
            json!({"subject": "b", "error": null, "correct": false, "method": "text"}),
            json!({"subject": "b", "error": null, "correct": true, "method": "text"}),
        ];
        let s = summarize(&recs, Task::Mc, "openai", "none", 3, Path::new("o.jsonl"), Value::Null);
        assert_eq!((s["items"].as_u64(), s["answered"].as_u64(), s["failed"].as_u64()), (Some(4), Some(3), Some(1)));
        let acc = &s["accuracy"];
        assert_eq!((acc["micro"].as_f64(), acc["macro"].as_f64()), (Some(0.5), Some(0.5)), "{s}");
        assert_eq!(acc["per_subject"]["a"]["accuracy"].as_f64(), Some(0.5));
        let answered = &s["accuracy_answered"];
        assert_eq!((answered["micro"].as_f64(), answered["macro"].as_f64()), (Some(2.0 / 3.0), Some(0.75)), "{s}");
        assert_eq!(answered["per_subject"]["a"]["accuracy"].as_f64(), Some(1.0));
    }
}
