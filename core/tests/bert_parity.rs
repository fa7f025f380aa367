//! BERT and tokenizer parity with Hugging Face on the real all-MiniLM-L6-v2 weights and real
//! mini-KILT text. Reference values come from `scripts/fixtures/minilm_reference.py`
//! (transformers 5.23, float32), which `scripts/test.sh` runs before the tests.

use rak_core::abi::Role;
use rak_core::models::bert::{BertConfig, BertInput, BertModel};
use rak_core::models::pooling::{pool, Pooling};
use rak_core::models::tokenizer::{Padding, TextTokenizer};
use std::path::PathBuf;
use tch::{Device, Tensor};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn model_dir() -> PathBuf {
    let d = root().join(".cache/models/all-MiniLM-L6-v2");
    assert!(d.join("model.safetensors").exists(), "{} missing: run scripts/test.sh (it fetches the model)", d.display());
    d
}

fn fixtures() -> PathBuf {
    let d = root().join(".cache/fixtures/minilm");
    assert!(d.join("expected.safetensors").exists(), "{} missing: run scripts/test.sh (it makes the references)", d.display());
    d
}

fn expected() -> std::collections::HashMap<String, Tensor> {
    Tensor::read_safetensors(fixtures().join("expected.safetensors")).unwrap().into_iter().collect()
}

fn texts() -> Vec<String> {
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixtures().join("texts.json")).unwrap()).unwrap();
    v["texts"].as_array().unwrap().iter().map(|t| t.as_str().unwrap().to_string()).collect()
}

fn max_abs(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

#[test]
fn tokenizer_ids_equal_the_python_fast_tokenizer_on_1200_corpus_lines() {
    let tok = TextTokenizer::load(&model_dir()).unwrap();
    let text = std::fs::read_to_string(fixtures().join("tokenizer_ids.jsonl")).unwrap();
    let mut checked = 0;
    for line in text.lines() {
        let row: serde_json::Value = serde_json::from_str(line).unwrap();
        let first = row["text"].as_str().unwrap();
        let second = row["text_pair"].as_str();
        let padding = if row["mode"] == "pad_max_length" { Padding::Fixed(128) } else { Padding::None };
        let pairs = second.map(|s| vec![s]);
        let enc = tok.encode(&[first], pairs.as_deref(), 128, padding).unwrap();
        for (field, got) in [("ids", &enc.input_ids), ("attention_mask", &enc.attention_mask), ("token_type_ids", &enc.token_type_ids)] {
            let want: Vec<i64> = row[field].as_array().unwrap().iter().map(|x| x.as_i64().unwrap()).collect();
            let got: Vec<i64> = got.view([-1]).try_into().unwrap();
            assert_eq!(got, want, "{field} differ for {}", row["id"]);
        }
        checked += 1;
    }
    assert!(checked >= 1000, "only {checked} lines");
}

#[test]
fn minilm_hidden_states_and_pooling_match_transformers() {
    let dir = model_dir();
    let model = BertModel::load(&dir, BertConfig::load(&dir).unwrap(), Device::Cpu).unwrap();
    let tok = TextTokenizer::load(&dir).unwrap();
    let texts = texts();
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let exp = expected();
    let enc = tok.encode(&refs, None, 128, Padding::Longest).unwrap();
    assert_eq!(enc.input_ids.size(), vec![64, 128]);
    assert!(enc.input_ids.equal(&exp["input_ids"]), "one padded batch tokenised as in Python");
    assert!(enc.attention_mask.equal(&exp["attention_mask"]));
    let input = BertInput { input_ids: enc.input_ids, attention_mask: enc.attention_mask.shallow_clone(), token_type_ids: enc.token_type_ids };
    // Without gradients the CPU forward runs on oneDNN's fused kernels (batches of at least
    // `onednn::MIN_ROWS` tokens; this one has 8,192); with them, on
    // libtorch's general layers (MKL, as transformers). Both must match transformers; oneDNN
    // sums in another order, so it gets 3e-5 on states of magnitude up to 6 (5e-6 relative).
    assert!(tch::no_grad(|| rak_core::models::onednn::usable(Device::Cpu, tch::Kind::Float)));
    let general = model.forward(&input, Role::Passage, false);
    let fused = tch::no_grad(|| model.forward(&input, Role::Passage, false));
    assert!(!rak_core::models::onednn::fell_back(), "the oneDNN path ran without falling back");
    // Padding positions are unconstrained in Python too; compare real tokens only.
    let m = enc.attention_mask.unsqueeze(-1).to_kind(tch::Kind::Float);
    for (path, states, tolerance) in [("general", general, 1e-5), ("oneDNN", fused, 3e-5)] {
        let diff = max_abs(&(&states * &m), &(&exp["last_hidden_state"] * &m));
        assert!(diff < tolerance, "{path} path: last_hidden_state max abs diff {diff}");
        let cls = pool(&states, &enc.attention_mask, Pooling::Cls, false);
        let diff = max_abs(&cls, &exp["cls"]);
        assert!(diff < tolerance, "{path} path: cls max abs diff {diff}");
        let mean = pool(&states, &enc.attention_mask, Pooling::Mean, false);
        let diff = max_abs(&mean, &exp["mean_pooled"]);
        assert!(diff < tolerance, "{path} path: mean_pooled max abs diff {diff}");
    }
}

#[test]
fn bad_checkpoints_name_the_file_and_tensor() {
    let dir = model_dir();
    let tmp = root().join("target").join(format!("bert-bad-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).unwrap();
    for f in ["config.json", "tokenizer.json"] {
        std::fs::copy(dir.join(f), tmp.join(f)).unwrap();
    }
    let load = || BertModel::load(&tmp, BertConfig::load(&tmp)?, Device::Cpu).map(|_| ());

    // Missing weights.
    let msg = format!("{:#}", load().unwrap_err());
    assert!(msg.contains("model.safetensors") && msg.contains(tmp.to_str().unwrap()), "{msg}");

    // Corrupt weights (truncated).
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    std::fs::write(tmp.join("model.safetensors"), &bytes[..bytes.len() / 3]).unwrap();
    let msg = format!("{:#}", load().unwrap_err());
    assert!(msg.contains("model.safetensors"), "{msg}");

    // A shape that disagrees with config.json.
    std::fs::write(tmp.join("model.safetensors"), &bytes).unwrap();
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    cfg["intermediate_size"] = 1000.into();
    std::fs::write(tmp.join("config.json"), cfg.to_string()).unwrap();
    let msg = format!("{:#}", load().unwrap_err());
    assert!(msg.contains("model.safetensors") && msg.contains("config.json implies") && msg.contains("1000"), "{msg}");

    // An unknown model_type.
    cfg["intermediate_size"] = 1536.into();
    cfg["model_type"] = "gpt2".into();
    std::fs::write(tmp.join("config.json"), cfg.to_string()).unwrap();
    let msg = format!("{:#}", load().unwrap_err());
    assert!(msg.contains("config.json") && msg.contains("gpt2"), "{msg}");

    // A missing tokenizer.
    std::fs::remove_file(tmp.join("tokenizer.json")).unwrap();
    let msg = format!("{:#}", TextTokenizer::load(&tmp).err().unwrap());
    assert!(msg.contains("tokenizer.json") && msg.contains("missing tokenizer"), "{msg}");
    let _ = std::fs::remove_dir_all(&tmp);
}

/// A passage is tokenised by its own form whatever its batchmates: titled ones as the pair
/// `[CLS] title [SEP] text [SEP]`, untitled ones as `[CLS] text [SEP]` (no empty title), each
/// row equal to the passage tokenised alone plus padding.
#[test]
fn passages_in_a_mixed_batch_are_tokenised_as_alone() {
    use rak_core::encoders::{bert::BertEncoder, passage_string};
    let enc = BertEncoder::create(serde_json::json!({"model": model_dir()}), Default::default()).unwrap();
    let texts = texts();
    let passages: Vec<String> =
        texts.iter().enumerate().map(|(i, t)| if i % 3 == 0 { passage_string("Super Bowl 50", t) } else { t.clone() }).collect();
    let refs: Vec<&str> = passages.iter().map(String::as_str).collect();
    let batch = enc.tokenize(&refs, Role::Passage, None).unwrap();
    let tok = TextTokenizer::load(&model_dir()).unwrap();
    let sep = tok.token_to_id("[SEP]").unwrap() as i64;
    for (i, p) in refs.iter().enumerate() {
        let alone = enc.tokenize(&[p], Role::Passage, None).unwrap();
        let n = alone.input_ids.size()[1];
        for (field, got, want) in [
            ("input_ids", &batch.input_ids, &alone.input_ids),
            ("attention_mask", &batch.attention_mask, &alone.attention_mask),
            ("token_type_ids", &batch.token_type_ids, &alone.token_type_ids),
        ] {
            assert!(got.get(i as i64).narrow(0, 0, n).equal(&want.get(0)), "passage {i} {field}: batch row differs from alone");
        }
        let ids: Vec<i64> = alone.input_ids.get(0).try_into().unwrap();
        let seps = ids.iter().filter(|&&t| t == sep).count();
        assert_eq!(seps, if i % 3 == 0 { 2 } else { 1 }, "passage {i}: {ids:?}");
    }
}

/// Batches handed to `prepare` are tokenised on another thread and taken by the encode call of
/// exactly those texts, role and task; the embeddings are those of tokenising inline, bit for
/// bit, training passes with keyed dropout included, and a batch that was not prepared (or
/// was prepared under another role) is tokenised inline.
#[test]
fn batches_tokenised_ahead_encode_as_tokenised_inline() {
    use rak_core::encoders::{bert::BertEncoder, passage_string};
    use rak_core::plugin::Encoder;
    let settings = |ahead: bool| serde_json::json!({"model": model_dir(), "task_prefix": true, "question_mark": true, "tokenize_ahead": ahead});
    let mut ahead = BertEncoder::create(settings(true), Default::default()).unwrap();
    let mut inline = BertEncoder::create(settings(false), Default::default()).unwrap();
    let texts = texts();
    let passages: Vec<String> = texts.iter().enumerate().map(|(i, t)| if i % 2 == 0 { passage_string("Super Bowl 50", t) } else { t.clone() }).collect();
    let passages: Vec<&str> = passages.iter().map(String::as_str).collect();
    let queries: Vec<&str> = texts.iter().map(|t| &t[..t.floor_char_boundary(60)]).collect();
    let keys: Vec<u64> = (1..=queries.len() as u64).collect();
    ahead.prepare(&passages, Role::Passage, None).unwrap();
    ahead.prepare(&queries, Role::Query, Some("squad")).unwrap();
    ahead.prepare(&queries, Role::Passage, None).unwrap();
    let q = ahead.encode_keyed(&queries, Role::Query, Some("squad"), &keys).unwrap();
    let p = ahead.encode(&passages, Role::Passage, None, false).unwrap();
    assert_eq!(ahead.tokenized_ahead(), 2);
    assert!(q.equal(&inline.encode_keyed(&queries, Role::Query, Some("squad"), &keys).unwrap()), "keyed training pass");
    assert!(p.equal(&inline.encode(&passages, Role::Passage, None, false).unwrap()), "passages");
    // The queries were prepared as passages, not as queries of another task.
    let other = ahead.encode(&queries, Role::Query, Some("fever"), false).unwrap();
    assert_eq!(ahead.tokenized_ahead(), 2);
    assert!(other.equal(&inline.encode(&queries, Role::Query, Some("fever"), false).unwrap()));
    assert_eq!(inline.tokenized_ahead(), 0, "off when asked");
}
