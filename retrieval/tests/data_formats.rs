//! Every reader and writer of `rak_retrieval::data` on small inline fixtures, each bad-input case,
//! and the vendored mini-KILT files (counts must equal its STATS.json).

use rak_retrieval::data::{self, beir, dpr, kilt, minikilt::MiniKilt, msmarco, trec, Passage, Query, Run};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

fn tmp(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("data_formats");
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn write(name: &str, text: &str) -> PathBuf {
    let p = tmp(name);
    std::fs::write(&p, text).unwrap();
    p
}

fn err_of<T: std::fmt::Debug>(r: anyhow::Result<T>) -> String {
    format!("{:#}", r.expect_err("expected an error"))
}

fn minikilt_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/minikilt")
}

// ---------------------------------------------------------------- BEIR

#[test]
fn beir_corpus_queries_qrels() {
    let c = write(
        "corpus.jsonl",
        "{\"_id\": \"d1\", \"title\": \"Page A\", \"text\": \"alpha\"}\n\n{\"_id\": 7, \"text\": \"no title\"}\n",
    );
    let ps: Vec<Passage> = beir::read_corpus(&c).unwrap().collect::<anyhow::Result<_>>().unwrap();
    assert_eq!(ps[0], Passage { id: "d1".into(), title: "Page A".into(), text: "alpha".into() });
    assert_eq!(ps[1].id, "7");
    assert_eq!(ps[1].title, "");
    let corpus = beir::load_corpus(&c).unwrap();
    assert_eq!(corpus.len(), 2);
    assert_eq!(corpus.title("d1"), Some("Page A"));

    let q = write(
        "queries.jsonl",
        "{\"_id\": \"q1\", \"text\": \"what?\", \"metadata\": {}}\n{\"_id\": \"q2\", \"text\": \"who?\", \"answers\": [\"x\"], \"pages\": [\"Page A\"]}\n",
    );
    let qs = beir::load_queries(&q).unwrap();
    assert_eq!(qs[0], Query { id: "q1".into(), text: "what?".into(), ..Query::default() });
    assert_eq!(qs[1].answers, vec!["x"]);
    assert_eq!(qs[1].pages, vec!["Page A"]);

    let with_header = write("qrels_header.tsv", "query-id\tcorpus-id\tscore\nq1\td1\t1\nq1\t7\t0\nq2\td1\t2\n");
    let without = write("qrels_plain.tsv", "q1\td1\t1\nq1\t7\t0\nq2\td1\t2\n");
    let a = beir::read_qrels(&with_header).unwrap();
    assert_eq!(a, beir::read_qrels(&without).unwrap());
    assert_eq!(a["q1"]["7"], 0);
    assert_eq!(a["q2"]["d1"], 2);
}

#[test]
fn malformed_json_line_names_file_and_line() {
    let c = write(
        "corpus.jsonl",
        "{\"_id\": \"d1\", \"title\": \"A\", \"text\": \"a\"}\n{\"_id\": \"d2\", \"title\": \"B\", \"text\": \"b\"}\n{\"_id\": \"d3\", \"title\": \"C\"\n",
    );
    let e = err_of(beir::load_corpus(&c));
    assert!(e.contains("corpus.jsonl:3: expected a JSON object with \"_id\""), "{e}");
    // The stream reports the bad line and goes on.
    let results: Vec<_> = beir::read_corpus(&c).unwrap().collect();
    assert_eq!(results.len(), 3);
    assert!(results[0].is_ok() && results[1].is_ok() && results[2].is_err());

    let c = write("corpus_noid.jsonl", "{\"title\": \"A\", \"text\": \"a\"}\n");
    let e = err_of(beir::load_corpus(&c));
    assert!(e.contains("corpus_noid.jsonl:1:") && e.contains("_id"), "{e}");

    // A repeated id is named by its line, blank lines counted.
    let c = write("corpus_dup.jsonl", "{\"_id\": \"d1\", \"text\": \"a\"}\n\n{\"_id\": \"d1\", \"text\": \"b\"}\n");
    let e = err_of(beir::load_corpus(&c));
    assert!(e.contains("corpus_dup.jsonl:3: passage id \"d1\" occurs twice"), "{e}");

    let q = write("queries_bad.jsonl", "\n{\"_id\": \"q1\", \"text\": \"ok\"}\n[1, 2]\n");
    let e = err_of(beir::load_queries(&q));
    assert!(e.contains("queries_bad.jsonl:3:"), "{e}");
}

#[test]
fn empty_files_are_errors_naming_the_file() {
    for (name, text) in [("empty_corpus.jsonl", ""), ("blank_corpus.jsonl", "\n  \n")] {
        let p = write(name, text);
        let e = err_of(beir::load_corpus(&p));
        assert!(e.contains(name) && e.contains("empty"), "{e}");
    }
    let p = write("empty_queries.jsonl", "");
    let e = err_of(beir::load_queries(&p));
    assert!(e.contains("empty_queries.jsonl") && e.contains("empty"), "{e}");
    let p = write("header_only_qrels.tsv", "query-id\tcorpus-id\tscore\n");
    assert!(err_of(beir::read_qrels(&p)).contains("header_only_qrels.tsv: empty"));
    let p = write("empty_kilt.jsonl", "");
    assert!(err_of(kilt::read_queries(&p).unwrap().collect::<anyhow::Result<Vec<_>>>()).contains("empty_kilt.jsonl"));
    let p = write("empty_collection.tsv", "");
    assert!(err_of(msmarco::read_collection(&p).unwrap().collect::<anyhow::Result<Vec<_>>>()).contains("empty_collection.tsv"));
    let p = write("empty_dpr.json", "[]");
    assert!(err_of(dpr::load(&p)).contains("empty_dpr.json: empty"));
    let p = write("empty_run.trec", "");
    assert!(err_of(trec::read_run(&p)).contains("empty_run.trec: empty"));
}

#[test]
fn bad_qrels_lines() {
    let p = write("qrels_bad_score.tsv", "query-id\tcorpus-id\tscore\nq1\td1\t1\nq1\td2\thigh\n");
    assert!(err_of(beir::read_qrels(&p)).contains("qrels_bad_score.tsv:3: score \"high\" is not an integer"));
    let p = write("qrels_cols.tsv", "q1\td1\t1\nq1 d2 1\n");
    assert!(err_of(beir::read_qrels(&p)).contains("qrels_cols.tsv:2: expected 3 tab-separated columns"));
    let p = write("qrels_dup.tsv", "q1\td1\t1\nq1\td1\t0\n");
    assert!(err_of(beir::read_qrels(&p)).contains("qrels_dup.tsv:2:"));
}

#[test]
fn unknown_qrels_ids_are_counted() {
    let p = write("qrels_unknown.tsv", "q1\td1\t1\nq1\tzz\t1\nq9\td1\t1\nq9\tyy\t0\n");
    let qrels = beir::read_qrels(&p).unwrap();
    let queries: HashSet<&str> = ["q1"].into();
    let passages: HashSet<&str> = ["d1"].into();
    let u = data::check_qrels_ids("qrels_unknown.tsv", &qrels, |q| queries.contains(q), |d| passages.contains(d));
    assert_eq!(u, data::UnknownIds { queries: 1, passages: 2, judgements: 3 });
    let ok = data::check_qrels_ids("x", &qrels, |_| true, |_| true);
    assert!(ok.is_empty());
}

// ---------------------------------------------------------------- KILT

const KILT: &str = r#"{"id": "k1", "input": "who wrote x?", "output": [{"answer": "Ann", "provenance": [{"wikipedia_id": "12", "title": "X (book)", "start_paragraph_id": 1}, {"wikipedia_id": "13", "title": "Ann"}]}, {"answer": "Ann B."}, {"answer": "Ann", "provenance": [{"wikipedia_id": "13", "title": "Ann"}]}]}
{"id": 2, "input": "claim", "output": [{"answer": "SUPPORTS", "provenance": [{"wikipedia_id": "5", "title": "Y"}]}]}
{"id": "k3", "input": "test item, no output"}
"#;

#[test]
fn kilt_queries() {
    let p = write("kilt.jsonl", KILT);
    let qs: Vec<Query> = kilt::read_queries(&p).unwrap().collect::<anyhow::Result<_>>().unwrap();
    assert_eq!(qs[0].id, "k1");
    assert_eq!(qs[0].answers, vec!["Ann", "Ann B."]);
    assert_eq!(qs[0].pages, vec!["X (book)", "Ann"]);
    assert_eq!(qs[0].page_sets, vec![vec!["X (book)".to_string(), "Ann".into()], vec!["Ann".to_string()]]);
    assert_eq!(qs[1].id, "2");
    assert_eq!(qs[1].pages, vec!["Y"]);
    assert!(qs[1].page_sets.is_empty(), "one gold set is just `pages`");
    assert_eq!(qs[1].gold_page_sets(), vec![&["Y".to_string()][..]]);
    assert!(qs[2].answers.is_empty() && qs[2].pages.is_empty());

    let bad = write("kilt_bad.jsonl", "{\"id\": \"a\", \"input\": \"x\"}\n{\"id\": \"b\", \"output\": []}\n");
    let e = err_of(kilt::read_queries(&bad).unwrap().collect::<anyhow::Result<Vec<_>>>());
    assert!(e.contains("kilt_bad.jsonl:2:") && e.contains("input"), "{e}");
}

#[test]
fn kilt_predictions_writer() {
    let corpus = data::Corpus::from_passages([
        Passage { id: "p1".into(), title: "Ann".into(), text: "".into() },
        Passage { id: "p2".into(), title: "Ann".into(), text: "".into() },
        Passage { id: "p3".into(), title: "X (book)".into(), text: "".into() },
        Passage { id: "p4".into(), title: "Z".into(), text: "".into() },
    ])
    .unwrap();
    let mut run = Run::new();
    run.insert("k1", vec![("p2".into(), 3.0), ("p1".into(), 2.0), ("p3".into(), 1.0), ("p4".into(), 0.5)]);
    let ids: HashMap<String, String> = [("Ann".to_string(), "13".to_string())].into();
    let path = tmp("pred/kilt.jsonl");
    kilt::write_predictions(&path, &run, &corpus, Some(&ids), ["k1", "absent"], 2).unwrap();
    let lines: Vec<serde_json::Value> =
        std::fs::read_to_string(&path).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(
        lines[0],
        serde_json::json!({"id": "k1", "output": [{"provenance": [
            {"wikipedia_title": "Ann", "title": "Ann", "wikipedia_id": "13"},
            {"wikipedia_title": "X (book)", "title": "X (book)"}]}]})
    );
    assert_eq!(lines[1], serde_json::json!({"id": "absent", "output": [{"provenance": []}]}));
    let leftovers: Vec<_> = std::fs::read_dir(path.parent().unwrap()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(leftovers.len(), 1, "no temporary file left: {leftovers:?}");

    run.insert("k2", vec![("nope".into(), 1.0)]);
    let e = err_of(kilt::write_predictions(&tmp("pred/bad.jsonl"), &run, &corpus, None, ["k2"], 5));
    assert!(e.contains("\"nope\"") && e.contains("not in the corpus"), "{e}");
    assert!(!tmp("pred/bad.jsonl").exists());
}

// ---------------------------------------------------------------- DPR

const DPR: &str = r#"[
  {"dataset": "nq", "question": "who sang x?", "answers": ["Bob", "Bob D."],
   "positive_ctxs": [{"title": "X (song)", "text": "X is sung by Bob.", "score": 1000, "title_score": 1, "passage_id": "11"},
                     {"title": "Bob", "text": "Bob is a singer.", "passage_id": 12}],
   "negative_ctxs": [{"title": "N", "text": "n", "passage_id": "99"}],
   "hard_negative_ctxs": [{"title": "H", "text": "h", "passage_id": "98"}]},
  {"question": "where is y?", "answers": ["Z"],
   "positive_ctxs": [{"title": "Y", "text": "Y is in Z.", "psg_id": "21"}, {"title": "Y", "text": "no id"}],
   "negative_ctxs": [], "hard_negative_ctxs": []}
]"#;

#[test]
fn dpr_json() {
    let p = write("dpr.json", DPR);
    let d = dpr::load(&p).unwrap();
    assert_eq!(d.queries.len(), 2);
    assert_eq!(d.queries[0].id, "0");
    assert_eq!(d.queries[0].answers, vec!["Bob", "Bob D."]);
    assert_eq!(d.queries[0].pages, vec!["X (song)", "Bob"]);
    assert_eq!(d.queries[1].pages, vec!["Y"]);
    let want: data::Qrels = [
        ("0".to_string(), BTreeMap::from([("11".to_string(), 1), ("12".to_string(), 1)])),
        ("1".to_string(), BTreeMap::from([("21".to_string(), 1)])),
    ]
    .into();
    assert_eq!(d.qrels, want);
    assert_eq!(d.positives_without_id, 1);

    let mut hard = Vec::new();
    let n = dpr::for_each_question(&p, |i, q| {
        hard.push((i, q.hard_negative_ctxs.len(), q.negative_ctxs.len()));
        Ok(())
    })
    .unwrap();
    assert_eq!(n, 2);
    assert_eq!(hard, vec![(0, 1, 1), (1, 0, 0)]);

    let bad = write("dpr_bad.json", "[\n {\"question\": \"a\", \"answers\": []},\n {\"answers\": []}\n]");
    let e = err_of(dpr::load(&bad));
    assert!(e.contains("dpr_bad.json:3:") && e.contains("question"), "{e}");
    let e = err_of(dpr::for_each_question(&p, |i, _| if i == 1 { anyhow::bail!("caller stops") } else { Ok(()) }));
    assert_eq!(e, "caller stops");
}

#[test]
fn dpr_passages_tsv() {
    let p = write("psgs.tsv", "id\ttext\ttitle\n1\t\"Aaron ( or ; \"\"Ahärôn\"\") is a prophet\"\tAaron\n2\tplain text\tB\n");
    let ps: Vec<Passage> = dpr::read_passages(&p).unwrap().collect::<anyhow::Result<_>>().unwrap();
    assert_eq!(ps[0], Passage { id: "1".into(), text: "Aaron ( or ; \"Ahärôn\") is a prophet".into(), title: "Aaron".into() });
    assert_eq!(ps[1].text, "plain text");
    let bad = write("psgs_bad.tsv", "id\ttext\ttitle\n1\tonly two\n");
    assert!(err_of(dpr::read_passages(&bad).unwrap().collect::<anyhow::Result<Vec<_>>>()).contains("psgs_bad.tsv:2: expected 3"));
}

// ---------------------------------------------------------------- MS MARCO

#[test]
fn msmarco_tsv() {
    let c = write("collection.tsv", "0\tThe presence of communication.\n1\tManhattan project.\n");
    let ps: Vec<Passage> = msmarco::read_collection(&c).unwrap().collect::<anyhow::Result<_>>().unwrap();
    assert_eq!(ps[1], Passage { id: "1".into(), title: "".into(), text: "Manhattan project.".into() });
    let q = write("queries.dev.tsv", "1048585\twhat is paula deen's brother\n2\tq two\n");
    let qs: Vec<Query> = msmarco::read_queries(&q).unwrap().collect::<anyhow::Result<_>>().unwrap();
    assert_eq!((qs[0].id.as_str(), qs[0].text.as_str()), ("1048585", "what is paula deen's brother"));
    let r = write("qrels.dev.tsv", "1048585\t0\t7187158\t1\n2 0 1 1\n");
    let qrels = msmarco::read_qrels(&r).unwrap();
    assert_eq!(qrels["1048585"]["7187158"], 1);
    assert_eq!(qrels["2"]["1"], 1);
    let bad = write("qrels_msm_bad.tsv", "1\t0\t2\t1\n1\t0\t3\n");
    assert!(err_of(msmarco::read_qrels(&bad)).contains("qrels_msm_bad.tsv:2: expected 4 columns"));
    let bad = write("collection_bad.tsv", "0\tok\nnotab\n");
    assert!(err_of(msmarco::read_collection(&bad).unwrap().collect::<anyhow::Result<Vec<_>>>()).contains("collection_bad.tsv:2:"));
}

// ---------------------------------------------------------------- TREC runs

#[test]
fn run_order_is_trec_evals() {
    let mut run = Run::new();
    run.insert(
        "q",
        vec![
            ("a".into(), 1.0),
            ("c".into(), 2.0),
            ("b".into(), 1.0),
            ("d".into(), 1.0 + 1e-12), // equal to 1.0 as a C float: a tie
            ("e".into(), 1.5),
            ("a".into(), 0.5), // repeated: the better entry stays
        ],
    );
    let ids: Vec<&str> = run.get("q").unwrap().iter().map(|(d, _)| d.as_str()).collect();
    assert_eq!(ids, ["c", "e", "d", "b", "a"]);
    assert_eq!(run.truncated(2).get("q").unwrap().len(), 2);
}

#[test]
fn trec_run_roundtrip_and_atomic_write() {
    let mut run = Run::new();
    run.insert("q1", vec![("d1".into(), 0.25), ("d2".into(), 12.5), ("d3".into(), -1.0)]);
    run.insert("q2", vec![("x".into(), 1e-20)]);
    let path = tmp("runs/out.trec");
    trec::write_run(&path, &run, "my-run", None).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    assert_eq!(text.lines().next().unwrap(), "q1 Q0 d2 1 12.5 my-run");
    assert_eq!(text.lines().count(), 4);
    assert_eq!(trec::read_run(&path).unwrap(), run);
    trec::write_run(&path, &run, "t", Some(1)).unwrap();
    assert_eq!(std::fs::read_to_string(&path).unwrap().lines().count(), 2);
    let names: Vec<_> = std::fs::read_dir(path.parent().unwrap()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names.len(), 1, "{names:?}");
    assert!(err_of(trec::write_run(&tmp("runs/bad.trec"), &run, "two words", None)).contains("one non-empty word"));
    assert!(!tmp("runs/bad.trec").exists());
}

#[test]
fn trec_run_bad_lines() {
    for (name, body, want) in [
        ("cols.trec", "q1 Q0 d1 1 1.0 t\nq1 Q0 d2 2 0.5\n", "cols.trec:2: expected 6 columns"),
        ("score.trec", "q1 Q0 d1 1 1.0 t\n\nq1 Q0 d2 2 high t\n", "score.trec:3: score \"high\" is not a finite number"),
        ("nan.trec", "q1 Q0 d1 1 nan t\n", "nan.trec:1: score \"nan\""),
        ("rank.trec", "q1 Q0 d1 first 1.0 t\n", "rank.trec:1: rank \"first\" is not an integer"),
        ("dup.trec", "q1 Q0 d1 1 1.0 t\nq2 Q0 d1 1 1.0 t\nq1 Q0 d1 2 0.5 t\n", "dup.trec:3: passage \"d1\" is listed twice"),
    ] {
        let p = write(name, body);
        let e = err_of(trec::read_run(&p));
        assert!(e.contains(want), "{name}: {e}");
    }
}

// ---------------------------------------------------------------- mini-KILT (vendored)

#[test]
fn minikilt_counts_match_stats() {
    let root = minikilt_root();
    let stats: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(root.join("STATS.json")).unwrap()).unwrap();
    let mk = MiniKilt::open(&root).unwrap();
    let corpus = mk.load_corpus().unwrap();
    assert_eq!(corpus.len() as u64, stats["corpus"]["passages"].as_u64().unwrap());
    let pages: HashSet<&str> = corpus.iter().map(|p| p.title.as_str()).collect();
    assert_eq!(pages.len() as u64, stats["corpus"]["pages"].as_u64().unwrap());

    let tasks = mk.tasks().unwrap();
    let want: Vec<String> = stats["tasks"].as_object().unwrap().keys().cloned().collect();
    assert_eq!(tasks, want);
    for task in &tasks {
        assert_eq!(mk.splits(task).unwrap(), ["dev", "train"]);
        for split in ["dev", "train"] {
            let s = &stats["tasks"][task.as_str()][split];
            let ts = mk.split(task, split).unwrap();
            let (queries, qrels) = ts.load().unwrap();
            assert_eq!(queries.len() as u64, s["queries"].as_u64().unwrap(), "{task}/{split} queries");
            let judgements: usize = qrels.values().map(|m| m.len()).sum();
            assert_eq!(judgements as u64, s["qrels"].as_u64().unwrap(), "{task}/{split} qrels");
            let with_answers = queries.iter().filter(|q| !q.answers.is_empty()).count();
            assert_eq!(with_answers as u64, s["with_answers"].as_u64().unwrap(), "{task}/{split} with answers");
            let gold_pages: HashSet<&str> = queries.iter().flat_map(|q| q.pages.iter().map(String::as_str)).collect();
            assert_eq!(gold_pages.len() as u64, s["pages"].as_u64().unwrap(), "{task}/{split} pages");
            let qids: HashSet<&str> = queries.iter().map(|q| q.id.as_str()).collect();
            let unknown = data::check_qrels_ids(task, &qrels, |q| qids.contains(q), |d| corpus.contains(d));
            assert!(unknown.is_empty(), "{task}/{split}: {unknown:?}");
            // Page-level relevance as the README defines it: every relevant passage is on a gold page.
            let by_id: HashMap<&str, &Query> = queries.iter().map(|q| (q.id.as_str(), q)).collect();
            for (q, docs) in &qrels {
                for d in docs.keys() {
                    assert!(by_id[q.as_str()].pages.iter().any(|p| Some(p.as_str()) == corpus.title(d)), "{task}: {q} {d}");
                }
            }
        }
    }
    assert_eq!(mk.all("dev").unwrap().len(), 4);
    assert!(mk.split("fever", "test").is_err());
    assert!(MiniKilt::open(root.join("tasks")).is_err());
}
