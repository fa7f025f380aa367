//! `host eval` on several tasks: names that cannot collide, and a corpus that is streamed
//! rather than held in memory.

use rak_e2e::*;
use serde_json::Value;
use std::io::Write;
use std::path::Path;

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// Runs named `nq/dev.trec` and `tqa/dev.trec` are two tasks, not one: each is reported
/// (as `nq/dev`, `tqa/dev`) and the macro average covers both. Two explicit equal names are
/// refused.
#[test]
fn runs_with_one_file_name_are_two_tasks() {
    let s = slice();
    let dir = TempDir::new("eval-names");
    let bm25 = dir.path().join("bm25");
    let out = host(&["index", "build", "--kind", "bm25", "--corpus", p(&s.corpus), "--output", p(&bm25)]);
    assert!(out.status.success(), "{}", stderr(&out));
    let (nq, tqa) = (dir.path().join("nq"), dir.path().join("tqa"));
    std::fs::create_dir_all(&nq).unwrap();
    std::fs::create_dir_all(&tqa).unwrap();
    let (run_a, run_b) = (nq.join("dev.trec"), tqa.join("dev.trec"));
    for (run, k) in [(&run_a, "20"), (&run_b, "1")] {
        let out = host(&["search", "--index", p(&bm25), "--bm25", "--queries", p(&s.queries), "--k", k, "--output", p(run)]);
        assert!(out.status.success(), "{}", stderr(&out));
    }
    let common = ["--qrels", p(&s.qrels), "--qrels", p(&s.qrels), "--corpus", p(&s.corpus)];
    let mut args = vec!["eval", "--run", p(&run_a), "--run", p(&run_b)];
    args.extend(common);
    let out = host(&args);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: Value = serde_json::from_str(&stdout(&out)).unwrap();
    let tasks = v["tasks"].as_object().unwrap();
    assert_eq!(tasks.keys().collect::<Vec<_>>(), vec!["nq/dev", "tqa/dev"], "{v}");
    let (a, b) = (tasks["nq/dev"]["metrics"]["recall@20"].as_f64().unwrap(), tasks["tqa/dev"]["metrics"]["recall@20"].as_f64().unwrap());
    assert!(a > b, "the two runs differ (k 20 vs 1): {a} {b}");
    let m = v["macro"]["recall@20"].as_f64().unwrap();
    assert!((m - (a + b) / 2.0).abs() < 1e-12, "the macro average covers both tasks");

    let mut args = vec!["eval", "--run", p(&run_a), "--run", p(&run_b), "--task", "x", "--task", "x"];
    args.extend(common);
    let out = host(&args);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(err.contains("\"x\"") && err.contains("nq/dev.trec") && err.contains("tqa/dev.trec"), "{err}");
}

/// Run `host` with `args` under a Python parent that reports the child's peak resident memory
/// (KiB) as the last line of stderr.
fn peak_rss_kib(args: &[&str]) -> (std::process::Output, u64) {
    let script = "import resource, subprocess, sys\n\
                  r = subprocess.run(sys.argv[1:])\n\
                  print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)\n\
                  sys.exit(r.returncode)";
    let out = std::process::Command::new(root().join(".venv/bin/python"))
        .arg("-c")
        .arg(script)
        .arg(host_bin())
        .args(args)
        .env_remove("RAK_PLUGIN_PATH")
        .output()
        .unwrap();
    let kib = stderr(&out).lines().last().and_then(|l| l.trim().parse().ok()).unwrap_or(u64::MAX);
    (out, kib)
}

/// `eval` keeps only the passages the runs and qrels name: on a corpus of 200 MB of text its
/// peak memory stays far below the corpus size.
#[test]
fn eval_streams_the_corpus() {
    let dir = TempDir::new("eval-memory");
    let corpus = dir.path().join("corpus.jsonl");
    let mut w = std::io::BufWriter::new(std::fs::File::create(&corpus).unwrap());
    let filler = "lorem ipsum dolor sit amet ".repeat(400); // ~10.8 kB
    for i in 0..20_000 {
        writeln!(w, "{{\"_id\": \"p{i}\", \"title\": \"Page {}\", \"text\": \"{filler} {i}\"}}", i / 10).unwrap();
    }
    drop(w);
    let size_kib = std::fs::metadata(&corpus).unwrap().len() / 1024;
    let (run, qrels, queries) = (dir.path().join("run.trec"), dir.path().join("qrels.tsv"), dir.path().join("q.jsonl"));
    std::fs::write(&run, "q1 Q0 p5 1 3.0 x\nq1 Q0 p17 2 2.0 x\nq2 Q0 p19999 1 1.0 x\n").unwrap();
    std::fs::write(&qrels, "query-id\tcorpus-id\tscore\nq1\tp17\t1\nq2\tp19999\t1\n").unwrap();
    std::fs::write(&queries, "{\"_id\": \"q1\", \"text\": \"a\", \"answers\": [\"dolor\"]}\n{\"_id\": \"q2\", \"text\": \"b\", \"answers\": [\"19999\"]}\n").unwrap();
    let (out, peak) = peak_rss_kib(&["eval", "--run", p(&run), "--qrels", p(&qrels), "--corpus", p(&corpus), "--queries", p(&queries)]);
    // What `host` itself takes (libtorch's libraries alone are hundreds of MB): the same
    // evaluation over a corpus of the three passages it needs.
    let small = dir.path().join("small.jsonl");
    let needed: Vec<String> = std::fs::read_to_string(&corpus)
        .unwrap()
        .lines()
        .filter(|l| ["\"p5\"", "\"p17\"", "\"p19999\""].iter().any(|id| l.contains(id)))
        .map(String::from)
        .collect();
    std::fs::write(&small, needed.join("\n") + "\n").unwrap();
    let (base_out, base) = peak_rss_kib(&["eval", "--run", p(&run), "--qrels", p(&qrels), "--corpus", p(&small), "--queries", p(&queries)]);
    assert!(base_out.status.success(), "{}", stderr(&base_out));
    assert_eq!(stdout(&base_out), stdout(&out), "the same metrics from the whole corpus and from the passages needed");
    assert!(out.status.success(), "{}", stderr(&out));
    let v: Value = serde_json::from_str(&stdout(&out)).unwrap();
    let m = &v["tasks"]["run"]["metrics"];
    assert_eq!(m["rprec_page"], 0.5, "q1 ranks page 0 above its gold page 1, q2 finds its page: {v}");
    assert_eq!(m["answer_acc@1"], 1.0, "texts of retrieved passages are kept for answers: {v}");
    assert!(peak < base + size_kib / 4, "peak RSS {peak} KiB ({base} KiB on a 3-passage corpus) for a corpus of {size_kib} KiB");
}
