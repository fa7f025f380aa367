//! The T5 plugins through the real ABI (discovered in the release folder, as `host` finds them):
//! the `taco` encoder and the `fid` reader against the committed transformers fixtures
//! (tests/fixtures/t5, made by scripts/fixtures/make_t5_fixtures.py).

use rak_core::abi::Role;
use rak_core::plugin::{Encoder, Reader};
use rak_e2e::*;
use rak_host::{Registry, Source};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use tch::{Kind, Tensor};

const TOL: f64 = 1e-4;
const VARIANTS: [&str; 2] = ["t5-v1_0", "t5-v1_1"];

fn fixture(variant: &str) -> PathBuf {
    root().join("tests/fixtures/t5").join(variant)
}

fn expected(dir: &Path) -> HashMap<String, Tensor> {
    Tensor::read_safetensors(dir.join("expected.safetensors")).unwrap().into_iter().collect()
}

fn meta(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap()
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array().unwrap().iter().map(|s| s.as_str().unwrap().to_string()).collect()
}

fn registry() -> Registry {
    let _ = plugin_file("rak_encoder_taco");
    let _ = plugin_file("rak_reader_fid");
    Registry::discover(&[Source::Dir(release_dir())]).expect("discover plugins")
}

fn max_abs(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.size(), b.size(), "shape");
    (a.to_kind(Kind::Double) - b.to_kind(Kind::Double)).abs().max().double_value(&[])
}

fn rows(t: &Tensor) -> Vec<Vec<i64>> {
    Vec::<Vec<i64>>::try_from(t).unwrap()
}

fn f32s(v: &Value) -> Vec<f32> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

fn taco(reg: &Registry, settings: Value) -> Box<dyn Encoder> {
    reg.encoder("taco", &settings).expect("create taco through the ABI")
}

fn encode(enc: &mut Box<dyn Encoder>, texts: &[String], role: Role, task: Option<&str>) -> Tensor {
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    enc.encode(&refs, role, task, false).unwrap()
}

// ---------------------------------------------------------------------------------------------
// taco
// ---------------------------------------------------------------------------------------------

/// Passages (no prefix, whatever the task) are the plain ST5-EncDec embedding of their text.
#[test]
fn taco_passages_equal_fixture_st5_embedding() {
    let reg = registry();
    for variant in VARIANTS {
        let dir = fixture(variant);
        let (e, m) = (expected(&dir), meta(&dir));
        assert_eq!(m["tokenize"]["max_length"], 48, "fixture texts were tokenised with max_length 48");
        let mut enc = taco(&reg, json!({"model": dir, "max_length": 48}));
        let texts = strings(&m["texts"]);
        for task in [None, Some("nq"), Some("fever")] {
            let got = encode(&mut enc, &texts, Role::Passage, task);
            let d = max_abs(&got, &e["st5_embedding"]);
            println!("{variant} taco passages (task {task:?}) vs st5_embedding: max abs diff {d:.3e}");
            assert!(d <= TOL, "{variant} task {task:?}: {d}");
        }
        let info = enc.info().unwrap();
        assert_eq!(info["dim"], m["config"]["d_model"]);
        let n: i64 = enc.parameters().unwrap().iter().map(|(_, t)| t.numel() as i64).sum();
        assert_eq!(info["parameters"], n);
        assert!(enc.parameters().unwrap().iter().any(|(name, _)| name == "encoder.block.0.layer.0.SelfAttention.q.weight"));
    }
}

/// The prefix is exactly `"{TASK} <extra_id_1> "` before the query, changes the embedding, is
/// off without a task or with `task_prefix: false`, and never touches passages.
#[test]
fn taco_task_prefix_on_queries_only() {
    let reg = registry();
    let dir = fixture("t5-v1_1");
    let texts = strings(&meta(&dir)["texts"]);
    let settings = json!({"model": dir, "max_length": 64, "query_max_length": 64, "task_names": {"squad": "SQuAD-X"}});
    let mut enc = taco(&reg, settings.clone());
    let plain = encode(&mut enc, &texts, Role::Passage, None);
    let q_none = encode(&mut enc, &texts, Role::Query, None);
    assert!(max_abs(&q_none, &plain) < 1e-6, "a query without a task has no prefix");
    let cases = [("nq", "NQ"), ("NQ", "NQ"), ("triviaqa", "TQA"), ("hotpotqa", "HOPO"), ("zsre", "ZSRE"), ("fever", "FEVER"), ("squad", "SQuAD-X"), ("eli5", "ELI5")];
    for (task, name) in cases {
        let q = encode(&mut enc, &texts, Role::Query, Some(task));
        let d = max_abs(&q, &plain);
        assert!(d > 1e-3, "task {task}: the prefix should change the query embedding (diff {d})");
        let prefixed: Vec<String> = texts.iter().map(|t| format!("{name} <extra_id_1> {t}")).collect();
        let want = encode(&mut enc, &prefixed, Role::Passage, None);
        assert!(max_abs(&q, &want) < 1e-6, "task {task}: query is not \"{name} <extra_id_1> text\"");
        let p = encode(&mut enc, &texts, Role::Passage, Some(task));
        assert!(max_abs(&p, &plain) < 1e-6, "task {task}: passages must not get a prefix");
    }
    // The prefix really is the sentinel token, not its characters.
    let core = rak_core::encoders::taco::TacoEncoder::create(settings).unwrap();
    let ids = rows(&core.tokenize(&[texts[0].as_str()], Role::Query, Some("nq")).unwrap().input_ids);
    assert!(ids[0].contains(&1998), "<extra_id_1> (id 1998) missing from {:?}", ids[0]);

    let mut off = taco(&reg, json!({"model": dir, "max_length": 64, "query_max_length": 64, "task_prefix": false}));
    let q = encode(&mut off, &texts, Role::Query, Some("nq"));
    assert!(max_abs(&q, &plain) < 1e-6, "task_prefix: false");

    // A titled passage reads "Title: {title} Text: {text}".
    let titled = rak_core::encoders::passage_string("Warsaw", &texts[2]);
    let got = encode(&mut enc, &[titled], Role::Passage, None);
    let want = encode(&mut enc, &[format!("Title: Warsaw Text: {}", texts[2])], Role::Passage, None);
    assert!(max_abs(&got, &want) < 1e-6);
}

/// Training mode: dropout on, and a loss on the returned embeddings fills the gradients of
/// the plugin's own parameters (shared by queries and passages).
#[test]
fn taco_gradients_flow_through_the_abi() {
    let reg = registry();
    let dir = fixture("t5-v1_1");
    let texts = strings(&meta(&dir)["texts"]);
    let mut enc = taco(&reg, json!({"model": dir}));
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    tch::manual_seed(0);
    let q = enc.encode(&refs[..2], Role::Query, Some("nq"), true).unwrap();
    let p = enc.encode(&refs[2..], Role::Passage, None, true).unwrap();
    assert!(q.requires_grad() && p.requires_grad());
    let again = enc.encode(&refs[..2], Role::Query, Some("nq"), true).unwrap();
    assert!(max_abs(&q, &again) > 1e-4, "dropout should make two training passes differ");
    let scores = q.matmul(&p.transpose(0, 1));
    let loss = scores.log_softmax(1, Kind::Float).diagonal(0, 0, 1).mean(Kind::Float).neg();
    loss.backward();
    let params = enc.parameters().unwrap();
    let norm = |t: &Tensor| if t.grad().defined() { t.grad().abs().sum(Kind::Double).double_value(&[]) } else { 0.0 };
    for (name, t) in &params {
        // The decoder's one step attends to itself only (softmax of one logit: no gradient
        // for its self-attention q/k and position bias), and the lm_head is not used.
        let unused = name.starts_with("lm_head.")
            || (name.starts_with("decoder.") && name.contains(".layer.0.SelfAttention.") && !name.contains(".v.") && !name.contains(".o."));
        if !unused {
            assert!(norm(t) > 0.0, "no gradient for {name}");
        }
    }
    assert!(norm(&params.iter().find(|(n, _)| n == "shared.weight").unwrap().1) > 0.0);
    // Eval mode afterwards is deterministic again.
    let a = encode(&mut enc, &texts, Role::Passage, None);
    let b = encode(&mut enc, &texts, Role::Passage, None);
    assert!(a.equal(&b) && !a.requires_grad());
}

/// Move every parameter the plugin hands out by seeded noise, in place through the ABI (as an
/// optimizer step would), so that the model differs from the checkpoint it was loaded from.
fn perturb(enc: &dyn Encoder) {
    tch::manual_seed(7);
    let _guard = tch::no_grad_guard();
    for (_, mut t) in enc.parameters().unwrap() {
        let noise = t.randn_like() * 0.05;
        let _ = t.g_add_(&noise);
    }
}

/// save -> reload through the plugin gives the changed model's embeddings (not the source
/// checkpoint's: the weights are changed before saving) and keeps the settings.
#[test]
fn taco_save_and_reload() {
    let reg = registry();
    for variant in VARIANTS {
        let dir = fixture(variant);
        let texts = strings(&meta(&dir)["texts"]);
        let settings = json!({"model": dir, "max_length": 20, "query_max_length": 12});
        let mut original = taco(&reg, settings.clone());
        let mut enc = taco(&reg, settings);
        perturb(enc.as_ref());
        let out = TempDir::new(&format!("taco-save-{variant}"));
        enc.save(out.path()).unwrap();
        for f in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "rak_encoder.json"] {
            assert!(out.path().join(f).exists(), "{variant}: {f} not saved");
        }
        let mut again = taco(&reg, json!({"model": out.path()}));
        assert_eq!(again.info().unwrap()["max_length"], 20, "saved settings are read back");
        assert_eq!(again.info().unwrap()["query_max_length"], 12);
        for (role, task) in [(Role::Passage, None), (Role::Query, Some("nq")), (Role::Query, None)] {
            let changed = encode(&mut enc, &texts, role, task);
            let reloaded = encode(&mut again, &texts, role, task);
            assert!(changed.equal(&reloaded), "{variant} {role:?} {task:?}: embeddings differ after save/load");
            let d = max_abs(&reloaded, &encode(&mut original, &texts, role, task));
            assert!(d > 1e-3, "{variant} {role:?} {task:?}: the reloaded model equals the source checkpoint (diff {d})");
        }
        assert_eq!(enc.info().unwrap()["parameters"], again.info().unwrap()["parameters"]);
    }
}

/// A passage's embedding does not depend on its batchmates: titled passages ("Title: ...
/// Text: ...") and untitled ones (their text alone) mixed in one batch, in any order, equal
/// each passage encoded alone.
#[test]
fn taco_passage_embedding_does_not_depend_on_batchmates() {
    let reg = registry();
    let dir = fixture("t5-v1_1");
    let texts = strings(&meta(&dir)["texts"]);
    let mut passages: Vec<String> = texts.iter().map(|t| rak_core::encoders::passage_string("Warsaw", t)).collect();
    passages.extend(texts.iter().cloned());
    let mut enc = taco(&reg, json!({"model": dir, "max_length": 64}));
    let alone: Vec<Tensor> = passages.iter().map(|p| encode(&mut enc, std::slice::from_ref(p), Role::Passage, None)).collect();
    let together = encode(&mut enc, &passages, Role::Passage, None);
    let reversed: Vec<String> = passages.iter().rev().cloned().collect();
    let backwards = encode(&mut enc, &reversed, Role::Passage, None);
    let n = passages.len();
    for (i, a) in alone.iter().enumerate() {
        let d = max_abs(&together.get(i as i64), &a.get(0)).max(max_abs(&backwards.get((n - 1 - i) as i64), &a.get(0)));
        assert!(d < 1e-5, "passage {i} ({:?}): batched vs alone max abs diff {d}", passages[i]);
    }
}

/// In training (dropout 0.1 in the fixture), a text's masks follow its key, not its batch:
/// what keeps a data-parallel run equal to one process.
#[test]
fn taco_keyed_dropout_follows_each_text_not_its_batch() {
    let reg = registry();
    let dir = fixture("t5-v1_1");
    let texts = strings(&meta(&dir)["texts"]);
    let mut enc = taco(&reg, json!({"model": dir, "max_length": 64}));
    check_keyed_dropout(enc.as_mut(), &texts, Role::Passage, None, 1e-5);
    check_keyed_dropout(enc.as_mut(), &texts, Role::Query, Some("nq"), 1e-5);
}

/// Batches announced through `prepare` encode as tokenised inline, through the ABI; and the
/// encoder takes them (counted on rak-core's `TacoEncoder`, which the plugin wraps).
#[test]
fn taco_tokenised_ahead_encodes_as_inline() {
    let reg = registry();
    let dir = fixture("t5-v1_1");
    let texts = strings(&meta(&dir)["texts"]);
    let settings = |ahead: bool| json!({"model": dir, "max_length": 64, "tokenize_ahead": ahead});
    let (mut ahead, mut inline) = (taco(&reg, settings(true)), taco(&reg, settings(false)));
    check_tokenized_ahead(ahead.as_mut(), inline.as_mut(), &texts, "nq");
    let mut core = rak_core::encoders::taco::TacoEncoder::create(settings(true)).unwrap();
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    core.prepare(&refs, Role::Query, Some("nq")).unwrap();
    let q = core.encode(&refs, Role::Query, Some("nq"), false).unwrap();
    assert_eq!(core.tokenized_ahead(), 1);
    assert!(q.equal(&encode(&mut inline, &texts, Role::Query, Some("nq"))));
    assert_eq!(rak_core::encoders::taco::TacoEncoder::create(settings(false)).unwrap().tokenized_ahead(), 0);
}

// ---------------------------------------------------------------------------------------------
// fid
// ---------------------------------------------------------------------------------------------

fn fid(reg: &Registry, settings: Value) -> Box<dyn Reader> {
    reg.reader("fid", &settings).expect("create fid through the ABI")
}

fn passages_json(m: &Value) -> Value {
    Value::Array(strings(&m["fid"]["passages"]).into_iter().map(|t| json!({"title": "ignored", "text": t})).collect())
}

/// transformers pads finished rows with pad (0); our rows stop at eos.
fn padded(ids: &Value, width: usize) -> Vec<i64> {
    ids.as_array().unwrap().iter().map(|x| x.as_i64().unwrap()).chain(std::iter::repeat(0)).take(width).collect()
}

/// The request built from expected.json's FiD passages and prompt tokenises to the fixture's
/// `fid_input_ids` (passage cut at 500 characters, not bytes; `</s>` kept under truncation).
#[test]
fn fid_inputs_reproduce_fixture_tokens() {
    for variant in VARIANTS {
        let dir = fixture(variant);
        let (e, m) = (expected(&dir), meta(&dir));
        let f = &m["fid"];
        let (prompt, chars) = (f["prompt"].as_str().unwrap(), f["max_chars"].as_u64().unwrap() as usize);
        let built: Vec<String> = strings(&f["passages"]).iter().map(|p| rak_core::readers::fid::fid_text(p, prompt, chars)).collect();
        assert_eq!(built, strings(&f["encoder_texts"]), "{variant}: encoder texts");
        let reader = rak_core::readers::fid::FidReader::create(json!({"model": dir, "max_length": f["max_length"]})).unwrap();
        let passages: Vec<rak_core::readers::fid::Passage> = serde_json::from_value(passages_json(&m)).unwrap();
        let (ids, mask) = reader.tokenize(&[reader.encoder_texts(prompt, &passages)]).unwrap();
        assert!(ids.squeeze_dim(0).equal(&e["fid_input_ids"]), "{variant}: fid_input_ids");
        assert!(mask.squeeze_dim(0).equal(&e["fid_attention_mask"]), "{variant}: fid_attention_mask");
    }
}

#[test]
fn fid_generate_matches_fixture() {
    let reg = registry();
    for variant in VARIANTS {
        let dir = fixture(variant);
        let (e, m) = (expected(&dir), meta(&dir));
        let mut reader = fid(&reg, json!({"model": dir, "max_length": m["fid"]["max_length"]}));

        // plain seq2seq: no passages, a batch of the four texts
        let texts = strings(&m["texts"]);
        let items: Vec<Value> = texts.iter().map(|t| json!({"prompt": t, "passages": []})).collect();
        let out = reader.generate(json!({"items": items, "max_new_tokens": m["generate_kwargs"]["max_new_tokens"]})).unwrap();
        let want = rows(&e["generated_ids"]);
        let outputs = out["outputs"].as_array().unwrap();
        assert_eq!(outputs.len(), 4);
        for (r, o) in outputs.iter().enumerate() {
            assert_eq!(padded(&o["ids"], want[r].len() - 1), want[r][1..].to_vec(), "{variant} generated_ids row {r}");
            let text = m["generated_text"][r].as_str().unwrap().replace("<pad>", "").replace("</s>", "");
            assert_eq!(o["text"].as_str().unwrap().trim(), text.trim(), "{variant} generated_text row {r}");
        }

        // FiD over the fixture's three passages, one item given bare with "question"
        let f = &m["fid"];
        let req = json!({"question": f["prompt"], "passages": passages_json(&m), "max_new_tokens": f["generate_kwargs"]["max_new_tokens"]});
        let out = reader.generate(req).unwrap();
        let want = rows(&e["fid_generated_ids"]);
        assert_eq!(padded(&out["outputs"][0]["ids"], want[0].len() - 1), want[0][1..].to_vec(), "{variant} fid_generated_ids");

        // a per-item limit is a prefix of the longer generation
        let items = json!({"items": [{"prompt": texts[0], "max_new_tokens": 3}, {"prompt": texts[0], "max_new_tokens": 8}]});
        let out = reader.generate(items).unwrap();
        let (short, long) = (&out["outputs"][0]["ids"], &out["outputs"][1]["ids"]);
        assert_eq!(short.as_array().unwrap()[..], long.as_array().unwrap()[..3]);
    }
}

#[test]
fn fid_passage_preferences_match_fixture() {
    let reg = registry();
    for variant in VARIANTS {
        let dir = fixture(variant);
        let (e, m) = (expected(&dir), meta(&dir));
        let f = &m["fid"];
        let mut reader = fid(&reg, json!({"model": dir, "max_length": f["max_length"]}));
        let passages = passages_json(&m);
        let mut reversed = passages.as_array().unwrap().clone();
        reversed.reverse();
        let req = json!({"items": [
            {"prompt": f["prompt"], "passages": passages},
            {"prompt": f["prompt"], "passages": reversed},
            {"prompt": f["prompt"], "passages": []},
        ]});
        let out = reader.passage_preferences(req).unwrap();
        let want: Vec<f32> = Vec::<f32>::try_from(&e["fid_cross_attention_scores"]).unwrap();
        let got = f32s(&out["items"][0]["scores"]);
        let mut got_rev = f32s(&out["items"][1]["scores"]);
        got_rev.reverse();
        for (g, name) in [(&got, "scores"), (&got_rev, "scores (batched, reversed)")] {
            assert_eq!(g.len(), want.len());
            let d = g.iter().zip(&want).map(|(a, b)| (a - b).abs() as f64).fold(0.0, f64::max);
            println!("{variant} fid {name}: max abs diff {d:.3e}");
            assert!(d <= TOL, "{variant} {name}: {g:?} vs {want:?}");
        }
        assert_eq!(out["items"][2]["scores"], json!([]));
    }
}

#[test]
fn fid_score_options_match_fixture() {
    let reg = registry();
    for variant in VARIANTS {
        let dir = fixture(variant);
        let (e, m) = (expected(&dir), meta(&dir));
        let rc = &m["rank_classification"];
        let texts = strings(&m["texts"]);
        let items: Vec<Value> = rc["input_rows"]
            .as_array()
            .unwrap()
            .iter()
            .zip(rc["options"].as_array().unwrap())
            .map(|(row, options)| json!({"prompt": texts[row.as_u64().unwrap() as usize], "passages": [], "options": options}))
            .collect();
        let mut reader = fid(&reg, json!({"model": dir}));
        let out = reader.score_options(json!({ "items": items })).unwrap();
        let want = Vec::<Vec<f32>>::try_from(&e["option_losses"]).unwrap();
        for (i, item) in out["items"].as_array().unwrap().iter().enumerate() {
            let got = f32s(&item["losses"]);
            let d = got.iter().zip(&want[i]).map(|(a, b)| (a - b).abs() as f64).fold(0.0, f64::max);
            println!("{variant} option_losses row {i}: max abs diff {d:.3e}");
            assert!(d <= TOL, "{variant} row {i}: {got:?} vs {:?}", want[i]);
            assert_eq!(item["best"], rc["winner"][i], "{variant} winner {i}");
        }
        // The options tokenise as the fixture's (with </s>).
        let core = rak_core::models::tokenizer::TextTokenizer::load(&dir).unwrap();
        for (opts, ids) in rc["options"].as_array().unwrap().iter().zip(rc["option_token_ids"].as_array().unwrap()) {
            for (o, want) in strings(opts).iter().zip(ids.as_array().unwrap()) {
                let got: Vec<i64> = core.ids(o, true).unwrap().into_iter().map(i64::from).collect();
                assert_eq!(json!(got), *want, "option {o:?}");
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// errors and listing
// ---------------------------------------------------------------------------------------------

fn err_text<T>(r: anyhow::Result<T>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => format!("{e:#}"),
    }
}

#[test]
fn errors_name_the_plugin_and_never_panic() {
    let reg = registry();
    let missing = root().join("target/e2e-tmp/no-such-model");
    let msg = err_text(reg.encoder("taco", &json!({"model": missing})));
    assert!(msg.contains("\"taco\"") && msg.contains("no-such-model") && !msg.contains("panicked"), "{msg}");
    let msg = err_text(reg.reader("fid", &json!({"model": missing})));
    assert!(msg.contains("\"fid\"") && msg.contains("no-such-model") && !msg.contains("panicked"), "{msg}");
    let msg = err_text(reg.encoder("taco", &json!({})));
    assert!(msg.contains("\"taco\"") && msg.contains("model"), "{msg}");
    let dir = fixture("t5-v1_0");
    let msg = err_text(reg.encoder("taco", &json!({"model": dir, "max_lenght": 3})));
    assert!(msg.contains("\"taco\"") && msg.contains("max_lenght"), "{msg}");

    let mut reader = fid(&reg, json!({"model": dir}));
    for (call, req) in [
        ("generate", json!({"pasages": []})),
        ("generate", json!({"items": [{"prompt": 3}]})),
        ("score_options", json!({"items": [{"prompt": "x", "options": []}]})),
        ("passage_preferences", json!({"items": "nope"})),
        ("passage_preferences", json!([1, 2])),
    ] {
        let r = match call {
            "generate" => reader.generate(req.clone()),
            "score_options" => reader.score_options(req.clone()),
            _ => reader.passage_preferences(req.clone()),
        };
        let msg = err_text(r);
        assert!(msg.contains("\"fid\"") && msg.contains(call) && !msg.contains("panicked"), "{call} {req}: {msg}");
    }
    // The reader still works after the errors.
    let out = reader.generate(json!({"prompt": "hello", "max_new_tokens": 2})).unwrap();
    assert!(out["outputs"][0]["ids"].as_array().unwrap().len() <= 2);
}

#[test]
fn plugins_list_shows_taco_and_fid() {
    let _ = registry();
    let out = host(&["plugins", "list"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let line = |name: &str| text.lines().find(|l| l.split_whitespace().next() == Some(name)).map(String::from);
    let taco = line("taco").unwrap_or_else(|| panic!("taco not listed:\n{text}"));
    assert!(taco.contains("encoder") && taco.contains("librak_encoder_taco.so"), "{taco}");
    let fid = line("fid").unwrap_or_else(|| panic!("fid not listed:\n{text}"));
    assert!(fid.contains("reader") && fid.contains("librak_reader_fid.so"), "{fid}");
}
