//! The `dpr` and `taser` encoder plugins through the real ABI, on the real all-MiniLM-L6-v2.

use rak_core::abi::Role;
use rak_e2e::*;
use rak_host::{Registry, Source};
use serde_json::json;
use std::path::{Path, PathBuf};
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
    let found = Tensor::read_safetensors(&f).unwrap().into_iter().find(|(n, _)| n == name);
    found.unwrap_or_else(|| panic!("{} has no {name}: stale, rerun scripts/test.sh", f.display())).1
}

fn fixture_texts() -> Vec<String> {
    let f = root().join(".cache/fixtures/minilm/texts.json");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(f).unwrap()).unwrap();
    v["texts"].as_array().unwrap().iter().map(|t| t.as_str().unwrap().to_string()).collect()
}

fn max_abs(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

/// One `adamw` step (lr 1e-3) through the ABI on the gradients the parameters hold.
fn adamw_step(reg: &Registry, params: &[(String, Tensor)], settings: serde_json::Value) {
    let grads: Vec<(String, Tensor)> = params.iter().map(|(n, t)| (n.clone(), t.grad())).collect();
    let ctx = rak_core::plugin::StepContext { lr: 1e-3, ..Default::default() };
    let mut opt = reg.optimizer("adamw", &settings).unwrap();
    rak_core::plugin::optimizer_step(opt.as_mut(), params, vec![("t".into(), 0.0, grads)], ctx).unwrap();
}

/// Embeddings of `texts` from the checkpoint `ckpt` as transformers and sentence-transformers
/// load it (`scripts/fixtures/hf_load_check.py`), by name.
fn hf_load_check(work: &Path, ckpt: &Path, texts: &[String]) -> std::collections::HashMap<String, Tensor> {
    let texts_file = work.join("texts.json");
    std::fs::write(&texts_file, serde_json::to_string(texts).unwrap()).unwrap();
    let out = work.join("hf.safetensors");
    let status = std::process::Command::new(python())
        .arg(root().join("scripts/fixtures/hf_load_check.py"))
        .args(["--model", ckpt.to_str().unwrap(), "--texts", texts_file.to_str().unwrap(), "--out", out.to_str().unwrap()])
        .status()
        .unwrap();
    assert!(status.success());
    Tensor::read_safetensors(&out).unwrap().into_iter().collect()
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

/// TACO's prefix in BERT form against transformers: each query as the pair (TASK, query),
/// mean-pooled over every token, and with `pool_task_prefix: false` over `[CLS]` and the
/// query's segment only (scripts/fixtures/minilm_reference.py). Passages never get a prefix.
/// In training (MiniLM's dropout 0.1), a text's masks follow its key, not its batch (texts of
/// different lengths, so the batch pads): what keeps a data-parallel run equal to one process.
#[test]
fn dpr_keyed_dropout_follows_each_text_not_its_batch() {
    let reg = registry();
    let texts: Vec<String> = fixture_texts().into_iter().take(6).collect();
    let mut enc = reg.encoder("dpr", &json!({"model": minilm()})).unwrap();
    check_keyed_dropout(enc.as_mut(), &texts, Role::Passage, None, 1e-5);
    let mut taser = reg.encoder("taser", &json!({"model": minilm()})).unwrap();
    check_keyed_dropout(taser.as_mut(), &texts, Role::Query, None, 1e-5);
}

/// Batches announced through `prepare` (tokenised on the plugin's own thread) encode as
/// tokenised inline, for both plugins, MT-DPR's query tweaks on.
#[test]
fn dpr_and_taser_tokenised_ahead_encode_as_inline() {
    let reg = registry();
    let texts: Vec<String> = fixture_texts().into_iter().take(6).collect();
    for plugin in ["dpr", "taser"] {
        let settings = |ahead: bool| json!({"model": minilm(), "question_mark": true, "task_markers": {"squad": "[unused0]"}, "tokenize_ahead": ahead});
        let mut ahead = reg.encoder(plugin, &settings(true)).unwrap();
        let mut inline = reg.encoder(plugin, &settings(false)).unwrap();
        check_tokenized_ahead(ahead.as_mut(), inline.as_mut(), &texts, "squad");
    }
}

#[test]
fn dpr_task_prefix_and_its_pooling_equal_transformers() {
    let reg = registry();
    let texts = fixture_texts();
    let tasks = ["fever", "squad", "vitaminc", "wikidata"];
    let encode_queries = |settings: serde_json::Value| {
        let mut enc = reg.encoder("dpr", &settings).unwrap();
        let rows: Vec<Tensor> = tasks
            .iter()
            .enumerate()
            .map(|(k, task)| {
                let qs: Vec<&str> = texts[32 + 8 * k..32 + 8 * (k + 1)].iter().map(String::as_str).collect();
                enc.encode(&qs, Role::Query, Some(task), false).unwrap()
            })
            .collect();
        (Tensor::cat(&rows, 0), enc)
    };
    let (pooled_all, _) = encode_queries(json!({"model": minilm(), "task_prefix": true}));
    let diff = max_abs(&pooled_all, &reference("prefix_mean"));
    assert!(diff < 1e-5, "prefix pooled with its tokens: max abs diff to transformers {diff}");
    let (query_only, mut enc) = encode_queries(json!({"model": minilm(), "task_prefix": true, "pool_task_prefix": false}));
    let diff = max_abs(&query_only, &reference("prefix_query_mean"));
    assert!(diff < 1e-5, "prefix left out of the mean: max abs diff to transformers {diff}");
    assert!(max_abs(&query_only, &pooled_all) > 1e-3, "the two poolings differ");
    // The setting touches prefixed queries only: passages and task-less queries are as before.
    let mut plain = reg.encoder("dpr", &json!({"model": minilm()})).unwrap();
    for (role, task) in [(Role::Passage, Some("squad")), (Role::Query, None)] {
        let want = plain.encode(&["Super Bowl 50"], role, task, false).unwrap();
        assert!(max_abs(&enc.encode(&["Super Bowl 50"], role, task, false).unwrap(), &want) < 1e-6, "{role:?} {task:?}");
    }
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
    adamw_step(&reg, &params, json!({}));

    let dir = TempDir::new("dpr-roundtrip");
    let ckpt = dir.path().join("ckpt");
    enc.save(&ckpt).unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer.json", "rak_encoder.json", "modules.json"] {
        assert!(ckpt.join(f).exists(), "{f} saved");
    }
    let texts = vec!["Who won Super Bowl 50?".to_string(), "Tuscany is a region of central Italy.".to_string(), "short".into()];
    let hf = hf_load_check(dir.path(), &ckpt, &texts);

    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let mut reloaded = reg.encoder("dpr", &json!({"model": ckpt})).unwrap();
    assert_eq!(reloaded.info().unwrap()["pooling"], "cls", "saved settings are reloaded");
    let ours = reloaded.encode(&refs, Role::Passage, None, false).unwrap();
    let diff = max_abs(&ours, &hf["cls"]);
    assert!(diff < 1e-5, "transformers on the saved checkpoint, max abs diff {diff}");
    let before = enc.encode(&refs, Role::Passage, None, false).unwrap();
    assert!(max_abs(&before, &ours) < 1e-6, "reloaded equals saved");
    let mut untrained = reg.encoder("dpr", &json!({"model": minilm(), "pooling": "cls", "normalize": false})).unwrap();
    let diff = max_abs(&untrained.encode(&refs, Role::Passage, None, false).unwrap(), &ours);
    assert!(diff > 1e-4, "the saved checkpoint holds the trained weights, not the original ones (diff {diff})");
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

    // TASER's [CLS] default yields to what a checkpoint saved: one trained with mean pooling
    // (a stage override) loads with it.
    let mean = reg.encoder("taser", &json!({"model": m, "pooling": "mean", "normalize": true})).unwrap();
    let dir = TempDir::new("taser-save-mean");
    mean.save(dir.path()).unwrap();
    let info = reg.encoder("taser", &json!({"model": dir.path()})).unwrap().info().unwrap();
    assert_eq!((&info["pooling"], &info["normalize"]), (&json!("mean"), &json!(true)), "{info}");

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

// ---------------------------------------------------------------------------------------------
// A passage's embedding does not depend on its batchmates
// ---------------------------------------------------------------------------------------------

/// 64 passages of varied lengths (the minilm fixture's texts, 4 to 256 tokens), every other
/// one with a title, so a batch mixes `(title, text)` pairs and lone texts.
fn mixed_passages() -> Vec<String> {
    let titles = ["Super Bowl 50", "Warsaw", "Nikola Tesla", "Normans"];
    fixture_texts()
        .iter()
        .enumerate()
        .map(|(i, t)| if i % 2 == 0 { rak_core::encoders::passage_string(titles[i / 2 % titles.len()], t) } else { t.clone() })
        .collect()
}

/// Embeddings of `texts` encoded in `order`, put back in the texts' order.
fn encode_in_order(enc: &mut Box<dyn rak_core::plugin::Encoder>, texts: &[String], order: &[usize], batch: usize) -> Tensor {
    let mut rows: Vec<Option<Tensor>> = texts.iter().map(|_| None).collect();
    for chunk in order.chunks(batch) {
        let refs: Vec<&str> = chunk.iter().map(|&i| texts[i].as_str()).collect();
        let out = enc.encode(&refs, Role::Passage, None, false).unwrap();
        for (k, &i) in chunk.iter().enumerate() {
            rows[i] = Some(out.get(k as i64));
        }
    }
    Tensor::stack(&rows.into_iter().map(Option::unwrap).collect::<Vec<_>>(), 0)
}

/// One at a time (plain path), all 64 in one batch (over `onednn::MIN_ROWS` tokens: the
/// oneDNN path) and in a shuffled order give the same embedding to every passage, titled or not.
fn assert_batch_independent(plugin: &str) {
    let mut enc = registry().encoder(plugin, &json!({"model": minilm()})).unwrap();
    let texts = mixed_passages();
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let lengths = enc.token_lengths(&refs, Role::Passage, None).unwrap().expect("token lengths");
    let longest = *lengths.iter().max().unwrap() as i64;
    assert!(64 * longest >= rak_core::models::onednn::MIN_ROWS && longest < rak_core::models::onednn::MIN_ROWS);
    let order: Vec<usize> = (0..texts.len()).collect();
    let alone = encode_in_order(&mut enc, &texts, &order, 1);
    let together = encode_in_order(&mut enc, &texts, &order, texts.len());
    let shuffled: Vec<usize> = (0..texts.len()).map(|i| i * 37 % texts.len()).collect();
    let reordered = encode_in_order(&mut enc, &texts, &shuffled, texts.len());
    let in_eights = encode_in_order(&mut enc, &texts, &shuffled, 8);
    for (what, got) in [("one batch of 64", &together), ("a shuffled batch", &reordered), ("shuffled batches of 8", &in_eights)] {
        let worst = (0..texts.len() as i64).map(|i| (max_abs(&got.get(i), &alone.get(i)), i)).fold((0.0, 0), |a, b| if b.0 > a.0 { b } else { a });
        let passage: String = texts[worst.1 as usize].chars().take(60).collect();
        assert!(worst.0 < 1e-5, "{plugin}: {what} vs one at a time: max abs diff {} (passage {}: {passage:?}...)", worst.0, worst.1);
    }
}

#[test]
fn dpr_passage_embedding_does_not_depend_on_batchmates() {
    assert_batch_independent("dpr");
}

#[test]
fn taser_passage_embedding_does_not_depend_on_batchmates() {
    assert_batch_independent("taser");
}

// ---------------------------------------------------------------------------------------------
// sentence-transformers 6.2 checkpoints
// ---------------------------------------------------------------------------------------------

/// The checkpoint `scripts/fixtures/st62_reference.py` saved with sentence-transformers 6.2
/// (perturbed MiniLM weights), its texts, and ST's own embeddings of them.
fn st62() -> (PathBuf, Vec<String>, Tensor) {
    let dir = root().join(".cache/fixtures/st62");
    let f = dir.join("expected.safetensors");
    assert!(f.exists(), "{} missing: run scripts/test.sh", f.display());
    let meta: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("texts.json")).unwrap()).unwrap();
    let texts = meta["texts"].as_array().unwrap().iter().map(|t| t.as_str().unwrap().to_string()).collect();
    let expected = Tensor::read_safetensors(f).unwrap().into_iter().find(|(n, _)| n == "st_embeddings").unwrap().1;
    (dir.join("model"), texts, expected)
}

fn assert_st62_settings(info: &serde_json::Value) {
    assert_eq!(info["pooling"], "mean");
    assert_eq!(info["normalize"], true);
    assert_eq!(info["max_length"], 200, "max_seq_length from tokenizer_config.json's model_max_length");
}

/// The 6.2 format (`"pooling_mode": "mean"`, no `max_seq_length` in sentence_bert_config.json,
/// new module type paths) is read as sentence-transformers reads it.
#[test]
fn dpr_on_a_sentence_transformers_6_2_checkpoint_equals_sentence_transformers() {
    let (model, texts, expected) = st62();
    let mut enc = registry().encoder("dpr", &json!({"model": model})).unwrap();
    assert_st62_settings(&enc.info().unwrap());
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let got = enc.encode(&refs, Role::Passage, None, false).unwrap();
    let diff = max_abs(&got, &expected);
    assert!(diff < 1e-5, "max abs diff to sentence-transformers 6.2 {diff}");
}

/// Saving an encoder made from a 6.2 checkpoint keeps what sentence-transformers needs: the
/// saved directory alone (without rak_encoder.json) gives the same settings, and
/// sentence-transformers itself loads it and computes the same embeddings.
#[test]
fn dpr_saved_from_a_sentence_transformers_6_2_checkpoint_keeps_its_files() {
    let (model, texts, expected) = st62();
    let reg = registry();
    let enc = reg.encoder("dpr", &json!({"model": model})).unwrap();
    let dir = TempDir::new("st62-save");
    let ckpt = dir.path().join("ckpt");
    enc.save(&ckpt).unwrap();
    for f in ["modules.json", "1_Pooling/config.json", "2_Normalize/config.json", "sentence_bert_config.json", "tokenizer_config.json", "config_sentence_transformers.json"] {
        assert!(ckpt.join(f).exists(), "{f} not saved");
    }
    std::fs::remove_file(ckpt.join(rak_core::encoders::bert::SETTINGS_FILE)).unwrap();
    let mut reloaded = reg.encoder("dpr", &json!({"model": ckpt})).unwrap();
    assert_st62_settings(&reloaded.info().unwrap());
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let diff = max_abs(&reloaded.encode(&refs, Role::Passage, None, false).unwrap(), &expected);
    assert!(diff < 1e-5, "reloaded without rak_encoder.json: max abs diff {diff}");

    let st = hf_load_check(dir.path(), &ckpt, &texts).remove("sentence_transformers").expect("ST ran");
    let diff = max_abs(&st, &expected);
    assert!(diff < 1e-5, "sentence-transformers on the saved directory: max abs diff {diff}");
}

// ---------------------------------------------------------------------------------------------
// Training through the ABI
// ---------------------------------------------------------------------------------------------

const QUERIES: [&str; 3] = ["who won super bowl 50?", "where is tuscany", "when was nikola tesla born"];
const PASSAGES: [&str; 3] = [
    "Super Bowl 50\u{1f}The Denver Broncos won Super Bowl 50.",
    "Tuscany is a region in central Italy.",
    "Nikola Tesla\u{1f}Tesla was born on 10 July 1856.",
];

/// Sum of |grad| of the named parameter (0 when it has none); panics on a non-finite gradient.
fn grad_norm(params: &[(String, Tensor)], name: &str) -> f64 {
    let (_, t) = params.iter().find(|(n, _)| n == name).unwrap_or_else(|| panic!("no parameter {name}"));
    let g = t.grad();
    if !g.defined() {
        return 0.0;
    }
    assert!(bool::try_from(g.isfinite().all()).unwrap(), "{name}: non-finite gradient");
    g.abs().sum(Kind::Double).double_value(&[])
}

fn zero_grads(params: &[(String, Tensor)]) {
    for (_, t) in params {
        let g = t.grad();
        if g.defined() {
            let _ = g.detach().zero_();
        }
    }
}

/// A loss that depends on the embeddings of one role only (a fixed direction, since the
/// embeddings are normalised and their norms carry no gradient).
fn one_role_loss(enc: &mut Box<dyn rak_core::plugin::Encoder>, role: Role) -> Tensor {
    let texts: &[&str] = if role == Role::Query { &QUERIES } else { &PASSAGES };
    let e = enc.encode(texts, role, Some("nq"), true).unwrap();
    assert!(e.requires_grad(), "{role:?}: encode(train=true) is attached to the graph");
    (&e * Tensor::ones_like(&e).cumsum(1, Kind::Float).sin()).sum(Kind::Float)
}

/// TASER's experts: a query loss reaches the query expert only, a passage loss the passage
/// expert only (block 3, the first specialised one).
fn assert_experts_get_their_role(enc: &mut Box<dyn rak_core::plugin::Encoder>, params: &[(String, Tensor)]) {
    let expert = |e: &str| format!("encoder.layer.2.{e}.intermediate.dense.weight");
    for (role, mine, other) in [(Role::Query, "q_ffn", "p_ffn"), (Role::Passage, "p_ffn", "q_ffn")] {
        zero_grads(params);
        one_role_loss(enc, role).backward();
        assert!(grad_norm(params, &expert(mine)) > 0.0, "{role:?} loss: no gradient for {mine}");
        assert_eq!(grad_norm(params, &expert(other)), 0.0, "{role:?} loss reached {other}");
    }
    zero_grads(params);
}

/// A contrastive loss on `encode(train=true)` fills the gradients of the parameters the plugin
/// hands out, and one AdamW step through the optimizer plugin changes them and the encoder.
fn assert_one_training_step_learns(plugin: &str) {
    let reg = registry();
    let mut enc = reg.encoder(plugin, &json!({"model": minilm()})).unwrap();
    let params = enc.parameters().unwrap();
    if plugin == "taser" {
        assert_experts_get_their_role(&mut enc, &params);
    }
    let before_out = enc.encode(&PASSAGES, Role::Passage, None, false).unwrap();
    tch::manual_seed(0);
    let q = enc.encode(&QUERIES, Role::Query, Some("nq"), true).unwrap();
    let p = enc.encode(&PASSAGES, Role::Passage, None, true).unwrap();
    // Cosine scores at temperature 0.05: taser's CLS embeddings are not normalised, and raw
    // inner products of 30-60 saturate the softmax (a zero loss in f32, and no gradient).
    let unit = |t: &Tensor| t / t.norm_scalaropt_dim(2, [-1], true);
    let scores = unit(&q).matmul(&unit(&p).tr()).g_mul_scalar(20.0);
    let loss = scores.log_softmax(-1, Kind::Float).diagonal(0, 0, 1).mean(Kind::Float).neg();
    loss.backward();
    let mut watched = vec!["embeddings.word_embeddings.weight", "encoder.layer.5.attention.output.dense.weight"];
    watched.push(if plugin == "taser" { "encoder.layer.5.p_ffn.output.dense.weight" } else { "encoder.layer.5.output.dense.weight" });
    if plugin == "taser" {
        watched.push("encoder.layer.5.q_ffn.output.dense.weight");
    }
    for name in &watched {
        assert!(grad_norm(&params, name) > 0.0, "{plugin}: no gradient for {name}");
    }
    let copy = |name: &str| params.iter().find(|(n, _)| n == name).unwrap().1.detach().copy();
    let before: Vec<Tensor> = watched.iter().map(|n| copy(n)).collect();
    adamw_step(&reg, &params, json!({"weight_decay": 0.0}));
    for (name, old) in watched.iter().zip(&before) {
        assert!(max_abs(&copy(name), old) > 1e-5, "{plugin}: the step left {name} unchanged");
    }
    let after_out = enc.encode(&PASSAGES, Role::Passage, None, false).unwrap();
    assert!(max_abs(&after_out, &before_out) > 1e-4, "{plugin}: the step did not change the embeddings");
}

#[test]
fn dpr_one_training_step_through_the_abi_learns() {
    assert_one_training_step_learns("dpr");
}

#[test]
fn taser_one_training_step_through_the_abi_learns() {
    assert_one_training_step_learns("taser");
}
