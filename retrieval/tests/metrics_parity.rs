//! Metrics against pytrec_eval (reference JSON made by scripts/fixtures/metrics_reference.py,
//! through scripts/fixtures/make_eval_fixtures.py, committed in tests/fixtures/eval), KILT's
//! page-level R-precision on a hand-computed fixture, and DPR answer matching.

use rak_retrieval::data::{beir, trec, Corpus, Passage, Qrels, Query, Run};
use rak_retrieval::eval::{self, answer, EvalOptions, MissingQueries};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const TOL: f64 = 1e-6;
/// Our measure name -> trec_eval's.
const NAMES: [(&str, &str); 6] = [
    ("rprec_passage", "Rprec"),
    ("recall@5", "recall_5"),
    ("recall@20", "recall_20"),
    ("recall@100", "recall_100"),
    ("mrr@10", "recip_rank"),
    ("ndcg@10", "ndcg_cut_10"),
];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn fixture(name: &str) -> PathBuf {
    root().join("tests/fixtures/eval").join(name)
}

fn parity(reference: &str, qrels_path: &Path, run_path: &Path) {
    let want: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixture(reference)).unwrap()).unwrap();
    let qrels = beir::read_qrels(qrels_path).unwrap();
    let run = trec::read_run(run_path).unwrap();
    let skip = EvalOptions { missing: MissingQueries::Skip, ..EvalOptions::default() };
    let got = eval::evaluate(&run, &qrels, &[], None, &skip);

    let want_q = want["per_query"].as_object().unwrap();
    assert_eq!(got.queries, want_q.len(), "{reference}: evaluated queries");
    assert_eq!(got.queries as u64, want["queries"].as_u64().unwrap());
    assert_eq!(got.unjudged_queries, 1, "the fixture run has one unjudged query");
    let missing = qrels.keys().filter(|q| !run.contains(q)).count();
    assert!(missing > 0);
    assert_eq!(got.missing_queries, missing);
    let mut worst = 0.0f64;
    for (qid, wm) in want_q {
        let gm = &got.per_query[qid];
        for (ours, theirs) in NAMES {
            let (g, w) = (gm[ours], wm[theirs].as_f64().unwrap());
            worst = worst.max((g - w).abs());
            assert!((g - w).abs() <= TOL, "{reference} {qid} {ours}: ours {g}, pytrec_eval {w}");
        }
    }
    for (ours, theirs) in NAMES {
        let (g, w) = (got.mean[ours], want["mean"][theirs].as_f64().unwrap());
        assert!((g - w).abs() <= TOL, "{reference} mean {ours}: ours {g}, pytrec_eval {w}");
    }
    println!("{reference}: {} queries, max abs diff {worst:.2e}", got.queries);

    // Missing queries as zeros (trec_eval -c): the same sums over all judged queries.
    let zero = eval::evaluate(&run, &qrels, &[], None, &EvalOptions::default());
    assert_eq!(zero.queries, qrels.len());
    assert_eq!(zero.missing_queries, missing);
    for (ours, theirs) in NAMES {
        let sum: f64 = want_q.values().map(|m| m[theirs].as_f64().unwrap()).sum();
        let w = sum / qrels.len() as f64;
        assert!((zero.mean[ours] - w).abs() <= TOL, "{reference} zero-filled mean {ours}");
    }
}

#[test]
fn pytrec_eval_parity_fever_dev() {
    parity("ref.fever.json", &root().join("data/minikilt/tasks/fever/qrels.dev.tsv"), &fixture("run.fever.trec"));
}

#[test]
fn pytrec_eval_parity_vitaminc_dev() {
    parity("ref.vitaminc.json", &root().join("data/minikilt/tasks/vitaminc/qrels.dev.tsv"), &fixture("run.vitaminc.trec"));
}

#[test]
fn pytrec_eval_parity_graded() {
    parity("ref.vitaminc-graded.json", &fixture("qrels.graded.tsv"), &fixture("run.vitaminc.trec"));
}

fn passage(id: &str, title: &str, text: &str) -> Passage {
    Passage { id: id.into(), title: title.into(), text: text.into() }
}

fn ranking(ids: &[&str]) -> Vec<(String, f64)> {
    ids.iter().enumerate().map(|(i, d)| (d.to_string(), 10.0 - i as f64)).collect()
}

fn qrels(entries: &[(&str, &str, i32)]) -> Qrels {
    let mut q = Qrels::new();
    for (qid, d, g) in entries {
        q.entry(qid.to_string()).or_default().insert(d.to_string(), *g);
    }
    q
}

/// KILT R-precision worked by hand. Pages: p1, p2 -> A; p3, p6 -> B; p4 -> C; p5 -> D.
#[test]
fn kilt_page_rprec_by_hand() {
    let corpus = Corpus::from_passages([
        passage("p1", "A", ""),
        passage("p2", "A", ""),
        passage("p3", "B", ""),
        passage("p4", "C", ""),
        passage("p5", "D", ""),
        passage("p6", "B", ""),
    ])
    .unwrap();
    let mut run = Run::new();
    // q1 pages A A B C D -> A B C D. Gold sets {A, C}: R=2, top 2 = A B -> 1/2; {B, D, E}: R=3,
    // top 3 = A B C -> 1/3. Max: 1/2.
    run.insert("q1", ranking(&["p1", "p2", "p3", "p4", "p5"]));
    // q2 pages B B C -> B C; gold {B, C} (R=2) -> 1 (without de-duplication it would be 1/2).
    run.insert("q2", ranking(&["p3", "p6", "p4"]));
    // q3 has no query entry: gold = pages of its relevant passages = {D} -> 1.
    run.insert("q3", ranking(&["p5", "p1"]));
    // q4: relevant p1, p2 are one page, gold {A} (R=1); top page B -> 0. Passage Rprec: 1/2.
    run.insert("q4", ranking(&["p3", "p1"]));
    run.insert("q9", ranking(&["p1"])); // unjudged
    let qrels = qrels(&[
        ("q1", "p1", 1),
        ("q2", "p3", 1),
        ("q3", "p5", 1),
        ("q3", "p1", 0),
        ("q4", "p1", 1),
        ("q4", "p2", 1),
        ("q5", "p1", 1), // absent from the run
    ]);
    let queries = vec![
        Query {
            id: "q1".into(),
            pages: vec!["A".into(), "C".into(), "B".into(), "D".into(), "E".into()],
            page_sets: vec![vec!["A".into(), "C".into()], vec!["B".into(), "D".into(), "E".into()]],
            ..Query::default()
        },
        Query { id: "q2".into(), pages: vec!["B".into(), "C".into(), "B".into()], ..Query::default() },
        Query { id: "q4".into(), ..Query::default() },
    ];
    let skip = EvalOptions { missing: MissingQueries::Skip, ..EvalOptions::default() };
    let ev = eval::evaluate(&run, &qrels, &queries, Some(&corpus), &skip);
    let page: BTreeMap<&str, f64> = ev.per_query.iter().map(|(q, m)| (q.as_str(), m["rprec_page"])).collect();
    assert_eq!(page, BTreeMap::from([("q1", 0.5), ("q2", 1.0), ("q3", 1.0), ("q4", 0.0)]));
    assert!((ev.mean["rprec_page"] - 0.625).abs() < 1e-12);
    assert_eq!(ev.per_query["q4"]["rprec_passage"], 0.5);
    assert_eq!((ev.queries, ev.missing_queries, ev.unjudged_queries), (4, 1, 1));

    let zero = eval::evaluate(&run, &qrels, &queries, Some(&corpus), &EvalOptions::default());
    assert_eq!(zero.queries, 5);
    assert!(zero.per_query["q5"].values().all(|&v| v == 0.0));
    assert!((zero.mean["rprec_page"] - 0.5).abs() < 1e-12);

    // The kernel on its own, KILT's example shapes.
    use eval::kilt::{ranked_pages, rprec_page};
    let ranked = ranked_pages(["A", "A ", "B", "C"]);
    assert_eq!(ranked, ["A", "B", "C"]);
    assert_eq!(rprec_page(&ranked, &[vec!["C", "B", "C"]]), 0.5);
    assert_eq!(rprec_page(&ranked, &[]), 0.0);
}

/// On the real mini-KILT dev queries (one gold page each) page R-precision is 1 exactly when
/// the first retrieved passage is on the gold page.
#[test]
fn page_rprec_on_minikilt_fever() {
    let mk = root().join("data/minikilt");
    let corpus = beir::load_corpus(&mk.join("corpus.jsonl")).unwrap();
    let queries = beir::load_queries(&mk.join("tasks/fever/queries.dev.jsonl")).unwrap();
    let qrels = beir::read_qrels(&mk.join("tasks/fever/qrels.dev.tsv")).unwrap();
    let run = trec::read_run(&fixture("run.fever.trec")).unwrap();
    let opts = EvalOptions { missing: MissingQueries::Skip, answer_accuracy: false };
    let ev = eval::evaluate(&run, &qrels, &queries, Some(&corpus), &opts);
    assert!(ev.mean.keys().all(|k| !k.starts_with("answer_acc")));
    let mut checked = 0;
    for q in queries.iter().filter(|q| q.pages.len() == 1 && run.contains(&q.id)) {
        let top = corpus.title(&run.get(&q.id).unwrap()[0].0).unwrap();
        let want = if top == q.pages[0] { 1.0 } else { 0.0 };
        assert_eq!(ev.per_query[&q.id]["rprec_page"], want, "{}", q.id);
        checked += 1;
    }
    assert!(checked > 50, "{checked}");
    // A page-level hit at 1 is never rarer than a passage-level one.
    assert!(ev.mean["rprec_page"] >= ev.mean["rprec_passage"] - 1e-12);
}

#[test]
fn dpr_has_answer_string_match() {
    let s = |v: &[&str]| v.iter().map(|a| a.to_string()).collect::<Vec<_>>();
    assert_eq!(answer::dpr_tokens("The U.S. army, 1,000 men"), ["the", "u", ".", "s", ".", "army", ",", "1", ",", "000", "men"]);
    assert!(answer::has_answer(&s(&["u.s. Army"]), "The U.S. army was there."));
    assert!(answer::has_answer(&s(&["Café"]), "a cafe\u{301} in Paris")); // NFD on both sides
    assert!(answer::has_answer(&s(&["cafe\u{301}"]), "CAFÉ"));
    assert!(!answer::has_answer(&s(&["Cafe"]), "café"), "NFD keeps the accent as a mark token");
    assert!(!answer::has_answer(&s(&["art"]), "a party"), "whole tokens only");
    assert!(answer::has_answer(&s(&["nope", "New York"]), "in new  york\ncity"));
    assert!(!answer::has_answer(&s(&["York New"]), "new york"));
    assert!(!answer::has_answer(&s(&["", "  "]), "anything"), "blank answers never match");
    assert!(answer::has_answer(&s(&["Ahärôn"]), "(\"Ahärôn\")"));
}

#[test]
fn answer_accuracy_and_macro_average() {
    let corpus = Corpus::from_passages([
        passage("p1", "A", "nothing here"),
        passage("p2", "A", "Paris is the capital of France."),
        passage("p3", "B", "still nothing"),
    ])
    .unwrap();
    let mut run = Run::new();
    run.insert("q1", ranking(&["p1", "p3", "p2"])); // answer at rank 3
    run.insert("q2", ranking(&["p2"])); // answer at rank 1
    run.insert("q3", ranking(&["p1"]));
    let qr = qrels(&[("q1", "p2", 1), ("q2", "p2", 1), ("q3", "p2", 1)]);
    let queries = vec![
        Query { id: "q1".into(), answers: vec!["paris".into()], ..Query::default() },
        Query { id: "q2".into(), answers: vec!["France".into()], ..Query::default() },
        Query { id: "q3".into(), ..Query::default() }, // no answers: not in answer_acc
    ];
    let ev = eval::evaluate(&run, &qr, &queries, Some(&corpus), &EvalOptions::default());
    assert_eq!(ev.answer_queries, 2);
    assert_eq!(ev.mean["answer_acc@1"], 0.5);
    assert_eq!(ev.mean["answer_acc@5"], 1.0);
    assert_eq!(ev.mean["answer_acc@20"], 1.0);
    assert!(!ev.per_query["q3"].contains_key("answer_acc@1"));
    assert!((ev.mean["mrr@10"] - (1.0 / 3.0 + 1.0 + 0.0) / 3.0).abs() < 1e-12);

    let mut run2 = Run::new();
    run2.insert("x1", ranking(&["p3"]));
    let qr2 = qrels(&[("x1", "p3", 1)]);
    let both = eval::evaluate_tasks(&[("qa", &run, &qr, &queries), ("other", &run2, &qr2, &[])], Some(&corpus), &EvalOptions::default());
    assert_eq!(both.tasks["qa"], ev);
    assert_eq!(both.tasks["other"].mean["mrr@10"], 1.0);
    assert!((both.macro_avg["mrr@10"] - (ev.mean["mrr@10"] + 1.0) / 2.0).abs() < 1e-12);
    assert_eq!(both.macro_avg["answer_acc@1"], 0.5, "only tasks with answers count");

    let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join("metrics_parity/metrics.json");
    both.write_json(&path).unwrap();
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(json["macro"]["mrr@10"].as_f64().unwrap(), both.macro_avg["mrr@10"]);
    assert_eq!(json["tasks"]["qa"]["per_query"]["q2"]["answer_acc@1"], 1.0);
    assert_eq!(json["tasks"]["qa"]["missing"], "zero");
}
