//! Peak memory of `host index build`: it must not grow with a copy (or two) of its input; and
//! of `host train` with an optimizer that takes the summed gradient over several tasks: it
//! holds one task's graph at a time.
//!
//! Each build runs as a child process; its peak resident set size is the kernel's high-water
//! mark for it (`VmHWM` in `/proc/PID/status`), read every few milliseconds until it exits
//! (the mark only grows, so only the last few milliseconds before exit could be missed).
//! Not `wait4`'s ru_maxrss: `Command::spawn` starts the child with vfork, and the kernel
//! folds the peak of the memory the child held before `exec` (this test process's) into it.
//! The figure includes `host`'s fixed start-up cost (libtorch: about 0.45 GiB, part of it a
//! short peak while loading), so every test first builds a tiny index of the same kind as the
//! floor and bounds the large build's peak above that floor by a fraction of the input's size.
//!
//! `RAK_MEMORY_TEST_HOST=/path/to/host` runs the tests against another build of `host` (for
//! instance one from before a change).

use rak_e2e::{host_bin, minilm_dir, task_data, TempDir};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn host() -> PathBuf {
    std::env::var_os("RAK_MEMORY_TEST_HOST").map(PathBuf::from).unwrap_or_else(host_bin)
}

/// `VmHWM` of a running process, in KiB (None once it has exited).
fn vm_hwm_kib(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines().find_map(|l| l.strip_prefix("VmHWM:")).and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// Run `host args` and return its peak RSS in MiB; panics (with its output) if it fails.
fn peak_rss_mib(args: &[&str], log: &Path) -> f64 {
    let out = std::fs::File::create(log).unwrap();
    let mut child = Command::new(host())
        .args(args)
        .env_remove("RAK_PLUGIN_PATH")
        .stdin(Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .spawn()
        .expect("run host");
    let mut peak = 0u64;
    let status = loop {
        if let Some(kib) = vm_hwm_kib(child.id()) {
            peak = peak.max(kib);
        }
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    };
    assert!(status.success(), "host {} failed ({status}):\n{}", args.join(" "), std::fs::read_to_string(log).unwrap_or_default());
    assert!(peak > 0, "no VmHWM read for host {}", args.join(" "));
    peak as f64 / 1024.0
}

/// Unit vectors of width `dim` (splitmix64 values, normalised), as `DIR/embeddings.npy` and
/// `DIR/ids.txt`; returns the size of the `.npy` file in MiB.
fn write_embeddings(dir: &Path, n: usize, dim: usize) -> f64 {
    std::fs::create_dir_all(dir).unwrap();
    let mut w = rak_retrieval::npy::NpyWriter::create(&dir.join("embeddings.npy"), dim).unwrap();
    let mut s = n as u64;
    let mut row = vec![0f32; dim];
    for _ in 0..n {
        for v in row.iter_mut() {
            s = s.wrapping_add(0x9E3779B97F4A7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
            *v = ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
        }
        let norm = row.iter().map(|v| v * v).sum::<f32>().sqrt();
        row.iter_mut().for_each(|v| *v /= norm);
        w.append(&row).unwrap();
    }
    w.finish().unwrap();
    let ids: Vec<String> = (0..n).map(|i| format!("doc{i}")).collect();
    rak_retrieval::npy::write_ids(&dir.join("ids.txt"), &ids).unwrap();
    std::fs::metadata(dir.join("embeddings.npy")).unwrap().len() as f64 / (1 << 20) as f64
}

fn index_build(kind: &str, input_flag: &str, input: &Path, out: &Path, extra: &[&str], log: &Path) -> f64 {
    let mut args = vec!["index", "build", "--kind", kind, input_flag, input.to_str().unwrap(), "--output", out.to_str().unwrap()];
    args.extend_from_slice(extra);
    peak_rss_mib(&args, log)
}

#[test]
fn flat_build_does_not_hold_the_embeddings_in_memory() {
    let tmp = TempDir::new("memory-flat");
    let (small, big) = (tmp.path().join("small"), tmp.path().join("big"));
    write_embeddings(&small, 1000, 384);
    // 100k x 384 f32 = 147 MiB. Holding it once would add about that much; the old build held
    // it twice (the memory-mapped file and a copy).
    let size = write_embeddings(&big, 100_000, 384);
    let log = tmp.path().join("host.log");
    let floor = index_build("flat", "--embeddings", &small, &tmp.path().join("i1"), &[], &log);
    let peak = index_build("flat", "--embeddings", &big, &tmp.path().join("i2"), &[], &log);
    eprintln!("flat: floor {floor:.0} MiB, peak {peak:.0} MiB for a {size:.0} MiB matrix");
    assert!(peak - floor < size / 2.0, "flat build peaked {:.0} MiB above a tiny build's {floor:.0} for a {size:.0} MiB matrix", peak - floor);
    // And it is the whole, right index.
    let idx = rak_retrieval::index::FlatIndex::load(&tmp.path().join("i2")).unwrap();
    assert_eq!(idx.len(), 100_000);
    let src = rak_retrieval::npy::NpyF32::open(&big.join("embeddings.npy")).unwrap();
    assert!(idx.vectors() == src.data());
}

#[test]
fn hnsw_build_holds_the_embeddings_once() {
    let tmp = TempDir::new("memory-hnsw");
    let (small, big) = (tmp.path().join("small"), tmp.path().join("big"));
    write_embeddings(&small, 1000, 384);
    // 200k x 384 = 293 MiB: large next to the memory host frees and touches again on its way
    // out (about 0.1 GiB of libtorch's pages, which the floor includes too).
    let size = write_embeddings(&big, 200_000, 384);
    let log = tmp.path().join("host.log");
    // A small graph (m = 4) built quickly (ef_construction = 8): the vectors dominate.
    let fast = ["--m", "4", "--ef-construction", "8"];
    let floor = index_build("hnsw", "--embeddings", &small, &tmp.path().join("i1"), &fast, &log);
    let peak = index_build("hnsw", "--embeddings", &big, &tmp.path().join("i2"), &fast, &log);
    eprintln!("hnsw: floor {floor:.0} MiB, peak {peak:.0} MiB for a {size:.0} MiB matrix");
    // One copy of the vectors plus the graph is about 1.1x the matrix above the floor; the old
    // build's two copies (the mapped file and the index's own) came to 1.7x.
    assert!(peak - floor < 1.4 * size, "HNSW build peaked {:.0} MiB above a tiny build's {floor:.0} for a {size:.0} MiB matrix", peak - floor);
}

/// A BEIR corpus of `docs` passages of about `words * 6` bytes each; returns its size in MiB.
fn write_corpus(path: &Path, docs: usize, words: usize) -> f64 {
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    let mut s = docs as u64;
    for d in 0..docs {
        write!(f, "{{\"_id\": \"d{d}\", \"title\": \"passage {d}\", \"text\": \"").unwrap();
        for _ in 0..words {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            write!(f, "w{:04} ", (s >> 33) % 5000).unwrap();
        }
        writeln!(f, "end\"}}").unwrap();
    }
    f.flush().unwrap();
    std::fs::metadata(path).unwrap().len() as f64 / (1 << 20) as f64
}

#[test]
fn bm25_build_streams_the_corpus() {
    let tmp = TempDir::new("memory-bm25");
    let (small, big) = (tmp.path().join("small.jsonl"), tmp.path().join("big.jsonl"));
    write_corpus(&small, 20, 1000);
    // 360 passages of 0.9 MB (310 MiB): long texts, so that holding the corpus (or tantivy's
    // queue of 10,000 documents) is what would dominate. The streaming build's own memory (the
    // bounded queue, tantivy's buffers and merges) is about 0.1 GiB whatever the corpus's
    // size; the old build held the corpus twice (its list of passages and tantivy's queue).
    let size = write_corpus(&big, 360, 150_000);
    let log = tmp.path().join("host.log");
    let floor = index_build("bm25", "--corpus", &small, &tmp.path().join("i1"), &[], &log);
    let peak = index_build("bm25", "--corpus", &big, &tmp.path().join("i2"), &[], &log);
    eprintln!("bm25: floor {floor:.0} MiB, peak {peak:.0} MiB for a {size:.0} MiB corpus");
    assert!(peak - floor < size / 2.0, "BM25 build peaked {:.0} MiB above a tiny build's {floor:.0} for a {size:.0} MiB corpus", peak - floor);
    let idx = rak_retrieval::index::Bm25Index::open(&tmp.path().join("i2")).unwrap();
    assert_eq!(idx.len(), 360);
    assert_eq!(idx.search("w0042", 400).unwrap().len(), 360);
}

/// AdamW on 4 tasks of 16 queries a step adds each task's gradient into the parameters' as its
/// backward pass ends, so it holds one task's graph at a time: its peak is that of 1 task of
/// 16, not that of 1 task of 64 (what one backward pass over the summed losses held: every
/// task's graph at once, 0.4 GB more on the taco recipe's 16 queries over 4 tasks).
#[test]
fn multitask_adamw_holds_one_task_s_graph_at_a_time() {
    let tmp = TempDir::new("memory-adamw");
    let train = |batch: usize| format!("optim = \"adamw\"\nper_device_train_batch_size = {batch}\nmax_steps = 2\nlogging_steps = 1\nsave_steps = 100\nhard_negatives = 0\nseed = 7");
    let four = vec![("a", "squad", 0, 64), ("b", "squad", 64, 64), ("c", "squad", 128, 64), ("d", "squad", 192, 64)];
    let runs = [("one of 16", vec![("a", "squad", 0, 256)], 16), ("four of 16", four, 64), ("one of 64", vec![("a", "squad", 0, 256)], 64)];
    let mut peaks = Vec::new();
    for (i, (name, tasks, batch)) in runs.iter().enumerate() {
        let dir = tmp.path().join(format!("run{i}"));
        let recipe = task_data(&dir, tasks, &train(*batch));
        let (model, out) = (minilm_dir(), dir.join("out"));
        let args = ["train", "--model", model.to_str().unwrap(), "--config", recipe.to_str().unwrap(), "--output-dir", out.to_str().unwrap()];
        let peak = peak_rss_mib(&args, &dir.join("host.log"));
        eprintln!("adamw, {name}: peak {peak:.0} MiB");
        peaks.push(peak);
    }
    let (one, four, big) = (peaks[0], peaks[1], peaks[2]);
    // The test can tell the two apart only when a graph 4 times as large shows.
    assert!(big - one > 300.0, "one task of 64 peaked only {:.0} MiB above one of 16", big - one);
    assert!(four - one < (big - one) / 2.0, "4 tasks of 16 peaked {:.0} MiB above 1 task of 16 ({one:.0}), nearer 1 task of 64 ({big:.0}): every task's graph held at once", four - one);
}
