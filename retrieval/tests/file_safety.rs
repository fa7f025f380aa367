//! Files changed by other programs, killed runs' leftovers, streaming builds: what the index
//! and `.npy` code must survive.

use rak_core::fsutil;
use rak_retrieval::index::{self, Bm25Index, FlatBackend, FlatIndex, HnswIndex, HnswParams};
use rak_retrieval::npy::{self, NpyF32, NpyRows, NpyWriter};
use rak_retrieval::pipeline::index::{build_index, IndexSpec};
use rak_retrieval::pipeline::Quiet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

fn tmpdir(tag: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let d = std::env::temp_dir().join(format!("rak-files-test-{}-{tag}-{}", std::process::id(), N.fetch_add(1, Ordering::SeqCst)));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Deterministic values in [-1, 1) (splitmix64).
fn vectors(n: usize, d: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n * d)
        .map(|_| {
            s = s.wrapping_add(0x9E3779B97F4A7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
            ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

fn ids(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("doc{i}")).collect()
}

fn err<T>(r: anyhow::Result<T>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => format!("{e:#}"),
    }
}

/// Overwrite `path` (an `.npy` matrix) with the same matrix, one value of row `row` made NaN,
/// as another program replacing the file would.
fn replace_with_nan(path: &Path, row: usize) {
    let a = NpyF32::open(path).unwrap();
    let (dim, mut data) = (a.dim(), a.data().to_vec());
    data[row * dim + 1] = f32::NAN;
    std::fs::remove_file(path).unwrap();
    npy::write_f32(path, &data, dim).unwrap();
}

#[test]
fn flat_load_refuses_a_nan_in_a_replaced_embeddings_file() {
    let (n, d) = (300, 16);
    let dir = tmpdir("flatnan").join("idx");
    FlatIndex::new(vectors(n, d, 1), d, ids(n)).unwrap().save(&dir).unwrap();
    let file = dir.join("embeddings.npy");
    replace_with_nan(&file, 123);
    // Unchecked, the NaN row would be every query's first hit: it sorts above every score.
    for e in [err(FlatIndex::load(&dir)), err(index::open(&dir))] {
        assert!(e.contains(&file.display().to_string()) && e.contains("row 123") && e.contains("non-finite"), "{e}");
    }
}

#[test]
fn hnsw_load_refuses_a_nan_in_a_replaced_vectors_file() {
    let (n, d) = (300, 16);
    let dir = tmpdir("hnswnan").join("idx");
    let p = HnswParams { m: 8, ef_construction: 32, ef_search: 32 };
    HnswIndex::build(&vectors(n, d, 2), d, ids(n), p).unwrap().save(&dir).unwrap();
    let file = dir.join("vectors.npy");
    replace_with_nan(&file, 77);
    for e in [err(HnswIndex::load(&dir)), err(index::open(&dir))] {
        assert!(e.contains(&file.display().to_string()) && e.contains("row 77") && e.contains("non-finite"), "{e}");
    }
}

/// Cut a file down to `len` bytes in place, as another program could while we hold it open.
fn truncate(path: &Path, len: u64) {
    std::fs::OpenOptions::new().write(true).open(path).unwrap().set_len(len).unwrap();
}

/// One scenario of [`a_file_truncated_after_open_does_not_kill_the_process`], run in a child
/// process: open, truncate the file to its header, then read everything.
fn truncated_after_open(scenario: &str) {
    let (n, d) = (4000, 32); // 512 KB: many pages past the header
    let base = vectors(n, d, 3);
    let q = vectors(5, d, 4);
    let dir = tmpdir(scenario);
    match scenario {
        "npy" => {
            let p = dir.join("emb.npy");
            npy::write_f32(&p, &base, d).unwrap();
            let a = NpyF32::open(&p).unwrap();
            truncate(&p, 128);
            assert_eq!(a.data(), &base[..]);
        }
        "flat_from_npy" => {
            let p = dir.join("emb.npy");
            npy::write_f32(&p, &base, d).unwrap();
            let flat = FlatIndex::from_npy(&p, ids(n)).unwrap();
            truncate(&p, 128);
            let want = FlatIndex::new(base.clone(), d, ids(n)).unwrap().search(&q, d, 10).unwrap();
            assert_eq!(flat.search_with(FlatBackend::Rust, &q, d, 10).unwrap().len(), 5);
            assert_eq!(flat.search(&q, d, 10).unwrap(), want);
        }
        "flat_load" => {
            let idx = dir.join("idx");
            let built = FlatIndex::new(base.clone(), d, ids(n)).unwrap();
            built.save(&idx).unwrap();
            let flat = FlatIndex::load(&idx).unwrap();
            truncate(&idx.join("embeddings.npy"), 128);
            assert_eq!(flat.search(&q, d, 10).unwrap(), built.search(&q, d, 10).unwrap());
        }
        "hnsw_load" => {
            let idx = dir.join("idx");
            let built = HnswIndex::build(&base, d, ids(n), HnswParams { m: 8, ef_construction: 32, ef_search: 32 }).unwrap();
            built.save(&idx).unwrap();
            let h = HnswIndex::load(&idx).unwrap();
            truncate(&idx.join("vectors.npy"), 128);
            assert_eq!(h.search(&q, d, 10).unwrap(), built.search(&q, d, 10).unwrap());
        }
        other => panic!("unknown scenario {other}"),
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_file_truncated_after_open_does_not_kill_the_process() {
    // A memory-mapped file that shrinks raises SIGBUS on the next read of a page past its end,
    // which would kill this whole test binary; so each scenario runs in a child process (this
    // test again, with RAK_TRUNCATE_SCENARIO set) and a signal there fails the test here.
    const TEST: &str = "a_file_truncated_after_open_does_not_kill_the_process";
    if let Ok(s) = std::env::var("RAK_TRUNCATE_SCENARIO") {
        return truncated_after_open(&s);
    }
    let mut failed = vec![];
    for scenario in ["npy", "flat_from_npy", "flat_load", "hnsw_load"] {
        let out = Command::new(std::env::current_exe().unwrap())
            .args([TEST, "--exact", "--nocapture", "--test-threads=1"])
            .env("RAK_TRUNCATE_SCENARIO", scenario)
            .output()
            .unwrap();
        if !out.status.success() {
            use std::os::unix::process::ExitStatusExt;
            let how = match out.status.signal() {
                Some(7) => "killed by SIGBUS".to_string(),
                Some(s) => format!("killed by signal {s}"),
                None => format!("failed: {}", String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr)),
            };
            failed.push(format!("{scenario}: {how}"));
        }
    }
    assert!(failed.is_empty(), "{failed:#?}");
}

#[test]
fn npy_rows_reports_a_file_truncated_while_reading() {
    let dir = tmpdir("rows");
    let p = dir.join("emb.npy");
    let (n, d) = (100_000, 8); // 3.2 MB, beyond the reader's buffer
    npy::write_f32(&p, &vectors(n, d, 5), d).unwrap();
    let mut r = NpyRows::open(&p).unwrap();
    let mut buf = vec![];
    assert_eq!(r.read_rows(10, &mut buf).unwrap(), 10);
    assert_eq!(buf, vectors(n, d, 5)[..10 * d]);
    assert_eq!(r.position(), 10);
    truncate(&p, 128 + 500 * 4 * d as u64);
    let e = err(r.read_rows(n, &mut buf));
    assert!(e.contains("emb.npy") && e.contains("rows 10..100000") && e.contains("changed while being read"), "{e}");
}

#[test]
fn flat_build_streams_rows_and_names_the_bad_one() {
    // 24.6 MB of rows: more than one 16 MiB block, so rows are checked and written block by
    // block and the bad row's number must count the blocks before it.
    let (n, d) = (3000, 2048);
    let base = vectors(n, d, 6);
    let emb = tmpdir("stream");
    npy::write_f32(&emb.join("embeddings.npy"), &base, d).unwrap();
    npy::write_ids(&emb.join("ids.txt"), &ids(n)).unwrap();
    let out = emb.join("idx");
    let meta = build_index(&IndexSpec::Flat { embeddings: emb.clone() }, &out, &Quiet).unwrap();
    assert_eq!((meta.kind.as_str(), meta.count, meta.dim), ("flat", n, d));
    let flat = FlatIndex::load(&out).unwrap();
    assert_eq!(flat.vectors(), &base[..]);
    assert_eq!(flat.ids()[2999], "doc2999");

    let mut bad = base.clone();
    bad[2500 * d + 7] = f32::INFINITY;
    npy::write_f32(&emb.join("embeddings.npy"), &bad, d).unwrap();
    let out2 = emb.join("idx2");
    let e = err(build_index(&IndexSpec::Flat { embeddings: emb.clone() }, &out2, &Quiet));
    assert!(e.contains("embeddings.npy") && e.contains("row 2500 holds a non-finite"), "{e}");
    assert!(!out2.exists());
    // ids.txt must match the rows.
    npy::write_ids(&emb.join("ids.txt"), &ids(n - 1)).unwrap();
    let e = err(build_index(&IndexSpec::Flat { embeddings: emb.clone() }, &out2, &Quiet));
    assert!(e.contains("2999 ids") && e.contains("3000 rows"), "{e}");
}

#[test]
fn bm25_build_stops_at_the_first_bad_document() {
    let dir = tmpdir("bm25bad");
    let out = dir.join("idx");
    let docs: Vec<anyhow::Result<(&str, &str, &str)>> =
        vec![Ok(("d1", "A", "alpha")), Ok(("d2", "B", "beta")), Err(anyhow::anyhow!("corpus.jsonl:3: not JSON")), Ok(("d4", "D", "delta"))];
    let e = err(Bm25Index::try_build(&out, docs, Default::default()));
    assert!(e.contains("corpus.jsonl:3: not JSON"), "{e}");
    assert!(!out.exists());
    // Through the pipeline, from a file: the reader's error names the line.
    let corpus = dir.join("corpus.jsonl");
    std::fs::write(&corpus, "{\"_id\": \"a\", \"text\": \"x\"}\n{\"_id\": \"b\", \"text\": 3}\n").unwrap();
    let e = err(build_index(&IndexSpec::Bm25 { corpus: corpus.clone(), params: Default::default() }, &out, &Quiet));
    assert!(e.contains("corpus.jsonl:2:"), "{e}");
    assert!(!out.exists());
    std::fs::write(&corpus, "{\"_id\": \"a\", \"text\": \"x y\"}\n{\"_id\": \"b\", \"text\": \"y z\"}\n").unwrap();
    let meta = build_index(&IndexSpec::Bm25 { corpus, params: Default::default() }, &out, &Quiet).unwrap();
    assert_eq!(meta.count, 2);
}

/// A process id that is not running: a child that has exited and been reaped.
fn dead_pid() -> u32 {
    let mut c = Command::new("true").spawn().unwrap();
    let pid = c.id();
    c.wait().unwrap();
    assert!(!fsutil::pid_alive(pid));
    pid
}

#[test]
fn atomic_writes_remove_leftovers_of_dead_processes_only() {
    let dir = tmpdir("leftovers");
    let target = dir.join("run.trec");
    let dead = dead_pid();
    let mut live = Command::new("sleep").arg("60").spawn().unwrap();
    let stale_file = dir.join(format!(".run.trec.tmp-{dead}"));
    let stale_dir = dir.join(format!(".run.trec.old-{dead}"));
    let live_file = dir.join(format!(".run.trec.tmp-{}", live.id()));
    let other_target = dir.join(format!(".other.tmp-{dead}"));
    for f in [&stale_file, &live_file, &other_target] {
        std::fs::write(f, "partial").unwrap();
    }
    std::fs::create_dir_all(stale_dir.join("sub")).unwrap();
    fsutil::write_bytes(&target, b"new").unwrap();
    let _ = live.kill();
    let _ = live.wait();
    assert_eq!(std::fs::read(&target).unwrap(), b"new");
    assert!(!stale_file.exists(), "a dead process's temporary file is removed");
    assert!(!stale_dir.exists(), "a dead process's .old directory is removed");
    assert!(live_file.exists(), "a live process's temporary file is kept");
    assert!(other_target.exists(), "leftovers of other targets are not touched");
}

#[test]
fn leftovers_under_this_processs_own_id_are_kept() {
    // Another thread of this process may be writing under our id right now.
    let dir = tmpdir("own");
    let own = dir.join(format!(".a.json.tmp-{}", std::process::id()));
    std::fs::write(&own, "in progress").unwrap();
    fsutil::remove_stale_temps(&dir.join("a.json"));
    assert!(own.exists());
}

#[test]
fn index_builds_remove_leftover_directories_of_dead_processes_only() {
    let dir = tmpdir("idxleft");
    let target = dir.join("idx");
    let dead = dead_pid();
    let mut live = Command::new("sleep").arg("60").spawn().unwrap();
    let stale_tmp = dir.join(format!(".idx.tmp-{dead}"));
    let stale_old = dir.join(format!(".idx.old-{dead}"));
    let live_tmp = dir.join(format!(".idx.tmp-{}", live.id()));
    for d in [&stale_tmp, &stale_old, &live_tmp] {
        std::fs::create_dir_all(d).unwrap();
        std::fs::write(d.join("embeddings.npy"), "partial").unwrap();
    }
    let (n, d) = (50, 8);
    FlatIndex::new(vectors(n, d, 8), d, ids(n)).unwrap().save(&target).unwrap();
    // Replacing an existing index goes through `.idx.old-<our pid>`, removed at the end.
    FlatIndex::new(vectors(n, d, 9), d, ids(n)).unwrap().save(&target).unwrap();
    let _ = live.kill();
    let _ = live.wait();
    assert!(!stale_tmp.exists() && !stale_old.exists(), "dead processes' leftovers are removed");
    assert!(live_tmp.exists(), "a live process's build directory is kept");
    let mut left: Vec<String> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    left.sort();
    assert_eq!(left, vec![".idx.tmp-".to_string() + &live.id().to_string(), "idx".into()]);
    assert_eq!(FlatIndex::load(&target).unwrap().vectors(), &vectors(n, d, 9)[..]);
}

#[test]
fn fsync_of_files_and_directories_runs() {
    // Durability itself cannot be tested without crashing the machine; this checks that the
    // fsync calls (file before the rename, directory after) succeed on every write path.
    let dir = tmpdir("fsync");
    fsutil::sync_dir(&dir).unwrap();
    assert!(err(fsutil::sync_dir(&dir.join("missing"))).contains("missing"));
    fsutil::write_bytes(&dir.join("a/b/c.json"), b"{}").unwrap();
    fsutil::sync_file(&dir.join("a/b/c.json")).unwrap();
    fsutil::write_atomically(&dir.join("d.bin"), |tmp| Ok(std::fs::write(tmp, [1u8, 2, 3])?)).unwrap();
    assert_eq!(std::fs::read(dir.join("d.bin")).unwrap(), [1, 2, 3]);
    let mut w = NpyWriter::create(&dir.join("e/emb.npy"), 4).unwrap();
    w.append(&[1.0, 2.0, 3.0, 4.0]).unwrap();
    w.finish().unwrap();
    assert_eq!(NpyF32::open(&dir.join("e/emb.npy")).unwrap().data(), &[1.0, 2.0, 3.0, 4.0]);
    let bm = Bm25Index::build(&dir.join("bm25"), [("d1", "t", "some text")], Default::default()).unwrap();
    assert_eq!(bm.len(), 1);
    // A failed write leaves neither the target nor its temporary file.
    let e = err(fsutil::write_atomically(&dir.join("f.bin"), |_| anyhow::bail!("no space")));
    assert!(e.contains("no space"));
    let names: Vec<String> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert!(names.iter().all(|n| !n.starts_with('.') && n != "f.bin"), "{names:?}");
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

/// An index is never built over a folder of someone else's, and replacing or removing one
/// removes only what the build wrote: a file put into it is a refusal that names it, and the
/// old index stays whole (issue 32).
#[test]
fn index_builds_replace_only_what_they_wrote() {
    let dir = tmpdir("idxforeign");
    let (n, d) = (40, 8);
    let emb = dir.join("emb");
    npy::write_f32(&emb.join("embeddings.npy"), &vectors(n, d, 3), d).unwrap();
    npy::write_ids(&emb.join("ids.txt"), &ids(n)).unwrap();
    let flat = || IndexSpec::Flat { embeddings: emb.clone() };

    // A folder of the user's: refused, untouched.
    let mine = dir.join("mine");
    std::fs::create_dir_all(mine.join("sub")).unwrap();
    std::fs::write(mine.join("notes.txt"), "mine").unwrap();
    let e = err(build_index(&flat(), &mine, &Quiet));
    assert!(e.contains(&mine.display().to_string()) && e.contains("not replaced"), "{e}");
    assert_eq!(names(&mine), ["notes.txt", "sub"]);
    assert_eq!(names(&dir), ["emb", "mine"], "no temporary folder left beside it");
    // An HNSW build (hours on a large corpus) is refused before it reads anything: here its
    // embeddings do not even exist, and the refusal is about the output.
    let hnsw = IndexSpec::Hnsw { embeddings: dir.join("missing"), params: HnswParams::default(), builder: Default::default() };
    let e = err(build_index(&hnsw, &mine, &Quiet));
    assert!(e.contains(&mine.display().to_string()) && e.contains("not replaced"), "{e}");

    // An index of ours is replaced; one with a file put into it (even in a subfolder) is not.
    let idx = dir.join("idx");
    build_index(&flat(), &idx, &Quiet).unwrap();
    build_index(&flat(), &idx, &Quiet).unwrap();
    std::fs::write(idx.join("notes.txt"), "mine").unwrap();
    let e = err(build_index(&flat(), &idx, &Quiet));
    assert!(e.contains("notes.txt") && e.contains("did not write"), "{e}");
    let e = err(index::remove_written(&idx));
    assert!(e.contains("notes.txt"), "{e}");
    assert!(idx.join("notes.txt").exists() && FlatIndex::load(&idx).is_ok(), "the old index and the file are kept");
    std::fs::remove_file(idx.join("notes.txt")).unwrap();
    index::remove_written(&idx).unwrap();
    assert!(!idx.exists());

    // BM25: opening and searching the index (tantivy's reader takes its lock files) leaves it
    // replaceable.
    let corpus = dir.join("corpus.jsonl");
    std::fs::write(&corpus, "{\"_id\": \"a\", \"text\": \"x y\"}\n{\"_id\": \"b\", \"text\": \"y z\"}\n").unwrap();
    let bm25 = || IndexSpec::Bm25 { corpus: corpus.clone(), params: Default::default() };
    let out = dir.join("bm25");
    build_index(&bm25(), &out, &Quiet).unwrap();
    let opened = index::open(&out).unwrap();
    drop(opened);
    build_index(&bm25(), &out, &Quiet).unwrap();
    std::fs::create_dir_all(out.join("extra")).unwrap();
    let e = err(build_index(&bm25(), &out, &Quiet));
    assert!(e.contains("extra"), "{e}");
}

/// Indexes and checkpoints written before `.written.json` existed are adopted when they hold
/// only what their kind writes (an index: our index.json and its kind's files; a checkpoint: the
/// trainer's state beside the model, tokenizer and optimizer files), so they can be rebuilt,
/// replaced or removed; anything else in them still makes them the user's (issue 32).
#[test]
fn outputs_of_versions_before_the_record_are_adopted_only_when_they_hold_only_their_kind_s_files() {
    let dir = tmpdir("idxolder");
    let (n, d) = (40, 8);
    let emb = dir.join("emb");
    npy::write_f32(&emb.join("embeddings.npy"), &vectors(n, d, 5), d).unwrap();
    npy::write_ids(&emb.join("ids.txt"), &ids(n)).unwrap();
    let corpus = dir.join("corpus.jsonl");
    std::fs::write(&corpus, "{\"_id\": \"a\", \"text\": \"x y\"}\n{\"_id\": \"b\", \"text\": \"y z\"}\n").unwrap();
    let specs = [("flat", IndexSpec::Flat { embeddings: emb.clone() }), ("bm25", IndexSpec::Bm25 { corpus: corpus.clone(), params: Default::default() })];
    for (name, spec) in &specs {
        let out = dir.join(name);
        build_index(spec, &out, &Quiet).unwrap();
        if *name == "bm25" {
            drop(index::open(&out).unwrap());
        }
        std::fs::remove_file(out.join(index::WRITTEN_FILE)).unwrap();
        build_index(spec, &out, &Quiet).unwrap_or_else(|e| panic!("{name}: an older index is not rebuilt: {e:#}"));
        assert!(out.join(index::WRITTEN_FILE).exists());
        std::fs::remove_file(out.join(index::WRITTEN_FILE)).unwrap();
        std::fs::write(out.join("notes.txt"), "mine").unwrap();
        let e = err(build_index(spec, &out, &Quiet));
        assert!(e.contains("no record of what the toolkit wrote"), "{name}: {e}");
        assert_eq!(std::fs::read_to_string(out.join("notes.txt")).unwrap(), "mine");
    }
    // An index.json another program wrote adopts nothing.
    let theirs = dir.join("theirs");
    std::fs::create_dir_all(&theirs).unwrap();
    std::fs::write(theirs.join("index.json"), r#"{"kind":"flat","dim":8,"count":1,"metric":"ip","params":{},"created_by":"someone"}"#).unwrap();
    std::fs::write(theirs.join("ids.txt"), "a\n").unwrap();
    assert!(err(index::remove_written(&theirs)).contains("no record"));

    // A checkpoint of an older run (a two-tower one: each tower's files in its subfolder).
    let ckpt = dir.join("checkpoint-4");
    for f in ["trainer_state.json", "optimizer.safetensors", "config.json", "model.safetensors", "tokenizer.json", "rak_encoder.json", "1_Pooling/config.json", "query_encoder/config.json", "passage_encoder/vocab.txt"] {
        std::fs::create_dir_all(ckpt.join(f).parent().unwrap()).unwrap();
        std::fs::write(ckpt.join(f), "{}").unwrap();
    }
    std::fs::write(ckpt.join("modules.json"), r#"[{"path": ""}, {"path": "1_Pooling"}]"#).unwrap();
    // rak's trainer state (rak-train's TrainerState), not just a file of that name.
    std::fs::write(ckpt.join("trainer_state.json"), RAK_STATE).unwrap();
    index::check_replaceable(&ckpt).unwrap();
    // A file the user put into a module folder is not one a save copied there.
    for extra in ["my-eval.json", "1_Pooling/notes.txt", "1_Pooling/notes.txt/x", "query_encoder/notes.txt"] {
        let path = ckpt.join(extra);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, "mine").unwrap();
        assert!(err(index::remove_written(&ckpt)).contains("no record"), "{extra}");
        assert!(path.exists());
        std::fs::remove_file(&path).unwrap();
        if extra.ends_with("/x") {
            std::fs::remove_dir(path.parent().unwrap()).unwrap();
        }
    }
    // Without the trainer's state file it is no checkpoint of ours.
    std::fs::rename(ckpt.join("trainer_state.json"), dir.join("state")).unwrap();
    assert!(err(index::remove_written(&ckpt)).contains("no record"));
    std::fs::rename(dir.join("state"), ckpt.join("trainer_state.json")).unwrap();
    // Nor with Hugging Face's trainer state of the same name.
    std::fs::write(ckpt.join("trainer_state.json"), HF_STATE).unwrap();
    assert!(err(index::remove_written(&ckpt)).contains("no record"));
    assert!(ckpt.join("model.safetensors").exists());
    std::fs::write(ckpt.join("trainer_state.json"), RAK_STATE).unwrap();
    index::remove_written(&ckpt).unwrap();
    assert!(!ckpt.exists());
}

/// The keys of rak-train's `TrainerState` (rak-train's tests check that its states pass
/// `index::is_trainer_state`).
const RAK_STATE: &str = r#"{"step": 4, "sampler": {"Taco": {}}, "skipped_steps": 0, "episode": 0, "config": {}, "world_size": 1}"#;
/// A Hugging Face Trainer checkpoint's `trainer_state.json`.
const HF_STATE: &str = r#"{"global_step": 10, "log_history": []}"#;

/// A file put into the old directory while the build ran stops the replacement, and the
/// finished build is kept where the error says, not thrown away (issue 32).
#[test]
fn a_build_refused_at_the_second_check_is_kept() {
    let dir = tmpdir("idxsecond");
    let out = dir.join("out");
    index::write_dir_atomically(&out, |tmp| Ok(std::fs::write(tmp.join("a.txt"), "old")?)).unwrap();
    let typed = index::write_dir_atomically(&out, |tmp| {
        std::fs::write(out.join("notes.txt"), "mine")?;
        Ok(std::fs::write(tmp.join("a.txt"), "new")?)
    })
    .unwrap_err();
    let e = format!("{typed:#}");
    assert!(e.contains("notes.txt") && e.contains("the finished build is kept in"), "{e}");
    let kept = fsutil::temp_path(&out);
    // Told from other errors by its type: a Milvus build then keeps its collection.
    assert_eq!(typed.downcast_ref::<index::KeptBuild>().map(|k| k.at.clone()), Some(kept.clone()));
    // A refusal before the build is no kept build.
    let before = index::write_dir_atomically(&out, |_| Ok(())).unwrap_err();
    assert!(before.downcast_ref::<index::KeptBuild>().is_none(), "{before:#}");
    assert!(kept.exists(), "the kept build stays through a refused build");
    assert!(e.contains(&kept.display().to_string()), "{e}");
    assert_eq!(std::fs::read_to_string(kept.join("a.txt")).unwrap(), "new");
    assert_eq!(std::fs::read_to_string(out.join("a.txt")).unwrap(), "old");
    assert_eq!(std::fs::read_to_string(out.join("notes.txt")).unwrap(), "mine");
}
