//! `host encode` under faults, with real `host` processes and the real MiniLM: processes
//! killed at random moments and resumed, several processes working on one output at once, and
//! a checkpoint rewritten in place between two runs. Each ends in a byte-for-byte comparison
//! with an uninterrupted run (or a refusal).

use rak_e2e::*;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant, SystemTime};

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// `n` real mini-KILT passages (every `step`-th line), texts cut to `words` words: short texts
/// encode fast, so a test can afford many parts and many runs.
fn small_corpus(dir: &Path, n: usize, step: usize, words: usize) -> PathBuf {
    let text = std::fs::read_to_string(minikilt().join("corpus.jsonl")).unwrap();
    let lines: Vec<String> = text
        .lines()
        .step_by(step)
        .take(n)
        .map(|l| {
            let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
            let cut: Vec<&str> = v["text"].as_str().unwrap().split_whitespace().take(words).collect();
            v["text"] = cut.join(" ").into();
            v.to_string()
        })
        .collect();
    assert_eq!(lines.len(), n);
    let path = dir.join("corpus.jsonl");
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    path
}

/// `host encode` with the dpr plugin; stderr is kept for error messages, stdout dropped.
fn encode_cmd(model: &Path, corpus: &Path, out: &Path, extra: &[&str]) -> Command {
    let mut cmd = Command::new(host_bin());
    cmd.args(["encode", "--encoder", "dpr", "--model", p(model), "--input", p(corpus), "--output", p(out)])
        .args(extra)
        .env_remove("RAK_PLUGIN_PATH")
        .env_remove("SLURM_ARRAY_TASK_ID")
        .env_remove("JOB_COMPLETION_INDEX")
        .env_remove("RANK")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    cmd
}

fn run_ok(mut cmd: Command) -> String {
    let out = cmd.output().expect("run host");
    let err = stderr(&out);
    assert!(out.status.success(), "host encode failed:\n{err}");
    err
}

/// `out` is marked complete and holds exactly the bytes of `reference`. Its `parts/` may still
/// exist when the writer was killed after marking it complete: the next run removes them.
fn assert_same_embeddings(reference: &Path, out: &Path) {
    assert!(out.join("encode.json").exists(), "{}: not marked complete", out.display());
    for name in ["embeddings.npy", "ids.txt"] {
        let read = |path: PathBuf| std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e} (in an output marked complete)", path.display()));
        let (a, b) = (read(reference.join(name)), read(out.join(name)));
        assert!(a == b, "{}: {} bytes differ from the uninterrupted run's {} bytes (or their content does)", out.join(name).display(), b.len(), a.len());
    }
}

/// After a run that exited successfully: as `assert_same_embeddings`, and no parts are left.
fn assert_same_output(reference: &Path, out: &Path) {
    assert_same_embeddings(reference, out);
    assert!(!out.join("parts").exists(), "{}: parts left after completion", out.display());
}

/// Start `cmd` with its stderr going to the file `log`: a pipe that nobody reads while the test
/// waits on another process could fill up and stall its writer.
fn spawn_logged(mut cmd: Command, log: PathBuf) -> (Child, PathBuf) {
    cmd.stderr(std::fs::File::create(&log).unwrap());
    (cmd.spawn().expect("start host"), log)
}

/// Wait for every child; each must exit 0. Returns their stderr.
fn wait_all_ok(children: Vec<(Child, PathBuf)>) -> Vec<String> {
    let ended: Vec<(ExitStatus, String)> =
        children.into_iter().map(|(mut c, log)| (c.wait().unwrap(), std::fs::read_to_string(log).unwrap())).collect();
    let all = ended.iter().map(|(_, e)| e.as_str()).collect::<Vec<_>>().join("\n---\n");
    for (status, err) in &ended {
        assert!(status.success(), "a concurrent host encode failed ({status:?}):\n{err}\n--- all of them:\n{all}");
    }
    ended.into_iter().map(|(_, e)| e).collect()
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        let target = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &target);
        } else {
            std::fs::copy(e.path(), target).unwrap();
        }
    }
}

/// xorshift64*: a seeded generator so that a failing kill schedule can be replayed
/// (`RAK_KILL_SEED=N`).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// Whether a join started in `out` since `since`: a temporary `embeddings.npy` was written
/// since then (whatever the writer names it, the name starts with a dot and holds
/// `embeddings.npy`; the time tells it from one that an earlier killed join left, and the
/// file system's coarse clock is no trouble because no join starts within a process's first
/// milliseconds).
fn joining(out: &Path, since: SystemTime) -> bool {
    let Ok(entries) = std::fs::read_dir(out) else { return false };
    entries.flatten().any(|e| {
        let n = e.file_name().to_string_lossy().into_owned();
        n.starts_with('.') && n.contains("embeddings.npy") && e.metadata().and_then(|m| m.modified()).is_ok_and(|t| t >= since)
    })
}

enum Ended {
    Exited(ExitStatus),
    Killed,
}

/// SIGKILL `child` once `fire` says so (polled every 100 µs), unless it exits first.
fn kill_when(child: &mut Child, mut fire: impl FnMut() -> bool) -> Ended {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return Ended::Exited(status);
        }
        if fire() {
            child.kill().unwrap(); // SIGKILL: no destructors, no flushing; the kernel drops its locks
            child.wait().unwrap();
            return Ended::Killed;
        }
        if start.elapsed() > Duration::from_secs(120) {
            child.kill().unwrap();
            panic!("host encode ran for two minutes");
        }
        std::thread::sleep(Duration::from_micros(100));
    }
}

/// How many finished parts `out` holds.
fn parts_done(out: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(out.join("parts")) else { return 0 };
    entries.flatten().filter(|e| e.file_name().to_str().is_some_and(|n| n.starts_with("part-") && n.ends_with(".npy"))).count()
}

/// Kill `host encode` at random moments (start-up, model loading, mid-part, mid-join), resume
/// after each kill, and check the result equals an uninterrupted run byte for byte. After
/// every kill, an output marked complete must already be the right one.
///
/// The moments are drawn relative to the run's progress, timed on the uninterrupted run, so
/// that most kills land in work still to do rather than after a run has finished.
#[test]
fn encode_survives_random_kills() {
    const KILLS: usize = 12;
    const PARTS: usize = 16;
    let seed: u64 = std::env::var("RAK_KILL_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x5eed_2026);
    eprintln!("kill schedule seed {seed} (replay with RAK_KILL_SEED={seed})");
    let mut rng = Rng(seed | 1);
    let dir = TempDir::new("encode-kills");
    let model = minilm_dir();
    // 320 short rows in 16 parts: parts are quick to encode, and the join has enough to read
    // that a kill can land inside it.
    let corpus = small_corpus(dir.path(), PARTS * 20, 7, 12);
    let args = ["--part-size", "20", "--batch-size", "32"];

    // The uninterrupted run, timed: until its first part (start-up, model, one part), and per
    // part after that.
    let reference = dir.path().join("reference");
    let t0 = Instant::now();
    let (mut child, log) = spawn_logged(encode_cmd(&model, &corpus, &reference, &args), dir.path().join("reference.log"));
    let (mut first_part, mut join) = (None, None);
    let ended = kill_when(&mut child, || {
        if first_part.is_none() && parts_done(&reference) > 0 {
            first_part = Some(t0.elapsed());
        }
        if join.is_none() && parts_done(&reference) == PARTS {
            join = Some(t0.elapsed());
        }
        false
    });
    assert!(matches!(ended, Ended::Exited(s) if s.success()), "{}", std::fs::read_to_string(log).unwrap());
    let t_ref = t0.elapsed();
    let startup = first_part.unwrap_or(t_ref);
    let per_part = join.unwrap_or(t_ref).saturating_sub(startup) / (PARTS as u32 - 1);

    let (mut kills, mut join_kills, mut rounds) = (0, 0, 0);
    while kills < KILLS {
        rounds += 1;
        let out = dir.path().join(format!("killed-{rounds}"));
        loop {
            let log = dir.path().join(format!("log-{rounds}-{kills}"));
            let spawned = SystemTime::now();
            let (mut child, log) = spawn_logged(encode_cmd(&model, &corpus, &out, &args), log);
            let started = Instant::now();
            let ended = match rng.below(4) {
                // Anywhere up to the end of the first part: start-up, model loading, a part.
                0 => {
                    let at = Duration::from_micros(rng.below(startup.as_micros() as u64));
                    kill_when(&mut child, || started.elapsed() >= at)
                }
                // Within a part, after a random number of further parts.
                1 | 2 => {
                    let target = (parts_done(&out) + 1 + rng.below(PARTS as u64) as usize).min(PARTS - 1);
                    let extra = Duration::from_micros(rng.below(per_part.as_micros() as u64));
                    let mut reached: Option<Instant> = None;
                    kill_when(&mut child, || {
                        if reached.is_none() && parts_done(&out) >= target {
                            reached = Some(Instant::now());
                        }
                        reached.is_some_and(|t| t.elapsed() >= extra)
                    })
                }
                // Once the join has begun, after up to 1 ms more (a join here takes a few).
                _ => {
                    let extra = Duration::from_micros(rng.below(1000));
                    let mut seen: Option<Instant> = None;
                    kill_when(&mut child, || {
                        if seen.is_none() && joining(&out, spawned) {
                            seen = Some(Instant::now());
                        }
                        seen.is_some_and(|t| t.elapsed() >= extra)
                    })
                }
            };
            match ended {
                Ended::Exited(status) => {
                    assert!(status.success(), "resumed host encode failed ({status:?}):\n{}", std::fs::read_to_string(&log).unwrap());
                    break;
                }
                Ended::Killed => {
                    kills += 1;
                    join_kills += joining(&out, spawned) as usize;
                    // Whatever the moment, an output that says it is complete is the right one.
                    if out.join("encode.json").exists() {
                        assert_same_embeddings(&reference, &out);
                    }
                }
            }
            if kills >= KILLS {
                run_ok(encode_cmd(&model, &corpus, &out, &args));
                break;
            }
        }
        assert_same_output(&reference, &out);
    }
    eprintln!(
        "{kills} kills ({join_kills} during a join) over {rounds} outputs; the uninterrupted run took {t_ref:?} ({startup:?} to its first part, then {per_part:?} a part)"
    );
}

/// Several shards of one output started at once, then two identical relaunches at once: every
/// process exits 0 and the output equals an uninterrupted run's byte for byte.
#[test]
fn concurrent_shards_and_relaunches_match_one_run() {
    let dir = TempDir::new("encode-concurrent");
    let model = minilm_dir();
    let corpus = small_corpus(dir.path(), 72, 11, 12);
    let args = ["--part-size", "6", "--batch-size", "16"];
    let reference = dir.path().join("reference");
    run_ok(encode_cmd(&model, &corpus, &reference, &args));

    let sharded = dir.path().join("sharded");
    let shards: Vec<_> = (0..3)
        .map(|i| {
            let (id, num) = (i.to_string(), "3".to_string());
            let mut a = args.to_vec();
            a.extend(["--shard-id", &id, "--shard-num", &num]);
            spawn_logged(encode_cmd(&model, &corpus, &sharded, &a), dir.path().join(format!("shard-{i}.log")))
        })
        .collect();
    wait_all_ok(shards);
    assert_same_output(&reference, &sharded);

    let relaunched = dir.path().join("relaunched");
    let twins: Vec<_> = (0..2).map(|i| spawn_logged(encode_cmd(&model, &corpus, &relaunched, &args), dir.path().join(format!("twin-{i}.log")))).collect();
    let errs = wait_all_ok(twins);
    assert_same_output(&reference, &relaunched);
    // Each twin of a one-shard run only exits once the output is whole: none may leave while
    // the other still holds some of the parts (that one could die, and `host encode && host
    // index build` would then fail).
    for e in &errs {
        assert!(!e.contains("parts present"), "a one-shard run exited before the output was complete:\n{e}");
    }
    eprintln!("{}", errs.join("\n---\n"));

    // A run killed after marking its output complete but before removing `parts/` (what a
    // random kill rarely hits): the next run says the output is complete and removes them.
    let stale = dir.path().join("stale-parts");
    copy_dir(&reference, &stale);
    std::fs::create_dir_all(stale.join("parts")).unwrap();
    std::fs::write(stale.join("parts").join("part-000000.lock"), b"").unwrap();
    std::fs::write(stale.join("parts").join("part-000001.npy"), b"torn").unwrap();
    let err = run_ok(encode_cmd(&model, &corpus, &stale, &args));
    assert!(err.contains("already complete"), "{err}");
    assert_same_output(&reference, &stale);
}

/// One command line under each scheduler: N processes started at once, each told its index
/// only by the environment a Slurm job array, a Kubernetes Indexed Job (plus the count flag it
/// needs) or torchrun gives it, make the same output as one process.
#[test]
fn scheduler_environments_shard_one_command_line() {
    let dir = TempDir::new("encode-schedulers");
    let model = minilm_dir();
    let corpus = small_corpus(dir.path(), 40, 11, 12);
    let args = ["--part-size", "5", "--batch-size", "16"];
    let reference = dir.path().join("reference");
    run_ok(encode_cmd(&model, &corpus, &reference, &args));

    type Env = Vec<(&'static str, String)>;
    let slurm = |i: usize| -> Env {
        // --array=1-7:2: tasks 1, 3, 5 and 7.
        vec![
            ("SLURM_ARRAY_TASK_ID", (1 + 2 * i).to_string()),
            ("SLURM_ARRAY_TASK_MIN", "1".into()),
            ("SLURM_ARRAY_TASK_MAX", "7".into()),
            ("SLURM_ARRAY_TASK_STEP", "2".into()),
            ("SLURM_ARRAY_TASK_COUNT", "4".into()),
        ]
    };
    let kubernetes = |i: usize| -> Env { vec![("JOB_COMPLETION_INDEX", i.to_string())] };
    let torchrun = |i: usize| -> Env { vec![("RANK", i.to_string()), ("WORLD_SIZE", "3".into())] };
    let schedulers: [(&str, usize, &dyn Fn(usize) -> Env, &[&str]); 3] =
        [("slurm", 4, &slurm, &[]), ("kubernetes", 2, &kubernetes, &["--shard-num", "2"]), ("torchrun", 3, &torchrun, &[])];
    for (name, n, env, extra) in schedulers {
        let out = dir.path().join(name);
        let mut a = args.to_vec();
        a.extend(extra);
        let procs: Vec<_> = (0..n)
            .map(|i| {
                let mut cmd = encode_cmd(&model, &corpus, &out, &a);
                cmd.envs(env(i));
                spawn_logged(cmd, dir.path().join(format!("{name}-{i}.log")))
            })
            .collect();
        let errs = wait_all_ok(procs);
        assert_same_output(&reference, &out);
        for (i, e) in errs.iter().enumerate() {
            assert!(e.contains(&format!("shard {i} of {n} (from ")), "{name} process {i} did not say its shard:\n{e}");
        }
    }
    // A torchrun rank told another count on the command line is refused, not half-encoded.
    let mut cmd = encode_cmd(&model, &corpus, &dir.path().join("disagree"), &["--shard-num", "2"]);
    cmd.envs(torchrun(0));
    let out = cmd.output().unwrap();
    assert!(!out.status.success(), "a disagreeing count was accepted");
    assert!(stderr(&out).contains("--shard-num 2 disagrees with WORLD_SIZE=3"), "{}", stderr(&out));
}

/// Many processes find every part present and try to join at once (shards finishing together,
/// or relaunches while a join runs): exactly one joins, the others wait and find the output
/// complete, and the result is whole. The parts are made cheaply: one real part gives the
/// manifest, the other parts are synthetic rows, so the join is long enough for the processes
/// to overlap.
#[test]
fn simultaneous_joins_write_one_whole_file() {
    const ROWS: usize = 12_000;
    const PART: usize = 400;
    let dir = TempDir::new("encode-joins");
    let model = minilm_dir();
    let corpus = dir.path().join("corpus.jsonl");
    let lines: Vec<String> = (0..ROWS).map(|i| format!("{{\"_id\":\"s{i}\",\"title\":\"\",\"text\":\"word {i}\"}}")).collect();
    std::fs::write(&corpus, lines.join("\n") + "\n").unwrap();
    let parts = ROWS / PART;
    let (part_size, shard_num) = (PART.to_string(), parts.to_string());
    let args = ["--part-size", &part_size, "--batch-size", "64"];

    // Shard 0 of `parts` encodes part 0 only and writes the manifest.
    let seed = dir.path().join("seed");
    let mut a = args.to_vec();
    a.extend(["--shard-id", "0", "--shard-num", &shard_num]);
    let err = run_ok(encode_cmd(&model, &corpus, &seed, &a));
    assert!(err.contains("parts present"), "{err}");
    let mut rng = Rng(7);
    for part in 1..parts {
        let rows: Vec<f32> = (0..PART * 384).map(|_| (rng.below(1 << 20) as f32) / (1 << 20) as f32 - 0.5).collect();
        let ids: Vec<String> = (part * PART..(part + 1) * PART).map(|i| format!("s{i}")).collect();
        let stem = seed.join("parts").join(format!("part-{part:06}"));
        rak_retrieval::npy::write_ids(&stem.with_extension("ids.txt"), &ids).unwrap();
        rak_retrieval::npy::write_f32(&stem.with_extension("npy"), &rows, 384).unwrap();
    }

    let reference = dir.path().join("reference");
    copy_dir(&seed, &reference);
    run_ok(encode_cmd(&model, &corpus, &reference, &args));
    assert!(std::fs::metadata(reference.join("embeddings.npy")).unwrap().len() > (ROWS * 384 * 4) as u64);

    for round in 0..3 {
        let out = dir.path().join(format!("joined-{round}"));
        copy_dir(&seed, &out);
        let joiners: Vec<_> = (0..6).map(|i| spawn_logged(encode_cmd(&model, &corpus, &out, &args), dir.path().join(format!("join-{round}-{i}.log")))).collect();
        wait_all_ok(joiners);
        assert_same_output(&reference, &out);
    }
}

/// A checkpoint rewritten in place (as a trainer's episodes do) must not count as the one that
/// made an existing output: the output is refused as made differently (as for any other change
/// of settings) instead of being reported complete with the old checkpoint's embeddings.
#[test]
fn rewritten_checkpoint_is_not_reused() {
    let dir = TempDir::new("encode-checkpoint");
    let model = dir.path().join("model");
    copy_dir(&minilm_dir(), &model);
    let corpus = small_corpus(dir.path(), 24, 13, 12);
    let args = ["--part-size", "8"];
    let out = dir.path().join("emb");
    run_ok(encode_cmd(&model, &corpus, &out, &args));
    let err = run_ok(encode_cmd(&model, &corpus, &out, &args));
    assert!(err.contains("already complete"), "the same checkpoint is recognised: {err}");
    let before = std::fs::read(out.join("embeddings.npy")).unwrap();

    // Halve the embedding LayerNorm's weights inside model.safetensors, in place: same path,
    // same size, same modification time.
    let file = model.join("model.safetensors");
    let mtime = std::fs::metadata(&file).unwrap().modified().unwrap();
    let mut bytes = std::fs::read(&file).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    let (name, info) = header.as_object().unwrap().iter().find(|(k, _)| k.ends_with("embeddings.LayerNorm.weight")).expect("a LayerNorm tensor");
    assert_eq!(info["dtype"], "F32", "{name}");
    let (start, end) = (info["data_offsets"][0].as_u64().unwrap() as usize, info["data_offsets"][1].as_u64().unwrap() as usize);
    let data = 8 + header_len;
    for v in bytes[data + start..data + end].chunks_exact_mut(4) {
        let x = f32::from_le_bytes(v.try_into().unwrap()) * 0.5;
        v.copy_from_slice(&x.to_le_bytes());
    }
    let mut f = std::fs::OpenOptions::new().write(true).open(&file).unwrap();
    std::io::Write::write_all(&mut f, &bytes).unwrap();
    f.set_modified(mtime).unwrap();
    drop(f);

    let again = encode_cmd(&model, &corpus, &out, &args).output().unwrap();
    let err = stderr(&again);
    assert_eq!(again.status.code(), Some(1), "stale embeddings must not be reused:\n{err}");
    assert!(err.contains("made differently") && !err.contains("already complete"), "{err}");
    assert_eq!(std::fs::read(out.join("embeddings.npy")).unwrap(), before, "the refused run leaves the output alone");

    // The rewritten checkpoint really makes other embeddings: reusing the old ones was wrong.
    let fresh = dir.path().join("emb-new");
    run_ok(encode_cmd(&model, &corpus, &fresh, &args));
    assert_ne!(std::fs::read(fresh.join("embeddings.npy")).unwrap(), before);
}

/// The identity of the checkpoint is taken before the model loads (a finished output loads
/// none). A checkpoint rewritten between the two (here by the `faulty` encoder itself, as it
/// loads) must not have its new weights' embeddings filed under the old digest.
#[test]
fn a_checkpoint_rewritten_while_loading_is_refused() {
    let dir = TempDir::new("encode-rewrite-on-load");
    let model = dir.path().join("model");
    std::fs::create_dir_all(&model).unwrap();
    std::fs::write(model.join("weights.bin"), b"the weights the identity names").unwrap();
    let corpus = small_corpus(dir.path(), 6, 13, 8);
    let out = dir.path().join("emb");
    let mut cmd = Command::new(host_bin());
    cmd.args(["--plugin", p(&faulty_plugin()), "encode", "--encoder", "faulty", "--model", p(&model), "--input", p(&corpus), "--output", p(&out)])
        .args(["--encoder-settings", r#"{"fault": "rewrite_on_load"}"#])
        .env_remove("RAK_PLUGIN_PATH");
    let o = cmd.output().unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("changed while the encoder was being loaded"), "{err}");
    assert!(!out.join("embeddings.npy").exists() && !out.join("encode.json").exists(), "nothing filed under the old identity");
}

/// The input is keyed by its content: a corpus rewritten in place to the same size and line
/// count is a new input, not the one an existing output was made from.
#[test]
fn an_input_rewritten_to_the_same_size_is_a_new_input() {
    let dir = TempDir::new("encode-input-content");
    let corpus = small_corpus(dir.path(), 10, 13, 8);
    let out = dir.path().join("emb");
    run_ok(encode_cmd(&minilm_dir(), &corpus, &out, &["--part-size", "4"]));
    let text = std::fs::read_to_string(&corpus).unwrap();
    // Swap two letters of one passage: same bytes, same lines, another text.
    let mut bytes = text.into_bytes();
    let at = (text_start(&bytes)..bytes.len() - 1).find(|&i| bytes[i].is_ascii_alphabetic() && bytes[i + 1].is_ascii_alphabetic() && bytes[i] != bytes[i + 1]).unwrap();
    bytes.swap(at, at + 1);
    std::fs::write(&corpus, &bytes).unwrap();
    let again = encode_cmd(&minilm_dir(), &corpus, &out, &["--part-size", "4"]).output().unwrap();
    let err = stderr(&again);
    assert_eq!(again.status.code(), Some(1), "embeddings of the old text must not be reused:\n{err}");
    assert!(err.contains("made differently"), "{err}");
}

/// Where the first passage's text begins in a JSONL corpus.
fn text_start(bytes: &[u8]) -> usize {
    let key = b"\"text\"";
    bytes.windows(key.len()).position(|w| w == key).unwrap() + key.len()
}

/// libtorch's exceptions carry a C++ backtrace of twenty-odd frames. Raised inside a plugin,
/// the user sees the message and where libtorch raised it, in a few lines; `--debug` shows
/// the frames.
#[test]
fn a_libtorch_error_in_a_plugin_is_reported_in_a_few_lines() {
    let dir = TempDir::new("encode-libtorch-error");
    let corpus = small_corpus(dir.path(), 4, 13, 8);
    let run = |debug: bool| {
        let mut cmd = Command::new(host_bin());
        cmd.args(["--plugin", p(&faulty_plugin()), "encode", "--encoder", "faulty", "--model", p(dir.path()), "--input", p(&corpus)])
            .args(["--output", p(&dir.path().join(format!("emb-{debug}"))), "--encoder-settings", r#"{"fault": "libtorch"}"#])
            .env_remove("RAK_PLUGIN_PATH")
            .env_remove("RAK_DEBUG");
        if debug {
            cmd.arg("--debug");
        }
        let o = cmd.output().unwrap();
        assert_eq!(o.status.code(), Some(1));
        stderr(&o)
    };
    let err = run(false);
    let error_lines: Vec<&str> = err.lines().skip_while(|l| !l.starts_with("error:")).collect();
    assert!(error_lines.len() <= 3, "{err}");
    assert!(err.contains("faulty") && err.contains("cannot be multiplied") && err.contains("[libtorch: "), "{err}");
    assert!(!err.contains("frame #"), "{err}");
    assert!(run(true).contains("frame #"), "--debug keeps the backtrace");
}

/// An `--output` that holds someone else's files is refused before anything is written into
/// it (the join would have written `ids.txt` over the user's), and joining an output of its
/// own removes only the parts it wrote from `parts/`, not a file put there (issue 32).
#[test]
fn a_foreign_output_is_refused_and_only_encode_s_parts_are_removed() {
    let dir = TempDir::new("encode-foreign");
    let corpus = small_corpus(dir.path(), 12, 40, 8);
    let names = |d: &Path| -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(d).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        v.sort();
        v
    };
    let foreign = dir.path().join("mine");
    std::fs::create_dir_all(&foreign).unwrap();
    std::fs::write(foreign.join("ids.txt"), "my ids\n").unwrap();
    let o = encode_cmd(&minilm_dir(), &corpus, &foreign, &[]).output().unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains(p(&foreign)) && err.contains("holds files that host encode did not write (ids.txt)"), "{err}");
    assert_eq!(std::fs::read_to_string(foreign.join("ids.txt")).unwrap(), "my ids\n");
    assert_eq!(names(&foreign), ["ids.txt"], "nothing written into the refused folder");

    // Its own output: shard 0 of 2 writes its parts, a file is put into parts/, shard 1 joins.
    let out = dir.path().join("ours");
    run_ok(encode_cmd(&minilm_dir(), &corpus, &out, &["--part-size", "4", "--shard-id", "0", "--shard-num", "2"]));
    std::fs::write(out.join("parts/notes.txt"), "mine").unwrap();
    run_ok(encode_cmd(&minilm_dir(), &corpus, &out, &["--part-size", "4", "--shard-id", "1", "--shard-num", "2"]));
    assert!(out.join("encode.json").exists());
    assert_eq!(names(&out.join("parts")), ["notes.txt"], "encode removed a file it did not write, or left its own");
    // Rerunning over its own finished output is fine, and still leaves the file.
    run_ok(encode_cmd(&minilm_dir(), &corpus, &out, &["--part-size", "4"]));
    assert_eq!(std::fs::read_to_string(out.join("parts/notes.txt")).unwrap(), "mine");
}
