//! Data-parallel `host train` (issue 23): `--nproc 2` with half the batch per process trains
//! as one process with the whole batch, over libtorch's c10d (Gloo on loopback).
//!
//! ANCE episodes split the corpus's encoding over the processes.
//!
//! The equivalence runs keep MiniLM's dropout on: the trainer keys each text's masks by
//! (seed, step, task, row), so they do not depend on which process encodes it. The other
//! tests turn it off (a MiniLM copy whose config sets it to 0), which they do not need.

use rak_e2e::*;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// AdamW's eps is 1e-6 rather than 1e-8: an element whose gradient is near 1e-8, where its
/// float32 noise is a few percent, would otherwise step by about lr in one run and less in the
/// other.
const TRAIN: &str = "optim_settings = { eps = 1e-6 }\nlearning_rate = 1e-4\nper_device_train_batch_size = 8\nmax_steps = 4\nwarmup_ratio = 0.0\nscore_scale = 20.0\nhard_negatives = 1\nnegative_depth = 10\nlogging_steps = 1\nsave_steps = 1\nseed = 7";

/// all-MiniLM-L6-v2 with dropout off: its files linked, its config rewritten.
fn minilm_without_dropout(dir: &Path) -> PathBuf {
    let out = dir.join("minilm-no-dropout");
    std::fs::create_dir_all(&out).unwrap();
    for e in std::fs::read_dir(minilm_dir()).unwrap().flatten() {
        if e.file_name() != "config.json" {
            std::os::unix::fs::symlink(e.path(), out.join(e.file_name())).unwrap();
        }
    }
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(minilm_dir().join("config.json")).unwrap()).unwrap();
    cfg["hidden_dropout_prob"] = 0.0.into();
    cfg["attention_probs_dropout_prob"] = 0.0.into();
    std::fs::write(out.join("config.json"), cfg.to_string()).unwrap();
    out
}

fn train(recipe: &Path, model: &Path, out: &Path, extra: &[&str]) -> Value {
    let o = Command::new(host_bin())
        .args(["train", "--model", p(model), "--config", p(recipe), "--output-dir", p(out)])
        .args(extra)
        .env_remove("RAK_PLUGIN_PATH")
        .env_remove("WORLD_SIZE")
        .output()
        .unwrap();
    assert!(o.status.success(), "host train {extra:?} failed:\n{}", stderr(&o));
    serde_json::from_str(&stdout(&o)).unwrap_or_else(|e| panic!("summary is not JSON ({e}): {}", stdout(&o)))
}

fn log(out: &Path) -> Vec<Value> {
    std::fs::read_to_string(out.join("trainer_log.jsonl")).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

fn weights(dir: &Path) -> Vec<(String, tch::Tensor)> {
    let mut w = tch::Tensor::read_safetensors(dir.join("model.safetensors")).unwrap();
    w.sort_by(|a, b| a.0.cmp(&b.0));
    w
}

/// The optimizer state of a checkpoint (`checkpoint-STEP/optimizer.safetensors`) whose name
/// starts with `kind/`, by parameter name (AdamW's `exp_avg` is `(1 - beta1) g` after the
/// first step; T-SAGE's `momentum` is `[tasks, ...]`).
fn state(out: &Path, step: u64, kind: &str) -> std::collections::HashMap<String, tch::Tensor> {
    let state = tch::Tensor::read_safetensors(out.join(format!("checkpoint-{step}/optimizer.safetensors"))).unwrap();
    state.into_iter().filter_map(|(k, t)| k.strip_prefix(&format!("{kind}/")).map(|n| (n.to_string(), t))).collect()
}

/// The elements where the two runs' arithmetic, not the data, decides the update: their
/// first gradients disagree by more than 1% (float32 rounding noise in a gradient whose exact
/// value is 0 or nearly: the runs sum the batch in other orders, and AdamW steps by
/// g / (|g| + eps) whatever its size), or, with T-SAGE, their task weights
/// `softmax(M / tau)` differ by more than 0.01 at some step (the momenta reach 1e4 here, so
/// a difference of 0.1% in them can move a weight from one task to the other). By parameter.
fn noise_elements(one: &Path, two: &Path, steps: u64) -> std::collections::HashMap<String, tch::Tensor> {
    let (a, b) = (state(one, 1, "exp_avg"), state(two, 1, "exp_avg"));
    let mut noise: std::collections::HashMap<String, tch::Tensor> =
        a.iter().map(|(n, x)| (n.clone(), (x - &b[n]).abs().gt_tensor(&((x.abs() + b[n].abs()) * 0.01)))).collect();
    for step in 1..=steps {
        let (m1, m2) = (state(one, step, "momentum"), state(two, step, "momentum"));
        for (n, x) in &m1 {
            // T-SAGE's default tau.
            let (wx, wy) = ((x / 2.0).softmax(0, tch::Kind::Float), (&m2[n] / 2.0).softmax(0, tch::Kind::Float));
            let moved = (wx - wy).abs().amax([0i64].as_slice(), false).gt(0.01);
            let e = noise.get_mut(n).unwrap();
            *e = e.logical_or(&moved);
        }
    }
    noise
}

/// Checks that `two` (a data-parallel run) trained as `one` did: the same losses at every
/// step, the same first gradients in all, and the same weights after 4 steps but where
/// rounding noise decides the update (see [`noise_elements`]).
fn same_training(one: &Path, two: &Path, what: &str) {
    let (a, b) = (log(one), log(two));
    assert_eq!(a.len(), 4);
    assert_eq!(b.len(), 4, "rank 0 alone writes the log, one line a step");
    for (x, y) in a.iter().zip(&b) {
        for (task, l) in x["loss"].as_object().unwrap() {
            let (l, m) = (l.as_f64().unwrap(), y["loss"][task].as_f64().unwrap());
            assert!((l - m).abs() <= 1e-5 * l.abs().max(1.0), "{what} step {}: {task} loss {l} in one process, {m} in two", x["step"]);
        }
    }
    // The first step's gradients in all: a sum counted twice or an average instead of a
    // sum over the processes would show here (AdamW's steps barely do).
    let size = |out: &Path| state(out, 1, "exp_avg").values().map(|m| m.abs().sum(tch::Kind::Double).double_value(&[])).sum::<f64>();
    let (s1, s2) = (size(one), size(two));
    assert!((s1 / s2 - 1.0).abs() < 1e-4, "{what}: the first gradients sum to {s1} in one process and {s2} in two");
    // Every element within 1e-5, except where rounding noise decides the update: those
    // within lr x steps, the most AdamW moves an element.
    let (mut worst, mut worst_noise, mut noisy, mut elements) = ((0.0f64, String::new()), 0.0f64, 0i64, 0i64);
    let noise_of = noise_elements(one, two, 4);
    for ((n, w1), (_, w2)) in weights(one).iter().zip(weights(two).iter()) {
        let d = (w1 - w2).abs();
        let noise = &noise_of[n];
        noisy += i64::try_from(noise.sum(tch::Kind::Int64)).unwrap();
        elements += w1.numel() as i64;
        let on_noise = d.masked_select(noise);
        if on_noise.numel() > 0 {
            worst_noise = worst_noise.max(on_noise.max().double_value(&[]));
        }
        let m = d.masked_fill(noise, 0.0).max().double_value(&[]);
        if m > worst.0 {
            worst = (m, n.clone());
        }
    }
    eprintln!("{what}: largest weight difference {:.3e} ({}); {noisy} elements stepped on rounding noise, within {worst_noise:.3e}", worst.0, worst.1);
    assert!(worst.0 <= 1e-5, "{what}: weights differ by {:.3e} at {}", worst.0, worst.1);
    // A few: a wrong gradient would make most elements disagree.
    assert!(noisy * 100 < elements, "{what}: {noisy} of {elements} elements decided by rounding noise");
    assert!(worst_noise <= 1e-4 * 4.0 * 1.01, "{what}: elements stepped on noise moved {worst_noise:.3e}, more than lr x steps");
    assert!((1..=4).all(|s| two.join(format!("checkpoint-{s}")).exists()), "rank 0 writes the checkpoints");
}

/// One process with 8 queries a step against two with 4 each, for AdamW and T-SAGE on two
/// tasks, dropout on (MiniLM's 0.1); then 2 queries against 1 each, where each task's
/// sub-batch is one query, so rank 0 encodes nothing and takes its gradients from rank 1 alone.
/// Each pair's runs are removed once compared (a run's checkpoints, optimizer state included,
/// take about 1 GB).
#[test]
fn two_processes_with_half_the_batch_train_as_one() {
    let dir = TempDir::new("train-dist");
    let recipe = small_task_data(dir.path(), 24, TRAIN);
    let model = minilm_dir();
    let mut first_losses = Vec::new();
    for optim in ["adamw", "tsage"] {
        let one = dir.path().join(format!("{optim}-one"));
        let two = dir.path().join(format!("{optim}-two"));
        train(&recipe, &model, &one, &["--optim", optim]);
        let s = train(&recipe, &model, &two, &["--optim", optim, "--per-device-train-batch-size", "4", "--nproc", "2"]);
        assert_eq!(s["steps"], 4, "{s}");
        same_training(&one, &two, optim);
        first_losses.push(log(&one)[0]["loss"].clone());
        for d in [one, two] {
            std::fs::remove_dir_all(d).unwrap();
        }
    }
    // Dropout was on: without it, the first step's losses are others.
    let off = dir.path().join("no-dropout");
    let no_dropout = minilm_without_dropout(dir.path());
    train(&recipe, &no_dropout, &off, &["--optim", "adamw", "--max-steps", "1"]);
    assert_ne!(log(&off)[0]["loss"], first_losses[0], "dropout made no difference to the first step");
    let (one, two) = (dir.path().join("empty-one"), dir.path().join("empty-two"));
    train(&recipe, &model, &one, &["--optim", "adamw", "--per-device-train-batch-size", "2"]);
    train(&recipe, &model, &two, &["--optim", "adamw", "--per-device-train-batch-size", "1", "--nproc", "2"]);
    same_training(&one, &two, "adamw, one query per task");
}

/// An ANCE episode over two processes: each encodes half the corpus with the first stage's
/// model, rank 0 indexes and mines, and the other reads its negatives. They are the negatives
/// one process mines, and the episode trains as one process does.
#[test]
fn ance_episodes_encode_the_corpus_over_the_processes() {
    let dir = TempDir::new("train-dist-ance");
    let recipe_text = TRAIN.replace("max_steps = 4", "max_steps = 2") + "\nance_episodes = 1\nance_depth = 10";
    let recipe = small_task_data(dir.path(), 24, &recipe_text);
    let model = minilm_without_dropout(dir.path());
    let (one, two) = (dir.path().join("one"), dir.path().join("two"));
    train(&recipe, &model, &one, &["--optim", "adamw"]);
    let o = Command::new(host_bin())
        .args(["train", "--model", p(&model), "--config", p(&recipe), "--output-dir", p(&two)])
        .args(["--optim", "adamw", "--per-device-train-batch-size", "4", "--nproc", "2"])
        .env_remove("RAK_PLUGIN_PATH")
        .env_remove("WORLD_SIZE")
        .output()
        .unwrap();
    // The corpus (362 lines) is cut into two parts of 256 lines for two processes, and each
    // encodes only its own: had rank 1 encoded nothing, rank 0 would have found half the
    // embeddings missing and failed.
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("encode: 362 embeddings"), "{}", stderr(&o));
    let negatives = |out: &Path| -> Value {
        let v: Value = serde_json::from_str(&std::fs::read_to_string(out.join("negatives-episode-1.json")).unwrap()).unwrap();
        v["negatives"].clone()
    };
    assert!(negatives(&one).as_object().is_some_and(|o| !o.is_empty()));
    assert_eq!(negatives(&one), negatives(&two), "two processes mined other negatives than one");
    assert!(!two.join("episode-1/ance").exists(), "the corpus embeddings are removed once mined");
    let (a, b) = (log(&one.join("episode-1")), log(&two.join("episode-1")));
    assert_eq!((a.len(), b.len()), (2, 2));
    for (x, y) in a.iter().zip(&b) {
        for (task, l) in x["loss"].as_object().unwrap() {
            let (l, m) = (l.as_f64().unwrap(), y["loss"][task].as_f64().unwrap());
            assert!((l - m).abs() <= 1e-4 * l.abs().max(1.0), "episode 1 step {}: {task} loss {l} in one process, {m} in two", x["step"]);
        }
    }
    let worst = weights(&one).iter().zip(weights(&two).iter()).map(|((_, x), (_, y))| (x - y).abs().max().double_value(&[])).fold(0.0, f64::max);
    assert!(worst <= 1e-4 * 4.0 * 1.01, "the final weights differ by {worst:.3e}");
}

/// The PIDs of `parent`'s children whose environment says `RANK=rank`.
fn children_with_rank(parent: u32, rank: usize) -> Vec<i32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        // The parent PID is the second field after the command name's closing parenthesis.
        let ppid = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1)).and_then(|p| p.parse::<u32>().ok());
        if ppid != Some(parent) {
            continue;
        }
        let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        if env.split(|&b| b == 0).any(|v| v == format!("RANK={rank}").as_bytes()) {
            out.push(pid);
        }
    }
    out
}

/// A process killed mid-run stops the run: `--nproc` fails with an error that names the dead
/// one (not another that died because it did), soon, not at a timeout; a resume over another
/// number of processes is refused. (Stopping the others, SIGTERM then SIGKILL, is
/// `commands::train`'s unit test.)
#[test]
fn a_killed_process_stops_the_run_and_the_world_size_is_kept() {
    let dir = TempDir::new("train-dist-kill");
    let recipe = small_task_data(dir.path(), 24, &TRAIN.replace("max_steps = 4", "max_steps = 200"));
    let model = minilm_without_dropout(dir.path());
    let out = dir.path().join("out");
    let mut run = Command::new(host_bin())
        .args(["train", "--model", p(&model), "--config", p(&recipe), "--output-dir", p(&out), "--optim", "adamw", "--per-device-train-batch-size", "4", "--nproc", "2"])
        .env_remove("RAK_PLUGIN_PATH")
        .env_remove("WORLD_SIZE")
        .stderr(std::fs::File::create(dir.path().join("stderr.txt")).unwrap())
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    while !out.join("checkpoint-2").exists() {
        assert!(started.elapsed().as_secs() < 300 && run.try_wait().unwrap().is_none(), "no checkpoint-2 while training");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let victims = children_with_rank(run.id(), 1);
    assert_eq!(victims.len(), 1, "one process of rank 1 under the launcher");
    let rank_0 = children_with_rank(run.id(), 0);
    assert_eq!(rank_0.len(), 1, "one process of rank 0 under the launcher");
    let killed_at = std::time::Instant::now();
    assert!(Command::new("kill").args(["-9", &victims[0].to_string()]).status().unwrap().success());
    // Rank 0 dies too, right after the launcher has reaped rank 1: the error must still name
    // rank 1, which failed first. (Killing rank 0 while rank 1 was still a zombie caught a
    // launcher that polled in rank order, but raced with the launcher's own waiting threads on
    // a busy machine: either exit could be seen first. The order of exits the launcher sees
    // is what it reports, and that is what this checks.)
    while Path::new(&format!("/proc/{}", victims[0])).exists() {
        assert!(killed_at.elapsed().as_secs() < 60, "rank 1 outlived SIGKILL, or the launcher never reaped it");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    std::thread::sleep(std::time::Duration::from_millis(200));
    // (The launcher may have stopped it already.)
    let _ = Command::new("kill").args(["-9", &rank_0[0].to_string()]).stderr(std::process::Stdio::null()).status();
    let status = run.wait().unwrap();
    let err = std::fs::read_to_string(dir.path().join("stderr.txt")).unwrap();
    assert!(!status.success(), "the run went on without rank 1");
    assert!(killed_at.elapsed().as_secs() < 60, "the run took {:?} to stop", killed_at.elapsed());
    assert!(err.contains("process 1 of 2 failed"), "the launcher named another process than the one that failed first:\n{err}");
    eprintln!("{err}");
    assert!(!Path::new(&format!("/proc/{}", rank_0[0])).exists(), "rank 0 is still running");
    // The checkpoints say two processes: one cannot resume them.
    let o = Command::new(host_bin())
        .args(["train", "--model", p(&model), "--config", p(&recipe), "--output-dir", p(&out), "--optim", "adamw", "--per-device-train-batch-size", "4", "--resume-from-checkpoint", "latest"])
        .env_remove("RAK_PLUGIN_PATH")
        .env_remove("WORLD_SIZE")
        .output()
        .unwrap();
    assert!(!o.status.success() && stderr(&o).contains("started over 2 processes and this one has 1"), "{}", stderr(&o));
}

/// The LISTEN sockets of process `pid` (from /proc/net/tcp and tcp6): their local addresses,
/// as the kernel writes them in hex.
fn listening(pid: i32) -> Vec<String> {
    let inodes: std::collections::HashSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.flatten().filter_map(|e| std::fs::read_link(e.path()).ok()).filter_map(|l| l.to_string_lossy().strip_prefix("socket:[").and_then(|s| s.strip_suffix(']')).map(str::to_string)).collect())
        .unwrap_or_default();
    let mut out = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        for line in std::fs::read_to_string(table).unwrap_or_default().lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() > 9 && f[3] == "0A" && inodes.contains(f[9]) {
                out.push(f[1].to_string());
            }
        }
    }
    out
}

/// Whether a local address of /proc/net/tcp{,6} (`HEXADDR:HEXPORT`) is a loopback one:
/// 127.x.x.x (its last byte first), ::1, or ::ffff:127.x.x.x.
fn loopback(addr: &str) -> bool {
    let ip = addr.split(':').next().unwrap();
    match ip.len() {
        8 => ip.ends_with("7F"),
        32 => ip == "00000000000000000000000001000000" || (ip.starts_with("0000000000000000FFFF0000") && ip.ends_with("7F")),
        _ => false,
    }
}

/// Rank 0 mines the BM25 negatives alone for longer than the collective timeout
/// (`RAK_DIST_TIMEOUT_S`; each block of queries mined is followed by a pause,
/// `RAK_TEST_SLOW_MINING_MS`, since mining tiny data takes no time): the other process waits
/// for it without that bound, and the run trains. Before, it waited in a barrier and failed
/// at the timeout, every time. The mining is saved a block of queries at a time: a run killed
/// after the first block mines only the second. While the run goes, no socket of its
/// processes listens beyond loopback (libtorch's store listened on every interface).
#[test]
fn rank_0_mines_alone_past_the_collective_timeout_and_a_rerun_resumes_the_mining() {
    let dir = TempDir::new("train-dist-slow-mining");
    let recipe = small_task_data(dir.path(), 24, &TRAIN.replace("max_steps = 4", "max_steps = 1").replace("save_steps = 1", "save_steps = 100"));
    let model = minilm_without_dropout(dir.path());
    let out = dir.path().join("out");
    let command = || {
        let mut c = Command::new(host_bin());
        c.args(["train", "--model", p(&model), "--config", p(&recipe), "--output-dir", p(&out), "--optim", "adamw", "--per-device-train-batch-size", "4", "--nproc", "2"])
            .env_remove("RAK_PLUGIN_PATH")
            .env_remove("WORLD_SIZE")
            .env("RAK_DIST_TIMEOUT_S", "10")
            .env("RAK_TEST_SLOW_MINING_MS", "15000");
        c
    };
    // The first run is killed once the first block (of two: one task each) is saved.
    let mut run = command().stdout(std::process::Stdio::null()).stderr(std::fs::File::create(dir.path().join("first.txt")).unwrap()).spawn().unwrap();
    let first_block = out.join(".negatives-episode-0.parts/0-0.json");
    let started = std::time::Instant::now();
    while !first_block.exists() {
        assert!(started.elapsed().as_secs() < 300 && run.try_wait().unwrap().is_none(), "no block of negatives saved: {}", std::fs::read_to_string(dir.path().join("first.txt")).unwrap());
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let ranks: Vec<i32> = (0..2).flat_map(|r| children_with_rank(run.id(), r)).collect();
    assert_eq!(ranks.len(), 2, "two processes under the launcher");
    let mut sockets: Vec<String> = ranks.iter().chain([&(run.id() as i32)]).flat_map(|&pid| listening(pid)).collect();
    sockets.sort();
    eprintln!("listening: {sockets:?}");
    assert!(!sockets.is_empty(), "no listening socket found (the store's, at least)");
    assert!(sockets.iter().all(|a| loopback(a)), "a socket of the run listens beyond loopback: {sockets:?}");
    run.kill().unwrap();
    run.wait().unwrap();
    // Its processes die with it (before the rerun writes the same folder).
    let gone = |pid: i32| std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |s| s.rsplit_once(')').is_some_and(|(_, r)| r.trim_start().starts_with('Z')));
    while !ranks.iter().all(|&pid| gone(pid)) {
        assert!(started.elapsed().as_secs() < 360, "the processes outlived their launcher");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(!out.join("negatives-episode-0.json").exists());
    // The rerun mines the second block alone: rank 1 waits 15 s, past the 10 s timeout.
    let o = command().output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("bm25 negatives: 1 of 2 blocks of queries were mined by an earlier run"), "{}", stderr(&o));
    assert!(out.join("negatives-episode-0.json").exists() && !out.join(".negatives-episode-0.parts").exists(), "the blocks are removed once the negatives are saved whole");
    // The same negatives as one process mining them all at once.
    let one = dir.path().join("one");
    train(&recipe, &model, &one, &["--optim", "adamw", "--max-steps", "1"]);
    let negatives = |out: &Path| -> Value { serde_json::from_str::<Value>(&std::fs::read_to_string(out.join("negatives-episode-0.json")).unwrap()).unwrap()["negatives"].clone() };
    assert_eq!(negatives(&out), negatives(&one));
}

/// An ANCE episode interrupted while its processes encode the corpus, resumed by another
/// number of processes: refused up front with the number of processes it was started over,
/// not with an error about the corpus parts the shards left in the episode's folder.
#[test]
fn an_ance_episode_resumed_by_another_number_of_processes_is_refused_up_front() {
    let dir = TempDir::new("train-dist-ance-world");
    let recipe_text = TRAIN.replace("max_steps = 4", "max_steps = 2") + "\nance_episodes = 1\nance_depth = 10";
    let recipe = small_task_data(dir.path(), 24, &recipe_text);
    let model = minilm_without_dropout(dir.path());
    let out = dir.path().join("out");
    let mut run = Command::new(host_bin())
        .args(["train", "--model", p(&model), "--config", p(&recipe), "--output-dir", p(&out)])
        .args(["--optim", "adamw", "--per-device-train-batch-size", "4", "--nproc", "2"])
        .env_remove("RAK_PLUGIN_PATH")
        .env_remove("WORLD_SIZE")
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    let encoding = out.join("episode-1/ance/corpus/parts/manifest.json");
    while !encoding.exists() {
        assert!(started.elapsed().as_secs() < 300 && run.try_wait().unwrap().is_none(), "episode 1 never started encoding the corpus");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    // The launcher's processes die with it.
    run.kill().unwrap();
    run.wait().unwrap();
    assert!(!out.join("negatives-episode-1.json").exists(), "the kill came after the mining");
    let o = Command::new(host_bin())
        .args(["train", "--model", p(&model), "--config", p(&recipe), "--output-dir", p(&out)])
        .args(["--optim", "adamw", "--per-device-train-batch-size", "4", "--resume-from-checkpoint", "latest"])
        .env_remove("RAK_PLUGIN_PATH")
        .env_remove("WORLD_SIZE")
        .output()
        .unwrap();
    assert!(!o.status.success(), "resumed over another number of processes");
    assert!(stderr(&o).contains("was started over 2 processes and this one has 1"), "{}", stderr(&o));
}
