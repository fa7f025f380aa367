//! BM25 as the papers used it (Lucene/Pyserini, k1 = 0.9, b = 0.4) against a Lucene-style
//! reference: PyPI `bm25s` (method `lucene`) with the same analysis, on every mini-KILT dev
//! query (scripts/fixtures/bm25_reference.py, outputs in `.cache/fixtures/bm25/`, made by
//! scripts/test.sh when missing). MRR@10 per task within 0.01, and the same top passage for at
//! least 97% of the queries (the rest differ by Lucene's one-byte length encoding, which
//! tantivy's norms follow and bm25s does not, reordering near-ties).

use rak_e2e::*;
use rak_retrieval::index::{Bm25Index, Bm25Params};
use std::collections::{HashMap, HashSet};
use std::io::BufRead;

fn lines(path: &std::path::Path) -> Vec<String> {
    let f = std::fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e} (run scripts/test.sh)", path.display()));
    std::io::BufReader::new(f).lines().map(Result::unwrap).collect()
}

#[test]
fn bm25_matches_bm25s_lucene_on_minikilt_dev() {
    let fixtures = root().join(".cache/fixtures/bm25");
    let reference: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixtures.join("reference.json")).expect("run scripts/test.sh")).unwrap();
    let params = Bm25Params { k1: reference["k1"].as_f64().unwrap() as f32, b: reference["b"].as_f64().unwrap() as f32 };
    assert_eq!(params, Bm25Params::default(), "the reference uses Pyserini's defaults");

    let data = minikilt();
    let docs = lines(&data.join("corpus.jsonl")).into_iter().map(|l| {
        let v: serde_json::Value = serde_json::from_str(&l).unwrap();
        (v["_id"].as_str().unwrap().to_string(), v["title"].as_str().unwrap_or("").to_string(), v["text"].as_str().unwrap_or("").to_string())
    });
    let dir = TempDir::new("bm25-parity");
    let index = Bm25Index::build(&dir.path().join("idx"), docs, params).unwrap();

    for (task, expected) in reference["tasks"].as_object().unwrap() {
        let tdir = data.join("tasks").join(task);
        let mut gold: HashMap<String, HashSet<String>> = HashMap::new();
        for l in lines(&tdir.join("qrels.dev.tsv")).iter().skip(1) {
            let f: Vec<&str> = l.split('\t').collect();
            gold.entry(f[0].to_string()).or_default().insert(f[1].to_string());
        }
        let mut top1: HashMap<String, String> = HashMap::new();
        for l in lines(&fixtures.join("runs").join(format!("{task}.dev.trec"))) {
            let f: Vec<&str> = l.split_whitespace().collect();
            if f[3] == "1" {
                top1.insert(f[0].to_string(), f[2].to_string());
            }
        }
        let (mut rr, mut n, mut same_top) = (0.0, 0usize, 0usize);
        for l in lines(&tdir.join("queries.dev.jsonl")) {
            let q: serde_json::Value = serde_json::from_str(&l).unwrap();
            let id = q["_id"].as_str().unwrap();
            let Some(g) = gold.get(id) else { continue };
            let hits = index.search(q["text"].as_str().unwrap(), 10).unwrap();
            rr += hits.iter().position(|(d, _)| g.contains(d)).map_or(0.0, |r| 1.0 / (r + 1) as f64);
            n += 1;
            same_top += usize::from(hits.first().map(|h| &h.0) == top1.get(id));
        }
        let mrr = rr / n as f64;
        let want = expected["mrr@10"].as_f64().unwrap();
        assert_eq!(n as u64, expected["queries"].as_u64().unwrap(), "{task}: query count");
        assert!((mrr - want).abs() <= 0.01, "{task}: MRR@10 {mrr:.4}, bm25s {want:.4}");
        let agree = same_top as f64 / n as f64;
        assert!(agree >= 0.97, "{task}: same top passage as bm25s for only {:.1}% of queries", 100.0 * agree);
        eprintln!("{task}: MRR@10 {mrr:.4} (bm25s {want:.4}), same top passage {:.1}%", 100.0 * agree);
    }
}
