//! `host augment --target fid`: the local FiD reader as a target, the AAR way (passages to
//! the encoder one by one, multiple choice by rank classification over the answer letters,
//! short answers by greedy generation). Checked against the reader called directly with the
//! prompt REFERENCE §6 gives, on the committed T5 fixture (random weights: the answers mean
//! nothing, the plumbing is what is tested).

use rak_core::readers::fid::FidReader;
use rak_e2e::*;
use serde_json::{json, Value};
use std::path::Path;

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

#[test]
fn fid_target_ranks_letters_and_generates_as_the_reader_does() {
    let dir = TempDir::new("augment-fid");
    let model = root().join("tests/fixtures/t5/t5-v1_1");
    let s = slice();
    let bm25 = dir.path().join("bm25");
    let out = host(&["index", "build", "--kind", "bm25", "--corpus", p(&s.corpus), "--output", p(&bm25)]);
    assert!(out.status.success(), "{}", stderr(&out));
    let cfg = dir.path().join("fid.toml");
    std::fs::write(&cfg, format!("[target]\nname = \"fid\"\nsettings = {{ passage_chars = 500 }}\n[retrieval]\ncorpus = \"{}\"\n", p(&s.corpus))).unwrap();
    let retriever = format!("bm25:{}", p(&bm25));
    let mc = minikilt().join("mc/dev.jsonl");
    let out_path = dir.path().join("mc.jsonl");
    let out = host(&[
        "augment", "--config", p(&cfg), "--task", "mc", "--input", p(&mc), "--output", p(&out_path), "--model", p(&model),
        "--retriever", &retriever, "--k", "2", "--limit", "5",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let recs: Vec<Value> = std::fs::read_to_string(&out_path).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(recs.len(), 5);

    // The same questions through the reader directly.
    let mut reader = FidReader::create(json!({"model": model, "passage_chars": 500})).unwrap();
    let corpus = rak_retrieval::data::beir::load_corpus(&s.corpus).unwrap();
    let items: Vec<Value> = std::fs::read_to_string(&mc).unwrap().lines().take(5).map(|l| serde_json::from_str(l).unwrap()).collect();
    for item in &items {
        let rec = recs.iter().find(|r| r["_id"] == item["_id"]).unwrap();
        assert_eq!(rec["method"], "rank_classification");
        let choices = item["choices"].as_array().unwrap();
        let letters: Vec<String> = (0..choices.len()).map(|i| ((b'A' + i as u8) as char).to_string()).collect();
        let options: String = letters.iter().zip(choices).map(|(l, c)| format!("- {l}: {}", c.as_str().unwrap())).collect::<Vec<_>>().join("\n");
        let prompt = format!(
            "Here's a problem to solve: {}\n\nAmong the {} following options, which is the correct answer?\n{options}",
            item["question"].as_str().unwrap(),
            choices.len()
        );
        let passages: Vec<Value> = rec["passages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|id| {
                let d = corpus.get(id.as_str().unwrap()).unwrap();
                json!({"title": d.title, "text": d.text})
            })
            .collect();
        assert_eq!(passages.len(), 2);
        let direct = reader.score_options(json!({"items": [{"prompt": prompt, "passages": passages, "options": letters}]})).unwrap();
        let d = &direct["items"][0];
        let best = d["best"].as_u64().unwrap() as usize;
        assert_eq!(rec["answer"], json!(letters[best]));
        assert_eq!(rec["correct"], json!(best == item["answer"].as_u64().unwrap() as usize));
        let (a, b): (Vec<f64>, Vec<f64>) = (
            rec["raw"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect(),
            d["losses"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect(),
        );
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(&b) {
            // Relative: the command batches items together (padding masked), this call runs one.
            assert!((x - y).abs() <= 1e-5 * y.abs().max(1.0), "losses {a:?} vs {b:?}");
        }
    }

    // Short answers: greedy generation, the first line judged against the aliases.
    let sq = minikilt().join("shortqa/dev.jsonl");
    let out_path = dir.path().join("shortqa.jsonl");
    let out = host(&["augment", "--config", p(&cfg), "--task", "shortqa", "--input", p(&sq), "--output", p(&out_path), "--model", p(&model), "--limit", "3"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let summary: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(summary["answered"], 3);
    let recs: Vec<Value> = std::fs::read_to_string(&out_path).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let first: Value = serde_json::from_str(std::fs::read_to_string(&sq).unwrap().lines().next().unwrap()).unwrap();
    let rec = recs.iter().find(|r| r["_id"] == first["_id"]).unwrap();
    assert_eq!(rec["method"], "generate");
    let direct = reader
        .generate(json!({"items": [{"prompt": format!("Q: {} A:", first["question"].as_str().unwrap()), "passages": []}], "max_new_tokens": 32}))
        .unwrap();
    assert_eq!(rec["raw"], direct["outputs"][0]["text"]);
}

#[test]
fn a_reader_target_refuses_a_base_url() {
    let dir = TempDir::new("augment-fid-url");
    let cfg = dir.path().join("fid.toml");
    std::fs::write(&cfg, "[target]\nname = \"fid\"\n").unwrap();
    let mc = minikilt().join("mc/dev.jsonl");
    let out = host(&[
        "augment", "--config", p(&cfg), "--task", "mc", "--input", p(&mc), "--output", p(&dir.path().join("o.jsonl")), "--base-url", "http://127.0.0.1:1",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("--base-url is for connector targets"), "{}", stderr(&out));
}

/// The reader's prompt digest covers the passages uncut; the cut (`[passages].max_chars`) is in
/// the setup digest, so a run with another cut is never resumed with the old answers.
#[test]
fn a_reader_run_with_another_passage_cut_is_not_resumed() {
    let dir = TempDir::new("augment-fid-cut");
    let model = root().join("tests/fixtures/t5/t5-v1_1");
    let s = slice();
    let bm25 = dir.path().join("bm25");
    let out = host(&["index", "build", "--kind", "bm25", "--corpus", p(&s.corpus), "--output", p(&bm25)]);
    assert!(out.status.success(), "{}", stderr(&out));
    let retriever = format!("bm25:{}", p(&bm25));
    let mc = minikilt().join("mc/dev.jsonl");
    let out_path = dir.path().join("mc.jsonl");
    let run = |max_chars: usize| {
        let cfg = dir.path().join(format!("fid-{max_chars}.toml"));
        std::fs::write(&cfg, format!("[target]\nname = \"fid\"\n[retrieval]\ncorpus = \"{}\"\n[passages]\nmax_chars = {max_chars}\n", p(&s.corpus))).unwrap();
        host(&[
            "augment", "--config", p(&cfg), "--task", "mc", "--input", p(&mc), "--output", p(&out_path), "--model", p(&model),
            "--retriever", &retriever, "--k", "1", "--limit", "2",
        ])
    };
    let first = run(0);
    assert!(first.status.success(), "{}", stderr(&first));
    let again = run(0);
    assert!(again.status.success(), "{}", stderr(&again));
    assert!(stderr(&again).contains("2 answered before, 0 to ask"), "{}", stderr(&again));
    let cut = run(40);
    assert_eq!(cut.status.code(), Some(1), "answers made from uncut passages were resumed: {}", stderr(&cut));
    assert!(stderr(&cut).contains("prompt settings"), "{}", stderr(&cut));
}
