//! The retrieval pipeline end to end through the `host` CLI on real mini-KILT data: encode
//! (with sharding and resumption), index, search, eval; and each bad input it must refuse.

use rak_e2e::*;
use serde_json::Value;
use std::path::Path;

fn minilm() -> String {
    minilm_dir().to_string_lossy().into_owned()
}

fn ok(args: &[&str]) -> String {
    let out = host(args);
    assert!(out.status.success(), "host {args:?} failed:\n{}", stderr(&out));
    stdout(&out)
}

fn fails(args: &[&str], needle: &str) -> String {
    let out = host(args);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "host {args:?} should fail cleanly:\n{err}");
    assert!(err.contains(needle), "expected {needle:?} in:\n{err}");
    assert!(!err.contains("panicked") && !err.contains("internal error"), "{err}");
    err
}

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// `host encode` with MiniLM; `extra` must include `--part-size`.
fn encode(corpus: &Path, out: &Path, extra: &[&str]) -> std::process::Output {
    let model = minilm();
    let mut args = vec!["encode", "--encoder", "dpr", "--model", &model, "--input", p(corpus), "--output", p(out)];
    args.extend_from_slice(extra);
    host(&args)
}

#[test]
fn encode_index_search_eval_on_real_data() {
    let s = slice();
    let emb = s.dir.join("emb");
    let out = encode(&s.corpus, &emb, &["--part-size", "100"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let n_passages = std::fs::read_to_string(&s.corpus).unwrap().lines().count();
    let ids = std::fs::read_to_string(emb.join("ids.txt")).unwrap();
    assert_eq!(ids.lines().count(), n_passages);
    let first_id = serde_json::from_str::<Value>(std::fs::read_to_string(&s.corpus).unwrap().lines().next().unwrap()).unwrap()["_id"].clone();
    assert_eq!(ids.lines().next().unwrap(), first_id.as_str().unwrap(), "rows keep input order");
    assert!(!emb.join("parts").exists(), "parts are removed once joined");
    // A second run finds the work done.
    let again = encode(&s.corpus, &emb, &["--part-size", "100"]);
    assert!(again.status.success() && stderr(&again).contains("already complete"));

    let flat = s.dir.join("flat");
    let hnsw = s.dir.join("hnsw");
    let bm25 = s.dir.join("bm25");
    ok(&["index", "build", "--kind", "flat", "--embeddings", p(&emb), "--output", p(&flat)]);
    ok(&["index", "build", "--kind", "hnsw", "--embeddings", p(&emb), "--output", p(&hnsw), "--m", "16"]);
    ok(&["index", "build", "--kind", "bm25", "--corpus", p(&s.corpus), "--output", p(&bm25)]);
    let info: Value = serde_json::from_str(&ok(&["index", "info", p(&hnsw)])).unwrap();
    assert_eq!(info["kind"], "hnsw");
    assert_eq!(info["dim"], 384);
    assert_eq!(info["count"], n_passages);

    let model = minilm();
    let mut metrics = Vec::new();
    for (name, index, extra) in [("flat", &flat, vec!["--encoder", "dpr", "--model", &model]), ("hnsw", &hnsw, vec!["--encoder", "dpr", "--model", &model]), ("bm25", &bm25, vec!["--bm25"])] {
        let run = s.dir.join(format!("{name}.trec"));
        let mut args = vec!["search", "--index", p(index), "--queries", p(&s.queries), "--k", "20", "--output", p(&run), "--task", "squad"];
        args.extend(extra);
        ok(&args);
        let lines = std::fs::read_to_string(&run).unwrap();
        assert_eq!(lines.lines().count(), 40 * 20, "{name}: 20 hits for each of 40 queries");
        assert_eq!(lines.lines().next().unwrap().split_whitespace().count(), 6);
        let out = host(&["eval", "--run", p(&run), "--qrels", p(&s.qrels), "--corpus", p(&s.corpus), "--queries", p(&s.queries), "--task", "squad"]);
        assert!(out.status.success(), "{}", stderr(&out));
        assert!(stderr(&out).contains("rprec_page"), "a human table on stderr");
        let v: Value = serde_json::from_str(&stdout(&out)).unwrap();
        let m = v["tasks"]["squad"]["metrics"].clone();
        for key in ["rprec_page", "rprec_passage", "recall@5", "recall@20", "recall@100", "mrr@10", "ndcg@10", "answer_acc@1", "answer_acc@5", "answer_acc@20"] {
            assert!(m[key].is_number(), "{name}: {key} in {m}");
        }
        assert!(m["mrr@10"].as_f64().unwrap() > 0.3, "{name}: real retrieval finds gold passages: {m}");
        metrics.push(m);
    }
    // HNSW on 300 vectors is exact in practice.
    assert!((metrics[0]["mrr@10"].as_f64().unwrap() - metrics[1]["mrr@10"].as_f64().unwrap()).abs() < 1e-9);
}

/// Shards run one after the other; the one that completes the set joins them; a rerun of an
/// unfinished output resumes without redoing finished parts; the result equals a one-shot run.
#[test]
fn encode_shards_and_resumes() {
    let s = slice();
    let whole = s.dir.join("emb-whole");
    assert!(encode(&s.corpus, &whole, &["--part-size", "64"]).status.success());
    let sharded = s.dir.join("emb-sharded");
    let first = encode(&s.corpus, &sharded, &["--part-size", "64", "--shard-id", "1", "--shard-num", "2"]);
    assert!(first.status.success(), "{}", stderr(&first));
    assert!(stderr(&first).contains("parts present"));
    assert!(!sharded.join("embeddings.npy").exists(), "no whole-looking output from half the parts");
    let done: Vec<_> = std::fs::read_dir(sharded.join("parts")).unwrap().flatten().map(|e| e.file_name()).collect();
    // Real kills at random moments, and shards running at once, are in encode_faults.rs.
    let rest = encode(&s.corpus, &sharded, &["--part-size", "64"]);
    assert!(rest.status.success(), "{}", stderr(&rest));
    assert!(stderr(&rest).contains("resuming"), "{}", stderr(&rest));
    assert!(done.len() >= 2);
    assert_eq!(std::fs::read(whole.join("ids.txt")).unwrap(), std::fs::read(sharded.join("ids.txt")).unwrap());
    let a = rak_retrieval::npy::NpyF32::open(&whole.join("embeddings.npy")).unwrap();
    let b = rak_retrieval::npy::NpyF32::open(&sharded.join("embeddings.npy")).unwrap();
    assert_eq!(a.rows(), b.rows());
    let max = a.data().iter().zip(b.data()).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    assert!(max < 1e-5, "sharded and one-shot embeddings differ by {max}");

    // Other settings into the same output are refused rather than mixed.
    fails(&["encode", "--encoder", "dpr", "--model", &minilm(), "--input", p(&s.corpus), "--output", p(&sharded), "--part-size", "50"], "made differently");
}

#[test]
fn bad_inputs_are_clear_errors_with_no_partial_output() {
    let s = slice();
    let dir = TempDir::new("pipeline-bad");
    let model = minilm();

    // A malformed JSON line: the error names the file and the line.
    let bad = dir.path().join("bad.jsonl");
    let good_lines: Vec<String> = std::fs::read_to_string(&s.corpus).unwrap().lines().take(3).map(String::from).collect();
    std::fs::write(&bad, format!("{}\n{}\n{{\"_id\": \"x\", \"text\": \n{}\n", good_lines[0], good_lines[1], good_lines[2])).unwrap();
    let out = dir.path().join("out-bad");
    fails(&["encode", "--encoder", "dpr", "--model", &model, "--input", p(&bad), "--output", p(&out)], &format!("{}:3:", p(&bad)));
    assert!(!out.join("embeddings.npy").exists());
    fails(&["index", "build", "--kind", "bm25", "--corpus", p(&bad), "--output", p(&dir.path().join("bm25-bad"))], &format!("{}:3:", p(&bad)));
    assert!(!dir.path().join("bm25-bad").exists(), "no partial index");

    // Empty corpus and query files.
    let empty = dir.path().join("empty.jsonl");
    std::fs::write(&empty, "").unwrap();
    fails(&["encode", "--encoder", "dpr", "--model", &model, "--input", p(&empty), "--output", p(&dir.path().join("e"))], "empty");
    fails(&["index", "build", "--kind", "bm25", "--corpus", p(&empty), "--output", p(&dir.path().join("b"))], "empty.jsonl");
    let bm25 = dir.path().join("bm25");
    ok(&["index", "build", "--kind", "bm25", "--corpus", p(&s.corpus), "--output", p(&bm25)]);
    fails(&["search", "--index", p(&bm25), "--bm25", "--queries", p(&empty), "--output", p(&dir.path().join("r.trec"))], "empty.jsonl");
    assert!(!dir.path().join("r.trec").exists());

    // Embeddings and ids of different lengths.
    let emb = dir.path().join("emb");
    std::fs::create_dir_all(&emb).unwrap();
    rak_retrieval::npy::write_f32(&emb.join("embeddings.npy"), &vec![0.5f32; 4 * 16], 16).unwrap();
    std::fs::write(emb.join("ids.txt"), "a\nb\nc\n").unwrap();
    fails(&["index", "build", "--kind", "flat", "--embeddings", p(&emb), "--output", p(&dir.path().join("f"))], "ids.txt");

    // An index of another dimension than the query encoder.
    std::fs::write(emb.join("ids.txt"), "a\nb\nc\nd\n").unwrap();
    let flat16 = dir.path().join("flat16");
    ok(&["index", "build", "--kind", "flat", "--embeddings", p(&emb), "--output", p(&flat16)]);
    let run = dir.path().join("dim.trec");
    let err = fails(&["search", "--index", p(&flat16), "--encoder", "dpr", "--model", &model, "--queries", p(&s.queries), "--output", p(&run)], "16-d");
    assert!(err.contains("384-d"), "{err}");
    assert!(!run.exists());

    // A TREC run with a bad line.
    let trec = dir.path().join("bad.trec");
    std::fs::write(&trec, "q1 Q0 d1 1 2.5 x\nq1 Q0 d2 2 notanumber x\n").unwrap();
    fails(&["eval", "--run", p(&trec), "--qrels", p(&s.qrels), "--corpus", p(&s.corpus)], &format!("{}:2", p(&trec)));

    // Qrels naming unknown ids: warned and counted, not fatal.
    let run = dir.path().join("bm25.trec");
    ok(&["search", "--index", p(&bm25), "--bm25", "--queries", p(&s.queries), "--output", p(&run)]);
    let qrels = dir.path().join("qrels.tsv");
    let mut text = std::fs::read_to_string(&s.qrels).unwrap();
    text += "ghost-query\tsquad:0:0\t1\nsquad-x\tno-such-passage\t1\n";
    std::fs::write(&qrels, text).unwrap();
    let out = host(&["eval", "--run", p(&run), "--qrels", p(&qrels), "--corpus", p(&s.corpus), "--queries", p(&s.queries)]);
    assert!(out.status.success(), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(err.contains("warning") && err.contains("2 judgements name unknown ids"), "{err}");
}
