//! The `dpr` and `taser` encoder plugins through the real ABI, on the real all-MiniLM-L6-v2.

use rak_core::abi::Role;
use rak_e2e::*;
use rak_host::{Registry, Source};
use serde_json::json;
use std::path::PathBuf;
use tch::{Kind, Tensor};

fn minilm() -> PathBuf {
    let d = root().join(".cache/models/all-MiniLM-L6-v2");
    assert!(d.join("model.safetensors").exists(), "{} missing: run scripts/test.sh", d.display());
    d
}

fn registry() -> Registry {
    Registry::discover(&[Source::Dir(release_dir())]).unwrap()
}

fn reference(name: &str) -> Tensor {
    let f = root().join(".cache/fixtures/minilm/expected.safetensors");
    assert!(f.exists(), "{} missing: run scripts/test.sh", f.display());
    Tensor::read_safetensors(f).unwrap().into_iter().find(|(n, _)| n == name).unwrap().1
}

fn fixture_texts() -> Vec<String> {
    let f = root().join(".cache/fixtures/minilm/texts.json");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(f).unwrap()).unwrap();
    v["texts"].as_array().unwrap().iter().map(|t| t.as_str().unwrap().to_string()).collect()
}

fn max_abs(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

fn python() -> PathBuf {
    root().join(".venv/bin/python")
}

/// Embeddings through the ABI equal sentence-transformers' on 64 real texts in one batch: the
/// encoder follows the checkpoint's modules.json (mean pooling, Normalize, max_seq_length 256).
#[test]
fn dpr_on_minilm_equals_sentence_transformers() {
    let mut enc = registry().encoder("dpr", &json!({"model": minilm()})).unwrap();
    let info = enc.info().unwrap();
    assert_eq!(info["pooling"], "mean");
    assert_eq!(info["normalize"], true);
    assert_eq!(info["max_length"], 256);
    let texts = fixture_texts();
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let got = enc.encode(&refs, Role::Passage, None, false).unwrap();
    let diff = max_abs(&got, &reference("st_embeddings"));
    assert!(diff < 1e-5, "max abs diff to sentence-transformers {diff}");
}

/// Train one step, save, and load the directory back with transformers and
/// sentence-transformers: same embeddings as the plugin computes after reloading.
#[test]
fn dpr_checkpoint_round_trips_through_transformers() {
    let reg = registry();
    let mut enc = reg.encoder("dpr", &json!({"model": minilm(), "pooling": "cls", "normalize": false})).unwrap();
    let params = enc.parameters().unwrap();
    let q = enc.encode(&["who won super bowl 50?"], Role::Query, Some("squad"), true).unwrap();
    let p = enc.encode(&["Super Bowl 50 was won by Denver", "Tuscany is in Italy"], Role::Passage, None, true).unwrap();
    q.matmul(&p.tr()).log_softmax(-1, Kind::Float).get(0).get(0).neg().backward();
    let tensors: Vec<Tensor> = params.iter().map(|(_, t)| t.shallow_clone()).collect();
    let grads: Vec<Tensor> = tensors.iter().map(|t| t.grad()).collect();
    reg.optimizer("adamw", &json!({})).unwrap().step(&tensors, &[grads], 1e-3).unwrap();

    let dir = TempDir::new("dpr-roundtrip");
    let ckpt = dir.path().join("ckpt");
    enc.save(&ckpt).unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer.json", "rak_encoder.json", "modules.json"] {
        assert!(ckpt.join(f).exists(), "{f} saved");
    }
    let texts = vec!["Who won Super Bowl 50?".to_string(), "Tuscany is a region of central Italy.".to_string(), "short".into()];
    let texts_file = dir.path().join("texts.json");
    std::fs::write(&texts_file, serde_json::to_string(&texts).unwrap()).unwrap();
    let out = dir.path().join("hf.safetensors");
    let status = std::process::Command::new(python())
        .arg(root().join("scripts/fixtures/hf_load_check.py"))
        .args(["--model", ckpt.to_str().unwrap(), "--texts", texts_file.to_str().unwrap(), "--out", out.to_str().unwrap()])
        .status()
        .unwrap();
    assert!(status.success());
    let hf: std::collections::HashMap<String, Tensor> = Tensor::read_safetensors(&out).unwrap().into_iter().collect();

    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let mut reloaded = reg.encoder("dpr", &json!({"model": ckpt})).unwrap();
    assert_eq!(reloaded.info().unwrap()["pooling"], "cls", "saved settings are reloaded");
    let ours = reloaded.encode(&refs, Role::Passage, None, false).unwrap();
    let diff = max_abs(&ours, &hf["cls"]);
    assert!(diff < 1e-5, "transformers on the saved checkpoint, max abs diff {diff}");
    let before = enc.encode(&refs, Role::Passage, None, false).unwrap();
    assert!(max_abs(&before, &ours) < 1e-6, "reloaded equals saved");
    // sentence-transformers reads the same directory with its own settings (mean + normalize).
    let mut st_like = reg.encoder("dpr", &json!({"model": ckpt, "pooling": "mean", "normalize": true})).unwrap();
    let diff = max_abs(&st_like.encode(&refs, Role::Passage, None, false).unwrap(), &hf["sentence_transformers"]);
    assert!(diff < 1e-5, "sentence-transformers on the saved checkpoint, max abs diff {diff}");
}

#[test]
fn dpr_two_towers_and_mtdpr_query_tweaks() {
    let reg = registry();
    let m = minilm();
    let mut shared = reg.encoder("dpr", &json!({"model": m, "pooling": "cls", "normalize": false})).unwrap();
    let mut two = reg.encoder("dpr", &json!({"model": m, "passage_model": m, "pooling": "cls", "normalize": false})).unwrap();
    assert_eq!(two.info().unwrap()["towers"], 2);
    assert_eq!(two.info().unwrap()["parameters"].as_i64().unwrap(), 2 * shared.info().unwrap()["parameters"].as_i64().unwrap());
    let a = shared.encode(&["Super Bowl 50"], Role::Passage, None, false).unwrap();
    let b = two.encode(&["Super Bowl 50"], Role::Passage, None, false).unwrap();
    assert!(max_abs(&a, &b) < 1e-6, "same weights in both towers");

    // A title is encoded as a (title, text) pair: different from the text alone.
    let titled = rak_core::encoders::passage_string("Super Bowl 50", "The game was played in 2016.");
    let with_title = shared.encode(&[titled.as_str()], Role::Passage, None, false).unwrap();
    let without = shared.encode(&["The game was played in 2016."], Role::Passage, None, false).unwrap();
    assert!(max_abs(&with_title, &without) > 1e-3);

    // MT-DPR: `?` on QA queries and a task marker token.
    let mut mt = reg
        .encoder("dpr", &json!({"model": m, "pooling": "cls", "normalize": false, "question_mark": true, "task_markers": {"fever": "[unused1]"}}))
        .unwrap();
    let q = mt.encode(&["who won super bowl 50"], Role::Query, Some("squad"), false).unwrap();
    let q_mark = shared.encode(&["who won super bowl 50?"], Role::Query, Some("squad"), false).unwrap();
    assert!(max_abs(&q, &q_mark) < 1e-6, "QA queries get a ? appended");
    let f = mt.encode(&["Egypt is in Africa"], Role::Query, Some("fever"), false).unwrap();
    let plain = shared.encode(&["Egypt is in Africa"], Role::Query, Some("fever"), false).unwrap();
    assert!(max_abs(&f, &plain) > 1e-4, "the fever marker changes the query");

    let err = reg.encoder("dpr", &json!({"model": m, "task_markers": {"x": "[not-a-token]"}})).err().unwrap();
    assert!(format!("{err:#}").contains("[not-a-token]"));
}

#[test]
fn taser_specialises_every_third_block_and_routes_by_role() {
    let reg = registry();
    let m = minilm();
    let mut taser = reg.encoder("taser", &json!({"model": m})).unwrap();
    let mut dpr = reg.encoder("dpr", &json!({"model": m, "pooling": "cls", "normalize": false})).unwrap();
    let info = taser.info().unwrap();
    assert_eq!(info["taser_every"], 3);
    // MiniLM: 6 blocks, so blocks 3 and 6 get a second FFN (intermediate + output + LayerNorm).
    let ffn = 384 * 1536 + 1536 + 1536 * 384 + 384 + 2 * 384;
    let base = dpr.info().unwrap()["parameters"].as_i64().unwrap();
    assert_eq!(info["parameters"].as_i64().unwrap(), base + 2 * ffn);
    let lr = &info["lr_scale"];
    assert!((lr["embeddings.word_embeddings.weight"].as_f64().unwrap() - 0.8f64.powi(8)).abs() < 1e-12);
    assert!((lr["encoder.layer.5.p_ffn.output.dense.weight"].as_f64().unwrap() - 0.8).abs() < 1e-12);
    assert!((lr["encoder.layer.0.attention.self.query.weight"].as_f64().unwrap() - 0.8f64.powi(6)).abs() < 1e-12);

    // Both experts start from the pretrained FFN: TASER equals BERT until trained.
    let t = ["Who won Super Bowl 50?"];
    let q0 = taser.encode(&t, Role::Query, None, false).unwrap();
    let p0 = taser.encode(&t, Role::Passage, None, false).unwrap();
    assert!(max_abs(&q0, &p0) < 1e-6 && max_abs(&q0, &dpr.encode(&t, Role::Query, None, false).unwrap()) < 1e-6);

    // Changing the query expert changes queries only.
    let params = taser.parameters().unwrap();
    let (_, w) = params.iter().find(|(n, _)| n == "encoder.layer.2.q_ffn.intermediate.dense.weight").expect("q expert");
    tch::no_grad(|| {
        let _ = w.shallow_clone().g_mul_scalar_(1.5);
    });
    let q1 = taser.encode(&t, Role::Query, None, false).unwrap();
    let p1 = taser.encode(&t, Role::Passage, None, false).unwrap();
    assert!(max_abs(&q0, &q1) > 1e-4 && max_abs(&p0, &p1) < 1e-6);

    // Save and reload keeps the experts apart.
    let dir = TempDir::new("taser-save");
    taser.save(dir.path()).unwrap();
    let mut again = reg.encoder("taser", &json!({"model": dir.path()})).unwrap();
    assert!(max_abs(&again.encode(&t, Role::Query, None, false).unwrap(), &q1) < 1e-6);
    assert!(max_abs(&again.encode(&t, Role::Passage, None, false).unwrap(), &p1) < 1e-6);

    let mut t2 = reg.encoder("taser", &json!({"model": m, "taser_every": 2})).unwrap();
    assert_eq!(t2.info().unwrap()["parameters"].as_i64().unwrap(), base + 3 * ffn);
    let _ = t2.encode(&t, Role::Query, None, false).unwrap();
}

#[test]
fn bad_encoder_settings_are_errors_naming_the_plugin() {
    let reg = registry();
    let e = reg.encoder("dpr", &json!({})).err().unwrap();
    assert!(format!("{e:#}").contains("\"model\""), "{e:#}");
    let e = reg.encoder("dpr", &json!({"model": "/nonexistent/model"})).err().unwrap();
    let msg = format!("{e:#}");
    assert!(msg.contains("dpr") && msg.contains("/nonexistent/model/config.json"), "{msg}");
    let e = reg.encoder("dpr", &json!({"model": minilm(), "device": "cuda:7"})).err().unwrap();
    assert!(format!("{e:#}").contains("cuda:7"));
    let e = reg.encoder("taser", &json!({"model": minilm(), "taser_every": 0})).err().unwrap();
    assert!(format!("{e:#}").contains("taser_every"));
}
