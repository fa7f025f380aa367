//! `host aar-train` (the `aar-train` command plugin) end to end on small real slices of
//! mini-KILT with all-MiniLM-L6-v2 as the starting retriever: white-box on the committed T5
//! fixture (random weights: the preferences mean nothing, the plumbing is what is tested),
//! black-box on the fault-injecting fake OpenAI server and on the real SmolLM2; a run killed in
//! a stage resumes there and ends with the uninterrupted run's model; bad inputs are counted,
//! never fatal.

use rak_core::readers::fid::FidReader;
use rak_e2e::fake_openai::{FakeServer, Fault, Options};
use rak_e2e::*;
use serde_json::{json, Value};
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

fn t5_fixture() -> PathBuf {
    root().join("tests/fixtures/t5/t5-v1_1")
}

/// A few training steps, a checkpoint after each; only the newest kept (a resume needs no
/// other, and each holds MiniLM and AdamW's state, about 260 MB).
const TRAIN: &str = "optim = \"adamw\"\nlearning_rate = 5e-5\nper_device_train_batch_size = 4\nmax_steps = 4\nsave_steps = 1\nsave_total_limit = 1\nlogging_steps = 1\nwarmup_ratio = 0.0\nscore_scale = 20.0";

/// Data in mini-KILT's layout (`queries` squad train queries after `skip`, their gold and every
/// 40th other passage) and an aar-train recipe over it.
fn setup(dir: &Path, skip: usize, queries: usize, source: &str, aar: &str, train: &str) -> PathBuf {
    task_data(dir, &[("squad", "squad", skip, queries)], "");
    write_recipe(dir, source, aar, train)
}

fn write_recipe(dir: &Path, source: &str, aar: &str, train: &str) -> PathBuf {
    let recipe = dir.join("aar.toml");
    std::fs::write(
        &recipe,
        format!(
            "[source]\n{source}\n\n[data]\ncorpus = \"{}\"\ntask_dir = \"{}\"\ntask = \"squad\"\n\n[aar]\n{aar}\n\n[train]\n{train}\n\n[model]\nencoder = \"dpr\"\nsettings = {{ max_length = 64 }}\n",
            dir.join("corpus.jsonl").display(),
            dir.join("tasks").display()
        ),
    )
    .unwrap();
    recipe
}

fn aar_cmd(recipe: &Path, out: &Path, source: &str, extra: &[&str]) -> Command {
    let mut c = Command::new(host_bin());
    c.args(["aar-train", "--source", source, "--encoder", "dpr", "--model", p(&minilm_dir()), "--config", p(recipe), "--output-dir", p(out)])
        .args(extra)
        .env_remove("RAK_PLUGIN_PATH");
    c
}

fn summary(o: &Output) -> Value {
    assert!(o.status.success(), "aar-train failed:\n{}", stderr(o));
    serde_json::from_str(&stdout(o)).unwrap_or_else(|e| panic!("summary is not JSON ({e}): {}", stdout(o)))
}

fn weights(dir: &Path) -> Vec<(String, tch::Tensor)> {
    let mut w = tch::Tensor::read_safetensors(dir.join("model.safetensors")).unwrap();
    w.sort_by(|a, b| a.0.cmp(&b.0));
    w
}

fn same_weights(a: &Path, b: &Path) {
    let (wa, wb) = (weights(a), weights(b));
    assert_eq!(wa.len(), wb.len());
    for ((na, ta), (nb, tb)) in wa.iter().zip(wb.iter()) {
        assert_eq!(na, nb);
        let diff = (ta - tb).abs().max().double_value(&[]);
        assert!(diff <= 1e-6, "{na}: final weights differ by {diff}");
    }
}

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))).unwrap()
}

fn jsonl(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array().unwrap().iter().map(|s| s.as_str().unwrap().to_string()).collect()
}

/// How LM-preferred passages join the gold (`aar.positives`).
#[derive(Clone, Copy, PartialEq)]
enum Rule {
    /// The authors': the LM's top K of the scored passages, gold or not, less the gold.
    Authors,
    /// The top K among the scored passages that are not gold.
    TopKNonGold,
}

/// The examples of a finished run, checked against AAR's rules: positives are gold and then
/// the LM-preferred passages the rule picks, recomputed here from the score records (best
/// score first, ties to the retriever's order; failed items never picked); negatives hold no
/// positive and come from the retriever's top `depth`.
fn check_examples(out: &Path, n: usize, k: usize, depth: usize, rule: Rule) -> Vec<Value> {
    let examples = read_json(&out.join("stages/select/examples.json"))["examples"].as_array().unwrap().clone();
    let by_query = |file: &str| -> std::collections::HashMap<String, Value> {
        jsonl(&out.join(file)).into_iter().map(|r| (r["query_id"].as_str().unwrap().to_string(), r)).collect()
    };
    let (retrieved, scores) = (by_query("stages/retrieve/retrieved.jsonl"), by_query("stages/score/scores.jsonl"));
    for e in &examples {
        let (gold, positives, negatives, added) = (strings(&e["gold"]), strings(&e["positives"]), strings(&e["negatives"]), strings(&e["lm_preferred"]));
        let qid = e["query_id"].as_str().unwrap();
        let hits = strings(&retrieved[qid]["hits"]);
        assert_eq!(&positives[..gold.len()], &gold[..], "positives begin with gold: {e}");
        assert_eq!(&positives[gold.len()..], &added[..], "then the LM-preferred: {e}");
        let rec = &scores[qid];
        let passages = strings(&rec["passages"]);
        assert_eq!(&passages[..], &hits[..n.min(hits.len())], "the scored passages are the top N: {rec}");
        // The scored passages, best first; a stable sort keeps the retriever's order on ties.
        let mut ranked: Vec<(String, f64)> = passages.iter().zip(rec["scores"].as_array().unwrap()).filter_map(|(p, s)| s.as_f64().map(|s| (p.clone(), s))).collect();
        ranked.sort_by(|a, b| b.1.total_cmp(&a.1));
        let want: Vec<String> = match rule {
            Rule::Authors => ranked.iter().take(k).filter(|(p, _)| !gold.contains(p)).map(|(p, _)| p.clone()).collect(),
            Rule::TopKNonGold => ranked.iter().filter(|(p, _)| !gold.contains(p)).take(k).map(|(p, _)| p.clone()).collect(),
        };
        assert_eq!(added, want, "the LM-preferred passages by the rule: {e} {rec}");
        assert!(negatives.iter().all(|x| !positives.contains(x) && hits[..depth.min(hits.len())].contains(x)), "negatives: {e}");
        assert_eq!(negatives.iter().collect::<HashSet<_>>().len(), negatives.len(), "distinct negatives: {e}");
    }
    examples
}

/// Every query's scores differ between its passages (what makes "the best scored" mean
/// something in [`check_examples`]).
fn distinct_scores(out: &Path) {
    for r in jsonl(&out.join("stages/score/scores.jsonl")) {
        let s: Vec<String> = r["scores"].as_array().unwrap().iter().filter(|x| !x.is_null()).map(|x| x.to_string()).collect();
        assert_eq!(s.iter().collect::<HashSet<_>>().len(), s.len(), "two passages of a query scored the same: {r}");
    }
}

/// White-box end to end on the T5 fixture: every stage's file, the summary and analysis, the
/// reader's preferences exactly as the `fid` reader computes them, a model `host search` uses,
/// and a rerun that finds everything done.
#[test]
fn white_box_end_to_end_on_the_t5_fixture() {
    let dir = TempDir::new("aar-white");
    let (n, k) = (5, 2);
    let recipe = setup(dir.path(), 0, 8, "reader_template = \" {question}\"\nbatch_size = 3", "n = 5\nk = 2\nnegatives_depth = 30\nnegatives_sampled = 10\nnegatives_per_query = 2", TRAIN);
    let out = dir.path().join("out");
    let o = aar_cmd(&recipe, &out, p(&t5_fixture()), &[]).output().unwrap();
    let s = summary(&o);
    assert_eq!((s["queries"].as_u64(), s["scored"].as_u64(), s["failed"].as_u64()), (Some(8), Some(8 * n as u64), Some(0)), "{s}");
    assert_eq!(s["source"]["kind"], "white-box");
    for stage in ["retrieve", "score", "select", "train", "final"] {
        assert!(out.join(format!("stages/{stage}.done.json")).exists(), "{stage} not marked done");
        assert_eq!(s["stages"][stage], "ran");
    }
    for f in ["stages/retrieve/retrieved.jsonl", "stages/score/scores.jsonl", "stages/select/examples.json", "analysis.json", "stages/summary.json", "model.safetensors"] {
        assert!(out.join(f).exists(), "{f} missing");
    }
    assert!(!out.join("stages/retrieve/emb").exists(), "the corpus embeddings are removed once the ranking is kept");
    let examples = check_examples(&out, n, k, 30, Rule::Authors);
    assert_eq!(examples.len(), 8);
    assert_eq!(s["positives_added"].as_u64(), Some(examples.iter().map(|e| e["lm_preferred"].as_array().unwrap().len() as u64).sum()));
    let a = read_json(&out.join("analysis.json"));
    let (picks, gold) = (a["lm_preferred"].as_u64().unwrap(), a["lm_preferred_gold"].as_u64().unwrap());
    assert_eq!(picks, 8 * k as u64, "{a}");
    // The authors' overlap: LM top-K passages that are gold / gold passages; the other share
    // divides by the LM's picks.
    let gold_passages: u64 = examples.iter().map(|e| e["gold"].as_array().unwrap().len() as u64).sum();
    assert_eq!((a["gold_passages"].as_u64(), a["positives_rule"].as_str()), (Some(gold_passages), Some("authors")), "{a}");
    assert!((a["overlap_authors"].as_f64().unwrap() - gold as f64 / gold_passages as f64).abs() < 1e-12, "{a}");
    assert!((a["lm_preferred_gold_share"].as_f64().unwrap() - gold as f64 / picks as f64).abs() < 1e-12, "{a}");
    assert_eq!((&s["overlap_authors"], &s["lm_preferred_gold_share"]), (&a["overlap_authors"], &a["lm_preferred_gold_share"]));
    // The authors' rule adds the LM's top K less the gold among them.
    assert_eq!(s["positives_added"].as_u64(), Some(picks - gold), "{s} {a}");
    // The trained model is the train stage's, and training moved it.
    same_weights(&out, &out.join("stages/train"));
    let moved = weights(&out).iter().zip(weights(&minilm_dir()).iter()).any(|((_, a), (_, b))| a.size() == b.size() && (a - b).abs().max().double_value(&[]) > 0.0);
    assert!(moved, "training changed nothing");

    // The scores are the reader's own, on the prompt AAR builds (passage[:500] + prompt).
    let mut reader = FidReader::create(json!({"model": t5_fixture(), "passage_chars": 500})).unwrap();
    let corpus = rak_retrieval::data::beir::load_corpus(&dir.path().join("corpus.jsonl")).unwrap();
    let record = &jsonl(&out.join("stages/score/scores.jsonl"))[0];
    let query = &jsonl(&out.join("stages/retrieve/retrieved.jsonl"))[0];
    let passages: Vec<Value> = strings(&record["passages"]).iter().map(|id| json!({"title": corpus.get(id.as_str()).unwrap().title, "text": corpus.get(id.as_str()).unwrap().text})).collect();
    let prompt = format!(" {}", query["query"].as_str().unwrap());
    let direct = reader.passage_preferences(json!({"items": [{"prompt": prompt, "passages": passages}]})).unwrap();
    for (a, b) in record["scores"].as_array().unwrap().iter().zip(direct["items"][0]["scores"].as_array().unwrap()) {
        assert!((a.as_f64().unwrap() - b.as_f64().unwrap()).abs() < 1e-6, "{record} vs {direct}");
    }

    // `host search` uses the output folder as a model.
    let (emb, idx, run) = (dir.path().join("emb"), dir.path().join("idx"), dir.path().join("run.trec"));
    let queries = dir.path().join("tasks/squad/queries.train.jsonl");
    for args in [
        vec!["encode", "--encoder", "dpr", "--model", p(&out), "--input", p(&dir.path().join("corpus.jsonl")), "--output", p(&emb)],
        vec!["index", "build", "--kind", "flat", "--embeddings", p(&emb), "--output", p(&idx)],
        vec!["search", "--index", p(&idx), "--encoder", "dpr", "--model", p(&out), "--queries", p(&queries), "--k", "5", "--output", p(&run)],
    ] {
        let o = host(&args);
        assert!(o.status.success(), "{args:?}: {}", stderr(&o));
    }
    assert_eq!(std::fs::read_to_string(&run).unwrap().lines().count(), 8 * 5);

    // A rerun finds every stage done and says the same, and leaves the model's identity alone:
    // embeddings made from it before are still its own.
    let again = summary(&aar_cmd(&recipe, &out, p(&t5_fixture()), &[]).output().unwrap());
    let o = host(&["encode", "--encoder", "dpr", "--model", p(&out), "--input", p(&dir.path().join("corpus.jsonl")), "--output", p(&emb)]);
    assert!(o.status.success() && stderr(&o).contains("already complete"), "{}", stderr(&o));
    for stage in ["retrieve", "score", "select", "train", "final"] {
        assert_eq!(again["stages"][stage], "done earlier");
    }
    assert_eq!((again["scored"].clone(), again["overlap_authors"].clone(), again["examples"].clone()), (s["scored"].clone(), s["overlap_authors"].clone(), s["examples"].clone()));
}

/// Kill `child` (SIGKILL) once `ready` holds, after `delay` more; whether it was still running.
fn kill_when(child: &mut std::process::Child, ready: impl Fn() -> bool, delay: Duration) -> bool {
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(300) {
        if ready() || child.try_wait().unwrap().is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(delay);
    let alive = child.try_wait().unwrap().is_none();
    let _ = child.kill();
    let _ = child.wait();
    alive
}

/// Delays drawn from a fixed seed (a small LCG): the kills land at the same moments each run.
fn delays(seed: u64, max_ms: u64) -> impl Iterator<Item = Duration> {
    let mut x = seed;
    std::iter::from_fn(move || {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        Some(Duration::from_millis((x >> 33) % max_ms))
    })
}

fn lines(path: &Path) -> usize {
    std::fs::read_to_string(path).map(|t| t.lines().count()).unwrap_or(0)
}

fn has_checkpoint(dir: &Path) -> bool {
    std::fs::read_dir(dir).map(|d| d.flatten().any(|e| e.file_name().to_string_lossy().starts_with("checkpoint-"))).unwrap_or(false)
}

/// White-box: SIGKILL in the score stage (after its first record), in the train stage (after
/// its first checkpoint, at a moment drawn from a fixed seed) and in the final stage (its
/// model written, its done marker not: the stage is too quick to kill from outside); each
/// rerun resumes in that stage and ends with the uninterrupted run's weights. Each kill must
/// land in its stage, or the test fails.
#[test]
fn a_run_killed_in_scoring_and_training_resumes_to_the_same_model() {
    let dir = TempDir::new("aar-kill");
    let recipe = setup(dir.path(), 40, 12, "batch_size = 2", "n = 10\nk = 2\nnegatives_depth = 40\nnegatives_sampled = 8\nnegatives_per_query = 2", TRAIN);
    let whole = dir.path().join("whole");
    let s = summary(&aar_cmd(&recipe, &whole, p(&t5_fixture()), &[]).output().unwrap());

    let killed = dir.path().join("killed");
    // Killed as soon as the first of six batches is recorded: the other five are still to run.
    let scores = killed.join("stages/score/scores.jsonl");
    let mut child = aar_cmd(&recipe, &killed, p(&t5_fixture()), &[]).stderr(Stdio::null()).stdout(Stdio::null()).spawn().unwrap();
    let in_scoring = kill_when(&mut child, || lines(&scores) > 0, Duration::ZERO) && !killed.join("stages/score.done.json").exists();
    let recorded = lines(&scores);
    assert!(in_scoring && recorded < 12, "the kill did not land in scoring ({recorded} of 12 records)");
    let mut d = delays(22, 1500);
    let train = killed.join("stages/train");
    let mut child = aar_cmd(&recipe, &killed, p(&t5_fixture()), &[]).stderr(Stdio::null()).stdout(Stdio::null()).spawn().unwrap();
    let in_training = kill_when(&mut child, || has_checkpoint(&train), d.next().unwrap()) && !killed.join("stages/train.done.json").exists();
    assert!(in_training, "the kill did not land in training");

    // The resume, killed again in the final stage.
    let o = aar_cmd(&recipe, &killed, p(&t5_fixture()), &[]).env("RAK_AAR_DIE_BEFORE_DONE", "final").output().unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(o.status.signal(), Some(9), "the run did not die in the final stage: {:?}\n{}", o.status, stderr(&o));
    let resumed = stderr(&o);
    assert!(resumed.contains("resumed from") && resumed.contains("stage train: resumed"), "{resumed}");
    for stage in ["retrieve", "score", "select"] {
        assert!(resumed.contains(&format!("stage {stage}: done earlier")), "{resumed}");
    }
    assert!(killed.join("stages/train.done.json").exists() && killed.join("stages/final.key.json").exists(), "the kill came before the final stage began");
    assert!(!killed.join("stages/final.done.json").exists(), "the kill came after the final stage");

    let o = aar_cmd(&recipe, &killed, p(&t5_fixture()), &[]).output().unwrap();
    let r = summary(&o);
    for stage in ["retrieve", "score", "select", "train"] {
        assert_eq!(r["stages"][stage], "done earlier", "{r}");
    }
    assert_eq!(r["stages"]["final"], "resumed", "{r}");
    assert_eq!(lines(&scores), 12, "one record per query, none repeated");
    assert_eq!((r["overlap_authors"].clone(), r["positives_added"].clone()), (s["overlap_authors"].clone(), s["positives_added"].clone()));
    assert_eq!(std::fs::read(whole.join("stages/select/examples.json")).unwrap(), std::fs::read(killed.join("stages/select/examples.json")).unwrap());
    same_weights(&whole, &killed);
    same_weights(&killed, &killed.join("stages/train"));
}

/// A death as a SIGKILL's at the end of each stage too quick to kill from outside (retrieve
/// and select: the output written, the done marker not, through `RAK_AAR_DIE_BEFORE_DONE`),
/// then a rerun: it resumes that stage from what is on disk and ends with the uninterrupted
/// run's examples and weights.
#[test]
fn a_run_that_dies_as_retrieve_or_select_ends_resumes_to_the_same_model() {
    let dir = TempDir::new("aar-die");
    let recipe = setup(dir.path(), 60, 6, "batch_size = 3", "n = 4\nk = 1\nnegatives_depth = 20\nnegatives_sampled = 4\nnegatives_per_query = 2", TRAIN);
    let whole = dir.path().join("whole");
    summary(&aar_cmd(&recipe, &whole, p(&t5_fixture()), &[]).output().unwrap());
    for stage in ["retrieve", "select"] {
        let out = dir.path().join(format!("died-{stage}"));
        let o = aar_cmd(&recipe, &out, p(&t5_fixture()), &[]).env("RAK_AAR_DIE_BEFORE_DONE", stage).output().unwrap();
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(o.status.signal(), Some(9), "{stage}: the run did not die by SIGKILL: {:?}\n{}", o.status, stderr(&o));
        let marks = |m: &str| out.join(format!("stages/{stage}.{m}.json")).exists();
        assert!(marks("key") && !marks("done"), "{stage}: begun, not done");
        let r = summary(&aar_cmd(&recipe, &out, p(&t5_fixture()), &[]).output().unwrap());
        assert_eq!(r["stages"][stage], "resumed", "{r}");
        assert_eq!(std::fs::read(whole.join("stages/select/examples.json")).unwrap(), std::fs::read(out.join("stages/select/examples.json")).unwrap());
        same_weights(&whole, &out);
    }
}

/// The fake server's settings for a recipe: its model named (it lists none), tokens forced
/// one by one as on llama.cpp, the cache in the test's folder, no retries.
fn fake_source(cache: &Path, extra: &str) -> String {
    format!(
        "settings = {{ base_url = \"http://127.0.0.1:9\", model = \"fake\", continuation_method = \"forced\", cache_dir = \"{}\", max_retries = 0, concurrency = 4 }}\nworkers = 3\n{extra}",
        cache.display()
    )
}

/// Black-box on the fake server: each passage scored by the connector's continuation
/// log-likelihood of the first answer after the recipe's prompt; a run killed while scoring
/// resumes by query id and ends with the uninterrupted run's model; a rerun over the same
/// cache asks the server nothing.
#[test]
fn black_box_scores_through_the_connector_and_resumes_a_killed_scoring() {
    let dir = TempDir::new("aar-black");
    let server = FakeServer::start(Options { delay: Duration::from_millis(3), ..Options::distinct_scores() });
    let cache = dir.path().join("cache");
    let source = fake_source(&cache, "template = \"{title}: {passage}\\nQ: {question}\\nA:\"\ncontinuation = \" {answer}\"");
    let recipe = setup(dir.path(), 100, 8, &source, "n = 4\nk = 1\nnegatives_depth = 30\nnegatives_sampled = 6\nnegatives_per_query = 2\npassage_chars = 120", TRAIN);
    let whole = dir.path().join("whole");
    let s = summary(&aar_cmd(&recipe, &whole, "openai", &["--base-url", &server.url]).output().unwrap());
    assert_eq!((s["scored"].as_u64(), s["failed"].as_u64(), s["source"]["kind"].as_str()), (Some(32), Some(0), Some("black-box")), "{s}");
    assert!(s["scoring"]["passages"] == 32 && s["scoring"]["scored_per_second"].as_f64().is_some_and(|r| r > 0.0), "{s}");
    let records = jsonl(&whole.join("stages/score/scores.jsonl"));
    let retrieved = jsonl(&whole.join("stages/retrieve/retrieved.jsonl"));
    let corpus = rak_retrieval::data::beir::load_corpus(&dir.path().join("corpus.jsonl")).unwrap();
    // What the server was asked: the prompt as the recipe builds it (the passage cut at 120
    // characters), the continuation " ANSWER" forced token by token.
    let asked: HashSet<String> = server.log().iter().filter(|l| l.path == "/tokenize").map(|l| l.prompt.clone()).collect();
    for q in &retrieved {
        let rec = records.iter().find(|r| r["query_id"] == q["query_id"]).unwrap();
        assert!(rec["methods"].as_array().unwrap().iter().all(|m| m == "forced_logit_bias"), "{rec}");
        let answer = q["answers"][0].as_str().unwrap();
        assert_eq!(rec["continuation"], format!(" {answer}"));
        // One token per character on the fake, each forced with a log-probability in
        // [-2, -0.1) drawn from the prompt it follows: the passages' scores differ.
        let tokens = (answer.chars().count() + 1) as f64;
        assert!(rec["scores"].as_array().unwrap().iter().all(|x| (-2.0 * tokens..-0.1 * tokens).contains(&x.as_f64().unwrap())), "{rec}");
        for id in strings(&rec["passages"]) {
            let d = corpus.get(id.as_str()).unwrap();
            let cut: String = d.text.chars().take(120).collect();
            let prompt = format!("{}: {cut}\nQ: {}\nA:", d.title, q["query"].as_str().unwrap());
            assert!(asked.contains(&prompt), "never asked {prompt:?}");
        }
    }
    distinct_scores(&whole);
    check_examples(&whole, 4, 1, 30, Rule::Authors);

    // Killed while scoring (its own cache, so the server is really asked), then resumed.
    let killed = dir.path().join("killed");
    let recipe2 = write_recipe(dir.path(), &fake_source(&dir.path().join("cache2"), "template = \"{title}: {passage}\\nQ: {question}\\nA:\"\ncontinuation = \" {answer}\""),
        "n = 4\nk = 1\nnegatives_depth = 30\nnegatives_sampled = 6\nnegatives_per_query = 2\npassage_chars = 120", TRAIN);
    let scores = killed.join("stages/score/scores.jsonl");
    let before = server.log().len();
    let mut child = aar_cmd(&recipe2, &killed, "openai", &["--base-url", &server.url]).stderr(Stdio::null()).stdout(Stdio::null()).spawn().unwrap();
    let landed = kill_when(&mut child, || lines(&scores) > 0, delays(7, 200).next().unwrap()) && !killed.join("stages/score.done.json").exists();
    let recorded = lines(&scores);
    assert!(landed && recorded < 8, "the kill did not land while scoring ({recorded} of 8 queries recorded)");
    let o = aar_cmd(&recipe2, &killed, "openai", &["--base-url", &server.url]).output().unwrap();
    let r = summary(&o);
    assert_eq!(r["stages"]["score"], "resumed", "{r}");
    assert!(stderr(&o).contains("scored earlier"), "{}", stderr(&o));
    assert_eq!(lines(&scores), 8, "one record per query");
    // Nothing answered was asked again, but for what was on the wire when the kill came (at
    // most the connector's concurrency): the records and the connector's cache hold the rest.
    let ok = |log: &[rak_e2e::fake_openai::Logged]| log.iter().filter(|l| l.outcome == "ok").count();
    let (whole_asked, killed_asked) = (ok(&server.log()[..before]), ok(&server.log()[before..]));
    assert!(killed_asked <= whole_asked + 4, "the killed and resumed runs asked {killed_asked} times, the whole run {whole_asked}");
    same_weights(&whole, &killed);

    // A new run over the first cache asks the server nothing.
    let before = server.log().len();
    let again = dir.path().join("again");
    summary(&aar_cmd(&recipe, &again, "openai", &["--base-url", &server.url]).output().unwrap());
    assert_eq!(server.log().len(), before, "a rerun over the same cache asked the server again");
    same_weights(&whole, &again);
}

/// REPLUG's mode (`aar.mode = "replug"`) over black-box scores that differ by passage: each
/// example carries its scored passages with the source's log-likelihoods, exactly as scored;
/// the trainer runs the `lm_supervised` loss with the recipe's β and no hard negatives, and
/// the KL it logs falls as the retriever learns the LM's preferences over the same queries. A
/// white-box source is refused for this mode.
#[test]
fn replug_trains_the_retriever_toward_the_lm_s_distribution() {
    let dir = TempDir::new("aar-replug");
    let source = fake_source(&dir.path().join("cache"), "");
    let train = "optim = \"adamw\"\nlearning_rate = 1e-4\nper_device_train_batch_size = 4\nmax_steps = 12\nsave_steps = 6\nlogging_steps = 1\nwarmup_ratio = 0.0\nscore_scale = 20.0\nlm_temperature = 0.5";
    let aar = "mode = \"replug\"\nn = 4\nk = 1\nnegatives_depth = 30\nnegatives_sampled = 6\nnegatives_per_query = 2\npassage_chars = 120";
    let recipe = setup(dir.path(), 100, 9, &source, aar, train);
    // Each forced token's log-probability from the length of the prompt it follows: passages
    // of one query get different scores. Every item of the second query fails, and every item
    // of the fourth but its gold passage's (retrieved in its top 4).
    let queries = jsonl(&dir.path().join("tasks/squad/queries.train.jsonl"));
    let text = |i: usize| queries[i]["text"].as_str().unwrap().to_string();
    let (all_fail, all_but_gold) = (text(1), text(3));
    let gold_id = std::fs::read_to_string(dir.path().join("tasks/squad/qrels.train.tsv")).unwrap().lines()
        .find(|l| l.starts_with(&format!("{}\t", queries[3]["_id"].as_str().unwrap()))).unwrap().split('\t').nth(1).unwrap().to_string();
    let corpus = rak_retrieval::data::beir::load_corpus(&dir.path().join("corpus.jsonl")).unwrap();
    let gold_cut: String = corpus.get(gold_id.as_str()).unwrap().text.chars().take(120).collect();
    let server = FakeServer::start(Options {
        forced_logprob: Some(Box::new(|prompt: &str| -0.2 - 0.4 * (prompt.chars().count() % 5) as f64)),
        plan: Box::new(move |prompt, _| (prompt.contains(&all_fail) || (prompt.contains(&all_but_gold) && !prompt.contains(&gold_cut))).then_some(Fault::ServerError)),
        ..Options::default()
    });
    let out = dir.path().join("out");
    let s = summary(&aar_cmd(&recipe, &out, "openai", &["--base-url", &server.url]).output().unwrap());
    assert_eq!(s["scored"].as_u64().unwrap() + s["failed"].as_u64().unwrap(), 36, "{s}");

    let records: std::collections::HashMap<String, Value> =
        jsonl(&out.join("stages/score/scores.jsonl")).into_iter().map(|r| (r["query_id"].as_str().unwrap().to_string(), r)).collect();
    let scored_pairs = |r: &Value| -> Vec<Value> {
        strings(&r["passages"]).into_iter().zip(r["scores"].as_array().unwrap()).filter(|(_, s)| !s.is_null()).map(|(p, s)| json!([p, s])).collect()
    };
    // Queries with no scored passage, with one (REPLUG's KL over one is 0), and the rest.
    let count = |f: &dyn Fn(usize) -> bool| records.values().filter(|r| f(scored_pairs(r).len())).count() as u64;
    let (none, one, rest) = (count(&|n| n == 0), count(&|n| n == 1), count(&|n| n >= 2));
    assert!(none == 1 && one == 1 && s["failed"].as_u64() == Some(7), "the failures did not land as planned: {s}");
    assert_eq!(
        (s["queries_without_scores"].as_u64(), s["dropped_fewer_than_two_scored"].as_u64(), s["examples"].as_u64()),
        (Some(none), Some(one), Some(rest)),
        "{s}"
    );
    let examples = read_json(&out.join("stages/select/examples.json"))["examples"].as_array().unwrap().clone();
    let mut distinct = HashSet::new();
    for e in &examples {
        let rec = &records[e["query_id"].as_str().unwrap()];
        let want = scored_pairs(rec);
        assert_eq!(e["lm_scores"].as_array().unwrap(), &want, "the example's LM scores are its scored passages, failed ones left out: {e}");
        assert_eq!((strings(&e["positives"]), e["negatives"].as_array().unwrap().len()), (strings(&e["gold"]), 0), "{e}");
        distinct.extend(want.iter().map(|w| w[1].to_string()));
    }
    assert!(distinct.len() > 2, "the fake's scores should differ by passage: {distinct:?}");

    let state = read_json(&out.join("stages/train/checkpoint-12/trainer_state.json"));
    let c = &state["config"];
    assert_eq!((c["loss"].as_str(), c["lm_temperature"].as_f64(), c["hard_negatives"].as_u64()), (Some("lm_supervised"), Some(0.5), Some(0)), "{c}");
    // The KL per step over 3 epochs of the same 8 queries: lower at the end.
    let losses: Vec<f64> = jsonl(&out.join("stages/train/trainer_log.jsonl")).iter().filter_map(|l| l["loss"]["squad"].as_f64()).collect();
    assert_eq!(losses.len(), 12, "{losses:?}");
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    assert!(mean(&losses[8..]) < 0.8 * mean(&losses[..4]), "the KL did not fall: {losses:?}");
    let analysis = read_json(&out.join("analysis.json"));
    // The analysis covers every query with a score, the one with a single one too.
    assert_eq!(analysis["queries_with_lm_scores"].as_u64(), Some(9 - none), "{analysis}");
    // The mode wants log-likelihoods: a white-box source is refused before anything runs.
    let o = aar_cmd(&recipe, &dir.path().join("white"), p(&t5_fixture()), &[]).output().unwrap();
    assert!(!o.status.success() && stderr(&o).contains("black-box"), "{}", stderr(&o));
    assert!(!dir.path().join("white/stages").exists());

    // A second source (other scores, AAR's mode) compared with the first: the share of its
    // top K (1) that is the first's, over the 8 queries both scored on the same top N.
    let other = FakeServer::start(Options { forced_logprob: Some(Box::new(|prompt: &str| -0.1 - 0.3 * (prompt.chars().count() % 3) as f64)), ..Options::default() });
    let recipe2 = write_recipe(dir.path(), &fake_source(&dir.path().join("cache2"), ""), &aar.replace("mode = \"replug\"\n", ""), TRAIN);
    let out2 = dir.path().join("second");
    let s2 = summary(&aar_cmd(&recipe2, &out2, "openai", &["--base-url", &other.url, "--compare-with", p(&out)]).output().unwrap());
    // Each source's best passage among those both scored (ties to the higher-ranked).
    let top1 = |r: &Value, mask: &Value| {
        let s: Vec<f64> = r["scores"].as_array().unwrap().iter().zip(mask["scores"].as_array().unwrap())
            .map(|(x, m)| if m.is_null() { f64::NEG_INFINITY } else { x.as_f64().unwrap_or(f64::NEG_INFINITY) }).collect();
        (0..s.len()).fold(0, |b, i| if s[i] > s[b] { i } else { b })
    };
    let second: std::collections::HashMap<String, Value> =
        jsonl(&out2.join("stages/score/scores.jsonl")).into_iter().map(|r| (r["query_id"].as_str().unwrap().to_string(), r)).collect();
    let both: Vec<&String> = second.keys().filter(|q| !scored_pairs(&records[q.as_str()]).is_empty()).collect();
    let same = both.iter().filter(|q| top1(&second[q.as_str()], &records[q.as_str()]) == top1(&records[q.as_str()], &second[q.as_str()])).count();
    let o = &s2["sources_overlap"][0];
    assert_eq!(
        (o["queries_compared"].as_u64(), o["queries_with_other_passages"].as_u64(), o["queries_not_scored_by_both"].as_u64(), o["queries_not_in_other"].as_u64()),
        (Some(both.len() as u64), Some(0), Some(1), Some(0)),
        "{o}"
    );
    assert_eq!(o["other_score_stage_finished"], true, "{o}");
    assert!((o["overlap"].as_f64().unwrap() - same as f64 / both.len() as f64).abs() < 1e-12, "{o}: {same} of {}", both.len());
    assert_eq!(o["source"]["kind"], "black-box", "{o}");
    assert_eq!(read_json(&out2.join("stages/sources_overlap.json")), s2["sources_overlap"]);
    // A folder that is no run is refused before any work.
    let o = aar_cmd(&recipe2, &dir.path().join("third"), "openai", &["--base-url", &other.url, "--compare-with", p(dir.path())]).output().unwrap();
    assert!(!o.status.success() && stderr(&o).contains("not an aar-train run"), "{}", stderr(&o));
}

/// Bad inputs are counted, never fatal: queries without gold are dropped; a corpus smaller
/// than N gives what there is; items the source fails are recorded, skipped and counted (and a
/// stage where every item failed stops, then resumes against a healthy server); a query
/// without an answer is not asked. Changed inputs are refused, or with --overwrite redone from
/// the first stage they touch.
#[test]
fn bad_inputs_are_counted_and_failures_skipped() {
    let dir = TempDir::new("aar-bad");
    // A tiny corpus: the gold passages of 6 queries and 3 others.
    task_data(dir.path(), &[("squad", "squad", 300, 6)], "");
    let corpus_path = dir.path().join("corpus.jsonl");
    let gold: HashSet<String> = std::fs::read_to_string(dir.path().join("tasks/squad/qrels.train.tsv")).unwrap().lines().skip(1).map(|l| l.split('\t').nth(1).unwrap().to_string()).collect();
    let all: Vec<String> = std::fs::read_to_string(&corpus_path).unwrap().lines().map(String::from).collect();
    let mut others = 0;
    let kept: Vec<String> = all
        .into_iter()
        .filter(|l| {
            let id = serde_json::from_str::<Value>(l).unwrap()["_id"].as_str().unwrap().to_string();
            gold.contains(&id) || {
                others += 1;
                others <= 3
            }
        })
        .collect();
    std::fs::write(&corpus_path, kept.join("\n") + "\n").unwrap();
    let passages = kept.len();
    assert!(passages < 10, "{passages} passages");
    // Two queries without gold (one unjudged, one judged on a passage the corpus lacks) and one
    // without answers.
    let qfile = dir.path().join("tasks/squad/queries.train.jsonl");
    let mut q = std::fs::read_to_string(&qfile).unwrap();
    q.push_str("{\"_id\": \"x:unjudged\", \"text\": \"who is nobody?\", \"answers\": [\"no one\"]}\n");
    q.push_str("{\"_id\": \"x:missing\", \"text\": \"where is nowhere?\", \"answers\": [\"here\"]}\n");
    let gold_of_first = std::fs::read_to_string(dir.path().join("tasks/squad/qrels.train.tsv")).unwrap().lines().nth(1).unwrap().split('\t').nth(1).unwrap().to_string();
    q.push_str("{\"_id\": \"x:noanswer\", \"text\": \"what has no answer?\", \"answers\": []}\n");
    std::fs::write(&qfile, q).unwrap();
    let mut qrels = std::fs::read_to_string(dir.path().join("tasks/squad/qrels.train.tsv")).unwrap();
    qrels.push_str("x:missing\tnot:in:corpus\t1\n");
    qrels.push_str(&format!("x:noanswer\t{gold_of_first}\t1\n"));
    std::fs::write(dir.path().join("tasks/squad/qrels.train.tsv"), qrels).unwrap();

    // Every item of the first server fails: the stage stops, nothing is marked done.
    let down = FakeServer::start(Options { plan: Box::new(|_, _| Some(Fault::ServerError)), ..Options::default() });
    let cache = dir.path().join("cache");
    let aar = "n = 10\nk = 2\nnegatives_depth = 200\nnegatives_sampled = 30\nnegatives_per_query = 1";
    let recipe = write_recipe(dir.path(), &fake_source(&cache, ""), aar, &TRAIN.replace("max_steps = 4", "max_steps = 2"));
    let out = dir.path().join("out");
    let o = aar_cmd(&recipe, &out, "openai", &["--base-url", &down.url]).output().unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("every item the source was asked failed"), "{}", stderr(&o));
    assert!(stderr(&o).contains(&format!("the corpus has {passages} passages")), "{}", stderr(&o));
    assert!(!out.join("stages/score.done.json").exists());
    // A source that answered nothing is not pinned as the stage's source (the resume its error
    // message promises works against the healthy server).
    assert!(!out.join("stages/score/source.json").exists(), "a source that answered nothing was recorded");

    // A server that fails about a third of the prompts (by their length): the rerun resumes,
    // asks the failed items again, and records, skips and counts those that fail again.
    let fails = |prompt: &str| !prompt.starts_with('\u{1}') && prompt.contains("\n\nQ: ") && prompt.chars().count().is_multiple_of(3);
    let flaky = FakeServer::start(Options { plan: Box::new(move |prompt, _| fails(prompt).then_some(Fault::ServerError)), ..Options::distinct_scores() });
    let o = aar_cmd(&recipe, &out, "openai", &["--base-url", &flaky.url]).output().unwrap();
    let s = summary(&o);
    let err = stderr(&o);
    assert_eq!(s["stages"]["score"], "resumed", "{s}");
    assert_eq!(s["queries_read"].as_u64(), Some(9), "{s}");
    assert_eq!(s["dropped_without_gold"].as_u64(), Some(2), "{s}");
    assert_eq!(s["queries"].as_u64(), Some(7), "{s}");
    assert_eq!(s["fewer_than_n_retrieved"].as_u64(), Some(7), "{s}");
    assert!(err.contains("fewer than N = 10"), "{err}");
    assert_eq!(s["skipped_without_answer"].as_u64(), Some(1), "{s}");
    let records = jsonl(&out.join("stages/score/scores.jsonl"));
    let latest: std::collections::HashMap<String, &Value> = records.iter().map(|r| (r["query_id"].as_str().unwrap().to_string(), r)).collect();
    let failed: Vec<(String, String)> = latest
        .values()
        .flat_map(|r| strings(&r["passages"]).into_iter().zip(r["errors"].as_array().unwrap().clone()).filter(|(_, e)| !e.is_null()).map(|(p, _)| (r["query_id"].as_str().unwrap().to_string(), p)))
        .collect();
    assert!(!failed.is_empty() && (failed.len() as u64) < 6 * passages as u64, "{} failed", failed.len());
    assert_eq!(s["failed"].as_u64(), Some(failed.len() as u64), "{s}");
    assert_eq!(s["scored"].as_u64(), Some(6 * passages as u64 - failed.len() as u64), "{s}");
    assert!(err.contains("failed and were skipped"), "{err}");
    distinct_scores(&out);
    let examples = check_examples(&out, 10, 2, 200, Rule::Authors);
    // Queries the source scored nothing of (the one without an answer, any whose every item
    // failed) are dropped, not trained on gold only, and counted.
    let without_scores = latest.values().filter(|r| r["scores"].as_array().unwrap().iter().all(Value::is_null)).count() as u64;
    assert!(without_scores >= 1, "x:noanswer has no scores");
    assert_eq!(s["queries_without_scores"].as_u64(), Some(without_scores), "{s}");
    assert_eq!(examples.len() as u64, 7 - without_scores, "{s}");
    assert!(examples.iter().all(|e| e["query_id"] != "x:noanswer"), "a query without scores became a gold-only example");
    for e in &examples {
        for a in strings(&e["lm_preferred"]) {
            assert!(!failed.contains(&(e["query_id"].as_str().unwrap().to_string(), a.clone())), "a failed item became a positive: {e}");
        }
    }
    assert!(out.join("model.safetensors").exists());

    // Changed inputs: refused, naming what changed; with --overwrite, redone from the train stage.
    let recipe = write_recipe(dir.path(), &fake_source(&cache, ""), aar, &TRAIN.replace("max_steps = 4", "max_steps = 3"));
    let o = aar_cmd(&recipe, &out, "openai", &["--base-url", &flaky.url]).output().unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("the train stage was run with other inputs") && stderr(&o).contains("--overwrite"), "{}", stderr(&o));
    let s = summary(&aar_cmd(&recipe, &out, "openai", &["--base-url", &flaky.url, "--overwrite"]).output().unwrap());
    assert_eq!((s["stages"]["select"].as_str(), s["stages"]["train"].as_str(), s["train"]["steps"].as_u64()), (Some("done earlier"), Some("ran"), Some(3)), "{s}");
    // The other rule, by name: the top K among the non-gold passages; the scores are kept.
    let recipe = write_recipe(dir.path(), &fake_source(&cache, ""), &format!("{aar}\npositives = \"top_k_non_gold\""), &TRAIN.replace("max_steps = 4", "max_steps = 3"));
    let s = summary(&aar_cmd(&recipe, &out, "openai", &["--base-url", &flaky.url, "--overwrite"]).output().unwrap());
    assert_eq!((s["stages"]["score"].as_str(), s["stages"]["select"].as_str()), (Some("done earlier"), Some("ran")), "{s}");
    let other_rule = check_examples(&out, 10, 2, 200, Rule::TopKNonGold);
    let added = |ex: &[Value]| ex.iter().map(|e| e["lm_preferred"].as_array().unwrap().len()).sum::<usize>();
    assert!(added(&other_rule) > added(&examples), "the LM's top 2 held gold somewhere, so the authors' rule adds fewer: {} vs {}", added(&examples), added(&other_rule));
    // The authors' filter: only queries that end with exactly three positives (here one gold
    // each: the queries whose LM top 2 holds no gold); the scores are kept. Fewer examples are
    // left: batches of 2.
    let train_few = TRAIN.replace("max_steps = 4", "max_steps = 3").replace("per_device_train_batch_size = 4", "per_device_train_batch_size = 2");
    let recipe = write_recipe(dir.path(), &fake_source(&cache, ""), &format!("{aar}\nexactly_three = true"), &train_few);
    let s = summary(&aar_cmd(&recipe, &out, "openai", &["--base-url", &flaky.url, "--overwrite"]).output().unwrap());
    assert_eq!((s["stages"]["score"].as_str(), s["stages"]["select"].as_str()), (Some("done earlier"), Some("ran")), "{s}");
    let kept = check_examples(&out, 10, 2, 200, Rule::Authors);
    assert!(kept.iter().all(|e| e["positives"].as_array().unwrap().len() == 3), "{kept:?}");
    let no_gold_in_top_2 = examples.iter().filter(|e| e["gold"].as_array().unwrap().len() == 1 && e["lm_preferred"].as_array().unwrap().len() == 2).count();
    assert_eq!(kept.len(), no_gold_in_top_2, "{kept:?}");
    assert!(kept.len() < examples.len(), "the filter kept every query");
    assert_eq!(kept.len() as u64 + s["dropped_not_exactly_three"].as_u64().unwrap() + without_scores, 7, "{s}");

    // A deeper retrieval for more negatives redoes the retrieval and the selection, not the
    // scoring: the top-N lists are the same, so are their scores (nothing is asked).
    let before = flaky.log().len();
    let recipe = write_recipe(dir.path(), &fake_source(&cache, ""), &format!("{}\nexactly_three = true", aar.replace("negatives_depth = 200", "negatives_depth = 150")), &train_few);
    // A file someone put in OUT, and one an earlier final stage wrote that this one does not.
    std::fs::write(out.join("notes.txt"), b"mine").unwrap();
    let record = out.join("stages/model_files.json");
    let mut recorded = read_json(&record);
    recorded["entries"].as_array_mut().unwrap().push(json!("pytorch_model.bin"));
    std::fs::write(&record, recorded.to_string()).unwrap();
    std::fs::write(out.join("pytorch_model.bin"), b"stale").unwrap();
    let s = summary(&aar_cmd(&recipe, &out, "openai", &["--base-url", &flaky.url, "--overwrite"]).output().unwrap());
    assert_eq!((s["stages"]["retrieve"].as_str(), s["stages"]["score"].as_str(), s["stages"]["select"].as_str()), (Some("ran"), Some("done earlier"), Some("ran")), "{s}");
    assert_eq!(flaky.log().len(), before, "the scores were asked again");
    // The final stage redone: nothing of the model before it is left in OUT, and nothing the
    // run did not write is gone.
    assert!(!out.join("pytorch_model.bin").exists(), "a stale model file survived the final stage's redo");
    assert_eq!(std::fs::read(out.join("notes.txt")).unwrap(), b"mine", "the final stage removed a file it did not write");
    assert!(out.join("model.safetensors").exists());

    // --retry-failed: the failed items are asked again (they fail again: the faults follow the
    // prompts), and the stages after the scoring are redone from its records.
    let s = summary(&aar_cmd(&recipe, &out, "openai", &["--base-url", &flaky.url, "--retry-failed"]).output().unwrap());
    assert_eq!(
        (s["stages"]["score"].as_str(), s["stages"]["select"].as_str(), s["stages"]["train"].as_str(), s["stages"]["final"].as_str()),
        (Some("retried"), Some("ran"), Some("ran"), Some("ran")),
        "{s}"
    );
    assert_eq!(s["failed"].as_u64(), Some(failed.len() as u64), "{s}");
    assert!(flaky.log().len() > before, "--retry-failed asked nothing");
    // --retry-failed against a server that is gone: it stops, and the model stays as it was
    // (the last complete one) until a new one is made.
    let model = std::fs::read(out.join("model.safetensors")).unwrap();
    let o = aar_cmd(&recipe, &out, "openai", &["--base-url", "http://127.0.0.1:9", "--retry-failed"]).output().unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("the source stopped answering"), "{}", stderr(&o));
    assert_eq!(std::fs::read(out.join("model.safetensors")).ok(), Some(model), "the model went before a new one was made");
    assert!(out.join("config.json").exists() && std::fs::read(out.join("notes.txt")).unwrap() == b"mine");
    let s = summary(&aar_cmd(&recipe, &out, "openai", &["--base-url", &flaky.url]).output().unwrap());
    assert_eq!((s["stages"]["score"].as_str(), s["stages"]["final"].as_str()), (Some("resumed"), Some("ran")), "{s}");

    // k = 0: positives are gold only (the human-label baseline); the source is never asked
    // (no --base-url: the recipe's placeholder address has no server).
    let recipe = write_recipe(dir.path(), &fake_source(&cache, ""), &aar.replace("k = 2", "k = 0"), &TRAIN.replace("max_steps = 4", "max_steps = 2"));
    let s = summary(&aar_cmd(&recipe, &dir.path().join("gold-only"), "openai", &[]).output().unwrap());
    assert_eq!((s["scored"].as_u64(), s["positives_added"].as_u64(), s["examples"].as_u64()), (Some(0), Some(0), Some(7)), "{s}");
    for e in read_json(&dir.path().join("gold-only/stages/select/examples.json"))["examples"].as_array().unwrap() {
        assert_eq!(e["positives"], e["gold"], "{e}");
    }
    // A finished k = 0 run reruns (it wrote no score records), and one killed in training resumes.
    let again = summary(&aar_cmd(&recipe, &dir.path().join("gold-only"), "openai", &[]).output().unwrap());
    assert_eq!((again["stages"]["score"].as_str(), again["stages"]["final"].as_str()), (Some("done earlier"), Some("done earlier")), "{again}");
    std::fs::remove_file(dir.path().join("gold-only/stages/train.done.json")).unwrap();
    let again = summary(&aar_cmd(&recipe, &dir.path().join("gold-only"), "openai", &[]).output().unwrap());
    assert_eq!((again["stages"]["score"].as_str(), again["stages"]["train"].as_str(), again["stages"]["final"].as_str()), (Some("done earlier"), Some("resumed"), Some("ran")), "{again}");

    // Settings that cannot work are errors before any work.
    for (aar, needle) in [("mode = \"replug\"\nk = 0", "asks no source"), ("n = 2\nk = 3", "aar.k = 3 is more than aar.n = 2")] {
        let recipe = write_recipe(dir.path(), &fake_source(&cache, ""), aar, TRAIN);
        let o = aar_cmd(&recipe, &dir.path().join("never"), "openai", &[]).output().unwrap();
        assert_eq!(o.status.code(), Some(1));
        assert!(stderr(&o).contains(needle), "{}", stderr(&o));
    }
    // A mistyped source folder is not taken for a connector's name.
    let recipe = write_recipe(dir.path(), &fake_source(&cache, ""), aar, TRAIN);
    let o = aar_cmd(&recipe, &dir.path().join("never"), p(&dir.path().join("no-such-model")), &[]).output().unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("no such folder"), "{}", stderr(&o));
    // A query id twice in the queries file: an error naming the file, not a panic.
    let mut q = std::fs::read_to_string(&qfile).unwrap();
    q.push_str("{\"_id\": \"x:noanswer\", \"text\": \"again?\", \"answers\": [\"yes\"]}\n");
    std::fs::write(&qfile, q).unwrap();
    let recipe = write_recipe(dir.path(), &fake_source(&cache, ""), aar, TRAIN);
    let o = aar_cmd(&recipe, &dir.path().join("dup"), "openai", &[]).output().unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("appears more than once") && stderr(&o).contains("queries.train.jsonl"), "{}", stderr(&o));
}

/// Output folders the run does not own are refused before any work, and nothing is written
/// into them: a folder that is not empty and no aar-train run's (a folder of runs), the
/// starting retriever or the source, or a folder inside either. Under torchrun's variables
/// (several processes) the command refuses to run at all.
#[test]
fn output_folders_it_does_not_own_are_refused_before_any_work() {
    let dir = TempDir::new("aar-refuse");
    let recipe = setup(dir.path(), 0, 2, "", "n = 4\nk = 1\nnegatives_depth = 20\nnegatives_sampled = 4\nnegatives_per_query = 2", TRAIN);
    let runs = dir.path().join("runs");
    std::fs::create_dir_all(runs.join("other-run")).unwrap();
    std::fs::write(runs.join("other-run/model.safetensors"), b"someone's").unwrap();
    let listing = |d: &Path| -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(d).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
        v.sort();
        v
    };
    let (minilm, t5) = (minilm_dir(), t5_fixture());
    let (minilm_before, t5_before) = (listing(&minilm), listing(&t5));
    for (out, source, needle) in [
        (runs.clone(), "openai", "not empty"),
        (minilm.clone(), "openai", "is --model"),
        (minilm.join("aar"), "openai", "inside --model"),
        (t5.clone(), p(&t5), "is --source"),
        (t5.join("aar"), p(&t5), "inside --source"),
        (dir.path().to_path_buf(), "openai", "not empty"),
    ] {
        let o = aar_cmd(&recipe, &out, source, &[]).output().unwrap();
        assert_eq!(o.status.code(), Some(1), "{}: {}", out.display(), stderr(&o));
        assert!(stderr(&o).contains(needle) && stderr(&o).contains("--output-dir"), "{}: {}", out.display(), stderr(&o));
        assert!(!out.join("stages").exists(), "{}: written into", out.display());
    }
    assert_eq!(listing(&runs), ["other-run"]);
    assert_eq!(std::fs::read(runs.join("other-run/model.safetensors")).unwrap(), b"someone's");
    assert_eq!((listing(&minilm), listing(&t5)), (minilm_before, t5_before));

    // One of several processes (torchrun's variables): refused, nothing made.
    let out = dir.path().join("dist");
    let o = aar_cmd(&recipe, &out, "openai", &[]).env("WORLD_SIZE", "2").env("RANK", "1").output().unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("WORLD_SIZE=2") && stderr(&o).contains("one process"), "{}", stderr(&o));
    assert!(!out.exists(), "a copy under torchrun began the run");
}

/// `host plugins inspect` shows the recipe's settings and the stages.
#[test]
fn inspect_shows_settings_and_stages() {
    let o = host(&["plugins", "inspect", p(&plugin_file("rak_command_aar"))]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["metadata"]["kind"], "command");
    assert_eq!(v["metadata"]["name"], "aar-train");
    assert_eq!(v["settings"]["recipe"]["aar.n"]["default"], 10);
    assert_eq!(v["settings"]["recipe"]["aar.negatives_per_query"]["default"], 7);
    let stages: Vec<&str> = v["settings"]["stages"].as_array().unwrap().iter().map(|s| s["name"].as_str().unwrap()).collect();
    assert_eq!(stages, ["retrieve", "score", "select", "train", "final"]);
}

/// Every recipe in configs/aar/ names only settings that exist: the plugin's own (its schema in
/// `host plugins inspect`), the source's and the encoder's (their plugins' schemas), and a
/// [train] section the trainer reads.
#[test]
fn every_aar_recipe_names_known_settings() {
    let registry = rak_host::Registry::discover(&[rak_host::Source::Dir(release_dir())]).unwrap();
    let schema_of = |name: &str| {
        let plugin = registry.iter().find(|p| p.header.name == name).unwrap_or_else(|| panic!("no plugin {name}"));
        rak_host::proxy::settings_schema(plugin)
    };
    let own = schema_of("aar-train")["recipe"].clone();
    let mut seen = 0;
    for entry in std::fs::read_dir(root().join("configs/aar")).unwrap().flatten() {
        let path = entry.path();
        if path.extension().and_then(|e| e.to_str()) != Some("toml") {
            continue;
        }
        let recipe: toml::Table = toml::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        for section in ["source", "data", "aar"] {
            for key in recipe[section].as_table().unwrap().keys() {
                assert!(own.get(format!("{section}.{key}")).is_some(), "{}: no setting {section}.{key}", path.display());
            }
        }
        let source = &recipe["source"];
        let plugin = match source["kind"].as_str().unwrap() {
            "white-box" => source.get("reader").and_then(|r| r.as_str()).unwrap_or("fid"),
            _ => source.get("connector").and_then(|r| r.as_str()).unwrap_or("openai"),
        };
        let source_schema = schema_of(plugin);
        for key in source["settings"].as_table().unwrap().keys() {
            assert!(source_schema.get(key).is_some(), "{}: {plugin} has no setting {key}", path.display());
        }
        let model = recipe["model"].as_table().unwrap();
        let encoder = model["encoder"].as_str().unwrap();
        let encoder_schema = schema_of(encoder);
        for key in model["settings"].as_table().unwrap().keys() {
            assert!(encoder_schema.get(key).is_some(), "{}: {encoder} has no setting {key}", path.display());
        }
        let train: rak_train::recipe::TrainSection = recipe["train"].clone().try_into().unwrap_or_else(|e| panic!("{}: [train]: {e}", path.display()));
        assert!(train.optim.is_some(), "{}: no optimizer", path.display());
        seen += 1;
    }
    assert!(seen >= 2, "{seen} recipes");
}

/// Black-box against the real SmolLM2 behind llama-server, 3 queries: the continuation
/// log-likelihoods come from forced tokens (llama.cpp has no echo) and differ per passage.
#[test]
fn black_box_on_the_real_smollm2() {
    let llama = LlamaServer::start("aar-llama-state", &[]);
    let dir = TempDir::new("aar-smollm2");
    let source = format!("settings = {{ base_url = \"http://127.0.0.1:9\", cache_dir = \"{}\" }}\nworkers = 1", dir.path().join("cache").display());
    let recipe = setup(dir.path(), 200, 3, &source, "n = 3\nk = 1\nnegatives_depth = 20\nnegatives_sampled = 4\nnegatives_per_query = 1\npassage_chars = 300", &TRAIN.replace("max_steps = 4", "max_steps = 2").replace("batch_size = 4", "batch_size = 3"));
    let out = dir.path().join("out");
    let s = summary(&aar_cmd(&recipe, &out, "openai", &["--base-url", &llama.url]).output().unwrap());
    assert_eq!((s["scored"].as_u64(), s["failed"].as_u64()), (Some(9), Some(0)), "{s}");
    for r in jsonl(&out.join("stages/score/scores.jsonl")) {
        assert!(r["methods"].as_array().unwrap().iter().all(|m| m == "forced_logit_bias"), "{r}");
        let scores: Vec<f64> = r["scores"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
        assert!(scores.iter().all(|x| *x < 0.0), "{r}");
        assert!(scores.windows(2).any(|w| w[0] != w[1]), "the passages change the answer's likelihood: {r}");
    }
    check_examples(&out, 3, 1, 20, Rule::Authors);
    assert!(out.join("model.safetensors").exists());
}

/// A black-box source with no server behind it: scoring stops once every worker's last query
/// found none (each query's other passages are not asked after its first found no server),
/// instead of failing every passage after its retries; the rerun against a server resumes
/// the stage and asks what was not scored.
#[test]
fn a_source_that_is_gone_stops_scoring_and_the_rerun_resumes() {
    let dir = TempDir::new("aar-gone");
    // Port 9 (discard): nothing listens there on a test machine.
    let nowhere = "http://127.0.0.1:9";
    let source = fake_source(&dir.path().join("cache"), "");
    let recipe = setup(dir.path(), 100, 8, &source, "n = 4\nk = 1\nnegatives_depth = 30\nnegatives_sampled = 6\nnegatives_per_query = 2", TRAIN);
    let out = dir.path().join("out");
    let o = aar_cmd(&recipe, &out, "openai", &["--base-url", nowhere]).output().unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("the source stopped answering"), "{}", stderr(&o));
    let records = jsonl(&out.join("stages/score/scores.jsonl"));
    // Three workers: three queries in a row found no server, and at most the two others in
    // flight were finished.
    assert!((3..=5).contains(&records.len()), "{} queries recorded", records.len());
    for r in &records {
        let errors = r["errors"].as_array().unwrap();
        assert!(errors.len() == 4 && errors.iter().all(|e| e.as_str().unwrap().starts_with("unreachable:")), "{r}");
        // Only the first passage was asked; the others say they were not.
        assert!(errors[1..].iter().all(|e| e.as_str().unwrap().contains("not asked")), "{r}");
    }
    assert!(!out.join("stages/score.done.json").exists());
    let server = FakeServer::start(Options::distinct_scores());
    let s = summary(&aar_cmd(&recipe, &out, "openai", &["--base-url", &server.url]).output().unwrap());
    assert_eq!(s["stages"]["score"], "resumed", "{s}");
    assert_eq!((s["scored"].as_u64(), s["failed"].as_u64()), (Some(32), Some(0)), "{s}");

    // A gone server stops the scoring even where a query's first passages are answered from
    // the connector's cache: the same queries' top 6 in a new run, the top 4 cached.
    let recipe = write_recipe(dir.path(), &source, "n = 6\nk = 1\nnegatives_depth = 30\nnegatives_sampled = 6\nnegatives_per_query = 2", TRAIN);
    let more = dir.path().join("more");
    let o = aar_cmd(&recipe, &more, "openai", &["--base-url", nowhere]).output().unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("the source stopped answering"), "{}", stderr(&o));
    let records = jsonl(&more.join("stages/score/scores.jsonl"));
    assert!((3..=5).contains(&records.len()), "{} queries recorded", records.len());
    for r in &records {
        let scores = r["scores"].as_array().unwrap();
        assert!(scores[..4].iter().all(|x| x.is_number()) && scores[4..].iter().all(Value::is_null), "the top 4 come from the cache: {r}");
        assert!(r["errors"][4].as_str().unwrap().starts_with("unreachable:"), "{r}");
    }
    assert!(!more.join("stages/score.done.json").exists());
}
