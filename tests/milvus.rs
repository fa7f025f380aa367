//! The Milvus index backend against a real Milvus server (milvus-lite's, from PyPI, started on
//! 127.0.0.1 by `scripts/milvus.sh` with a state folder of the test's own): built by `host index
//! build --kind milvus`, it returns what exact search returns, `host search` reads it like a
//! local index, and a collection that changed, vanished or was never ours, a server that is
//! down and an index type the server lacks each give a clear error. Each build fills a
//! collection of its own: a failed rebuild leaves the earlier build searchable, two builds of
//! one name never share vectors, nor two runs of one ANCE recipe. The server dies with the test
//! that started it.

use milvus::v2::prelude::*;
use rak_e2e::*;
use rak_retrieval::index::{self, FlatIndex, Index, IndexMeta, MilvusAnn, MilvusParams};
use rak_retrieval::pipeline::search::search_vectors;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A Milvus server of the test's own, stopped at drop.
struct Milvus {
    uri: String,
    state: TempDir,
}

impl Milvus {
    fn start(tag: &str) -> Self {
        let state = TempDir::new(tag);
        // Tied to this process: a test killed before its drop leaves no server behind.
        let out = Command::new(root().join("scripts/milvus.sh"))
            .arg("start")
            .env("MILVUS_STATE_DIR", state.path())
            .env("MILVUS_PARENT_PID", std::process::id().to_string())
            .output()
            .unwrap();
        assert!(out.status.success(), "Milvus did not start: {}", stderr(&out));
        let uri = stdout(&out).trim().to_string();
        assert!(uri.starts_with("http://127.0.0.1:"), "{uri}");
        Milvus { uri, state }
    }

    fn stop(&self) {
        let out = Command::new(root().join("scripts/milvus.sh")).arg("stop").env("MILVUS_STATE_DIR", self.state.path()).output().unwrap();
        assert!(out.status.success(), "{}", stderr(&out));
    }

    /// The collections on the server whose names start with `prefix`, sorted. Through the
    /// SDK's v1 client: v2's refuses milvus-lite's answer (it sends no collection ids).
    fn collections(&self, prefix: &str) -> Vec<String> {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let mut all: Vec<String> = rt.block_on(async { milvus::client::Client::new(self.uri.clone()).await.unwrap().list_collections().await.unwrap() });
        all.retain(|n| n.starts_with(prefix));
        all.sort();
        all
    }

    /// Run one SDK call (to change the server behind the toolkit's back).
    fn sdk<T, F: std::future::Future<Output = milvus::v2::error::Result<T>>>(&self, f: impl FnOnce(ClientV2) -> F) -> T {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let config = ConnectConfig::new().uri(self.uri.clone()).keepalive_while_idle(false);
            let client = ClientV2::new(&config).await.unwrap();
            f(client).await.unwrap()
        })
    }
}

impl Drop for Milvus {
    fn drop(&mut self) {
        let _ = Command::new(root().join("scripts/milvus.sh")).arg("stop").env("MILVUS_STATE_DIR", self.state.path()).output();
    }
}

/// `n` unit vectors of width `dim` from a fixed seed (a small LCG: no rand dependency).
fn unit_vectors(n: usize, dim: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    let mut v: Vec<f32> = (0..n * dim)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 33) as f32 / (1u64 << 31) as f32) - 0.5
        })
        .collect();
    for row in v.chunks_mut(dim) {
        let norm = row.iter().map(|x| x * x).sum::<f32>().sqrt();
        row.iter_mut().for_each(|x| *x /= norm);
    }
    v
}

/// An embeddings directory as `host encode` writes it.
fn embeddings(dir: &Path, vectors: &[f32], dim: usize) -> PathBuf {
    let out = dir.join("emb");
    std::fs::create_dir_all(&out).unwrap();
    rak_retrieval::npy::write_f32(&out.join("embeddings.npy"), vectors, dim).unwrap();
    let ids: Vec<String> = (0..vectors.len() / dim).map(|i| format!("doc{i}")).collect();
    std::fs::write(out.join("ids.txt"), ids.join("\n") + "\n").unwrap();
    out
}

fn build(m: &Milvus, emb: &Path, out: &Path, collection: &str, extra: &[&str]) -> std::process::Output {
    let mut args = vec!["index", "build", "--kind", "milvus", "--uri", &m.uri, "--collection", collection];
    args.extend(["--embeddings", emb.to_str().unwrap(), "--output", out.to_str().unwrap()]);
    args.extend(extra);
    host(&args)
}

fn build_ok(m: &Milvus, emb: &Path, out: &Path, collection: &str, extra: &[&str]) {
    let o = build(m, emb, out, collection, extra);
    assert!(o.status.success(), "host index build --kind milvus failed: {}", stderr(&o));
}

/// The collection that holds the vectors of the index folder `dir`.
fn stored(dir: &Path) -> String {
    let params: MilvusParams = serde_json::from_value(IndexMeta::read(dir).unwrap().params).unwrap();
    params.stored_collection()
}

fn open_err(dir: &Path) -> String {
    match index::open(dir) {
        Ok(_) => panic!("{} opened", dir.display()),
        Err(e) => format!("{e:#}"),
    }
}

#[test]
fn milvus_index_returns_what_exact_search_returns() {
    let dir = TempDir::new("milvus-exact");
    let m = Milvus::start("milvus-exact-state");
    let (n, dim, k) = (3000, 64, 10);
    let vectors = unit_vectors(n, dim, 7);
    let emb = embeddings(dir.path(), &vectors, dim);
    let queries = unit_vectors(50, dim, 11);

    let ids: Vec<String> = (0..n).map(|i| format!("doc{i}")).collect();
    let exact = Index::Flat(FlatIndex::new(vectors.clone(), dim, ids).unwrap());
    let want = search_vectors(&exact, &queries, dim, k).unwrap();

    let flat = dir.path().join("milvus-flat");
    build_ok(&m, &emb, &flat, "exact_flat", &["--ann", "flat"]);
    // IVF_FLAT searching every cluster is exact too; searching 2 of 32 is not.
    let ivf_all = dir.path().join("milvus-ivf-all");
    build_ok(&m, &emb, &ivf_all, "exact_ivf", &["--ann", "ivf_flat", "--nlist", "32", "--nprobe", "32"]);
    let info = stdout(&host(&["index", "info", ivf_all.to_str().unwrap()]));
    assert!(info.contains("\"kind\": \"milvus\"") && info.contains("exact_ivf") && info.contains("\"count\": 3000"), "{info}");

    for idx in [&flat, &ivf_all] {
        let got = search_vectors(&index::open(idx).unwrap(), &queries, dim, k).unwrap();
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(&want) {
            let g_ids: Vec<&str> = g.iter().map(|(id, _)| id.as_str()).collect();
            let w_ids: Vec<&str> = w.iter().map(|(id, _)| id.as_str()).collect();
            assert_eq!(g_ids, w_ids, "{}: not exact search's top {k}", idx.display());
            for ((_, gs), (_, ws)) in g.iter().zip(w) {
                assert!((gs - ws).abs() < 1e-4, "{}: score {gs} against exact {ws}", idx.display());
            }
        }
    }

    // Fewer clusters searched: `set_ef_search` (host search --ef-search) is what sets nprobe.
    // milvus-lite searches a collection this small exactly whatever its index (checked with
    // pymilvus: recall 1.0 at nprobe 1, `indexed_rows` 0), so the recall drop is not asserted.
    let ivf = dir.path().join("milvus-ivf");
    build_ok(&m, &emb, &ivf, "approx_ivf", &["--ann", "ivf_flat", "--nlist", "32", "--nprobe", "2"]);
    let mut approx = index::open(&ivf).unwrap();
    let Index::Milvus(mi) = &mut approx else { panic!("not a Milvus index") };
    assert_eq!(mi.params().ann, MilvusAnn::IvfFlat { nlist: 32, nprobe: 2 });
    mi.set_ef_search(64);
    assert_eq!(mi.params().ann, MilvusAnn::IvfFlat { nlist: 32, nprobe: 32 }, "nprobe is capped at nlist");
    let got = search_vectors(&approx, &queries, dim, k).unwrap();
    assert!(got.iter().all(|h| h.len() == k), "fewer than {k} hits");

    // A rebuild replaces the collection this toolkit made, and the index still answers.
    build_ok(&m, &emb, &flat, "exact_flat", &["--ann", "flat"]);
    let again = search_vectors(&index::open(&flat).unwrap(), &queries, dim, k).unwrap();
    let top = |r: &[Vec<(String, f32)>]| r.iter().map(|h| h[0].0.clone()).collect::<Vec<_>>();
    assert_eq!(top(&again), top(&want));
}

/// `host search` reads a Milvus index as it reads a local one: the same run as the flat index
/// over the same MiniLM embeddings of a real mini-KILT slice.
#[test]
fn host_search_reads_a_milvus_index_like_a_local_one() {
    let dir = TempDir::new("milvus-search");
    let m = Milvus::start("milvus-search-state");
    let s = slice();
    let model = minilm_dir();
    let emb = dir.path().join("emb");
    let o = host(&["encode", "--encoder", "dpr", "--model", model.to_str().unwrap(), "--input", s.corpus.to_str().unwrap(), "--output", emb.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let flat = dir.path().join("flat");
    let o = host(&["index", "build", "--kind", "flat", "--embeddings", emb.to_str().unwrap(), "--output", flat.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let milvus = dir.path().join("milvus");
    build_ok(&m, &emb, &milvus, "minikilt_slice", &["--ann", "flat"]);
    let run = |idx: &Path, out: &str| {
        let out = dir.path().join(out);
        let o = host(&[
            "search", "--index", idx.to_str().unwrap(), "--encoder", "dpr", "--model", model.to_str().unwrap(),
            "--queries", s.queries.to_str().unwrap(), "--k", "10", "--output", out.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        // query, Q0, passage, rank (scores may differ in their last digits)
        std::fs::read_to_string(out).unwrap().lines().map(|l| l.split_whitespace().take(4).collect::<Vec<_>>().join(" ")).collect::<Vec<_>>()
    };
    let (a, b) = (run(&flat, "flat.trec"), run(&milvus, "milvus.trec"));
    assert_eq!(a.len(), 400);
    assert_eq!(a, b, "the Milvus index ranks otherwise than exact search");

    // host serve over the Milvus index answers as host search does, and stops cleanly (the
    // index's own runtime must not be dropped inside the server's).
    use std::io::{BufRead, BufReader, Read, Write};
    let mut child = Command::new(host_bin())
        .args(["serve", "--index", milvus.to_str().unwrap(), "--encoder", "dpr", "--model", model.to_str().unwrap(), "--corpus", s.corpus.to_str().unwrap(), "--port", "0"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::fs::File::create(dir.path().join("serve.log")).unwrap())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let listening: serde_json::Value = serde_json::from_str(&line).unwrap_or_else(|_| panic!("{}", std::fs::read_to_string(dir.path().join("serve.log")).unwrap()));
    let addr = listening["listening"].as_str().unwrap().trim_start_matches("http://").to_string();
    let first: serde_json::Value = serde_json::from_str(std::fs::read_to_string(&s.queries).unwrap().lines().next().unwrap()).unwrap();
    let body = serde_json::json!({"query": first["text"], "k": 10}).to_string();
    let mut conn = std::net::TcpStream::connect(&addr).unwrap();
    write!(conn, "POST /search HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
    let mut reply = String::new();
    conn.read_to_string(&mut reply).unwrap();
    let json: serde_json::Value = serde_json::from_str(reply.split_once("\r\n\r\n").unwrap().1).unwrap_or_else(|_| panic!("{reply}"));
    let served: Vec<String> = json["passages"].as_array().unwrap().iter().map(|h| h["id"].as_str().unwrap().to_string()).collect();
    let qid = first["_id"].as_str().unwrap();
    let expected: Vec<String> = b.iter().filter(|l| l.starts_with(&format!("{qid} "))).map(|l| l.split(' ').nth(2).unwrap().to_string()).collect();
    assert_eq!(served, expected);
    assert!(Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap().success());
    let status = child.wait().unwrap();
    let log = std::fs::read_to_string(dir.path().join("serve.log")).unwrap();
    assert!(status.success() && !log.contains("internal error"), "{status:?}: {log}");
}

#[test]
fn milvus_faults_are_named() {
    let dir = TempDir::new("milvus-faults");
    let m = Milvus::start("milvus-faults-state");
    let dim = 16;
    let emb = embeddings(dir.path(), &unit_vectors(200, dim, 3), dim);

    // Flags missing.
    let o = host(&["index", "build", "--kind", "milvus", "--embeddings", emb.to_str().unwrap(), "--output", dir.path().join("x").to_str().unwrap()]);
    assert!(!o.status.success() && stderr(&o).contains("--kind milvus needs --uri URI, --collection NAME and --embeddings DIR"), "{}", stderr(&o));

    // An index type this server lacks: its own refusal, with the server named; no directory,
    // no half-made collection; the token the client sent is not shown.
    let out = dir.path().join("hnsw");
    let o = Command::new(host_bin())
        .args(["index", "build", "--kind", "milvus", "--uri", &m.uri, "--collection", "hnsw_here", "--ann", "hnsw"])
        .args(["--embeddings", emb.to_str().unwrap(), "--output", out.to_str().unwrap()])
        .env("MILVUS_TOKEN", "root:s3cret-token")
        .output()
        .unwrap();
    let err = stderr(&o);
    assert!(!o.status.success() && err.contains(&m.uri) && err.contains("HNSW"), "{err}");
    assert!(!err.contains("s3cret"), "the token was printed: {err}");
    assert!(!out.exists(), "a failed build left {}", out.display());
    assert_eq!(m.collections("hnsw_here"), Vec::<String>::new(), "a failed build left its collection");

    // A rebuild that fails leaves the earlier build as it was: its folder opens and searches.
    let kept_first = dir.path().join("rebuilt");
    build_ok(&m, &emb, &kept_first, "rebuilt", &["--ann", "flat"]);
    let o = build(&m, &emb, &kept_first, "rebuilt", &["--ann", "hnsw"]);
    assert!(!o.status.success() && stderr(&o).contains("HNSW"), "the rebuild did not fail at the server: {}", stderr(&o));
    let idx = index::open(&kept_first).unwrap_or_else(|e| panic!("a failed rebuild broke the earlier build: {e:#}"));
    assert_eq!(search_vectors(&idx, &unit_vectors(1, dim, 5), dim, 3).unwrap()[0].len(), 3);
    assert_eq!(m.collections("rebuilt"), vec![stored(&kept_first)], "the failed rebuild left its collection");
    // A rebuild that succeeds drops the build it replaced.
    build_ok(&m, &emb, &kept_first, "rebuilt", &["--ann", "flat"]);
    assert_eq!(m.collections("rebuilt"), vec![stored(&kept_first)]);

    // A collection this toolkit did not make is never replaced.
    m.sdk(|c| async move {
        c.create_collection(CreateSimpleCollectionRequest::builder().collection_name("theirs").dimension(dim as u32).build()?).await
    });
    let o = build(&m, &emb, &dir.path().join("theirs"), "theirs", &["--ann", "flat"]);
    assert!(!o.status.success() && stderr(&o).contains("collection theirs exists and was not made by this toolkit"), "{}", stderr(&o));
    assert!(m.sdk(|c| async move { c.has_collection(HasCollectionRequest::builder().collection_name("theirs").build()?).await }).exists());

    // One collection name built for two folders, with as many rows: each searches its own
    // vectors (sharing one collection, the first folder mapped the second build's rows through
    // its own ids, or its ANCE run mined with the other run's vectors).
    let (first, second) = (dir.path().join("first"), dir.path().join("second"));
    let (mine, other) = (unit_vectors(200, dim, 3), unit_vectors(200, dim, 4));
    build_ok(&m, &emb, &first, "shared", &["--ann", "flat"]);
    build_ok(&m, &embeddings(&dir.path().join("other"), &other, dim), &second, "shared", &["--ann", "flat"]);
    assert_ne!(stored(&first), stored(&second));
    for (folder, vectors) in [(&first, &mine), (&second, &other)] {
        // Each folder's own row 7, searched for, comes back first with a score of 1.
        let hits = search_vectors(&index::open(folder).unwrap(), &vectors[7 * dim..8 * dim], dim, 1).unwrap();
        assert_eq!(hits[0][0].0, "doc7", "{}", folder.display());
        assert!((hits[0][0].1 - 1.0).abs() < 1e-4, "{}: {:?}", folder.display(), hits[0]);
    }

    // Rows added behind the index's back: refused on open, naming both counts.
    let ours = dir.path().join("ours");
    build_ok(&m, &emb, &ours, "ours", &["--ann", "flat"]);
    let ours_stored = stored(&ours);
    let name = ours_stored.clone();
    m.sdk(|c| async move {
        let columns = vec![FieldData::Int64 { name: "row".into(), values: vec![5000] }, FieldData::FloatVector { name: "vec".into(), values: vec![vec![0.25; 16]] }];
        c.insert(InsertRequest::builder().collection_name(name).columns(columns).build()?).await
    });
    let err = open_err(&ours);
    assert!(err.contains("holds 201 rows, not the 200"), "{err}");

    // The collection dropped: refused on open, saying how to rebuild.
    let name = ours_stored.clone();
    m.sdk(|c| async move { c.drop_collection(DropCollectionRequest::builder().collection_name(name).build()?).await });
    let err = open_err(&ours);
    assert!(err.contains(&format!("collection {ours_stored} is gone")) && err.contains("host index build --kind milvus"), "{err}");

    // The server down: an error naming it, within the connect timeout; the token never shown.
    let kept = dir.path().join("kept");
    build_ok(&m, &emb, &kept, "kept", &["--ann", "flat"]);
    m.stop();
    let t = std::time::Instant::now();
    let q = dir.path().join("q.jsonl");
    std::fs::write(&q, "{\"_id\": \"q1\", \"text\": \"anything\"}\n").unwrap();
    let o = Command::new(host_bin())
        .args(["search", "--index", kept.to_str().unwrap(), "--encoder", "dpr", "--model", minilm_dir().to_str().unwrap()])
        .args(["--queries", q.to_str().unwrap(), "--output", dir.path().join("run.trec").to_str().unwrap()])
        .env("MILVUS_TOKEN", "root:s3cret-token")
        .output()
        .unwrap();
    let err = stderr(&o);
    assert!(!o.status.success() && err.contains(&m.uri), "{err}");
    assert!(!err.contains("s3cret"), "the token was printed: {err}");
    assert!(t.elapsed() < std::time::Duration::from_secs(60), "took {:?}", t.elapsed());
}

/// ANCE's episodes mine through a Milvus collection when the recipe says so
/// (`ance_index = { kind = "milvus", ... }`), with the same negatives as the in-memory index.
/// Two runs of that recipe at once, into two folders, each mine through a collection of their
/// own (one replacing the other's while it mines would fail it, or hand it the other's
/// vectors), and each drops its own once mined.
#[test]
fn ance_mines_through_milvus_as_through_a_local_index() {
    let dir = TempDir::new("milvus-ance");
    let m = Milvus::start("milvus-ance-state");
    let train = "optim = \"adamw\"\nlearning_rate = 5e-5\nper_device_train_batch_size = 6\nmax_steps = 2\nlogging_steps = 1\nsave_steps = 2\nhard_negatives = 1\nnegative_depth = 20\nseed = 7\nance_episodes = 1\nance_depth = 10";
    let recipe = |name: &str, extra: &str| {
        let data = dir.path().join(name);
        std::fs::create_dir_all(&data).unwrap();
        small_task_data(&data, 12, &format!("{train}\n{extra}"))
    };
    let start = |recipe: &Path, out: &Path| {
        Command::new(host_bin())
            .args(["train", "--model", minilm_dir().to_str().unwrap(), "--config", recipe.to_str().unwrap(), "--output-dir", out.to_str().unwrap()])
            .env_remove("RAK_PLUGIN_PATH")
            .stderr(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap()
    };
    let negatives = |child: std::process::Child, out: &Path| {
        let o = child.wait_with_output().unwrap();
        assert!(o.status.success(), "{}: {}", out.display(), stderr(&o));
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("negatives-episode-1.json")).unwrap()).unwrap();
        (v["negatives"].clone(), stderr(&o))
    };
    let flat = recipe("flat", "");
    let (local, _) = negatives(start(&flat, &dir.path().join("flat/run")), &dir.path().join("flat/run"));
    let shared = recipe("milvus", &format!("ance_index = {{ kind = \"milvus\", uri = \"{}\", collection = \"ance_minilm\" }}", m.uri));
    let (a, b) = (dir.path().join("run-a"), dir.path().join("run-b"));
    let (run_a, run_b) = (start(&shared, &a), start(&shared, &b));
    let ((remote_a, log_a), (remote_b, log_b)) = (negatives(run_a, &a), negatives(run_b, &b));
    let flushed = |log: &str| log.lines().find_map(|l| l.split("flushing ").nth(1)).map(|s| s.split_whitespace().next().unwrap().to_string());
    let (ca, cb) = (flushed(&log_a), flushed(&log_b));
    assert!(ca.as_deref().is_some_and(|c| c.starts_with("ance_minilm")), "the episode did not index through Milvus:\n{log_a}");
    assert!(cb.as_deref().is_some_and(|c| c.starts_with("ance_minilm")), "the episode did not index through Milvus:\n{log_b}");
    assert_ne!(ca, cb, "two runs of one recipe mined through one collection");
    // Their collections were dropped once mined.
    assert!(local.as_object().is_some_and(|o| !o.is_empty()));
    assert_eq!(local, remote_a, "Milvus's negatives differ from the flat index's");
    assert_eq!(local, remote_b, "Milvus's negatives differ from the flat index's");
    assert_eq!(m.collections("ance_minilm"), Vec::<String>::new(), "the runs left their collections");
}

/// A test killed before it stops its server leaves none: the server dies with the process
/// `MILVUS_PARENT_PID` names.
#[test]
fn the_server_dies_with_the_process_that_started_it() {
    let state = TempDir::new("milvus-tied-state");
    let mut parent = Command::new("sleep").arg("600").spawn().unwrap();
    let out = Command::new(root().join("scripts/milvus.sh"))
        .arg("start")
        .env("MILVUS_STATE_DIR", state.path())
        .env("MILVUS_PARENT_PID", parent.id().to_string())
        .output()
        .unwrap();
    assert!(out.status.success(), "Milvus did not start: {}", stderr(&out));
    let pid = std::fs::read_to_string(state.path().join("pid")).unwrap().split_whitespace().next().unwrap().to_string();
    // Gone, or a zombie no one has reaped yet.
    let alive = || std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| s.rsplit_once(')').is_some_and(|(_, r)| !r.trim_start().starts_with('Z')));
    assert!(alive(), "no server at pid {pid}");
    parent.kill().unwrap();
    parent.wait().unwrap();
    let killed = std::time::Instant::now();
    while alive() {
        if killed.elapsed() > std::time::Duration::from_secs(20) {
            let _ = Command::new(root().join("scripts/milvus.sh")).arg("stop").env("MILVUS_STATE_DIR", state.path()).output();
            panic!("the server outlived the process it was tied to by 20 s");
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    // A process that does not exist is refused before any server starts.
    let out = Command::new(root().join("scripts/milvus.sh")).arg("start").env("MILVUS_STATE_DIR", state.path()).env("MILVUS_PARENT_PID", "999999999").output().unwrap();
    assert!(!out.status.success() && stderr(&out).contains("MILVUS_PARENT_PID=999999999: no such process"), "{}", stderr(&out));
}
