//! `host train` end to end on a small real slice of mini-KILT with all-MiniLM-L6-v2: a killed
//! run resumes to exactly the uninterrupted result; bad inputs are clear errors.

use rak_e2e::*;
use serde_json::Value;
use std::collections::HashSet;
use std::path::Path;
use std::process::{Command, Output};

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

const TRAIN: &str = "optim = \"adamw\"\nlearning_rate = 5e-5\nper_device_train_batch_size = 6\nmax_steps = 8\nlogging_steps = 1\nsave_steps = 2\nhard_negatives = 1\nnegative_depth = 20\nseed = 7";

fn train_cmd(recipe: &Path, out: &Path, extra: &[&str]) -> Command {
    let mut c = Command::new(host_bin());
    c.args(["train", "--model", p(&minilm_dir()), "--config", p(recipe), "--output-dir", p(out)]).args(extra).env_remove("RAK_PLUGIN_PATH").env_remove("RAK_STEP_PHASES").env_remove("RAK_TORCH_PROFILE").env_remove("RAK_TORCH_PROFILE_STEPS");
    c
}

fn run(c: &mut Command) -> Output {
    c.output().unwrap()
}

fn losses(out: &Path) -> Vec<Value> {
    std::fs::read_to_string(out.join("trainer_log.jsonl")).unwrap().lines().map(|l| serde_json::from_str::<Value>(l).unwrap()["loss"].clone()).collect()
}

fn weights(dir: &Path) -> Vec<(String, tch::Tensor)> {
    let mut w = tch::Tensor::read_safetensors(dir.join("model.safetensors")).unwrap();
    w.sort_by(|a, b| a.0.cmp(&b.0));
    w
}

/// SIGKILL a run once a checkpoint exists (at a moment drawn from a fixed seed), resume with
/// `--resume-from-checkpoint latest`: the same per-step losses and the same final weights as
/// an uninterrupted run (which tokenised ahead).
#[test]
fn a_killed_run_resumes_to_the_same_result() {
    let dir = TempDir::new("train-resume");
    let recipe = small_task_data(dir.path(), 24, TRAIN);
    // The uninterrupted run tokenises ahead (on the CPU only when asked), the others do not:
    // the next step's texts, drawn while a step runs, must reach the encoder as it encodes
    // them, and leave a checkpoint's sampler where that step left it.
    let ahead = dir.path().join("recipe-ahead.toml");
    let text = std::fs::read_to_string(&recipe).unwrap();
    assert!(text.contains("settings = { max_length = 64 }"), "{text}");
    std::fs::write(&ahead, text.replace("settings = { max_length = 64 }", "settings = { max_length = 64, tokenize_ahead = true }")).unwrap();
    let whole = dir.path().join("whole");
    let o = run(&mut train_cmd(&ahead, &whole, &[]));
    assert!(o.status.success(), "{}", stderr(&o));
    let want = losses(&whole);
    assert_eq!(want.len(), 8, "one log line per step");
    assert!(!std::fs::read_to_string(whole.join("trainer_log.jsonl")).unwrap().contains("phases"), "no step phases unless RAK_STEP_PHASES asks");

    let killed = dir.path().join("killed");
    let mut kills = 0;
    for (round, wait_ms) in [700u64, 1900].into_iter().enumerate() {
        let mut child = train_cmd(&recipe, &killed, &["--resume-from-checkpoint", "latest"]).stderr(std::process::Stdio::null()).spawn().unwrap();
        // Wait for a new checkpoint, then a little more, then kill mid-step.
        let started = std::time::Instant::now();
        while started.elapsed().as_secs() < 300 {
            let now = std::fs::read_dir(&killed).map(|d| d.flatten().filter(|e| e.file_name().to_string_lossy().starts_with("checkpoint-")).count()).unwrap_or(0);
            if now > round || child.try_wait().unwrap().is_some() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        std::thread::sleep(std::time::Duration::from_millis(wait_ms));
        if child.try_wait().unwrap().is_none() {
            kills += 1;
        }
        let _ = child.kill();
        let _ = child.wait();
    }
    assert!(kills > 0, "no kill landed while a run was going: nothing was resumed");
    let o = run(&mut train_cmd(&recipe, &killed, &["--resume-from-checkpoint", "latest"]));
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("resumed from"), "{}", stderr(&o));
    assert_eq!(losses(&killed), want, "per-step losses after kills and resumes");
    // Starting afresh over a finished run's checkpoints needs saying so.
    let o = run(&mut train_cmd(&recipe, &killed, &[]));
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("--overwrite-output-dir"), "{}", stderr(&o));
    for ((na, a), (nb, b)) in weights(&whole).iter().zip(weights(&killed).iter()) {
        assert_eq!(na, nb);
        let diff = (a - b).abs().max().double_value(&[]);
        assert!(diff <= 1e-6, "{na}: final weights differ by {diff}");
    }
    st_loads_the_trained_model(dir.path(), &whole);
    // No half-written checkpoint is left behind.
    for e in std::fs::read_dir(&killed).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        assert!(!name.starts_with('.') || !name.contains("checkpoint"), "leftover {name}");
    }
}

/// Training started from a sentence-transformers checkpoint ends in one that
/// sentence-transformers itself loads (scripts/fixtures/hf_load_check.py) and that embeds as
/// the toolkit does.
fn st_loads_the_trained_model(work: &Path, model: &Path) {
    let texts: Vec<String> = ["who wrote the iliad", "the capital city of tuscany"].iter().map(|s| s.to_string()).collect();
    let texts_file = work.join("st-texts.json");
    std::fs::write(&texts_file, serde_json::to_string(&texts).unwrap()).unwrap();
    let out = work.join("st.safetensors");
    let status = Command::new(root().join(".venv/bin/python"))
        .arg(root().join("scripts/fixtures/hf_load_check.py"))
        .args(["--model", p(model), "--texts", p(&texts_file), "--out", p(&out)])
        .status()
        .unwrap();
    assert!(status.success(), "hf_load_check.py failed on {}", model.display());
    let st = tch::Tensor::read_safetensors(&out).unwrap().into_iter().find(|(n, _)| n == "sentence_transformers").expect("sentence-transformers loaded it").1;
    let registry = rak_host::Registry::discover(&[rak_host::Source::Dir(release_dir())]).unwrap();
    let mut enc = registry.encoder("dpr", &serde_json::json!({"model": model})).unwrap();
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let ours = enc.encode(&refs, rak_core::abi::Role::Query, None, false).unwrap();
    let diff = (ours - &st).abs().max().double_value(&[]);
    assert!(diff < 1e-5, "sentence-transformers vs the toolkit on the trained model: {diff}");
    let mut start = registry.encoder("dpr", &serde_json::json!({"model": minilm_dir()})).unwrap();
    let before = start.encode(&refs, rak_core::abi::Role::Query, None, false).unwrap();
    assert!((before - st).abs().max().double_value(&[]) > 1e-4, "the trained model differs from the start");
}

/// The names in `dir`, sorted.
fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

fn fails(o: &Output, needles: &[&str]) {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    for n in needles {
        assert!(err.contains(n), "expected {n:?} in:\n{err}");
    }
    assert!(!err.contains("panicked") && !err.contains("internal error"), "{err}");
}

#[test]
fn bad_training_inputs_are_clear_errors() {
    let dir = TempDir::new("train-bad");
    let recipe = small_task_data(dir.path(), 12, TRAIN);
    let out = dir.path().join("out");

    // A task without training data: an empty file, or queries none of which has gold.
    std::fs::write(dir.path().join("tasks/fever/qrels.train.tsv"), "query-id\tcorpus-id\tscore\nnobody\tsquad:5:0\t1\n").unwrap();
    fails(&run(&mut train_cmd(&recipe, &out, &[])), &["task \"fever\" has no training examples"]);
    std::fs::write(dir.path().join("tasks/fever/queries.train.jsonl"), "").unwrap();
    fails(&run(&mut train_cmd(&recipe, &out, &[])), &["fever/queries.train.jsonl", "no queries"]);
    let recipe = small_task_data(dir.path(), 12, TRAIN);

    // Queries without gold and judgements naming unknown passages are dropped and reported.
    let qrels = dir.path().join("tasks/fever/qrels.train.tsv");
    let text = std::fs::read_to_string(&qrels).unwrap();
    let mut lines: Vec<&str> = text.lines().collect();
    let dropped = lines.remove(1).split('\t').next().unwrap().to_string();
    std::fs::write(&qrels, format!("{}\n{dropped}\tno-such-passage\t1\n", lines.join("\n"))).unwrap();
    let o = run(&mut train_cmd(&recipe, &out, &["--max-steps", "1"]));
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("dropped 1 queries without a relevant corpus passage") && err.contains("ignored 1 judgements"), "{err}");
    // Resuming it with another optimizer or encoder setting is refused, naming what changed;
    // with the same recipe it resumes (and, being finished, has nothing left to do).
    let resume = ["--max-steps", "1", "--resume-from-checkpoint", "latest"];
    fails(&run(&mut train_cmd(&recipe, &out, &[&resume[..], &["--optim", "tsage"]].concat())), &["another recipe", "optim: \"adamw\" then, \"tsage\" now"]);
    let other = dir.path().join("other.toml");
    std::fs::write(&other, std::fs::read_to_string(&recipe).unwrap().replace("max_length = 64", "max_length = 32")).unwrap();
    fails(&run(&mut train_cmd(&other, &out, &resume)), &["another recipe", "encoder_settings.max_length: 64 then, 32 now"]);
    let o = run(&mut train_cmd(&recipe, &out, &resume));
    assert!(o.status.success(), "{}", stderr(&o));
    let out = dir.path().join("out-later");

    // Loss weights by queries with an optimizer that weighs tasks by their gradients' sizes.
    let weighted = dir.path().join("weighted.toml");
    std::fs::write(&weighted, std::fs::read_to_string(&recipe).unwrap().replace("[train]\n", "[train]\ntask_loss_weight = \"queries\"\n")).unwrap();
    fails(&run(&mut train_cmd(&weighted, &out, &["--optim", "gradnorm"])), &["task_loss_weight = \"queries\"", "gradnorm"]);
    // REPLUG's loss needs LM scores, which task files do not hold; its β with another loss.
    let lm = dir.path().join("lm.toml");
    std::fs::write(&lm, std::fs::read_to_string(&recipe).unwrap().replace("[train]\n", "[train]\nloss = \"lm_supervised\"\n")).unwrap();
    fails(&run(&mut train_cmd(&lm, &out, &[])), &["lm_supervised", "aar-train"]);
    std::fs::write(&lm, std::fs::read_to_string(&recipe).unwrap().replace("[train]\n", "[train]\nlm_temperature = 0.1\n")).unwrap();
    fails(&run(&mut train_cmd(&lm, &out, &["--max-steps", "1"])), &["lm_temperature", "recipe's loss is \"nce\""]);
    // NCE's mask of positive copies with a loss that has its own rule.
    std::fs::write(&lm, std::fs::read_to_string(&recipe).unwrap().replace("[train]\n", "[train]\nmask_positive_copies = true\nloss = \"multi_positive\"\n")).unwrap();
    fails(&run(&mut train_cmd(&lm, &out, &["--max-steps", "1"])), &["mask_positive_copies", "\"multi_positive\""]);

    // An empty passage text named by the training data.
    let corpus = dir.path().join("corpus.jsonl");
    let text = std::fs::read_to_string(&corpus).unwrap();
    let gold_line = std::fs::read_to_string(dir.path().join("tasks/squad/qrels.train.tsv")).unwrap().lines().nth(1).unwrap().split('\t').nth(1).unwrap().to_string();
    let edited: Vec<String> = text
        .lines()
        .map(|l| {
            let mut v: Value = serde_json::from_str(l).unwrap();
            if v["_id"] == gold_line.as_str() {
                v["text"] = Value::from(" ");
            }
            v.to_string()
        })
        .collect();
    std::fs::write(&corpus, edited.join("\n") + "\n").unwrap();
    let out2 = dir.path().join("out2");
    fails(&run(&mut train_cmd(&recipe, &out2, &[])), &["has an empty text", &gold_line]);
    let recipe = small_task_data(dir.path(), 12, TRAIN);

    // Unknown optimizer, unknown encoder setting, unknown recipe key: the known ones are listed.
    fails(&run(&mut train_cmd(&recipe, &out, &["--optim", "nadam"])), &["no optimizer plugin named \"nadam\"", "adamw"]);
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, std::fs::read_to_string(&recipe).unwrap().replace("max_length = 64", "max_length = 64, pooling_mode = \"max\"")).unwrap();
    fails(&run(&mut train_cmd(&bad, &out, &[])), &["pooling_mode", "pooling"]);
    std::fs::write(&bad, std::fs::read_to_string(&recipe).unwrap().replace("[train]", "[train]\nlearnin_rate = 1.0")).unwrap();
    fails(&run(&mut train_cmd(&bad, &out, &[])), &["learnin_rate", "learning_rate"]);

    // Recipe numbers out of range, a NaN, a task named twice: refused before any work, one
    // error naming the key.
    for (edit, needle) in [
        ("[train]\nwarmup_ratio = 1.5", "train.warmup_ratio = 1.5: it must be in [0, 1]"),
        ("[train]\nscore_scale = 0.0", "train.score_scale = 0: it must be finite and above 0"),
        ("[train]\nmax_grad_norm = nan", "train.max_grad_norm is NaN"),
        ("[train]\nnum_train_epochs = 0.0", "train.num_train_epochs = 0"),
    ] {
        std::fs::write(&bad, std::fs::read_to_string(&recipe).unwrap().replace("[train]", edit)).unwrap();
        fails(&run(&mut train_cmd(&bad, &dir.path().join("out-numbers"), &[])), &[needle]);
    }
    std::fs::write(&bad, std::fs::read_to_string(&recipe).unwrap().replace("save_steps = 2", "save_steps = 0")).unwrap();
    fails(&run(&mut train_cmd(&bad, &dir.path().join("out-numbers"), &[])), &["train.save_steps = 0"]);
    fails(&run(&mut train_cmd(&recipe, &dir.path().join("out-numbers"), &["--learning-rate", "NaN"])), &["train.learning_rate is NaN"]);
    fails(&run(&mut train_cmd(&recipe, &dir.path().join("out-numbers"), &["--learning-rate=-1e-5"])), &["train.learning_rate = -0.00001"]);
    std::fs::write(&bad, std::fs::read_to_string(&recipe).unwrap().replace("\"fever\"]", "\"fever\", \"squad\"]")).unwrap();
    fails(&run(&mut train_cmd(&bad, &dir.path().join("out-numbers"), &[])), &["data.tasks names task \"squad\" twice"]);
    assert!(!dir.path().join("out-numbers").exists(), "refused before any work");

    // A loss that becomes non-finite: steps are skipped with a warning, then the run stops.
    let o = run(&mut train_cmd(&recipe, &dir.path().join("out3"), &["--learning-rate", "1e30", "--max-steps", "20"]));
    fails(&o, &["non-finite loss", "max_skipped_steps"]);
    // A finite loss with an infinite gradient (the `faulty` encoder's): never handed to the
    // optimizer (an infinity in its state would last the whole run), the step is skipped with
    // a warning naming the parameter, and it counts toward max_skipped_steps.
    let inf = dir.path().join("inf.toml");
    let text = std::fs::read_to_string(&recipe).unwrap().replace("encoder = \"dpr\"", "encoder = \"faulty\"").replace("max_length = 64", "fault = \"inf_gradient\"");
    std::fs::write(&inf, text.replace("[train]", "[train]\nmax_skipped_steps = 2").replace("save_steps = 2", "save_steps = 100")).unwrap();
    for optim in ["adamw", "tsage"] {
        let o = run(train_cmd(&inf, &dir.path().join(format!("out-inf-{optim}")), &["--optim", optim]).args(["--plugin", p(&faulty_plugin())]));
        fails(&o, &["non-finite gradient of w", "3 steps had a non-finite loss or gradient", "max_skipped_steps = 2"]);
        assert_eq!(stderr(&o).matches("is skipped").count(), 3, "{}", stderr(&o));
    }
}

/// The TACO authors' schedule as stage overrides: the BM25 stage without the task prefix and
/// with AdamW, the ANCE episode with the prefix and T-SAGE; each stage's model says which
/// prefix it trained with and its optimizer state is its optimizer's. A resume without the
/// overrides is refused, naming them; a bad setting of a later stage's optimizer is refused
/// before any work.
#[test]
fn stage_overrides_give_a_stage_its_own_prefix_and_optimizer() {
    let dir = TempDir::new("train-stages");
    let train = TRAIN.replace("max_steps = 8", "max_steps = 2").replace("optim = \"adamw\"", "optim = \"tsage\"") + "\nance_episodes = 1\nance_depth = 10";
    let recipe = small_task_data(dir.path(), 12, &train);
    let text = std::fs::read_to_string(&recipe).unwrap().replace("max_length = 64 }", "max_length = 64, task_prefix = true }");
    let overrides = "\n[[train.stage_overrides]]\nstages = [0]\nmodel_settings = { task_prefix = false }\noptim = \"adamw\"\n";
    std::fs::write(&recipe, format!("{text}{overrides}")).unwrap();
    let out = dir.path().join("out");
    let o = Command::new(host_bin()).args(["train", "--model", p(&minilm_dir()), "--config", p(&recipe), "--output-dir", p(&out)]).env_remove("RAK_PLUGIN_PATH").output().unwrap();
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("stage 0 of 1 (BM25 negatives, adamw with {") && err.contains("stage 1 of 1 (ANCE negatives, tsage with {"), "{err}");
    let prefix = |dir: &Path| -> Value {
        let s: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("rak_encoder.json")).unwrap()).unwrap();
        s["task_prefix"].clone()
    };
    assert_eq!(prefix(&out.join("episode-0")), Value::Bool(false));
    assert_eq!(prefix(&out.join("episode-1")), Value::Bool(true));
    assert_eq!(prefix(&out), Value::Bool(true), "the run's model is the last stage's");
    let state = |stage: &str| -> Vec<String> {
        let mut names: Vec<String> = tch::Tensor::read_safetensors(out.join(stage).join("checkpoint-2/optimizer.safetensors")).unwrap().into_iter().map(|(n, _)| n).collect();
        names.sort();
        names
    };
    let (adamw, tsage) = (state("episode-0"), state("episode-1"));
    assert!(adamw.iter().any(|n| n.starts_with("exp_avg")), "{adamw:?}");
    assert_ne!(adamw, tsage, "T-SAGE keeps its task sensitivities besides Adam's moments");

    std::fs::write(&recipe, &text).unwrap();
    let o = run(&mut train_cmd(&recipe, &out, &["--resume-from-checkpoint", "latest"]));
    fails(&o, &["another recipe", "train.stage_overrides: [{"]);

    // A misspelt setting of the last stage's optimizer fails before the first stage trains.
    let misspelt = dir.path().join("misspelt.toml");
    std::fs::write(&misspelt, format!("{text}\n[[train.stage_overrides]]\nstages = [1]\noptim_settings = {{ tua = 2.0 }}\n")).unwrap();
    let never = dir.path().join("never");
    fails(&run(&mut train_cmd(&misspelt, &never, &[])), &["stage 1's optimizer", "tua"]);
    assert!(!never.exists(), "refused before any work");
}

/// `negatives-episode-E.json`: every example's negatives by task and query id.
fn saved_negatives(path: &Path) -> (String, std::collections::BTreeMap<String, Vec<String>>) {
    let v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut out = std::collections::BTreeMap::new();
    for (_, by_query) in v["negatives"].as_object().unwrap() {
        for (q, ids) in by_query.as_object().unwrap() {
            out.insert(q.clone(), ids.as_array().unwrap().iter().map(|i| i.as_str().unwrap().to_string()).collect());
        }
    }
    (v["source"].as_str().unwrap().to_string(), out)
}

/// ANCE episodes: after the BM25 stage, negatives are mined with the trained model over the
/// whole corpus (top `ance_depth` minus gold), saved, and a new stage trains on them; the final
/// model lands in the output folder. A run killed in the episode resumes to the same weights.
#[test]
fn ance_episodes_mine_with_the_model_and_resume_exactly() {
    let dir = TempDir::new("train-ance");
    let train = TRAIN.replace("max_steps = 8", "max_steps = 4") + "\nance_episodes = 1\nance_depth = 10";
    let recipe = small_task_data(dir.path(), 12, &train);
    let whole = dir.path().join("whole");
    let o = run(&mut train_cmd(&recipe, &whole, &[]));
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("mining negatives"), "{}", stderr(&o));
    // The last stage saved its model into OUT before marking the stage done; it is not loaded
    // and saved there again after (that save would be newer than the mark).
    let modified = |p: &Path| std::fs::metadata(p).unwrap().modified().unwrap();
    let (saved, marked) = (modified(&whole.join("model.safetensors")), modified(&whole.join("episode-1/stage_done")));
    assert!(saved <= marked, "OUT's model was written again after the last stage was done ({saved:?} > {marked:?})");

    let (src0, bm25) = saved_negatives(&whole.join("negatives-episode-0.json"));
    let (src1, ance) = saved_negatives(&whole.join("negatives-episode-1.json"));
    let (key0, key1): (Value, Value) = (serde_json::from_str(&src0).unwrap(), serde_json::from_str(&src1).unwrap());
    assert!(key0["miner"]["bm25"].is_object() && key1["miner"]["ance"]["checkpoint"]["model"].is_string(), "{src0} / {src1}");
    assert_eq!(bm25.keys().collect::<Vec<_>>(), ance.keys().collect::<Vec<_>>());
    let mut gold: std::collections::HashMap<String, HashSet<String>> = Default::default();
    for task in ["squad", "fever"] {
        for line in std::fs::read_to_string(dir.path().join("tasks").join(task).join("qrels.train.tsv")).unwrap().lines().skip(1) {
            let c: Vec<&str> = line.split('\t').collect();
            gold.entry(c[0].to_string()).or_default().insert(c[1].to_string());
        }
    }
    let mut changed = 0;
    for (q, negs) in &ance {
        assert!(!negs.is_empty() && negs.len() <= 10, "{q}: {} negatives", negs.len());
        assert!(negs.iter().all(|n| !gold[q].contains(n)), "{q}: a gold passage among its negatives");
        changed += usize::from(negs != &bm25[q][..bm25[q].len().min(negs.len())].to_vec());
    }
    assert!(changed * 2 > ance.len(), "the model's negatives should differ from BM25's for most queries ({changed} of {})", ance.len());
    // Each stage has its log and final model; the last one is the output's.
    assert_eq!(losses(&whole.join("episode-0")).len(), 4);
    assert_eq!(losses(&whole.join("episode-1")).len(), 4);
    assert!(!whole.join("episode-1/ance").exists(), "the corpus embeddings are removed once mined");
    let (top, last) = (weights(&whole), weights(&whole.join("episode-1")));
    assert!(top.iter().zip(&last).all(|((na, a), (nb, b))| na == nb && a.equal(b)));
    let first = weights(&whole.join("episode-0"));
    assert!(first.iter().zip(&last).any(|((_, a), (_, b))| !a.equal(b)), "episode 1 trained");

    // Stopped at the episode boundary (episode 0 done, episode 1 not begun: no checkpoint of
    // it to check settings against), a resume with another trainer setting is refused.
    let boundary = dir.path().join("boundary");
    assert!(Command::new("cp").args(["-r", p(&whole), p(&boundary)]).status().unwrap().success());
    std::fs::remove_dir_all(boundary.join("episode-1")).unwrap();
    let _ = std::fs::remove_file(boundary.join("negatives-episode-1.json"));
    let _ = std::fs::remove_file(boundary.join("final_model_done"));
    let resume = ["--resume-from-checkpoint", "latest"];
    for (flag, value, key) in [("--learning-rate", "1e-4", "train.learning_rate: "), ("--seed", "8", "train.seed: 7 then"), ("--per-device-train-batch-size", "4", "train.per_device_train_batch_size: 6 then")] {
        fails(&run(&mut train_cmd(&recipe, &boundary, &[&resume[..], &[flag, value]].concat())), &["another recipe", key]);
    }
    let other_loss = dir.path().join("other-loss.toml");
    std::fs::write(&other_loss, std::fs::read_to_string(&recipe).unwrap() + "loss = \"multi_positive\"\n").unwrap();
    fails(&run(&mut train_cmd(&other_loss, &boundary, &resume)), &["another recipe", "train.loss: \"nce\" then, \"multi_positive\" now"]);

    // Kill in episode 1 (once it has a checkpoint), resume: the same final weights.
    let killed = dir.path().join("killed");
    let mut child = train_cmd(&recipe, &killed, &[]).stderr(std::process::Stdio::null()).spawn().unwrap();
    let started = std::time::Instant::now();
    while started.elapsed().as_secs() < 300 && child.try_wait().unwrap().is_none() {
        if std::fs::read_dir(killed.join("episode-1")).map(|d| d.flatten().any(|e| e.file_name().to_string_lossy().starts_with("checkpoint-"))).unwrap_or(false) {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let killed_early = child.try_wait().unwrap().is_none();
    let _ = child.kill();
    let _ = child.wait();
    assert!(killed_early, "the run ended before it could be killed in episode 1");
    let o = run(&mut train_cmd(&recipe, &killed, &["--resume-from-checkpoint", "latest"]));
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!stderr(&o).contains("mining negatives"), "the saved episode-1 negatives are reused: {}", stderr(&o));
    assert_eq!(saved_negatives(&killed.join("negatives-episode-1.json")).1, ance);
    for ((na, a), (_, b)) in weights(&whole).iter().zip(weights(&killed).iter()) {
        let diff = (a - b).abs().max().double_value(&[]);
        assert!(diff <= 1e-6, "{na}: final weights differ by {diff}");
    }
    // Starting over needs saying so.
    fails(&run(&mut train_cmd(&recipe, &killed, &[])), &["--overwrite-output-dir"]);
    // Starting over a run killed while encoding the corpus for episode 1: the parts it left
    // were made by another checkpoint than this run's, and go; a file of the user's there stays,
    // in the work folder or in its corpus/ or index/ (then the encode refuses, naming it).
    let work = killed.join("episode-1/ance");
    std::fs::create_dir_all(work.join("corpus/parts")).unwrap();
    std::fs::create_dir_all(work.join("index")).unwrap();
    std::fs::write(work.join("corpus/parts/manifest.json"), r#"{"checkpoint": "another"}"#).unwrap();
    std::fs::write(work.join("corpus/embeddings.npy"), "stale").unwrap();
    for mine in ["notes.txt", "corpus/notes.txt", "index/notes.txt"] {
        std::fs::write(work.join(mine), "mine").unwrap();
    }
    let o = run(&mut train_cmd(&recipe, &killed, &["--overwrite-output-dir", "--max-steps", "1"]));
    fails(&o, &["notes.txt", "did not write"]);
    assert!(stderr(&o).contains("the ANCE index is kept") && stderr(&o).contains("corpus is kept"), "{}", stderr(&o));
    for mine in ["notes.txt", "corpus/notes.txt", "index/notes.txt"] {
        assert_eq!(std::fs::read_to_string(work.join(mine)).unwrap(), "mine", "{mine}");
    }
    assert!(!work.join("corpus/parts").exists() && !work.join("corpus/embeddings.npy").exists());
    std::fs::remove_dir_all(work.join("corpus")).unwrap();
    std::fs::remove_dir_all(work.join("index")).unwrap();
    let o = run(&mut train_cmd(&recipe, &killed, &["--overwrite-output-dir", "--max-steps", "1"]));
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(std::fs::read_to_string(work.join("notes.txt")).unwrap(), "mine");
    assert!(!work.join("corpus").exists());

    // Resuming from a checkpoint of a finished stage retrains what follows it (its negatives
    // are mined again), to the same result.
    let again = dir.path().join("again");
    assert!(Command::new("cp").args(["-r", p(&whole), p(&again)]).status().unwrap().success());
    let ckpt = again.join("episode-0/checkpoint-2");
    let o = run(&mut train_cmd(&recipe, &again, &["--resume-from-checkpoint", p(&ckpt)]));
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("mining negatives"), "episode 1's negatives were stale: {}", stderr(&o));
    for ((na, a), (_, b)) in weights(&whole).iter().zip(weights(&again).iter()) {
        let diff = (a - b).abs().max().double_value(&[]);
        assert!(diff <= 1e-6, "{na}: final weights differ by {diff}");
    }
    // A resume must keep the run's number of episodes.
    fails(&run(&mut train_cmd(&recipe, &again, &["--resume-from-checkpoint", "latest", "--ance-episodes", "2"])), &["started with 1 ANCE episodes"]);
    // Overwriting with fewer episodes leaves nothing of the earlier stages to be picked up.
    let o = run(&mut train_cmd(&recipe, &again, &["--overwrite-output-dir", "--ance-episodes", "0", "--max-steps", "1"]));
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!again.join("episode-1/stage_done").exists() && !again.join("negatives-episode-1.json").exists());
}

/// Each cache of a run is keyed on everything it depends on: the run's BM25 index on the
/// corpus's content, the saved negatives on the corpus, the examples and the fill of empty
/// lists (its seed and count). A corpus rewritten in place, another seed or another number of
/// hard negatives is never served an earlier run's cache, even with --overwrite-output-dir
/// in the same folder.
#[test]
fn caches_are_keyed_on_what_they_depend_on() {
    let dir = TempDir::new("train-caches");
    let train = TRAIN.replace("max_steps = 8", "max_steps = 1");
    let recipe = small_task_data(dir.path(), 6, &train);
    let out = dir.path().join("out");
    let key = || -> Value { serde_json::from_str(&saved_negatives(&out.join("negatives-episode-0.json")).0).unwrap() };
    let reused = "BM25 negatives from";
    let o = run(&mut train_cmd(&recipe, &out, &[]));
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!stderr(&o).contains(reused), "{}", stderr(&o));
    let first = key();

    // The same run again: the negatives are reused (they depend on nothing it changed).
    let o = run(&mut train_cmd(&recipe, &out, &["--overwrite-output-dir"]));
    assert!(o.status.success() && stderr(&o).contains(reused), "{}", stderr(&o));

    // Another seed: the fill of empty negative lists is drawn from it.
    let o = run(&mut train_cmd(&recipe, &out, &["--overwrite-output-dir", "--seed", "8"]));
    assert!(o.status.success(), "{}", stderr(&o));
    assert_ne!(key()["fill"], first["fill"], "the negatives of seed 7 were reused for seed 8");
    assert!(!stderr(&o).contains(reused), "{}", stderr(&o));
    assert!(!stderr(&o).contains("rebuilding"), "the same corpus keeps its index: {}", stderr(&o));

    // Another number of hard negatives.
    let more = dir.path().join("more.toml");
    std::fs::write(&more, std::fs::read_to_string(&recipe).unwrap().replace("hard_negatives = 1", "hard_negatives = 2")).unwrap();
    let o = run(&mut train_cmd(&more, &out, &["--overwrite-output-dir"]));
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(key()["fill"]["count"], 2);
    assert!(!stderr(&o).contains(reused), "{}", stderr(&o));

    // The corpus rewritten in place (same path): the index is rebuilt and the negatives mined
    // again from the new text.
    let corpus = dir.path().join("corpus.jsonl");
    let text = std::fs::read_to_string(&corpus).unwrap();
    std::fs::write(&corpus, text.replacen("\"text\": \"", "\"text\": \"zyzzyva ", 1)).unwrap();
    let o = run(&mut train_cmd(&recipe, &out, &["--overwrite-output-dir"]));
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("rebuilding"), "the index of the old corpus was reused: {}", stderr(&o));
    assert_ne!(key()["corpus_sha256"], first["corpus_sha256"]);
    // Resuming after the corpus changed again (or with exclude_gold_pages flipped) would train
    // the checkpoint on other data: refused, naming what changed.
    let text = std::fs::read_to_string(&corpus).unwrap();
    std::fs::write(&corpus, text.replacen("zyzzyva ", "zyzzyvas ", 1)).unwrap();
    fails(&run(&mut train_cmd(&recipe, &out, &["--resume-from-checkpoint", "latest"])), &["another recipe", "corpus_sha256"]);
    std::fs::write(&corpus, &text).unwrap();
    let flipped = dir.path().join("flipped.toml");
    std::fs::write(&flipped, std::fs::read_to_string(&recipe).unwrap().replace("hard_negatives = 1", "hard_negatives = 1\nexclude_gold_pages = true")).unwrap();
    fails(&run(&mut train_cmd(&flipped, &out, &["--resume-from-checkpoint", "latest"])), &["another recipe", "exclude_gold_pages"]);
    let o = run(&mut train_cmd(&recipe, &out, &["--resume-from-checkpoint", "latest"]));
    assert!(o.status.success(), "the same recipe and corpus resume: {}", stderr(&o));
}

/// `exclude_answer_negatives` (DPR's rule): every query still gets its top BM25 passage that
/// is not gold, but none that holds one of its answers, where without the setting some do; the
/// saved negatives are keyed on it, and a run made without it is not resumed with it.
#[test]
fn negatives_holding_an_answer_are_left_out_when_asked() {
    use rak_retrieval::eval::answer::has_answer;
    let dir = TempDir::new("train-answer-negatives");
    let train = TRAIN.replace("max_steps = 8", "max_steps = 1").replace("negative_depth = 20", "negative_depth = 1");
    // Squad questions of few pages: the other paragraphs of a page often name the answer.
    let plain = task_data(dir.path(), &[("squad", "squad", 0, 80)], &train);
    let filtered = dir.path().join("filtered.toml");
    std::fs::write(&filtered, std::fs::read_to_string(&plain).unwrap().replace("hard_negatives = 1", "hard_negatives = 1\nexclude_answer_negatives = true")).unwrap();
    let texts: std::collections::HashMap<String, String> = std::fs::read_to_string(dir.path().join("corpus.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            (v["_id"].as_str().unwrap().to_string(), v["text"].as_str().unwrap().to_string())
        })
        .collect();
    let answers: std::collections::HashMap<String, Vec<String>> = std::fs::read_to_string(dir.path().join("tasks/squad/queries.train.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            (v["_id"].as_str().unwrap().to_string(), v["answers"].as_array().unwrap().iter().map(|a| a.as_str().unwrap().to_string()).collect())
        })
        .collect();
    let holding = |negatives: &std::collections::BTreeMap<String, Vec<String>>| {
        negatives.iter().filter(|(q, ids)| answers.get(*q).is_some_and(|a| ids.iter().any(|id| has_answer(a, &texts[id])))).count()
    };

    let (out_plain, out_filtered) = (dir.path().join("plain"), dir.path().join("filtered"));
    let o = run(&mut train_cmd(&plain, &out_plain, &[]));
    assert!(o.status.success(), "{}", stderr(&o));
    let (_, before) = saved_negatives(&out_plain.join("negatives-episode-0.json"));
    assert!(holding(&before) > 0, "the slice has no squad negative holding an answer: the test would prove nothing");

    let o = run(&mut train_cmd(&filtered, &out_filtered, &[]));
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("negatives that hold one of their answers"), "{}", stderr(&o));
    let (key, after) = saved_negatives(&out_filtered.join("negatives-episode-0.json"));
    assert_eq!(holding(&after), 0, "{after:?}");
    assert_eq!(after.len(), before.len());
    assert!(after.values().all(|ids| ids.len() == 1), "each query keeps one negative from deeper in the ranking: {after:?}");
    // Queries whose top negative held no answer keep it.
    for (q, ids) in &before {
        if !answers.get(q).is_some_and(|a| has_answer(a, &texts[&ids[0]])) {
            assert_eq!(&after[q], ids, "{q}");
        }
    }
    assert!(serde_json::from_str::<Value>(&key).unwrap()["exclude_answer_negatives"]["answers_sha256"].is_string(), "{key}");
    fails(&run(&mut train_cmd(&filtered, &out_plain, &["--resume-from-checkpoint", "latest"])), &["another recipe", "exclude_answer_negatives"]);
}

/// `host analyze` on a small T-SAGE run: the JSON's task-specific and not-activated shares
/// equal a direct computation from the saved momentum; the plots are PNG files; the
/// commitment rate between two checkpoints is reported; fresh gradients work too.
#[test]
fn analyze_reports_task_specialisation_from_tsage_momentum() {
    let dir = TempDir::new("train-analyze");
    let train = TRAIN.replace("optim = \"adamw\"", "optim = \"tsage\"\noptim_settings = { median_of = \"nonzero\", beta = 0.5 }").replace("max_steps = 8", "max_steps = 4");
    let recipe = small_task_data(dir.path(), 12, &train);
    let out = dir.path().join("run");
    let o = run(&mut train_cmd(&recipe, &out, &[]));
    assert!(o.status.success(), "{}", stderr(&o));

    let analyze = |extra: &[&str]| {
        let mut c = Command::new(host_bin());
        c.args(["analyze", "--config", p(&recipe)]).args(extra).env_remove("RAK_PLUGIN_PATH");
        run(&mut c)
    };
    let o = analyze(&["--checkpoint", p(&out.join("checkpoint-4")), "--compare", p(&out.join("checkpoint-2")), "--output", p(&dir.path().join("a"))]);
    assert!(o.status.success(), "{}", stderr(&o));
    let a: Value = serde_json::from_str(&std::fs::read_to_string(dir.path().join("a/analysis.json")).unwrap()).unwrap();
    assert!(a["source"].as_str().unwrap().contains("T-SAGE momentum"), "{}", a["source"]);

    // Independently: entropy of softmax(M / 2) over the tasks, from the checkpoint's momentum.
    let state = tch::Tensor::read_safetensors(out.join("checkpoint-4/optimizer.safetensors")).unwrap();
    let rows: Vec<tch::Tensor> = state.iter().filter(|(n, _)| n.starts_with("momentum/")).map(|(_, t)| t.reshape([2, -1])).collect();
    let m = tch::Tensor::cat(&rows, 1);
    let logp = (&m / 2.0).log_softmax(0, tch::Kind::Double);
    let h = -(logp.exp() * &logp).sum_dim_intlist(0, false, tch::Kind::Double);
    let p_count = m.size()[1] as f64;
    let specific = h.lt(0.3).sum(tch::Kind::Double).double_value(&[]) / p_count;
    let idle = m.lt(0.1).all_dim(0, false).sum(tch::Kind::Double).double_value(&[]) / p_count;
    assert_eq!(a["parameters"].as_i64().unwrap() as f64, p_count);
    assert!((a["task_specific"].as_f64().unwrap() - specific).abs() < 1e-6, "{} vs {specific}", a["task_specific"]);
    assert!((a["not_activated"].as_f64().unwrap() - idle).abs() < 1e-6, "{} vs {idle}", a["not_activated"]);
    assert!(specific > 0.0 && idle > 0.0 && idle < 1.0, "a fixture where the shares say something: {specific} {idle}");
    let rate = a["commitment"]["rate"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&rate) && a["commitment"]["task_specific_parameters"].as_i64().unwrap() > 0, "{}", a["commitment"]);
    for png in ["sensitivity_density.png", "entropy_histogram.png"] {
        let bytes = std::fs::read(dir.path().join("a").join(png)).unwrap();
        assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n") && bytes.len() > 10_000, "{png}: {} bytes", bytes.len());
    }

    let o = analyze(&["--checkpoint", p(&out), "--source", "gradients", "--batches", "2", "--batch-size", "6", "--output", p(&dir.path().join("g"))]);
    assert!(o.status.success(), "{}", stderr(&o));
    let g: Value = serde_json::from_str(&std::fs::read_to_string(dir.path().join("g/analysis.json")).unwrap()).unwrap();
    assert!(g["source"].as_str().unwrap().starts_with("gradients"));
    assert_eq!(g["parameters"], a["parameters"]);
    // A model trained without T-SAGE has no momentum to read.
    let o = analyze(&["--checkpoint", p(&minilm_dir()), "--source", "momentum"]);
    fails(&o, &["no T-SAGE momentum"]);
}

/// Every recipe in configs/ parses, names plugins that exist, and gives only settings they
/// declare (optimizers are created with them; encoders' settings are checked against their
/// schema, since the full-scale recipes name checkpoints that are not here).
#[test]
fn every_recipe_parses_and_names_known_plugins_and_settings() {
    let registry = rak_host::Registry::discover(&[rak_host::Source::Dir(release_dir())]).unwrap();
    let mut seen = 0;
    for group in ["minikilt", "kilt"] {
        for entry in std::fs::read_dir(root().join("configs").join(group)).unwrap().flatten() {
            let path = entry.path();
            if path.extension().and_then(|e| e.to_str()) != Some("toml") {
                continue;
            }
            let recipe = rak_train::recipe::read_recipe(&path).unwrap_or_else(|e| panic!("{}: {e:#}", path.display()));
            let optim = recipe.train.optim.clone().expect("every recipe names its optimizer");
            recipe.validate().unwrap_or_else(|e| panic!("{}: {e:#}", path.display()));
            let encoder = recipe.model.encoder.clone().expect("every recipe names its encoder");
            let plugin = registry.iter().find(|p| p.header.name == encoder).unwrap_or_else(|| panic!("{}: no encoder {encoder}", path.display()));
            let schema = rak_host::proxy::settings_schema(plugin);
            // Every stage's optimizer and encoder settings, with the stage overrides applied.
            for stage in 0..=recipe.train.ance_episodes {
                let plan = recipe.train.stage_plan(&recipe.model.settings, &optim, stage);
                registry.optimizer(&plan.optim, &Value::Object(plan.optim_settings)).unwrap_or_else(|e| panic!("{} stage {stage}: {e:#}", path.display()));
                for key in plan.model_settings.keys() {
                    assert!(schema.get(key).is_some(), "{} stage {stage}: encoder {encoder} has no setting {key}", path.display());
                }
            }
            seen += 1;
        }
    }
    assert!(seen >= 18, "{seen} recipes");
}

/// Every encoder trains with every optimizer: two steps each on a small real slice (MiniLM for
/// `dpr` and `taser`, the fixture T5 for `taco`), finite losses, a saved model.
/// The encoder setting `bf16` would train bf16 weights and AdamW moments: a recipe that gives
/// it is refused (pointing at --bf16), and a checkpoint an older version's training saved
/// with it is trained in float32; no checkpoint or final model carries the setting on.
#[test]
fn training_keeps_float32_weights_whatever_the_encoder_settings_say() {
    let dir = TempDir::new("train-bf16-setting");
    let recipe = small_task_data(dir.path(), 12, &TRAIN.replace("max_steps = 8", "max_steps = 2"));
    let text = std::fs::read_to_string(&recipe).unwrap();
    assert!(text.contains("settings = { max_length = 64 }"), "{text}");
    let bf16_recipe = dir.path().join("bf16.toml");
    std::fs::write(&bf16_recipe, text.replace("settings = { max_length = 64 }", "settings = { max_length = 64, bf16 = true }")).unwrap();
    fails(&run(&mut train_cmd(&bf16_recipe, &dir.path().join("refused"), &[])), &["bf16 = true", "float32", "--bf16"]);

    // A starting checkpoint whose saved settings say bf16 = true.
    let start = dir.path().join("start");
    assert!(Command::new("cp").args(["-r", p(&minilm_dir()), p(&start)]).status().unwrap().success());
    let settings_file = start.join("rak_encoder.json");
    let mut saved: Value = std::fs::read_to_string(&settings_file).ok().and_then(|t| serde_json::from_str(&t).ok()).unwrap_or_else(|| serde_json::json!({}));
    saved["bf16"] = Value::Bool(true);
    std::fs::write(&settings_file, saved.to_string()).unwrap();
    let out = dir.path().join("out");
    let o = Command::new(host_bin())
        .args(["train", "--model", p(&start), "--config", p(&recipe), "--output-dir", p(&out)])
        .env_remove("RAK_PLUGIN_PATH")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("float32 weights"), "says so: {}", stderr(&o));
    for dir in [out.join("checkpoint-2"), out.clone()] {
        for (name, w) in weights(&dir) {
            assert_eq!(w.kind(), tch::Kind::Float, "{}: {name} is {:?}", dir.display(), w.kind());
        }
        let s: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("rak_encoder.json")).unwrap()).unwrap();
        assert!(s.get("bf16").is_none(), "{}/rak_encoder.json passes bf16 on: {s}", dir.display());
    }
    // AdamW's moments (its step counts are integers).
    let moments: Vec<_> = tch::Tensor::read_safetensors(out.join("checkpoint-2/optimizer.safetensors")).unwrap().into_iter().filter(|(n, _)| n.starts_with("exp_avg")).collect();
    assert!(!moments.is_empty());
    for (name, m) in moments {
        assert_eq!(m.kind(), tch::Kind::Float, "optimizer state {name} is {:?}", m.kind());
    }
}

/// Every encoder with every optimizer, in float32; in bf16 as well for every optimizer with
/// dpr, and with one optimizer of each gradient path (AdamW's summed gradient, T-SAGE's per-task
/// gradients) for taser and taco: the optimizers see the same float32 gradients whichever
/// encoder made them, so the other eight bf16 runs (a minute and a half of CI) checked nothing
/// new, and train_parity holds each encoder's bf16 step to PyTorch's autocast.
#[test]
fn every_encoder_trains_with_every_optimizer_in_float32_and_some_in_bf16() {
    let dir = TempDir::new("train-matrix");
    // No warm-up: T-SAGE (burn-in = warm-up) and every other optimizer act from step 0, at a
    // learning rate that moves weights visibly in 3 steps.
    let train = "learning_rate = 1e-4\nper_device_train_batch_size = 4\nmax_steps = 3\nlogging_steps = 1\nsave_steps = 100\nhard_negatives = 1\nnegative_depth = 10\nwarmup_ratio = 0.0\nseed = 3";
    let recipe = small_task_data(dir.path(), 6, train);
    let t5 = root().join("tests/fixtures/t5/t5-v1_1");
    let encoders = [("dpr", minilm_dir()), ("taser", minilm_dir()), ("taco", t5)];
    let optimizers: [(&str, &str); 6] = [
        ("adamw", "{}"),
        ("tsage", "{\"form\": \"exact\"}"),
        ("tsage", "{\"form\": \"lean\", \"median_of\": \"nonzero\"}"),
        ("pcgrad", "{}"),
        ("cgd", "{}"),
        ("gradnorm", "{}"),
    ];
    for (encoder, model) in &encoders {
        let start: std::collections::HashMap<String, tch::Tensor> = weights(model).into_iter().collect();
        for (i, (optim, settings)) in optimizers.iter().enumerate() {
            let what = format!("{encoder} + {optim} {settings}");
            let config = dir.path().join(format!("{encoder}-{i}.toml"));
            let text = std::fs::read_to_string(&recipe).unwrap().replace("encoder = \"dpr\"", &format!("encoder = \"{encoder}\""));
            let settings: Value = serde_json::from_str(settings).unwrap();
            let inline: Vec<String> = settings.as_object().unwrap().iter().map(|(k, v)| format!("{k} = {v}")).collect();
            std::fs::write(&config, text.replace("[train]", &format!("[train]\noptim = \"{optim}\"\noptim_settings = {{ {} }}", inline.join(", ")))).unwrap();
            // The update each precision made: trained minus starting weights, over the tensors
            // both hold (TASER's experts are new), flattened in name order.
            let mut updates = Vec::new();
            let mut step_losses: Vec<Vec<f64>> = Vec::new();
            let precisions: &[bool] = if *encoder == "dpr" || i < 2 { &[false, true] } else { &[false] };
            for &bf16 in precisions {
                let out = dir.path().join(format!("{encoder}-{i}-{}", if bf16 { "bf16" } else { "f32" }));
                let mut c = Command::new(host_bin());
                c.args(["train", "--model", p(model), "--config", p(&config), "--output-dir", p(&out)]).env_remove("RAK_PLUGIN_PATH");
                if bf16 {
                    c.arg("--bf16");
                }
                let o = run(&mut c);
                assert!(o.status.success(), "{what} bf16 {bf16}: {}", stderr(&o));
                let log = losses(&out);
                assert_eq!(log.len(), 3, "{what} bf16 {bf16}");
                for step in &log {
                    assert!(step.as_object().unwrap().values().all(|l| l.as_f64().is_some_and(f64::is_finite)), "{what}: {step}");
                }
                step_losses.push(log.iter().flat_map(|step| step.as_object().unwrap().values().map(|l| l.as_f64().unwrap()).collect::<Vec<_>>()).collect());
                let trained = weights(&out);
                let mut delta = Vec::new();
                for (name, w) in &trained {
                    assert_eq!(w.kind(), tch::Kind::Float, "{what} bf16 {bf16}: {name} saved as {:?}", w.kind());
                    assert!(w.isfinite().all().int64_value(&[]) == 1, "{what} bf16 {bf16}: {name} is not finite");
                    if let Some(w0) = start.get(name) {
                        delta.push((w - w0.to_kind(tch::Kind::Float)).flatten(0, -1));
                    }
                }
                let delta = tch::Tensor::cat(&delta, 0);
                let moved = delta.norm().double_value(&[]);
                assert!(moved > 1e-3, "{what} bf16 {bf16}: the weights barely moved (update norm {moved:e})");
                updates.push(delta);
                // 28 runs of a model, a checkpoint and its optimizer state: 8 GB if kept.
                std::fs::remove_dir_all(&out).unwrap();
            }
            if updates.len() < 2 {
                continue;
            }
            // AdamW's first steps move every element by about lr whatever its gradient's size,
            // so both precisions move the weights by about as much. Where the embeddings are
            // unit length (dpr here), bf16 rounds the scores by little against their spread:
            // the losses stay within a few percent and the update goes the same way (not
            // closer: where a gradient is mostly rounding noise, bf16 can flip its sign). The
            // other two score with raw inner products in the tens (TASER's default [CLS], the
            // random fixture T5), where bf16's rounding alone moves the loss by tenths; all
            // three are held to PyTorch's own autocast in train_parity.
            let (a, b) = (&updates[0], &updates[1]);
            let cosine = (a * b).sum(tch::Kind::Double).double_value(&[]) / (a.norm().double_value(&[]) * b.norm().double_value(&[]));
            let ratio = b.norm().double_value(&[]) / a.norm().double_value(&[]);
            let loss_gap = step_losses[0].iter().zip(&step_losses[1]).map(|(x, y)| (x - y).abs() / x.abs().max(0.1)).fold(0.0, f64::max);
            println!("{what}: bf16 against float32: update cosine {cosine:.4}, norm ratio {ratio:.4}, largest relative loss gap {loss_gap:.4}");
            assert!((0.8..1.25).contains(&ratio), "{what}: the bf16 update's norm is {ratio:.4} x float32's");
            if *encoder == "dpr" {
                assert!(cosine > 0.3, "{what}: the bf16 update does not go float32's way (cosine {cosine:.4})");
                assert!(loss_gap < 0.05, "{what}: bf16 losses {:?} against float32's {:?}", step_losses[1], step_losses[0]);
            }
        }
    }
}

/// The output folder is the run's own (issue 32): one that holds files of someone else's (here
/// a parent folder of other runs) is refused, with or without --overwrite-output-dir, and so
/// are the starting model's folder, a folder inside it and one that holds it; starting over
/// removes only what the run wrote, and a file put into one of its checkpoints is a refusal
/// that names it, not a file removed.
#[test]
fn the_output_folder_is_the_run_s_own_and_overwrite_removes_only_what_it_wrote() {
    let dir = TempDir::new("train-own-output");
    let recipe = small_task_data(dir.path(), 12, TRAIN);
    let cmd = |model: &Path, out: &Path, extra: &[&str]| {
        let mut c = Command::new(host_bin());
        c.args(["train", "--model", p(model), "--config", p(&recipe), "--output-dir", p(out), "--max-steps", "2"]).args(extra).env_remove("RAK_PLUGIN_PATH");
        c
    };
    // A parent of other runs.
    let runs = dir.path().join("runs");
    std::fs::create_dir_all(runs.join("other-run")).unwrap();
    std::fs::write(runs.join("other-run/run.json"), "{}").unwrap();
    std::fs::write(runs.join("notes.txt"), "mine").unwrap();
    for extra in [&[][..], &["--overwrite-output-dir"][..]] {
        fails(&run(&mut cmd(&minilm_dir(), &runs, extra)), &[p(&runs), "holds files that no run of host train wrote", "notes.txt", "other-run"]);
    }
    let mut left: Vec<String> = std::fs::read_dir(&runs).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    left.sort();
    assert_eq!(left, ["notes.txt", "other-run"], "the refused folder was written to");

    // The starting model's folder, one inside it, one that holds it.
    let holder = dir.path().join("holder");
    let model = holder.join("model");
    std::fs::create_dir_all(&model).unwrap();
    for e in std::fs::read_dir(minilm_dir()).unwrap().flatten() {
        std::os::unix::fs::symlink(e.path(), model.join(e.file_name())).unwrap();
    }
    fails(&run(&mut cmd(&model, &model, &["--overwrite-output-dir"])), &["is the starting model's folder"]);
    fails(&run(&mut cmd(&model, &model.join("out"), &[])), &["lies inside the starting model's folder"]);
    fails(&run(&mut cmd(&model, &holder, &["--overwrite-output-dir"])), &["lies inside the output folder"]);
    assert!(!model.join("out").exists() && !model.join("run.json").exists() && !holder.join("run.json").exists());
    // The model's folder spelled through a folder that does not exist yet.
    let around = holder.join("new/../model");
    for extra in [&[][..], &["--overwrite-output-dir"][..]] {
        fails(&run(&mut cmd(&model, &around, extra)), &["is the starting model's folder"]);
    }
    assert!(!holder.join("new").exists() && !model.join("run.json").exists() && !model.join("checkpoint-2").exists());

    // A folder with a run.json and a checkpoint-N that are not host train's.
    let foreign = dir.path().join("foreign");
    std::fs::create_dir_all(foreign.join("checkpoint-7")).unwrap();
    std::fs::write(foreign.join("run.json"), r#"{"name":"sacred"}"#).unwrap();
    std::fs::write(foreign.join("config.json"), "mine").unwrap();
    std::fs::write(foreign.join("checkpoint-7/notes.txt"), "mine").unwrap();
    for extra in [&[][..], &["--overwrite-output-dir"][..]] {
        fails(&run(&mut cmd(&minilm_dir(), &foreign, extra)), &[p(&foreign), "holds files that no run of host train wrote", "config.json"]);
    }
    let mut left: Vec<String> = std::fs::read_dir(&foreign).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    left.sort();
    assert_eq!(left, ["checkpoint-7", "config.json", "run.json"], "the refused folder was written to");
    assert_eq!(std::fs::read_to_string(foreign.join("run.json")).unwrap(), r#"{"name":"sacred"}"#);
    assert_eq!(std::fs::read_to_string(foreign.join("config.json")).unwrap(), "mine");
    assert_eq!(std::fs::read_dir(foreign.join("checkpoint-7")).unwrap().count(), 1);

    // Hugging Face's Trainer output: its checkpoints hold a trainer_state.json too, in its shape.
    let hf = dir.path().join("hf");
    std::fs::create_dir_all(hf.join("checkpoint-10")).unwrap();
    std::fs::write(hf.join("checkpoint-10/trainer_state.json"), r#"{"global_step":10,"log_history":[]}"#).unwrap();
    std::fs::write(hf.join("checkpoint-10/model.safetensors"), "theirs").unwrap();
    for extra in [&[][..], &["--overwrite-output-dir"][..], &["--resume-from-checkpoint", "latest"][..]] {
        fails(&run(&mut cmd(&minilm_dir(), &hf, extra)), &[p(&hf), "holds files that no run of host train wrote", "checkpoint-10"]);
    }
    assert_eq!(names(&hf), ["checkpoint-10"], "the refused folder was written to");
    assert_eq!(names(&hf.join("checkpoint-10")), ["model.safetensors", "trainer_state.json"]);

    // A run of its own: a file beside it is kept; one put into its checkpoint stops the
    // overwrite (naming it) instead of going with the checkpoint.
    let out = dir.path().join("out");
    let o = run(&mut cmd(&minilm_dir(), &out, &[]));
    assert!(o.status.success(), "{}", stderr(&o));
    std::fs::write(out.join("notes.txt"), "mine").unwrap();
    std::fs::write(out.join("checkpoint-2/my-eval.json"), "{}").unwrap();
    fails(&run(&mut cmd(&minilm_dir(), &out, &["--overwrite-output-dir"])), &["checkpoint-2", "my-eval.json", "did not write"]);
    assert!(out.join("checkpoint-2/my-eval.json").exists());
    std::fs::remove_file(out.join("checkpoint-2/my-eval.json")).unwrap();
    let o = run(&mut cmd(&minilm_dir(), &out, &["--overwrite-output-dir"]));
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(std::fs::read_to_string(out.join("notes.txt")).unwrap(), "mine");
}

/// `RAK_STEP_PHASES` logs where each step's time went, for the summed-gradient path (AdamW) and
/// the per-task one (T-SAGE); the phases fit in the step (a run without it logs none:
/// `a_killed_run_resumes_to_the_same_result`). `RAK_TORCH_PROFILE` writes libtorch's trace of
/// the steps after the first two (up to `RAK_TORCH_PROFILE_STEPS`), each a `rak::step` scope
/// holding its phases' scopes and the operators they ran (what `bench/trace_table.py` reads).
#[test]
fn step_phases_and_traces_are_written_when_asked() {
    let dir = TempDir::new("train-phases");
    let recipe = small_task_data(dir.path(), 12, &TRAIN.replace("max_steps = 8", "max_steps = 2"));
    for (optim, extra) in [("adamw", &[][..]), ("tsage", &["--optim", "tsage"][..])] {
        let out = dir.path().join(optim);
        let o = run(train_cmd(&recipe, &out, extra).env("RAK_STEP_PHASES", "1"));
        assert!(o.status.success(), "{}", stderr(&o));
        let lines: Vec<Value> = std::fs::read_to_string(out.join("trainer_log.jsonl")).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(lines.len(), 2);
        let mut before = 0.0;
        for l in &lines {
            let phases = l["phases_seconds_per_step"].as_object().unwrap_or_else(|| panic!("{optim}: no phases in {l}"));
            let names: Vec<&str> = phases.keys().map(String::as_str).collect();
            assert_eq!(names, ["backward", "forward", "loss", "optimizer", "sample"], "{optim}");
            let sum: f64 = phases.values().map(|v| v.as_f64().unwrap()).sum();
            assert!(phases.values().all(|v| v.as_f64().unwrap() >= 0.0) && sum > 0.0, "{optim}: {l}");
            // One line a step: its phases fit in that step's own time (seconds_per_step is the
            // mean since the loop began), and make up most of it (the rest is logging).
            let until = l["seconds_per_step"].as_f64().unwrap() * l["step"].as_f64().unwrap();
            let step = until - before;
            before = until;
            assert!(sum <= step + 1e-3 && sum >= 0.5 * step, "{optim}: phases {sum} s of a {step} s step: {l}");
        }
    }
    // The trace: 4 steps, the first two left out, the rest capped by RAK_TORCH_PROFILE_STEPS.
    let recipe = small_task_data(dir.path(), 12, &TRAIN.replace("max_steps = 8", "max_steps = 4"));
    for (optim, extra, cap, want) in [("adamw", &[][..], "20", 2), ("tsage", &["--optim", "tsage"][..], "1", 1)] {
        let traces = dir.path().join(format!("{optim}-trace"));
        let o = run(train_cmd(&recipe, &dir.path().join(format!("{optim}-traced")), extra).env("RAK_TORCH_PROFILE", &traces).env("RAK_TORCH_PROFILE_STEPS", cap));
        assert!(o.status.success(), "{}", stderr(&o));
        assert!(stderr(&o).contains("libtorch's profile of the steps"), "{}", stderr(&o));
        let trace: Value = serde_json::from_slice(&std::fs::read(traces.join("host-trace.json")).unwrap()).unwrap();
        let names: Vec<&str> = trace["traceEvents"].as_array().unwrap().iter().filter(|e| e["cat"] == "user_annotation" || e["cat"] == "cpu_op").filter_map(|e| e["name"].as_str()).collect();
        let count = |n: &str| names.iter().filter(|&&m| m == n).count();
        assert_eq!(count("rak::step"), want, "{optim}: one scope a recorded step");
        for scope in ["rak::forward", "rak::loss", "rak::backward", "rak::optimizer"] {
            assert!(count(scope) >= want, "{optim}: {scope} {}", count(scope));
        }
        assert!(count("aten::mm") > 10 && names.iter().any(|n| n.contains("Backward")), "{optim}: forward and backward operators recorded");
    }
    // `=0` means off: it must not add a device wait to every step.
    let out = dir.path().join("off");
    let o = run(train_cmd(&recipe, &out, &[]).env("RAK_STEP_PHASES", "0"));
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!std::fs::read_to_string(out.join("trainer_log.jsonl")).unwrap().contains("phases"), "RAK_STEP_PHASES=0 logged phases");
}

/// Every file of a folder, recursively, with its size and modification time.
fn listing(dir: &Path) -> Vec<(String, u64, std::time::SystemTime)> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            let m = e.metadata().unwrap();
            if m.is_dir() {
                todo.push(e.path());
            }
            out.push((e.path().strip_prefix(dir).unwrap().display().to_string(), if m.is_dir() { 0 } else { m.len() }, m.modified().unwrap()));
        }
    }
    out.sort();
    out
}

/// A resume that is refused (a mistyped checkpoint, one of other settings) leaves a finished
/// ANCE run as it was, run.json included; one that changes only logging and saving is taken;
/// `max_grad_norm = 0` clips nothing (as Hugging Face's Trainer) and the model trains; a
/// finished run whose checkpoints were deleted is not overwritten without --overwrite-output-dir.
#[test]
fn a_refused_resume_leaves_the_run_as_it_was() {
    let dir = TempDir::new("train-refused-resume");
    let train = TRAIN.replace("max_steps = 8", "max_steps = 2").replace("save_steps = 2", "save_steps = 1") + "\nmax_grad_norm = 0.0\nance_episodes = 1\nance_depth = 10";
    let recipe = small_task_data(dir.path(), 6, &train);
    let out = dir.path().join("out");
    let o = run(&mut train_cmd(&recipe, &out, &[]));
    assert!(o.status.success(), "{}", stderr(&o));
    // No clipping: the log has no clipped norm, and every stage moved the weights.
    let line: Value = serde_json::from_str(std::fs::read_to_string(out.join("episode-0/trainer_log.jsonl")).unwrap().lines().next().unwrap()).unwrap();
    assert!(line["optimizer"]["grad_norm"].is_null(), "{line}");
    let (start, first, last) = (weights(&minilm_dir()), weights(&out.join("episode-0")), weights(&out));
    assert!(start.iter().zip(&first).any(|((_, a), (_, b))| !a.equal(b)), "max_grad_norm = 0 trained nothing");
    assert!(first.iter().zip(&last).any(|((_, a), (_, b))| !a.equal(b)), "episode 1 trained nothing");

    let before = listing(&out);
    assert!(before.iter().any(|(n, ..)| n == "episode-1/checkpoint-1") && before.iter().any(|(n, ..)| n == "final_model_done"), "{before:?}");
    let missing = out.join("episode-0/checkpoint-9");
    fails(&run(&mut train_cmd(&recipe, &out, &["--resume-from-checkpoint", p(&missing)])), &["checkpoint-9", "no such checkpoint folder"]);
    assert_eq!(listing(&out), before, "a refused resume changed the run's files");
    // A checkpoint of other trainer settings (run.json of a version that did not record them,
    // so that only the checkpoint's own check refuses it): refused naming the setting, nothing
    // removed or rewritten.
    let run_file = out.join("run.json");
    let mut recorded: Value = serde_json::from_str(&std::fs::read_to_string(&run_file).unwrap()).unwrap();
    recorded["recipe"].as_object_mut().unwrap().remove("train");
    std::fs::write(&run_file, recorded.to_string()).unwrap();
    let before = listing(&out);
    let ckpt = out.join("episode-0/checkpoint-1");
    fails(&run(&mut train_cmd(&recipe, &out, &["--resume-from-checkpoint", p(&ckpt), "--learning-rate", "1e-4"])), &["learning_rate: 0.00005 then, 0.0001 now"]);
    assert_eq!(listing(&out), before, "a refused resume changed the run's files");
    assert_eq!(std::fs::read_to_string(&run_file).unwrap(), recorded.to_string());
    // Queries edited since the run began: the rest of it would train on other data.
    let queries = dir.path().join("tasks/squad/queries.train.jsonl");
    let kept = std::fs::read_to_string(&queries).unwrap();
    std::fs::write(&queries, kept.replacen("\"text\": \"", "\"text\": \"edited ", 1)).unwrap();
    fails(&run(&mut train_cmd(&recipe, &out, &["--resume-from-checkpoint", "latest"])), &["started on other task data", "squad/queries.train.jsonl changed since the run began"]);
    assert_eq!(listing(&out), before, "a refused resume changed the run's files");
    std::fs::write(&queries, kept).unwrap();

    // Other logging and saving only: resumed mid-stage (the refusal's two JSON blobs are gone).
    let relogged = dir.path().join("relogged.toml");
    std::fs::write(&relogged, std::fs::read_to_string(&recipe).unwrap().replace("logging_steps = 1", "logging_steps = 2").replace("save_steps = 1", "save_steps = 5")).unwrap();
    let ckpt = out.join("episode-1/checkpoint-1");
    let o = run(&mut train_cmd(&relogged, &out, &["--resume-from-checkpoint", p(&ckpt)]));
    assert!(o.status.success() && stderr(&o).contains("resumed from"), "{}", stderr(&o));

    // A finished run whose checkpoints (and stages) the user deleted: our run.json and the
    // model remain, and a new run there needs --overwrite-output-dir.
    for e in std::fs::read_dir(&out).unwrap() {
        let path = e.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if path.is_dir() {
            std::fs::remove_dir_all(&path).unwrap();
        } else if name.starts_with("negatives-") || name == "final_model_done" {
            std::fs::remove_file(&path).unwrap();
        }
    }
    let before = listing(&out);
    fails(&run(&mut train_cmd(&recipe, &out, &["--ance-episodes", "0"])), &["earlier run", "--overwrite-output-dir"]);
    assert_eq!(listing(&out), before);
}
