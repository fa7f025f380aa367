//! Stage (b): the source LM scores each query's top N passages.
//!
//! - White-box (REFERENCE §6, the paper's): the reader's `passage_preferences`, FiD
//!   cross-attention of the first decoder step over `passage[:passage_chars] + prompt`, queries
//!   sent `batch_size` at a time in fixed chunks of the query order, so a resumed run puts the
//!   same queries in the same batch as an uninterrupted one.
//! - Black-box (beyond the paper): the connector's `continuation_logprob`, log P(answer |
//!   prompt with the passage), one request per passage, `workers` queries at once. An item
//!   whose request fails is recorded with its error, never scored, and counted; the connector
//!   caches the replies it accepted, so a rerun asks nothing twice.
//!
//! Records (`scores.jsonl`, one per query, appended as queries finish): `query_id`,
//! `passages` (the top N ids), `scores` (a number or null per passage), `errors` (null or a
//! message per passage), `skipped` (why a query was not asked, else null). A resumed stage
//! skips the queries it has records for, except records with failed items, which are asked
//! again (their answered items come from the connector's cache); the latest record wins.
//! `--retry-failed` does the same for a finished stage. The source (`source.json`) is recorded
//! with the first answered item, so a server that was down at the first run pins nothing; a
//! `describe` that failed at the start is asked again then, and only if it still fails is what
//! is known pinned (unverified, the configured model name); a later run whose describe names
//! another model than the configured one is refused, and with none configured the model it
//! names is pinned with a notice (see `decide_source`). A gone
//! server stops the stage once every worker's last query met it, answered items of those queries (from the cache) notwithstanding.

use crate::config::{fill, Config, Source};
use crate::data::{corpus_passages, Passage, RecordLog, Retrieved};
use crate::stages::{Stages, Start};
use anyhow::{bail, Context, Result};
use rak_core::plugin::{Connector, Host, HostProgress, Reader};
// The reader's own cut (Python's `text[:chars]`): the black-box prompt cuts passages as the
// white-box reader does.
use rak_core::readers::fid::char_prefix;
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

/// One query's scores, aligned with its top N passages.
#[derive(Debug, Clone)]
pub struct Scores {
    pub passages: Vec<String>,
    pub scores: Vec<Option<f64>>,
}

const RESULT_FILE: &str = "scores.jsonl";
const SOURCE_FILE: &str = "source.json";

/// Run (or resume, or skip) the stage; the scores by query, its report, and how it started.
pub fn run(cfg: &Config, host: &Host, stages: &Stages, key: &Value, queries: &[Retrieved]) -> Result<(HashMap<String, Scores>, Value, &'static str)> {
    let folder = stages.folder("score");
    let how = match stages.begin("score", key)? {
        // k = 0 asks no source and writes no records.
        Start::Done(report) if cfg.aar.k == 0 => return Ok((HashMap::new(), report, "done earlier")),
        Start::Done(report) if cfg.retry_failed && report["failed"].as_u64().unwrap_or(0) > 0 => {
            host.log(&format!("aar-train: score: --retry-failed: asking the source again for {} failed items", report["failed"]))?;
            stages.reopen("score")?;
            "retried"
        }
        Start::Done(report) => return Ok((load(&folder.join(RESULT_FILE))?, report, "done earlier")),
        Start::Resume => "resumed",
        Start::Fresh => "ran",
    };
    if cfg.aar.k == 0 {
        let report = json!({"skipped": "aar.k = 0: the positives are gold only, no source is asked"});
        stages.finish("score", &report)?;
        return Ok((HashMap::new(), report, how));
    }
    let (mut log, earlier) = RecordLog::open(&folder.join(RESULT_FILE))?;
    let mut latest: HashMap<String, Value> = HashMap::new();
    for r in earlier {
        let id = r["query_id"].as_str().context("a score record without query_id")?.to_string();
        latest.insert(id, r);
    }
    let n = cfg.aar.n;
    let wanted: HashSet<&str> = queries.iter().flat_map(|q| q.top_n(n)).map(String::as_str).collect();
    let passages = corpus_passages(&cfg.corpus, &wanted)?;
    // This session's scoring: passages recorded and the time from the source's first request
    // (after loading it) to the last record (docs/BENCHMARKS.md reads it).
    let mut session = Session::default();
    match &cfg.source {
        Source::WhiteBox { reader, prompt, batch_size, .. } => {
            let mut reader = host.reader(reader, &serde_json::Value::Object(cfg.source_settings.clone()))?;
            let recorded: HashSet<String> = latest.keys().cloned().collect();
            let done = |q: &Retrieved| recorded.contains(&q.id);
            let todo = queries.iter().filter(|q| !done(q)).count();
            if todo < queries.len() {
                host.log(&format!("aar-train: score: {} queries scored earlier, {todo} to go", queries.len() - todo))?;
            }
            let bar = host.progress("aar: score (white-box)", todo as u64)?;
            let started = std::time::Instant::now();
            for chunk in queries.chunks(*batch_size) {
                if chunk.iter().all(done) {
                    continue;
                }
                // The whole chunk is asked, recorded or not: batches are the same as an
                // uninterrupted run's, so are the scores, to the last bit.
                let items: Vec<Value> = chunk
                    .iter()
                    .map(|q| {
                        let ps: Vec<Value> = q.top_n(n).iter().map(|id| json!({"title": passages[id].title, "text": passages[id].text})).collect();
                        json!({"prompt": fill(prompt, &[("question", &q.query)]), "passages": ps})
                    })
                    .collect();
                let reply = reader.passage_preferences(json!({"items": items}))?;
                let got = reply["items"].as_array().context("passage_preferences: the reply has no items")?;
                if got.len() != chunk.len() {
                    bail!("passage_preferences: {} items asked, {} answered", chunk.len(), got.len());
                }
                let mut records = Vec::new();
                for (q, item) in chunk.iter().zip(got) {
                    if done(q) {
                        continue;
                    }
                    let ids = q.top_n(n);
                    let scores: Vec<Option<f64>> = serde_json::from_value(item["scores"].clone()).context("passage_preferences: an item without scores")?;
                    if scores.len() != ids.len() {
                        bail!("passage_preferences: {} scores for {} passages of query {:?}", scores.len(), ids.len(), q.id);
                    }
                    records.push(json!({"query_id": q.id, "passages": ids, "scores": scores, "errors": vec![Value::Null; ids.len()], "skipped": null}));
                }
                log.append(&records)?;
                session.count(&records);
                session.seconds = started.elapsed().as_secs_f64();
                for r in records {
                    latest.insert(r["query_id"].as_str().unwrap_or_default().to_string(), r);
                }
                bar.inc(chunk.iter().filter(|q| !done(q)).count() as u64)?;
            }
        }
        Source::BlackBox { connector, prompt, continuation, workers } => {
            let conn = host.connector(connector, &serde_json::Value::Object(cfg.source_settings.clone()))?;
            let source_file = folder.join(SOURCE_FILE);
            let scored_before = latest.values().any(|r| r["scores"].as_array().is_some_and(|v| v.iter().any(|x| !x.is_null())));
            let to_record = Mutex::new(check_source(host, &conn, cfg, &source_file, scored_before)?);
            // Queries not recorded, or recorded with failed items (asked again).
            let pending: Vec<&Retrieved> = queries.iter().filter(|q| latest.get(&q.id).is_none_or(has_failures)).collect();
            if pending.len() < queries.len() {
                host.log(&format!("aar-train: score: {} queries scored earlier, {} to go", queries.len() - pending.len(), pending.len()))?;
            }
            let bar = host.progress("aar: score (black-box)", pending.len() as u64)?;
            let log = Mutex::new(&mut log);
            let fresh: Mutex<Vec<Value>> = Mutex::new(Vec::new());
            let next = AtomicUsize::new(0);
            // Queries in a row whose source could not be reached: once every worker's last
            // query found no server, it is gone, and the rest would only fail after retries.
            let in_a_row = AtomicUsize::new(0);
            let gone_after = (*workers).min(pending.len()).max(1);
            // Latched when it trips: a query still in flight that then scores must not undo
            // the stop (the stage would otherwise end on queries never asked).
            let gone = AtomicBool::new(false);
            let job = BlackBox { conn: &conn, prompt, continuation, n, passages: &passages, chars: cfg.aar.passage_chars };
            let started = std::time::Instant::now();
            std::thread::scope(|s| -> Result<()> {
                let handles: Vec<_> = (0..(*workers).min(pending.len().max(1)))
                    .map(|_| {
                        s.spawn(|| -> Result<()> {
                            loop {
                                let i = next.fetch_add(1, Ordering::Relaxed);
                                let Some(q) = pending.get(i) else { return Ok(()) };
                                let record = job.score(q);
                                let mut log = log.lock().unwrap_or_else(|e| e.into_inner());
                                // The source is recorded with its first answer, so a server
                                // down at the start never pins a source that answered nothing.
                                let mut pending_source = to_record.lock().unwrap_or_else(|e| e.into_inner());
                                if pending_source.is_some() && record["scores"].as_array().is_some_and(|v| v.iter().any(|x| !x.is_null())) {
                                    let pending = pending_source.take().unwrap_or_default();
                                    let now = pin_at_first_answer(pending, !scored_before, || conn.complete(json!({"op": "describe"})));
                                    rak_core::fsutil::write_bytes(&source_file, now.to_string().as_bytes())?;
                                }
                                drop(pending_source);
                                log.append(std::slice::from_ref(&record))?;
                                if found_no_server(&record) {
                                    if in_a_row.fetch_add(1, Ordering::Relaxed) + 1 >= gone_after {
                                        gone.store(true, Ordering::Relaxed);
                                        next.store(usize::MAX / 2, Ordering::Relaxed);
                                    }
                                } else {
                                    in_a_row.store(0, Ordering::Relaxed);
                                }
                                drop(log);
                                fresh.lock().unwrap_or_else(|e| e.into_inner()).push(record);
                                inc(&bar)?;
                            }
                        })
                    })
                    .collect();
                for h in handles {
                    h.join().map_err(|_| anyhow::anyhow!("a scoring thread panicked"))??;
                }
                Ok(())
            })?;
            if gone.load(Ordering::Relaxed) {
                bail!(
                    "the source stopped answering: {gone_after} queries in a row found no server (the connector's `unreachable`); \
                     what was scored is kept, and a rerun resumes the stage once the server is back"
                );
            }
            session.seconds = started.elapsed().as_secs_f64();
            let fresh = fresh.into_inner().unwrap_or_else(|e| e.into_inner());
            session.count(&fresh);
            for r in fresh {
                latest.insert(r["query_id"].as_str().unwrap_or_default().to_string(), r);
            }
        }
    }
    drop(log);

    let mut report = report(queries, &latest, n)?;
    report["this_session"] = session.report();
    if report["scored"].as_u64() == Some(0) && report["failed"].as_u64().unwrap_or(0) > 0 {
        bail!(
            "every item the source was asked failed ({} items; first errors: {}); nothing is scored. Fix the source and rerun: the stage resumes and asks the failed items again",
            report["failed"],
            report["first_errors"]
        );
    }
    for q in queries {
        if !latest.contains_key(&q.id) {
            bail!("query {:?} has no score record after the stage", q.id);
        }
    }
    stages.finish("score", &report)?;
    let scores = latest.iter().map(|(id, r)| Ok((id.clone(), parse(r)?))).collect::<Result<_>>()?;
    Ok((scores, report, how))
}

/// Where each stage's key holds the score key: the later stages' keys contain the earlier ones'.
const SCORE_KEY_IN: [(&str, &[&str]); 4] = [("score", &[]), ("select", &["score"]), ("train", &["select", "score"]), ("final", &["train", "select", "score"])];

/// A white-box run from before the score key held the device and dtype keeps its scores when
/// today's key is its own on the defaults (see `Config::upgrade_source_key`), instead of every
/// such run's scores being "other inputs". The score key inside the later stages' recorded keys
/// is upgraded the same way (`keys`: today's key of each stage by name), or a rerun of a run
/// past scoring would be refused at the select stage. Called before any stage begins.
pub fn keep_older_white_box_scores(stages: &Stages, keys: &[(&str, &Value)]) -> Result<()> {
    for (name, key) in keys {
        let inner = SCORE_KEY_IN.iter().find(|(n, _)| n == name).map(|(_, p)| *p).with_context(|| format!("no score key in the {name} stage's key"))?;
        stages.upgrade_key(name, key, |then| {
            let mut upgraded = then.clone();
            let score_key = inner.iter().try_fold(&mut upgraded, |v, k| v.get_mut(*k))?;
            let source = Config::upgrade_source_key(&score_key["source"])?;
            score_key["source"] = source;
            Some(upgraded)
        })?;
    }
    Ok(())
}

/// What one session of the stage scored, and how fast.
#[derive(Default)]
struct Session {
    /// Passages of the records written (scored, failed or skipped).
    passages: usize,
    /// Those with a score.
    scored: usize,
    seconds: f64,
}

impl Session {
    fn count(&mut self, records: &[Value]) {
        for r in records {
            self.passages += r["passages"].as_array().map_or(0, Vec::len);
            self.scored += r["scores"].as_array().map_or(0, |s| s.iter().filter(|x| !x.is_null()).count());
        }
    }

    /// The rate is of scored passages over the whole time, failures' retries included.
    fn report(&self) -> Value {
        let rate = if self.seconds > 0.0 { json!(self.scored as f64 / self.seconds) } else { Value::Null };
        json!({"passages": self.passages, "scored": self.scored, "seconds": self.seconds, "scored_per_second": rate})
    }
}

fn inc(bar: &HostProgress) -> Result<()> {
    bar.inc(1)
}

/// Whether a query found no server: one of its items could not reach it (the items after that
/// one are not asked). Items before it may have been answered, from the connector's cache:
/// a gone server is gone all the same.
fn found_no_server(r: &Value) -> bool {
    r["errors"].as_array().is_some_and(|errors| errors.iter().any(unreachable))
}

/// An item's error says the connector found no server (its kind `unreachable`).
fn unreachable(error: &Value) -> bool {
    error.as_str().is_some_and(|e| e.starts_with("unreachable:"))
}

fn has_failures(r: &Value) -> bool {
    r["errors"].as_array().is_some_and(|e| e.iter().any(|x| !x.is_null()))
}

/// What the scores depend on besides the settings: the model the server serves and the server
/// (the connector's `describe`, without the port). Recorded with the stage's first answered
/// item; a resume against another model is refused rather than mixing two sources' scores.
/// What to record (none when recorded already).
fn check_source(host: &Host, conn: &rak_core::plugin::HostConnector, cfg: &Config, path: &Path, scored_before: bool) -> Result<Option<Value>> {
    let recorded = match std::fs::read_to_string(path) {
        Ok(text) => Some(serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", path.display()))?),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(e).with_context(|| format!("{}: cannot read", path.display())),
    };
    let configured = cfg.source_settings.get("model").and_then(Value::as_str).filter(|m| !m.trim().is_empty());
    let (record, notice) = decide_source(recorded, conn.complete(json!({"op": "describe"})), configured, scored_before, path)?;
    if let Some(notice) = notice {
        host.log(&notice)?;
    }
    Ok(record)
}

/// The source's identity in a `describe` reply: its model and server; none when it failed or
/// names no model.
fn identity(described: &Result<Value>) -> Option<Value> {
    match described {
        Ok(d) if d.get("error").is_none() && d.get("model").is_some_and(|m| !m.is_null()) => Some(json!({"model": d["model"], "server": d["server"]})),
        _ => None,
    }
}

/// What is pinned with the stage's first answered item: `pending`, decided at the start, except
/// that on a stage with no scores before this run (`fresh_stage`) an unverified one is asked
/// for again: the server has just answered, so it is up, and a describe that failed at the start
/// (a transient failure, or the server still loading) most likely answers now. Only if it still
/// fails is `unverified` pinned. On a stage with earlier scores, the unverified record stands:
/// those scores were not this describe's model's for certain.
fn pin_at_first_answer(pending: Value, fresh_stage: bool, describe: impl FnOnce() -> Result<Value>) -> Value {
    if fresh_stage && pending["unverified"] == json!(true) {
        if let Some(id) = identity(&describe()) {
            return id;
        }
    }
    pending
}

/// [`check_source`]'s decision from the identity recorded earlier and what `describe` answered
/// now (`configured`: the source setting `model`, the name the requests send; `scored_before`:
/// the stage has scores already).
///
/// A failed describe is no identity, but the items scored then still came from some model:
/// what is known of it is pinned, `{"unverified": true, "configured_model": NAME or null}`
/// (the replies do not say which model answered, so the name the requests sent is all there
/// is). A later run whose describe fails goes on; one whose describe names a model is refused
/// unless that model is the configured name the earlier items were asked with (then its
/// identity is pinned from there on). When no name was configured (the shipped black-box
/// recipes send `model = ""`), the first model a later describe names is accepted and pinned,
/// with a notice (the second value) that the scores so far cannot be tied to a model: refusing
/// would block every resume for good over one transient describe failure. A verified identity
/// recorded earlier is never confirmed by a failed describe (the resume waits for one that
/// answers). A missing or `null` record (an earlier version's, after a failed describe) with
/// scores already recorded is the same unverified case; without scores nothing was pinned, and
/// what describes now is.
fn decide_source(recorded: Option<Value>, described: Result<Value>, configured: Option<&str>, scored_before: bool, path: &Path) -> Result<(Option<Value>, Option<String>)> {
    let now = identity(&described);
    let unverified = |name: Option<&str>| json!({"unverified": true, "configured_model": name});
    let recorded = recorded.filter(|r| !r.is_null());
    match (recorded, now) {
        (None, now) if !scored_before => Ok((Some(now.unwrap_or_else(|| unverified(configured))), None)),
        // Scores without a record: an earlier version's run whose describe failed.
        (None, None) => Ok((Some(unverified(configured)), None)),
        (None, Some(now)) => from_unverified(&unverified(configured), now, path),
        (Some(then), now) if then["unverified"] == json!(true) => match now {
            None => Ok((None, None)),
            Some(now) => from_unverified(&then, now, path),
        },
        (Some(then), Some(now)) if then == now => Ok((None, None)),
        (Some(then), Some(now)) => bail!(
            "{}: this stage was begun with the source {then}, which is now {now}; point --base-url at the same model, or rerun with --overwrite after changing a source setting to score everything again",
            path.display()
        ),
        (Some(then), None) => {
            let why = match described {
                Ok(d) => d.get("error").map_or_else(|| format!("no model in {d}"), Value::to_string),
                Err(e) => format!("{e:#}"),
            };
            bail!(
                "{}: this stage was begun with the source {then}, and the source cannot say what it is now (its describe failed: {why}); rerun when it answers, so its scores are not mixed with another model's",
                path.display()
            )
        }
    }
}

/// A source that describes itself as `now`, resuming a stage whose earlier items were scored
/// while it could not (`then`, unverified): pinned if `now` is the model those items were asked
/// for by name, refused if they were asked for another, and pinned with a notice if they were
/// asked for none (nothing says which model answered them; see [`decide_source`]).
fn from_unverified(then: &Value, now: Value, path: &Path) -> Result<(Option<Value>, Option<String>)> {
    match then["configured_model"].as_str() {
        Some(name) if now["model"].as_str() == Some(name) => Ok((Some(now), None)),
        None => {
            let notice = format!(
                "aar-train: score: {}: this stage's earlier items were scored while the source could not say what model it is, and no model was \
                 configured by name; it now says {now}, which is pinned from here on. The scores so far cannot be tied to a model: they are taken as \
                 this one's (if they may be another's, rerun with --overwrite after changing a source setting to score everything again)",
                path.display()
            );
            Ok((Some(now), Some(notice)))
        }
        Some(name) => bail!(
            "{}: this stage's earlier items were scored while the source could not say what model it is (the requests named {name:?}), and it now says {now}; \
             nothing shows they came from that model, and their scores are not mixed with another model's. \
             Rerun with --overwrite after changing a source setting to score everything again (or, if you know it is the same model, remove {} to accept it)",
            path.display(),
            path.display()
        ),
    }
}

struct BlackBox<'a> {
    conn: &'a rak_core::plugin::HostConnector,
    prompt: &'a str,
    continuation: &'a str,
    n: usize,
    passages: &'a HashMap<String, Passage>,
    chars: usize,
}

impl BlackBox<'_> {
    /// One query's record: every passage asked, failures recorded, never raised.
    fn score(&self, q: &Retrieved) -> Value {
        let ids = q.top_n(self.n);
        let Some(answer) = q.answers.first() else {
            return json!({"query_id": q.id, "passages": ids, "scores": vec![Value::Null; ids.len()], "errors": vec![Value::Null; ids.len()],
                "skipped": "no answer to score"});
        };
        let continuation = fill(self.continuation, &[("answer", answer.trim())]);
        let (mut scores, mut errors, mut methods) = (Vec::new(), Vec::new(), Vec::new());
        for id in ids {
            // A passage that found no server: the query's others would too, each after its
            // retries. They are recorded with the same error and asked again on a rerun.
            if errors.last().is_some_and(unreachable) {
                scores.push(Value::Null);
                errors.push(json!("unreachable: not asked, an earlier passage of the query found no server"));
                methods.push(Value::Null);
                continue;
            }
            let p = &self.passages[id];
            let prompt = fill(self.prompt, &[("passage", char_prefix(&p.text, self.chars)), ("title", &p.title), ("question", &q.query)]);
            let reply = self.conn.complete(json!({"op": "continuation_logprob", "prompt": prompt, "continuation": continuation}));
            match reply {
                Ok(r) if r.get("error").is_none() => match r["logprob"].as_f64() {
                    Some(lp) if lp.is_finite() => {
                        scores.push(json!(lp));
                        errors.push(Value::Null);
                        methods.push(r["method"].clone());
                    }
                    _ => {
                        scores.push(Value::Null);
                        errors.push(json!(format!("no finite logprob in the reply: {}", short(&r.to_string()))));
                        methods.push(Value::Null);
                    }
                },
                Ok(r) => {
                    let e = &r["error"];
                    scores.push(Value::Null);
                    errors.push(json!(format!("{}: {}", e["kind"].as_str().unwrap_or("error"), short(e["message"].as_str().unwrap_or("")))));
                    methods.push(Value::Null);
                }
                Err(e) => {
                    scores.push(Value::Null);
                    errors.push(json!(short(&format!("{e:#}"))));
                    methods.push(Value::Null);
                }
            }
        }
        json!({"query_id": q.id, "passages": ids, "scores": scores, "errors": errors, "methods": methods, "skipped": null, "continuation": continuation})
    }
}

fn short(s: &str) -> String {
    if s.chars().count() > 300 { format!("{}...", char_prefix(s, 300)) } else { s.to_string() }
}

fn parse(r: &Value) -> Result<Scores> {
    Ok(Scores {
        passages: serde_json::from_value(r["passages"].clone()).context("a score record without passages")?,
        scores: serde_json::from_value(r["scores"].clone()).context("a score record without scores")?,
    })
}

/// Counts over the latest record of every query.
fn report(queries: &[Retrieved], latest: &HashMap<String, Value>, n: usize) -> Result<Value> {
    let (mut items, mut scored, mut failed, mut skipped, mut unscored) = (0usize, 0usize, 0usize, 0usize, 0usize);
    let mut methods: BTreeMap<String, usize> = BTreeMap::new();
    let mut first_errors = Vec::new();
    for q in queries {
        let Some(r) = latest.get(&q.id) else { continue };
        if !r["skipped"].is_null() {
            skipped += 1;
            unscored += 1;
            continue;
        }
        let s = parse(r)?;
        if s.passages != q.top_n(n) {
            bail!("the score record of query {:?} names other passages than its retrieval", q.id);
        }
        items += s.scores.len();
        let ok = s.scores.iter().filter(|x| x.is_some()).count();
        scored += ok;
        if ok == 0 {
            unscored += 1;
        }
        for (i, e) in r["errors"].as_array().into_iter().flatten().enumerate() {
            if let Some(msg) = e.as_str() {
                failed += 1;
                if first_errors.len() < 5 {
                    first_errors.push(json!({"query_id": q.id, "passage": s.passages.get(i), "error": msg}));
                }
            }
        }
        for m in r["methods"].as_array().into_iter().flatten().filter_map(Value::as_str) {
            *methods.entry(m.to_string()).or_default() += 1;
        }
    }
    Ok(json!({
        "queries": queries.len(),
        "items": items,
        "scored": scored,
        "failed": failed,
        "skipped_without_answer": skipped,
        "queries_without_scores": unscored,
        "methods": methods,
        "first_errors": first_errors,
    }))
}

/// The scores another run's score stage recorded (`RUN/stages/score/scores.jsonl`), by query,
/// read without writing to it (that run may still be scoring); and whether its score stage is
/// finished.
pub fn load_run(run: &Path) -> Result<(HashMap<String, Scores>, bool)> {
    let path = run.join("stages/score").join(RESULT_FILE);
    let records = RecordLog::read(&path).with_context(|| format!("{}: not an aar-train run with LM scores", run.display()))?;
    Ok((by_query(&records)?, run.join("stages/score.done.json").exists()))
}

/// The latest record of each query in a finished stage's file.
fn load(path: &Path) -> Result<HashMap<String, Scores>> {
    if !path.exists() {
        bail!("{}: missing, though the score stage is marked done; rerun with --overwrite after changing a source setting, or remove the output folder, to score again", path.display());
    }
    by_query(&RecordLog::read(path)?)
}

/// Each query's latest record.
fn by_query(records: &[Value]) -> Result<HashMap<String, Scores>> {
    let mut out = HashMap::new();
    for r in records {
        out.insert(r["query_id"].as_str().context("a score record without query_id")?.to_string(), parse(r)?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A failed describe is never the source's identity, and cannot confirm a recorded one.
    #[test]
    fn a_failed_describe_is_no_identity() {
        let path = Path::new("source.json");
        let ok = || Ok(json!({"model": "m1", "server": "127.0.0.1", "requested": "m1"}));
        let failed = || Err(anyhow::anyhow!("connection refused"));
        let id = json!({"model": "m1", "server": "127.0.0.1"});
        // First run: what describe said.
        assert_eq!(decide_source(None, ok(), None, false, path).unwrap(), (Some(id.clone()), None));
        // An earlier version's null (a failed describe recorded) before any score: re-pinned.
        assert_eq!(decide_source(Some(Value::Null), ok(), None, false, path).unwrap(), (Some(id.clone()), None));
        // A resume: the same source goes on; another is refused; one that cannot say waits.
        assert_eq!(decide_source(Some(id.clone()), ok(), None, true, path).unwrap(), (None, None));
        let e = decide_source(Some(id.clone()), Ok(json!({"model": "m2", "server": "127.0.0.1"})), None, true, path).unwrap_err().to_string();
        assert!(e.contains("which is now"), "{e}");
        let e = decide_source(Some(id), failed(), None, true, path).unwrap_err().to_string();
        assert!(e.contains("describe failed") && e.contains("connection refused"), "{e}");
    }

    /// Items scored while describe failed came from some model: what is known of it is pinned
    /// (unverified, the configured name), and a later run whose describe names another model
    /// than the configured one is refused rather than mixing two models' scores.
    #[test]
    fn scores_asked_while_describe_failed_pin_the_configured_model() {
        let path = Path::new("source.json");
        let failed = || Err(anyhow::anyhow!("connection refused"));
        let says = |m: &str| Ok(json!({"model": m, "server": "127.0.0.1"}));
        let pinned = |m: Option<&str>| json!({"unverified": true, "configured_model": m});
        // First run: the describe fails (or answers an error); what is known is pinned.
        assert_eq!(decide_source(None, failed(), Some("a"), false, path).unwrap(), (Some(pinned(Some("a"))), None));
        assert_eq!(decide_source(None, Ok(json!({"error": {"kind": "unreachable", "message": "x"}})), None, false, path).unwrap(), (Some(pinned(None)), None));
        // A resume whose describe fails again goes on as it was.
        assert_eq!(decide_source(Some(pinned(Some("a"))), failed(), Some("a"), true, path).unwrap(), (None, None));
        // One whose describe names the model the items were asked for: pinned from then on.
        let a = json!({"model": "a", "server": "127.0.0.1"});
        assert_eq!(decide_source(Some(pinned(Some("a"))), says("a"), Some("a"), true, path).unwrap(), (Some(a), None));
        // Another model than the one configured: refused.
        let e = decide_source(Some(pinned(Some("a"))), says("b"), Some("a"), true, path).unwrap_err().to_string();
        assert!(e.contains("source.json") && e.contains("\"a\"") && e.contains("\"b\""), "{e}");
        // An earlier version's run (scores recorded, no identity) asked for a configured model
        // is refused another one.
        let e = decide_source(Some(Value::Null), says("b"), Some("a"), true, path).unwrap_err().to_string();
        assert!(e.contains("could not say"), "{e}");
        assert_eq!(decide_source(None, failed(), Some("a"), true, path).unwrap(), (Some(pinned(Some("a"))), None));
    }

    /// The shipped black-box recipes configure no model name (`model = ""`): a stage whose
    /// describe failed once is not refused on every later resume. The first model a later
    /// describe names is pinned, with a notice that the earlier scores cannot be tied to it.
    #[test]
    fn an_unverified_stage_with_no_configured_model_pins_the_next_model_described() {
        let path = Path::new("source.json");
        let b = json!({"model": "b", "server": "127.0.0.1"});
        let says_b = || Ok(json!({"model": "b", "server": "127.0.0.1"}));
        let unverified = json!({"unverified": true, "configured_model": null});
        for recorded in [Some(unverified.clone()), None, Some(Value::Null)] {
            let (record, notice) = decide_source(recorded.clone(), says_b(), None, true, path).unwrap();
            assert_eq!(record, Some(b.clone()), "{recorded:?}");
            let notice = notice.expect("a notice");
            assert!(notice.contains("source.json") && notice.contains("cannot be tied to a model") && notice.contains("\"b\""), "{notice}");
        }
        // Once pinned, the resume after it goes on, and another model is refused.
        assert_eq!(decide_source(Some(b.clone()), says_b(), None, true, path).unwrap(), (None, None));
        assert!(decide_source(Some(b), Ok(json!({"model": "c", "server": "127.0.0.1"})), None, true, path).is_err());
    }

    /// A describe that failed at the start of a fresh stage is asked again with the first
    /// answered item (the server is up then): what it says is pinned, `unverified` only if it
    /// still fails. A stage with earlier scores keeps its unverified record, and a verified
    /// one is never asked again.
    #[test]
    fn the_first_answer_asks_a_failed_describe_again() {
        let unverified = json!({"unverified": true, "configured_model": null});
        let id = json!({"model": "m1", "server": "127.0.0.1"});
        let says = || Ok(json!({"model": "m1", "server": "127.0.0.1", "requested": ""}));
        assert_eq!(pin_at_first_answer(unverified.clone(), true, says), id);
        assert_eq!(pin_at_first_answer(unverified.clone(), true, || Err(anyhow::anyhow!("refused"))), unverified);
        assert_eq!(pin_at_first_answer(unverified.clone(), true, || Ok(json!({"error": {"kind": "x"}}))), unverified);
        assert_eq!(pin_at_first_answer(unverified.clone(), false, says), unverified, "earlier scores are not tied to it");
        let other = json!({"model": "m0", "server": "127.0.0.1"});
        assert_eq!(pin_at_first_answer(other.clone(), true, || panic!("a verified identity is not asked again")), other);
    }

    /// An older white-box run's score key (no device or dtype) is today's on the defaults:
    /// its scores are done, not other inputs; on another device they are.
    #[test]
    fn an_older_white_box_run_keeps_its_scores() {
        let out = std::env::temp_dir().join(format!("aar-score-key-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&out);
        let stages = Stages::new(out.join("stages"), false).unwrap();
        let source = |extra: Value| {
            let mut s = json!({"kind": "white-box", "reader": "fid", "model_sha256": "sha", "prompt": "p", "batch_size": 8, "settings": {"batch_size": 8}});
            s.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            json!({"top_n_sha256": "t", "n": 10, "source": s})
        };
        let old = source(json!({}));
        assert!(matches!(stages.begin("score", &old).unwrap(), Start::Fresh));
        stages.finish("score", &json!({"scored": 1})).unwrap();
        let cuda = source(json!({"device": "cuda", "dtype": "float32"}));
        keep_older_white_box_scores(&stages, &[("score", &cuda)]).unwrap();
        assert!(stages.begin("score", &cuda).is_err(), "CPU-default scores taken as CUDA's");
        let now = source(json!({"device": "cpu", "dtype": "float32"}));
        keep_older_white_box_scores(&stages, &[("score", &now)]).unwrap();
        assert!(matches!(stages.begin("score", &now).unwrap(), Start::Done(_)));
        let _ = std::fs::remove_dir_all(&out);
    }

    /// An older white-box run finished past scoring: the score key inside the select, train and
    /// final stages' keys is upgraded too, so a plain rerun finds every stage done instead of
    /// refusing the select stage as run with other inputs.
    #[test]
    fn an_older_white_box_run_keeps_its_later_stages() {
        let out = std::env::temp_dir().join(format!("aar-later-keys-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&out);
        let stages = Stages::new(out.join("stages"), false).unwrap();
        let keys = |source: Value| {
            let score = json!({"top_n_sha256": "t", "n": 10, "source": source});
            let select = json!({"retrieve": {"r": 1}, "score": score, "k": 4, "seed": 1});
            let train = json!({"select": select, "train": {"max_steps": 5}});
            let fin = json!({"train": train});
            [("score", score), ("select", select), ("train", train), ("final", fin)]
        };
        let source = json!({"kind": "white-box", "reader": "fid", "model_sha256": "sha", "prompt": "p", "batch_size": 8, "settings": {"batch_size": 8}});
        for (name, key) in keys(source.clone()) {
            assert!(matches!(stages.begin(name, &key).unwrap(), Start::Fresh));
            stages.finish(name, &json!({"stage": name})).unwrap();
        }
        let mut today_source = source;
        today_source["device"] = json!("cpu");
        today_source["dtype"] = json!("float32");
        let today = keys(today_source);
        let by_name: Vec<(&str, &Value)> = today.iter().map(|(n, k)| (*n, k)).collect();
        keep_older_white_box_scores(&stages, &by_name).unwrap();
        for (name, key) in &today {
            match stages.begin(name, key) {
                Ok(Start::Done(report)) => assert_eq!(report["stage"], *name),
                Ok(_) => panic!("the {name} stage was not done"),
                Err(e) => panic!("the {name} stage: {e:#}"),
            }
        }
        let _ = std::fs::remove_dir_all(&out);
    }

    /// A query whose first passages came from the cache and whose next found no server found
    /// no server.
    #[test]
    fn a_query_answered_in_part_from_the_cache_still_found_no_server() {
        let r = json!({"errors": [null, null, "unreachable: cannot connect", "unreachable: not asked, an earlier passage of the query found no server"]});
        assert!(found_no_server(&r));
        assert!(!found_no_server(&json!({"errors": [null, "retries_exhausted: HTTP 500"]})));
        assert!(!found_no_server(&json!({"errors": []})));
    }
}
