//! `host augment --target openai` against a real server: llama.cpp's `llama-server` serving
//! SmolLM2-135M-Instruct on 127.0.0.1 (built and fetched by `scripts/llama-server.sh`, once per
//! machine). Multiple choice is answered from the letters' log-probabilities, short answers by
//! greedy generation, a rerun is served from the cache, and the connector's forced-token
//! log-likelihood agrees with the log-probabilities the server reports while generating.

use rak_e2e::*;
use rak_host::{Registry, Source};
use serde_json::{json, Value};
use std::path::Path;

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

fn augment(args: &[&str]) -> (Value, Vec<Value>, String) {
    let out = host(args);
    assert!(out.status.success(), "{}", stderr(&out));
    let output = args.iter().position(|a| *a == "--output").map(|i| args[i + 1]).unwrap();
    let recs = std::fs::read_to_string(output).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    (serde_json::from_str(&stdout(&out)).unwrap(), recs, stderr(&out))
}

#[test]
fn real_server_answers_multiple_choice_and_short_questions() {
    let llama = LlamaServer::start("llama-state", &[("LLAMA_PARALLEL", "2")]);
    let dir = TempDir::new("augment-llama");
    let cache = dir.path().join("cache");
    let cfg = dir.path().join("recipe.toml");
    let shipped = std::fs::read_to_string(root().join("configs/augment/openai.toml")).unwrap();
    // The shipped recipe, with this test's cache and the vendored corpus.
    std::fs::write(
        &cfg,
        shipped
            .replace("concurrency = 4,", &format!("concurrency = 2, cache_dir = \"{}\",", p(&cache)))
            .replace("corpus = \"data/minikilt/corpus.jsonl\"", &format!("corpus = \"{}\"", p(&minikilt().join("corpus.jsonl")))),
    )
    .unwrap();
    let bm25 = dir.path().join("bm25");
    let out = host(&["index", "build", "--kind", "bm25", "--corpus", p(&minikilt().join("corpus.jsonl")), "--output", p(&bm25)]);
    assert!(out.status.success(), "{}", stderr(&out));
    let retriever = format!("bm25:{}", p(&bm25));
    let mc = minikilt().join("mc/dev.jsonl");
    let sq = minikilt().join("shortqa/dev.jsonl");

    // Multiple choice, closed book: every item answered from the letters' log-probabilities.
    let out1 = dir.path().join("mc.jsonl");
    let (summary, recs, _) = augment(&[
        "augment", "--target", "openai", "--config", p(&cfg), "--task", "mc", "--input", p(&mc), "--output", p(&out1),
        "--base-url", &llama.url, "--limit", "12",
    ]);
    assert_eq!((summary["answered"].as_u64(), summary["failed"].as_u64()), (Some(12), Some(0)));
    for r in &recs {
        assert_eq!(r["method"], "letter_logprobs", "{r}");
        let n = r["logprobs"].as_array().unwrap().len();
        assert!((2..=13).contains(&n));
        assert!(r["logprobs"].as_array().unwrap().iter().all(|v| v.as_f64().unwrap() <= 0.0));
        assert!(r["passages"].as_array().unwrap().is_empty());
    }

    // Short answers with three BM25 passages each.
    let out2 = dir.path().join("shortqa.jsonl");
    let (summary, recs, _) = augment(&[
        "augment", "--target", "openai", "--config", p(&cfg), "--task", "shortqa", "--input", p(&sq), "--output", p(&out2),
        "--base-url", &llama.url, "--retriever", &retriever, "--k", "3", "--limit", "12",
    ]);
    assert_eq!((summary["answered"].as_u64(), summary["failed"].as_u64()), (Some(12), Some(0)));
    assert!(summary["target_stats"]["prompt_tokens"].as_u64().unwrap() > 12 * 100, "three passages per prompt: {summary}");
    for r in &recs {
        assert_eq!(r["passages"].as_array().unwrap().len(), 3);
        assert_eq!(r["method"], "text");
        // No stop sequence: the answer is the reply's first non-empty line (a reply that begins
        // with a line break is read, not left empty).
        let first = r["raw"].as_str().unwrap().lines().map(str::trim).find(|l| !l.is_empty()).unwrap_or("");
        assert_eq!(r["answer"].as_str().unwrap(), first, "{r}");
    }

    // A rerun into a fresh file is answered from the cache alone, with the same answers.
    let out3 = dir.path().join("shortqa-again.jsonl");
    let (again, recs2, _) = augment(&[
        "augment", "--target", "openai", "--config", p(&cfg), "--task", "shortqa", "--input", p(&sq), "--output", p(&out3),
        "--base-url", &llama.url, "--retriever", &retriever, "--k", "3", "--limit", "12",
    ]);
    assert_eq!(again["target_stats"]["requests"], 0);
    assert_eq!(again["target_stats"]["cache_hits"], 12);
    let answers = |rs: &[Value]| {
        let mut v: Vec<(String, String)> = rs.iter().map(|r| (r["_id"].as_str().unwrap().into(), r["answer"].as_str().unwrap().into())).collect();
        v.sort();
        v
    };
    assert_eq!(answers(&recs), answers(&recs2));
}

/// log P(continuation | prompt) by forcing tokens (llama.cpp has no echo) equals the sum of
/// the log-probabilities the server reported while generating that continuation greedily.
#[test]
fn forced_continuation_loglikelihood_matches_generation_logprobs() {
    let llama = LlamaServer::start("llama-state", &[("LLAMA_PARALLEL", "2")]);
    let registry = Registry::discover(&[Source::Dir(release_dir())]).unwrap();
    let conn = registry.connector("openai", &json!({"base_url": llama.url, "cache": false})).unwrap();
    let prompt = "Q: What is the capital of France?\nA:";
    let gen = conn.complete(json!({"op": "complete", "prompt": prompt, "max_tokens": 4, "top_logprobs": 1})).unwrap();
    assert!(gen.get("error").is_none(), "{gen}");
    let positions = gen["positions"].as_array().unwrap();
    assert_eq!(positions.len(), 4, "{gen}");
    let text: String = positions.iter().map(|p| p["token"].as_str().unwrap()).collect();
    let want: f64 = positions.iter().map(|p| p["logprob"].as_f64().unwrap()).sum();
    let got = conn.complete(json!({"op": "continuation_logprob", "prompt": prompt, "continuation": text})).unwrap();
    assert_eq!(got["method"], "forced_logit_bias", "llama.cpp ignores echo: {got}");
    assert_eq!(got["tokens"], 4);
    let ll = got["logprob"].as_f64().unwrap();
    assert!((ll - want).abs() < 1e-3, "forced {ll} vs generated {want}");
    // An unlikely continuation scores lower than the model's own.
    let odd = conn.complete(json!({"op": "continuation_logprob", "prompt": prompt, "continuation": " Walrus banana"})).unwrap();
    assert!(odd["logprob"].as_f64().unwrap() < ll - 5.0, "{odd}");
    let stats = conn.complete(json!({"op": "stats"})).unwrap();
    assert_eq!(stats["cache_hits"], 0);
    assert!(stats["requests"].as_u64().unwrap() >= 1 + 1 + 2 + 4);
}
