//! `host augment --target openai` against a fault-injecting server: 429 with `Retry-After`
//! (seconds and HTTP date), 500, bodies that are not JSON, stalls past the timeout and dropped
//! connections are retried within bounds; every item ends answered or with an error record;
//! a killed run resumes asking only for what is missing; prompts over the context are cut;
//! the API key never shows. Malformed replies are never cached; each endpoint's limit on
//! log-probabilities is kept; the cache and the resume follow the model the server serves,
//! not its port; a second run on one output is refused; oversized replies fail.

use rak_e2e::fake_openai::{FakeServer, Fault, Options};
use rak_e2e::*;
use rak_host::{Registry, Source};
use serde_json::{json, Value};
use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const KEY: &str = "sk-test-3f9c1d7e-NEVER-PRINT-ME";

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// A recipe pointing at the fake server, with short timeouts and backoffs.
fn recipe(dir: &Path, url: &str, extra: &str) -> std::path::PathBuf {
    recipe_with_corpus(dir, url, extra, &minikilt().join("corpus.jsonl"))
}

fn recipe_with_corpus(dir: &Path, url: &str, extra: &str, corpus: &Path) -> std::path::PathBuf {
    recipe_full(dir, url, "fake", extra, corpus)
}

/// A recipe with this `model` setting ("" = ask the server what it serves).
fn recipe_full(dir: &Path, url: &str, model: &str, extra: &str, corpus: &Path) -> std::path::PathBuf {
    let cfg = dir.join("recipe.toml");
    let cache = dir.join("cache");
    std::fs::write(
        &cfg,
        format!(
            "[target]\nname = \"openai\"\nsettings = {{ base_url = \"{url}/v1\", model = \"{model}\", api_key_env = \"RAK_TEST_KEY\", timeout_s = 1.0, \
             concurrency = 4, max_retries = 4, retry_budget_s = 30, backoff_base_s = 0.05, backoff_max_s = 0.2, cache_dir = \"{}\"{extra} }}\n\
             [retrieval]\ncorpus = \"{}\"\n",
            p(&cache),
            p(corpus)
        ),
    )
    .unwrap();
    cfg
}

fn augment(cfg: &Path, task: &str, n: usize, out: &Path, more: &[&str]) -> Output {
    augment_with_key(cfg, task, n, out, more, KEY)
}

fn augment_with_key(cfg: &Path, task: &str, n: usize, out: &Path, more: &[&str], key: &str) -> Output {
    augment_command(cfg, task, n, out, more, key).output().unwrap()
}

fn augment_command(cfg: &Path, task: &str, n: usize, out: &Path, more: &[&str], key: &str) -> Command {
    let input = minikilt().join(format!("{task}/dev.jsonl"));
    let limit = n.to_string();
    let mut args = vec!["augment", "--config", p(cfg), "--task", task, "--input", p(&input), "--output", p(out), "--limit", &limit];
    args.extend_from_slice(more);
    let mut c = Command::new(host_bin());
    c.args(&args).env_remove("RAK_PLUGIN_PATH").env("RAK_TEST_KEY", key);
    c
}

/// The first `n` short questions of the dev file: (id, question, first alias).
fn short_questions(n: usize) -> Vec<(String, String, String)> {
    std::fs::read_to_string(minikilt().join("shortqa/dev.jsonl"))
        .unwrap()
        .lines()
        .take(n)
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            let text = |k: &str| v[k].as_str().unwrap().to_string();
            (text("_id"), text("question"), v["answers"][0].as_str().unwrap().to_string())
        })
        .collect()
}

fn records(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

/// Every file under `dir`, as text.
fn all_text_under(dir: &Path) -> String {
    let mut s = String::new();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let path = e.path();
            if path.is_dir() {
                s.push_str(&all_text_under(&path));
            } else {
                s.push_str(&String::from_utf8_lossy(&std::fs::read(&path).unwrap_or_default()));
            }
        }
    }
    s
}

#[test]
fn every_fault_is_retried_and_every_item_answered_once() {
    let dir = TempDir::new("augment-faults");
    let faults = |i: usize| match i % 6 {
        0 => Fault::TooMany("1".into()),
        1 => Fault::TooMany(httpdate_in(Duration::from_secs(2))),
        2 => Fault::ServerError,
        3 => Fault::Garbage,
        4 => Fault::Stall(Duration::from_millis(1600)),
        _ => Fault::Close,
    };
    // Each prompt fails once with a fault chosen by its length, then succeeds.
    let server = FakeServer::start(Options {
        plan: Box::new(move |prompt, attempt| (attempt == 0).then(|| faults(prompt.len()))),
        ..Options::default()
    });
    let cfg = recipe(dir.path(), &server.url, "");
    let out_path = dir.path().join("results.jsonl");
    let out = augment(&cfg, "mc", 18, &out_path, &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let recs = records(&out_path);
    assert_eq!(recs.len(), 18);
    let ids: HashSet<&str> = recs.iter().map(|r| r["_id"].as_str().unwrap()).collect();
    assert_eq!(ids.len(), 18, "each item once");
    for r in &recs {
        assert!(r["error"].is_null(), "{r}");
        assert_eq!(r["method"], "letter_logprobs");
        for key in ["prompt_sha256", "passages", "raw", "answer", "correct"] {
            assert!(r.get(key).is_some(), "{key} missing in {r}");
        }
    }
    let answered = server.answered();
    assert_eq!(answered.len(), 18);
    assert!(answered.values().all(|&n| n == 1), "one successful answer per prompt: {answered:?}");
    let log = server.log();
    let kinds: HashSet<&str> = log.iter().map(|l| l.outcome.as_str()).collect();
    for k in ["429", "500", "garbage", "stall", "close", "ok"] {
        assert!(kinds.contains(k), "no {k} was injected: {kinds:?}");
    }
    // Retry-After is honoured: the retry of a 429 comes no sooner than it asked.
    for (i, l) in log.iter().enumerate().filter(|(_, l)| l.outcome == "429") {
        let next = log[i + 1..].iter().find(|m| m.prompt == l.prompt).expect("a retry");
        // Both forms ask for at least a second (the HTTP date, 2 s ahead, has 1 s resolution).
        assert!(next.at.duration_since(l.at) >= Duration::from_millis(950), "retried after {:?}", next.at.duration_since(l.at));
    }
    // The key went to the server, and nowhere else.
    assert!(log.iter().all(|l| l.auth.as_deref() == Some(&format!("Bearer {KEY}"))));
    let summary: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(summary["answered"], 18);
    assert_eq!(summary["failed"], 0);
    assert_eq!(summary["target_stats"]["retries"], 18);
    for text in [stdout(&out), stderr(&out), std::fs::read_to_string(&out_path).unwrap(), all_text_under(dir.path())] {
        assert!(!text.contains(KEY), "the API key leaked");
    }

    // A rerun asks nothing, not even the cache: every item is in the results file.
    let before = server.log().len();
    let again = augment(&cfg, "mc", 18, &out_path, &[]);
    assert!(again.status.success(), "{}", stderr(&again));
    assert_eq!(server.log().len(), before);
    let s2: Value = serde_json::from_str(&stdout(&again)).unwrap();
    assert_eq!((s2["target_stats"]["requests"].as_u64(), s2["target_stats"]["cache_hits"].as_u64()), (Some(0), Some(0)));
    // What this invocation asked is told apart from what it kept.
    assert_eq!((s2["timing"]["asked"].as_u64(), s2["timing"]["kept_from_earlier_runs"].as_u64()), (Some(0), Some(18)), "{s2}");
    assert_eq!(summary["timing"]["kept_from_earlier_runs"].as_u64(), Some(0), "{summary}");
    assert_eq!(records(&out_path).len(), 18);
    // A fresh output asks nothing either: every reply is in the cache.
    let fresh = dir.path().join("fresh.jsonl");
    let third = augment(&cfg, "mc", 18, &fresh, &[]);
    assert!(third.status.success(), "{}", stderr(&third));
    // (Nor does it ask for 20 alternatives again: replies cached with 5 say the server refused more.)
    assert_eq!(server.log().len(), before);
    let s: Value = serde_json::from_str(&stdout(&third)).unwrap();
    assert_eq!(s["target_stats"]["cache_hits"], 18);
    assert_eq!(s["target_stats"]["requests"], 0);
    assert_eq!(s["accuracy"], serde_json::from_str::<Value>(&stdout(&out)).unwrap()["accuracy"]);
}

fn httpdate_in(d: Duration) -> String {
    httpdate::fmt_http_date(std::time::SystemTime::now() + d)
}

#[test]
fn retries_are_bounded_and_failed_items_are_asked_again() {
    let dir = TempDir::new("augment-bounded");
    let out_path = dir.path().join("results.jsonl");
    // The first shortqa question always gets a 500 from this server.
    let first = std::fs::read_to_string(minikilt().join("shortqa/dev.jsonl")).unwrap();
    let first: Value = serde_json::from_str(first.lines().next().unwrap()).unwrap();
    let needle = first["question"].as_str().unwrap().to_string();
    let n2 = needle.clone();
    let bad = FakeServer::start(Options { plan: Box::new(move |prompt, _| prompt.contains(&n2).then_some(Fault::ServerError)), ..Options::default() });
    let cfg = recipe(dir.path(), &bad.url, ", cache = false");
    let out = augment(&cfg, "shortqa", 6, &out_path, &[]);
    assert_eq!(out.status.code(), Some(3), "some item failed: {}", stderr(&out));
    let recs = records(&out_path);
    assert_eq!(recs.len(), 6);
    let failed: Vec<&Value> = recs.iter().filter(|r| !r["error"].is_null()).collect();
    assert_eq!(failed.len(), 1);
    let msg = failed[0]["error"].as_str().unwrap();
    assert!(msg.contains("gave up after 5 attempts") && msg.contains("500"), "{msg}");
    let attempts = bad.log().iter().filter(|l| l.prompt.contains(&needle)).count();
    assert_eq!(attempts, 5, "max_retries = 4: five attempts in all");
    let summary: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!((summary["answered"].as_u64(), summary["failed"].as_u64()), (Some(5), Some(1)));
    // The headline counts the failed item wrong; the answered-only figure is given beside it.
    let correct = recs.iter().filter(|r| r["correct"] == true).count() as f64;
    assert_eq!(summary["accuracy"]["micro"].as_f64(), Some(correct / 6.0), "{summary}");
    assert_eq!(summary["accuracy"]["per_subject"]["shortqa"]["accuracy"].as_f64(), Some(correct / 6.0), "{summary}");
    assert_eq!(summary["accuracy_answered"]["micro"].as_f64(), Some(correct / 5.0), "{summary}");

    // Against a healthy server, only the failed item is asked again.
    let good = FakeServer::start(Options::default());
    let cfg = recipe(dir.path(), &good.url, ", cache = false");
    let out = augment(&cfg, "shortqa", 6, &out_path, &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let log = good.log();
    assert_eq!(log.len(), 1, "only the failed item: {log:?}");
    assert!(log[0].prompt.contains(&needle));
    let recs = records(&out_path);
    assert_eq!(recs.len(), 6);
    assert!(recs.iter().all(|r| r["error"].is_null()));
    assert_eq!(recs.iter().map(|r| r["_id"].as_str().unwrap()).collect::<HashSet<_>>().len(), 6);
}

#[test]
fn a_killed_run_resumes_with_each_item_exactly_once() {
    let dir = TempDir::new("augment-kill");
    let server = FakeServer::start(Options { delay: Duration::from_millis(120), ..Options::default() });
    // No cache: a resume that asked answered items again would show in the server's log.
    let cfg = recipe(dir.path(), &server.url, ", cache = false");
    let out_path = dir.path().join("results.jsonl");
    let input = minikilt().join("mc/dev.jsonl");
    let mut child = Command::new(host_bin())
        .args(["augment", "--config", p(&cfg), "--task", "mc", "--input", p(&input), "--output", p(&out_path), "--limit", "40", "--workers", "2"])
        .env_remove("RAK_PLUGIN_PATH")
        .env("RAK_TEST_KEY", KEY)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while std::fs::read_to_string(&out_path).map(|s| s.lines().count()).unwrap_or(0) < 6 {
        assert!(t0.elapsed() < Duration::from_secs(60), "no progress");
        assert!(child.try_wait().unwrap().is_none(), "host augment ended before it was killed");
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let before: Vec<Value> = std::fs::read_to_string(&out_path).unwrap().lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
    assert!(before.len() < 40, "killed before the end");
    let done_prompts: HashSet<String> = before.iter().map(|r| r["prompt_sha256"].as_str().unwrap().to_string()).collect();
    let asked_before = server.log().len();

    let out = augment(&cfg, "mc", 40, &out_path, &["--workers", "2"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let recs = records(&out_path);
    let mut count: HashMap<&str, usize> = HashMap::new();
    for r in &recs {
        *count.entry(r["_id"].as_str().unwrap()).or_default() += 1;
    }
    assert_eq!(count.len(), 40);
    assert!(count.values().all(|&n| n == 1), "each item exactly once");
    // Nothing answered before the kill was asked again.
    let sha = |prompt: &str| rak_host::augment::sha256(prompt);
    for l in &server.log()[asked_before..] {
        assert!(!done_prompts.contains(&sha(&l.prompt)), "an answered item was asked again");
    }
    // And nothing answered was lost: the old records are still there, unchanged.
    for r in &before {
        assert!(recs.contains(r));
    }
}

#[test]
fn prompts_over_the_context_are_cut_from_the_passages_end() {
    let dir = TempDir::new("augment-context");
    let s = slice();
    let bm25 = dir.path().join("bm25");
    let out = host(&["index", "build", "--kind", "bm25", "--corpus", p(&s.corpus), "--output", p(&bm25)]);
    assert!(out.status.success(), "{}", stderr(&out));
    // Answers without log-probabilities too: multiple choice falls back to parsing the text.
    let server = FakeServer::start(Options { context_chars: Some(900), logprobs: false, ..Options::default() });
    let cfg = recipe_with_corpus(dir.path(), &server.url, "", &s.corpus);
    let out_path = dir.path().join("results.jsonl");
    let retriever = format!("bm25:{}", p(&bm25));
    let out = augment(&cfg, "mc", 8, &out_path, &["--retriever", &retriever, "--k", "5"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let recs = records(&out_path);
    assert_eq!(recs.len(), 8);
    let cut = recs.iter().filter(|r| r["warning"].as_str().is_some_and(|w| w.contains("passages cut"))).count();
    assert!(cut > 0, "some prompt was over 900 characters and was cut");
    for r in &recs {
        assert!(r["error"].is_null(), "{r}");
        assert_eq!(r["method"], "text", "no log-probabilities: the answer is parsed from text");
        assert_eq!(r["passages"].as_array().unwrap().len(), 5);
        assert!(r["answer"].is_string());
        // A cut record names the passages still shown: a prefix of the retrieved ones, and
        // fewer than 5 (a 900-character prompt holds far fewer of these passages).
        if let Some(shown) = r["passages_shown"].as_array() {
            assert!(shown.len() < 5 && r["passages"].as_array().unwrap().starts_with(shown), "{r}");
        } else {
            assert!(r["warning"].is_null(), "a cut record without passages_shown: {r}");
        }
    }
    assert!(server.log().iter().filter(|l| l.outcome == "ok").all(|l| l.prompt.chars().count() <= 900));
    assert!(stderr(&out).contains("passages cut"), "a warning on stderr");
}

#[test]
fn the_key_never_shows_even_when_the_server_quotes_it() {
    let dir = TempDir::new("augment-echo");
    let server = FakeServer::start(Options { plan: Box::new(|_, _| Some(Fault::EchoAuth)), ..Options::default() });
    let cfg = recipe(dir.path(), &server.url, "");
    let out_path = dir.path().join("results.jsonl");
    let out = augment(&cfg, "shortqa", 2, &out_path, &[]);
    assert_eq!(out.status.code(), Some(3));
    let recs = records(&out_path);
    assert_eq!(recs.len(), 2);
    for r in &recs {
        let e = r["error"].as_str().unwrap();
        assert!(e.contains("401") && e.contains("Bearer <api key>"), "the server's quote, scrubbed: {e}");
    }
    assert_eq!(server.log().len(), 2, "a 401 is not retried");
    for text in [stdout(&out), stderr(&out), all_text_under(dir.path())] {
        assert!(!text.contains(KEY), "the API key leaked");
    }
}

#[test]
fn a_retry_after_past_the_budget_fails_at_once() {
    let dir = TempDir::new("augment-budget");
    let server = FakeServer::start(Options { plan: Box::new(|_, _| Some(Fault::TooMany("3600".into()))), ..Options::default() });
    let cfg = recipe(dir.path(), &server.url, "");
    let out_path = dir.path().join("results.jsonl");
    let t0 = Instant::now();
    let out = augment(&cfg, "mc", 1, &out_path, &[]);
    assert!(t0.elapsed() < Duration::from_secs(20), "did not wait out an hour's Retry-After");
    assert_eq!(out.status.code(), Some(3));
    let e = records(&out_path)[0]["error"].as_str().unwrap().to_string();
    assert!(e.contains("gave up after 1 attempts") && e.contains("429"), "{e}");
}

#[test]
fn a_missing_key_variable_is_a_clear_error_that_names_it() {
    let dir = TempDir::new("augment-nokey");
    let server = FakeServer::start(Options::default());
    let cfg = recipe(dir.path(), &server.url, "");
    let out_path = dir.path().join("results.jsonl");
    let input = minikilt().join("mc/dev.jsonl");
    let out = Command::new(host_bin())
        .args(["augment", "--config", p(&cfg), "--task", "mc", "--input", p(&input), "--output", p(&out_path), "--limit", "2"])
        .env_remove("RAK_PLUGIN_PATH")
        .env_remove("RAK_TEST_KEY")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("RAK_TEST_KEY"), "{}", stderr(&out));
    assert!(server.log().is_empty());
}

#[test]
fn malformed_replies_are_never_cached() {
    let dir = TempDir::new("augment-shape");
    let qs = short_questions(4);
    let shapes = [json!({"choices": []}), Value::Null, json!({"choices": [{"index": 0, "finish_reason": "stop"}]})];
    let needles: Vec<String> = qs.iter().take(3).map(|q| q.1.clone()).collect();
    // The first answer to each of three questions is well-formed JSON of the wrong shape.
    let server = FakeServer::start(Options {
        plan: Box::new(move |prompt, attempt| {
            let i = needles.iter().position(|n| prompt.contains(n.as_str()))?;
            (attempt == 0).then(|| Fault::Shape(shapes[i].clone()))
        }),
        ..Options::default()
    });
    let cfg = recipe(dir.path(), &server.url, "");
    let out_path = dir.path().join("results.jsonl");
    let out = augment(&cfg, "shortqa", 4, &out_path, &[]);
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    let recs = records(&out_path);
    let failed: Vec<&Value> = recs.iter().filter(|r| !r["error"].is_null()).collect();
    assert_eq!(failed.len(), 3, "{recs:?}");
    for r in &failed {
        assert!(r["error"].as_str().unwrap().starts_with("bad_reply"), "{r}");
    }
    // The rerun asks the server again (nothing malformed was cached) and is answered.
    let before = server.log().len();
    let again = augment(&cfg, "shortqa", 4, &out_path, &[]);
    assert!(again.status.success(), "a malformed reply was served from the cache: {}", stderr(&again));
    assert_eq!(server.log().len(), before + 3, "{:?}", &server.log()[before..]);
    assert!(records(&out_path).iter().all(|r| r["error"].is_null()));
    // Every accepted reply is cached: a fresh output asks nothing.
    let fresh = dir.path().join("fresh.jsonl");
    let third = augment(&cfg, "shortqa", 4, &fresh, &[]);
    assert!(third.status.success(), "{}", stderr(&third));
    let s: Value = serde_json::from_str(&stdout(&third)).unwrap();
    assert_eq!((s["target_stats"]["requests"].as_u64(), s["target_stats"]["cache_hits"].as_u64()), (Some(0), Some(4)), "{s}");
}

#[test]
fn a_forced_token_the_server_ignored_is_never_cached() {
    let dir = TempDir::new("augment-forced");
    // llama.cpp's /completion prompts are token ids: the fake's begin with BOS (id 1). The
    // first answer for each context ignores the logit bias.
    let server = FakeServer::start(Options { plan: Box::new(|prompt, attempt| (prompt.starts_with('\u{1}') && attempt == 0).then_some(Fault::IgnoreBias)), ..Options::default() });
    let registry = Registry::discover(&[Source::Dir(release_dir())]).unwrap();
    let settings = json!({"base_url": server.url, "model": "fake", "continuation_method": "forced", "cache_dir": dir.path().join("cache"), "max_retries": 0});
    let conn = registry.connector("openai", &settings).unwrap();
    let ask = json!({"op": "continuation_logprob", "prompt": "Q: The capital of Peru is A:", "continuation": "L"});
    let first = conn.complete(ask.clone()).unwrap();
    assert_eq!(first["error"]["kind"], "bad_reply", "{first}");
    assert!(first["error"]["message"].as_str().unwrap().contains("forced token"), "{first}");
    let second = conn.complete(ask.clone()).unwrap();
    assert!(second.get("error").is_none(), "the ignored token was served from the cache: {second}");
    assert_eq!((second["logprob"].as_f64(), second["tokens"].as_u64(), second["method"].as_str()), (Some(-0.5), Some(1), Some("forced_logit_bias")));
    let completions = server.log().iter().filter(|l| l.path == "/completion").count();
    assert_eq!(completions, 2);
    // The accepted one is cached.
    let third = conn.complete(ask).unwrap();
    assert_eq!(third["cached"], true, "{third}");
}

#[test]
fn short_keys_and_placeholders_never_rewrite_replies() {
    let dir = TempDir::new("augment-shortkey");
    // The text holds "EMPTY" (vLLM's placeholder key); every reply holds "text" and the number 1.
    let server = FakeServer::start(Options { text: Some(Box::new(|_| " EMPTY set\nQ: next".to_string())), ..Options::default() });
    for key in ["1", "text", "EMPTY"] {
        let cfg = recipe(dir.path(), &server.url, ", cache = false");
        let out_path = dir.path().join(format!("results-{key}.jsonl"));
        let out = augment_with_key(&cfg, "shortqa", 3, &out_path, &[], key);
        assert!(out.status.success(), "key {key:?}: {}", stderr(&out));
        for r in records(&out_path) {
            assert_eq!(r["answer"], "EMPTY set", "key {key:?}: {r}");
        }
    }
}

#[test]
fn openais_masked_key_in_a_refusal_is_scrubbed() {
    let dir = TempDir::new("augment-masked");
    let server = FakeServer::start(Options { plan: Box::new(|_, _| Some(Fault::PartialKey)), ..Options::default() });
    let cfg = recipe(dir.path(), &server.url, "");
    let out_path = dir.path().join("results.jsonl");
    let out = augment(&cfg, "shortqa", 1, &out_path, &[]);
    assert_eq!(out.status.code(), Some(3));
    let e = records(&out_path)[0]["error"].as_str().unwrap().to_string();
    assert!(e.contains("401") && e.contains("Incorrect API key provided: <api key>."), "{e}");
    let tail = &KEY[KEY.len() - 4..];
    for text in [e.as_str(), &stdout(&out), &stderr(&out), &all_text_under(dir.path())] {
        assert!(!text.contains(tail) && !text.contains(&KEY[..8]), "part of the key shows: {text}");
    }
}

#[test]
fn a_reply_that_quotes_the_key_is_refused_and_never_stored() {
    let dir = TempDir::new("augment-quote");
    let server = FakeServer::start(Options { plan: Box::new(|_, attempt| (attempt == 0).then_some(Fault::QuoteKey)), ..Options::default() });
    let cfg = recipe(dir.path(), &server.url, "");
    let out_path = dir.path().join("results.jsonl");
    let out = augment(&cfg, "shortqa", 2, &out_path, &[]);
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    for r in records(&out_path) {
        let e = r["error"].as_str().unwrap();
        assert!(e.contains("API key"), "{e}");
    }
    for text in [stdout(&out), stderr(&out), all_text_under(dir.path())] {
        assert!(!text.contains(KEY), "the API key leaked");
    }
    // Not cached: the rerun asks again and is answered.
    let again = augment(&cfg, "shortqa", 2, &out_path, &[]);
    assert!(again.status.success(), "{}", stderr(&again));
    assert!(!all_text_under(dir.path()).contains(KEY));
}

#[test]
fn a_body_cut_mid_stream_is_retried() {
    let dir = TempDir::new("augment-truncated");
    let server = FakeServer::start(Options { plan: Box::new(|_, attempt| (attempt == 0).then_some(Fault::Truncated)), ..Options::default() });
    let cfg = recipe(dir.path(), &server.url, "");
    let out_path = dir.path().join("results.jsonl");
    let out = augment(&cfg, "shortqa", 3, &out_path, &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(records(&out_path).iter().all(|r| r["error"].is_null()));
    let s: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(s["target_stats"]["retries"], 3, "{s}");
    assert_eq!(server.log().iter().filter(|l| l.outcome == "truncated").count(), 3);
}

#[test]
fn top_logprobs_respect_each_endpoints_limit() {
    let dir = TempDir::new("augment-toplogprobs");
    let server = FakeServer::start(Options::default());
    for (endpoint, path) in [("completions", "/v1/completions"), ("chat", "/v1/chat/completions")] {
        let cfg = recipe(dir.path(), &server.url, &format!(", endpoint = \"{endpoint}\", top_logprobs = 20, cache = false"));
        let out_path = dir.path().join(format!("mc-{endpoint}.jsonl"));
        let out = augment(&cfg, "mc", 4, &out_path, &[]);
        assert!(out.status.success(), "{endpoint}: {}", stderr(&out));
        for r in records(&out_path) {
            assert!(r["error"].is_null(), "{endpoint}: {r}");
            assert_eq!(r["method"], "letter_logprobs", "{endpoint}: {r}");
        }
        let log: Vec<_> = server.log().into_iter().filter(|l| l.path == path).collect();
        assert!(!log.is_empty(), "{endpoint}: nothing reached {path}");
        for l in &log {
            match endpoint {
                // 20 until the server refuses it by name (each worker's first try at most),
                // then OpenAI's 5; every item was answered (above).
                "completions" => assert!(
                    l.body["logprobs"] == 5 || (l.body["logprobs"] == 20 && l.outcome.contains("400")),
                    "OpenAI's limit on /v1/completions: {} {}",
                    l.body,
                    l.outcome
                ),
                _ => assert_eq!((&l.body["logprobs"], &l.body["top_logprobs"]), (&json!(true), &json!(20)), "{}", l.body),
            }
        }
        if endpoint == "completions" {
            let refused = log.iter().filter(|l| l.body["logprobs"] == 20).count();
            assert!((1..=4).contains(&refused), "the cap is learned from the first refusals: {refused} refused of {}", log.len());
        }
        // Short answers on this endpoint too.
        let out_path = dir.path().join(format!("shortqa-{endpoint}.jsonl"));
        let out = augment(&cfg, "shortqa", 3, &out_path, &[]);
        assert!(out.status.success(), "{endpoint}: {}", stderr(&out));
        for r in records(&out_path) {
            assert!(r["error"].is_null() && (r["answer"] == "A" || r["answer"] == "B"), "{endpoint}: {r}");
        }
    }
}

/// The cap of 5 on `/v1/completions` is learnt from a server's refusal (and remembered in the
/// cache for the next run), never from cached replies to a recipe that itself asked for 5.
#[test]
fn the_logprobs_cap_is_learnt_from_refusals_not_from_replies_to_5() {
    let dir = TempDir::new("augment-logprobs-cap");
    // llama.cpp takes any number: replies cached for top_logprobs = 5 must not make a later
    // run with 20 ask for 5.
    let open = FakeServer::start(Options { completions_logprobs: None, ..Options::default() });
    let cfg = recipe(dir.path(), &open.url, ", top_logprobs = 5");
    let out = augment(&cfg, "mc", 4, &dir.path().join("five.jsonl"), &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(open.log().iter().all(|l| l.body["logprobs"] == 5), "{:?}", open.log());
    let cfg = recipe(dir.path(), &open.url, ", top_logprobs = 20");
    let out = augment(&cfg, "mc", 4, &dir.path().join("twenty.jsonl"), &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let twenty: Vec<_> = open.log().into_iter().filter(|l| l.body["logprobs"] == 20).collect();
    assert_eq!(twenty.len(), 4, "each item asked for the 20 the recipe says: {:?}", open.log());
    // OpenAI's limit: learnt from the first refusals, then remembered: a rerun on the same
    // cache asks nothing over it (each item's reply to 5 is served from the cache).
    let dir = TempDir::new("augment-logprobs-cap-refused");
    let limited = FakeServer::start(Options::default());
    let cfg = recipe(dir.path(), &limited.url, ", top_logprobs = 20");
    let out = augment(&cfg, "mc", 4, &dir.path().join("first.jsonl"), &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(limited.log().iter().any(|l| l.body["logprobs"] == 20 && l.outcome.contains("400")), "{:?}", limited.log());
    let again = FakeServer::start(Options::default());
    let cfg = recipe(dir.path(), &again.url, ", top_logprobs = 20");
    let out = augment(&cfg, "mc", 4, &dir.path().join("second.jsonl"), &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(again.log().is_empty(), "the refusal was remembered and the replies served from the cache: {:?}", again.log());
}

/// The first run finds no server (the connector cannot learn what it serves) and writes
/// error records; the rerun, with the server up and listing its model, asks those items
/// instead of refusing the file as another setup's.
#[test]
fn a_first_run_without_a_server_does_not_bar_the_rerun() {
    let dir = TempDir::new("augment-first-down");
    let corpus = minikilt().join("corpus.jsonl");
    let out_path = dir.path().join("results.jsonl");
    // Port 9 (discard): nothing listens there on a test machine.
    let down = recipe_full(dir.path(), "http://127.0.0.1:9", "local", ", cache = false", &corpus);
    let out = augment(&down, "shortqa", 6, &out_path, &["--workers", "2"]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let failed = records(&out_path);
    assert!(!failed.is_empty() && failed.iter().all(|r| r["error"].as_str().is_some_and(|e| e.starts_with("unreachable:"))), "{failed:?}");
    let server = FakeServer::start(Options { models: Some(vec!["/models/x.gguf".into()]), ..Options::default() });
    let up = recipe_full(dir.path(), &server.url, "local", ", cache = false", &corpus);
    let out = augment(&up, "shortqa", 6, &out_path, &[]);
    assert!(out.status.success(), "the rerun was refused: {}", stderr(&out));
    assert!(stderr(&out).contains(&format!("asking again {} items that failed", failed.len())), "{}", stderr(&out));
    assert_eq!(server.log().len(), 6, "every item asked once: {:?}", server.log());
    let recs = records(&out_path);
    assert_eq!(recs.len(), 6);
    assert!(recs.iter().all(|r| r["error"].is_null()), "{recs:?}");
}

#[test]
fn short_answers_after_a_leading_line_break_are_read() {
    let dir = TempDir::new("augment-leading-newline");
    let qs = short_questions(6);
    let answers = qs.clone();
    // Small models often begin with a line break: "\nPortugal\nQ: ...".
    let server = FakeServer::start(Options {
        text: Some(Box::new(move |prompt| {
            let alias = answers.iter().find(|(_, q, _)| prompt.contains(q.as_str())).map(|(_, _, a)| a.clone()).unwrap_or_default();
            format!("\n{alias}\nQ: something else A: no")
        })),
        ..Options::default()
    });
    let cfg = recipe(dir.path(), &server.url, "");
    let out_path = dir.path().join("results.jsonl");
    let out = augment(&cfg, "shortqa", 6, &out_path, &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let recs = records(&out_path);
    for (id, _, alias) in &qs {
        let r = recs.iter().find(|r| r["_id"] == id.as_str()).unwrap();
        assert_eq!(r["answer"].as_str(), Some(alias.as_str()), "{r}");
        assert_eq!(r["correct"], true, "{r}");
    }
}

#[test]
fn the_cache_and_the_resume_follow_the_served_model_not_the_port() {
    let dir = TempDir::new("augment-served");
    let corpus = minikilt().join("corpus.jsonl");
    let out_path = dir.path().join("results.jsonl");
    let serving = |m: &str| FakeServer::start(Options { models: Some(vec![m.to_string()]), ..Options::default() });
    // model = "": the connector asks the server what it serves.
    let a = serving("/models/SmolLM2-135M-Instruct-Q8_0.gguf");
    let out = augment(&recipe_full(dir.path(), &a.url, "", "", &corpus), "shortqa", 3, &out_path, &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let s: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(s["model"], "/models/SmolLM2-135M-Instruct-Q8_0.gguf", "{s}");
    assert_eq!(a.log_all().iter().filter(|l| l.path == "/v1/models").count(), 1, "asked once");
    // Another model behind another port: the old answers are not resumed ...
    let b = serving("/models/qwen2.5-coder-1.5b-q4_k_m.gguf");
    let cfg_b = recipe_full(dir.path(), &b.url, "", "", &corpus);
    let out = augment(&cfg_b, "shortqa", 3, &out_path, &[]);
    assert_eq!(out.status.code(), Some(1), "another model's answers were resumed: {}", stderr(&out));
    assert!(stderr(&out).contains("another target, model"), "{}", stderr(&out));
    // ... nor its replies served from the cache.
    let out = augment(&cfg_b, "shortqa", 3, &dir.path().join("b.jsonl"), &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let s: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(s["target_stats"]["cache_hits"], 0, "{s}");
    // The first model again, restarted on another port: resumed, and its cache still serves.
    let c = serving("/models/SmolLM2-135M-Instruct-Q8_0.gguf");
    let cfg_c = recipe_full(dir.path(), &c.url, "", "", &corpus);
    let out = augment(&cfg_c, "shortqa", 3, &out_path, &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = augment(&cfg_c, "shortqa", 3, &dir.path().join("c.jsonl"), &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let s: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!((s["target_stats"]["requests"].as_u64(), s["target_stats"]["cache_hits"].as_u64()), (Some(0), Some(3)), "{s}");
    assert!(c.log_all().iter().all(|l| l.path == "/v1/models"), "only asked what it serves: {:?}", c.log_all());
    // A server that cannot say what it serves, and no model named: refused, asking for one.
    let silent = FakeServer::start(Options::default());
    let out = augment(&recipe_full(dir.path(), &silent.url, "", "", &corpus), "shortqa", 3, &dir.path().join("d.jsonl"), &[]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stderr(&out).contains("/v1/models") && stderr(&out).contains("model"), "{}", stderr(&out));
    assert!(silent.log_all().iter().all(|l| l.path == "/v1/models"), "nothing asked without a model");
    // One name given to two servers that each serve another model (llama.cpp ignores the
    // name): keyed on what each serves, so the second gets none of the first's replies, and
    // its run does not resume the first's answers.
    let (x, y) = (serving("/models/x.gguf"), serving("/models/y.gguf"));
    let named = dir.path().join("named.jsonl");
    let out = augment(&recipe_full(dir.path(), &x.url, "local", "", &corpus), "shortqa", 3, &named, &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = augment(&recipe_full(dir.path(), &y.url, "local", "", &corpus), "shortqa", 3, &named, &[]);
    assert_eq!(out.status.code(), Some(1), "another model's answers were resumed under one name: {}", stderr(&out));
    let out = augment(&recipe_full(dir.path(), &y.url, "local", "", &corpus), "shortqa", 3, &dir.path().join("named-y.jsonl"), &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let s: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(s["target_stats"]["cache_hits"], 0, "{s}");
    assert_eq!(s["model"], "/models/y.gguf", "{s}");
    // Two models served and none named: refused, naming them.
    let two = FakeServer::start(Options { models: Some(vec!["m1".into(), "m2".into()]), ..Options::default() });
    let out = augment(&recipe_full(dir.path(), &two.url, "", "", &corpus), "shortqa", 3, &dir.path().join("e.jsonl"), &[]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stderr(&out).contains("m1") && stderr(&out).contains("m2"), "{}", stderr(&out));
}

#[test]
fn a_second_run_on_the_same_output_is_refused() {
    let dir = TempDir::new("augment-lock");
    // 20 items at 400 ms each: the second run has about 8 s to start (libtorch included) and
    // reach the lock while the first still holds it, even on a loaded machine.
    let server = FakeServer::start(Options { delay: Duration::from_millis(400), ..Options::default() });
    let cfg = recipe(dir.path(), &server.url, ", cache = false");
    let out_path = dir.path().join("results.jsonl");
    let first = augment_command(&cfg, "mc", 20, &out_path, &["--workers", "1"], KEY).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let t0 = Instant::now();
    while std::fs::read_to_string(&out_path).map(|s| s.lines().count()).unwrap_or(0) < 1 {
        assert!(t0.elapsed() < Duration::from_secs(60), "no progress");
        std::thread::sleep(Duration::from_millis(20));
    }
    let second = augment(&cfg, "mc", 20, &out_path, &["--workers", "1"]);
    assert_eq!(second.status.code(), Some(1), "a second run on the same output went ahead: {}", stderr(&second));
    assert!(stderr(&second).contains("another host augment"), "{}", stderr(&second));
    let first = first.wait_with_output().unwrap();
    assert!(first.status.success(), "{}", stderr(&first));
    let recs = records(&out_path);
    assert_eq!(recs.len(), 20, "the first run's records are all there");
    assert_eq!(recs.iter().map(|r| r["_id"].as_str().unwrap()).collect::<HashSet<_>>().len(), 20);
    // Once it is done, the output is free again.
    let third = augment(&cfg, "mc", 20, &out_path, &[]);
    assert!(third.status.success(), "{}", stderr(&third));
}

#[test]
fn oversized_replies_fail_clearly() {
    let dir = TempDir::new("augment-huge");
    let qs = short_questions(2);
    let (q0, q1) = (qs[0].1.clone(), qs[1].1.clone());
    const MIB: usize = 1 << 20;
    let server = FakeServer::start(Options {
        plan: Box::new(move |prompt, _| {
            if prompt.contains(&q0) {
                Some(Fault::Huge(17 * MIB))
            } else if prompt.contains(&q1) {
                Some(Fault::HugeUnannounced(17 * MIB))
            } else {
                None
            }
        }),
        ..Options::default()
    });
    let cfg = recipe(dir.path(), &server.url, "");
    let out_path = dir.path().join("results.jsonl");
    let out = augment(&cfg, "shortqa", 3, &out_path, &[]);
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    let recs = records(&out_path);
    assert_eq!(recs.iter().filter(|r| r["error"].is_null()).count(), 1);
    for r in recs.iter().filter(|r| !r["error"].is_null()) {
        let e = r["error"].as_str().unwrap();
        assert!(e.contains("max_response_bytes") && e.contains("16777216"), "{e}");
    }
    assert_eq!(server.log().iter().filter(|l| l.outcome == "huge").count(), 2, "not retried");
}

/// No server at the address: the connector says so (not "name the model"), after its
/// retries, without asking anything.
#[test]
fn no_server_at_the_address_is_named() {
    let dir = TempDir::new("augment-noserver");
    // Port 9 (discard): nothing listens there on a test machine.
    let url = "http://127.0.0.1:9";
    let out = augment(&recipe_full(dir.path(), url, "", "", &minikilt().join("corpus.jsonl")), "shortqa", 3, &dir.path().join("r.jsonl"), &[]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stderr(&out).contains(&format!("cannot connect to {url}")) && stderr(&out).contains("--base-url"), "{}", stderr(&out));
}

/// A server that goes away in the middle of a run: the run stops once every worker's last
/// item found no server (it does not fail the rest one by one after their retries), keeps
/// what was answered, and a rerun against the server restarted on another port asks only
/// the rest.
#[test]
fn a_server_that_goes_away_stops_the_run_and_a_rerun_asks_the_rest() {
    let dir = TempDir::new("augment-gone");
    const N: usize = 60;
    let server = FakeServer::start(Options { delay: Duration::from_millis(30), ..Options::default() });
    let out_path = dir.path().join("results.jsonl");
    let corpus = minikilt().join("corpus.jsonl");
    let mut run = augment_command(&recipe_full(dir.path(), &server.url, "fake", "", &corpus), "shortqa", N, &out_path, &["--workers", "4"], KEY)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while server.log().iter().filter(|l| l.outcome == "ok").count() < 8 {
        if t0.elapsed() > Duration::from_secs(60) {
            let _ = run.kill();
            panic!("no progress");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    server.shut_down();
    let out = run.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stderr(&out).contains("the target stopped answering") && stderr(&out).contains("a rerun asks only the rest"), "{}", stderr(&out));
    let recs = records(&out_path);
    let answered: HashSet<String> = recs.iter().filter(|r| r["error"].is_null()).map(|r| r["_id"].as_str().unwrap().to_string()).collect();
    let unreachable = recs.iter().filter(|r| r["error"].as_str().is_some_and(|e| e.starts_with("unreachable:"))).count();
    assert!(answered.len() >= 8, "{} answered", answered.len());
    assert!((4..=8).contains(&unreachable), "stops after the workers' last items: {unreachable} found no server");
    assert!(recs.len() < N, "asked every item after the server went away: {} records", recs.len());
    // Back on another port: only what was not answered is asked.
    let back = FakeServer::start(Options::default());
    let out = augment(&recipe_full(dir.path(), &back.url, "fake", ", cache = false", &corpus), "shortqa", N, &out_path, &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let asked: HashSet<String> = back.log().iter().map(|l| l.prompt.clone()).collect();
    assert_eq!(back.log().len(), N - answered.len(), "asked again what was answered");
    assert_eq!(asked.len(), N - answered.len());
    let s: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!((s["items"].as_u64(), s["failed"].as_u64()), (Some(N as u64), Some(0)), "{s}");
}

/// `--retriever run:FILE` as the AAR judge stage uses it: `host search` over a dense index
/// writes the ranking, and judging from it gives the prompts `dense:INDEX` gives; a question
/// without a ranking, or with fewer than k passages, is an error naming it, before any request.
#[test]
fn a_fixed_ranking_gives_the_prompts_its_search_gave_and_a_missing_question_is_named() {
    let dir = TempDir::new("augment-ranked");
    let s = slice();
    let model = minilm_dir();
    let (emb, flat) = (dir.path().join("emb"), dir.path().join("flat"));
    for args in [
        vec!["encode", "--encoder", "dpr", "--model", p(&model), "--input", p(&s.corpus), "--output", p(&emb)],
        vec!["index", "build", "--kind", "flat", "--embeddings", p(&emb), "--output", p(&flat)],
    ] {
        let out = host(&args);
        assert!(out.status.success(), "{}", stderr(&out));
    }
    // The first 6 short-answer questions as search queries (STAGE=rank's conversion).
    let queries = dir.path().join("queries.jsonl");
    let lines: Vec<String> = short_questions(6).iter().map(|(id, q, _)| json!({"_id": id, "text": q}).to_string()).collect();
    std::fs::write(&queries, lines.join("\n") + "\n").unwrap();
    let run = dir.path().join("ranking.trec");
    let out = host(&["search", "--index", p(&flat), "--encoder", "dpr", "--model", p(&model), "--queries", p(&queries), "--k", "3", "--output", p(&run)]);
    assert!(out.status.success(), "{}", stderr(&out));

    let server = FakeServer::start(Options::default());
    let cfg = recipe_with_corpus(dir.path(), &server.url, "", &s.corpus);
    let searched = dir.path().join("searched.jsonl");
    let dense = format!("dense:{}", p(&flat));
    let out = augment(&cfg, "shortqa", 6, &searched, &["--retriever", &dense, "--k", "3", "--encoder", "dpr", "--encoder-model", p(&model)]);
    assert!(out.status.success(), "{}", stderr(&out));
    let ranked = dir.path().join("ranked.jsonl");
    let from_run = format!("run:{}", p(&run));
    let out = augment(&cfg, "shortqa", 6, &ranked, &["--retriever", &from_run, "--k", "3"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let by_id = |path: &Path| records(path).into_iter().map(|r| (r["_id"].as_str().unwrap().to_string(), r)).collect::<HashMap<_, _>>();
    let (a, b) = (by_id(&searched), by_id(&ranked));
    assert_eq!(a.len(), 6);
    for (id, r) in &a {
        assert_eq!(r["passages"].as_array().unwrap().len(), 3, "{id}");
        assert_eq!(r["passages"], b[id]["passages"], "{id}");
        assert_eq!(r["prompt_sha256"], b[id]["prompt_sha256"], "{id}: the same passages make the same prompt");
    }

    let trec = std::fs::read_to_string(&run).unwrap();
    let first = short_questions(1).remove(0).0;
    let asked = server.log().len();
    let refused = |text: String, needles: &[&str]| {
        std::fs::write(&run, text).unwrap();
        let out = augment(&cfg, "shortqa", 6, &dir.path().join("refused.jsonl"), &["--retriever", &from_run, "--k", "3"]);
        assert!(!out.status.success());
        let err = stderr(&out);
        assert!(err.contains(p(&run)) && err.contains(&format!("{first:?}")) && needles.iter().all(|n| err.contains(n)), "{err}");
        assert_eq!(server.log().len(), asked, "nothing asked");
    };
    let lines_of = |keep: &dyn Fn(&str, usize) -> bool| -> String {
        let mut seen: HashMap<String, usize> = HashMap::new();
        trec.lines()
            .filter(|l| {
                let q = l.split_whitespace().next().unwrap().to_string();
                let n = seen.entry(q.clone()).or_default();
                *n += 1;
                keep(&q, *n)
            })
            .map(|l| format!("{l}\n"))
            .collect()
    };
    refused(lines_of(&|q, _| q != first), &["no ranking"]);
    refused(lines_of(&|q, n| q != first || n <= 2), &["2 ranked passages", "--k 3"]);
    // Scores that order the first question's passages against its rank column (as distances
    // would): refused, not judged on the passages the scores put first. Tied scores are
    // accepted, and the rank column orders them.
    let mut firsts: Vec<Vec<String>> = Vec::new();
    let mut others = String::new();
    for l in trec.lines() {
        let cols: Vec<String> = l.split_whitespace().map(str::to_string).collect();
        if cols[0] == first {
            firsts.push(cols);
        } else {
            others += &format!("{l}\n");
        }
    }
    let scores: Vec<String> = firsts.iter().rev().map(|c| c[4].clone()).collect();
    let reversed: String = firsts.iter().zip(scores).map(|(c, score)| format!("{} Q0 {} {} {score} {}\n", c[0], c[2], c[3], c[5])).collect();
    refused(reversed + &others, &["rank 2", "above rank 1", "fall with rank"]);
    let tied: String = firsts.iter().map(|c| format!("{} Q0 {} {} 0.5 {}\n", c[0], c[2], c[3], c[5])).collect();
    std::fs::write(&run, tied + &others).unwrap();
    let tied_out = dir.path().join("tied.jsonl");
    let out = augment(&cfg, "shortqa", 6, &tied_out, &["--retriever", &from_run, "--k", "3"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(by_id(&tied_out)[&first]["passages"], a[&first]["passages"], "tied scores keep the rank column's order");
}
