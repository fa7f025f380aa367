//! A plugin built out of tree, the way a third party would, and loaded with `--plugin`.

use rak_core::abi::Role;
use rak_e2e::*;
use rak_host::{Registry, Source};
use tch::Kind;

#[test]
fn hashbow_loads_with_plugin_flag() {
    let so = hashbow_plugin();
    let out = host(&["--plugin", so.to_str().unwrap(), "plugins", "list"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let line = text.lines().find(|l| l.starts_with("hashbow")).expect("hashbow listed");
    assert!(line.contains("encoder") && line.contains("0.3.0"), "{line}");
    assert!(text.contains("adamw"), "built-ins are still found next to host:\n{text}");
}

#[test]
fn embeddings_have_the_right_shape_and_are_deterministic() {
    let reg = Registry::discover(&[Source::File(hashbow_plugin())]).unwrap();
    let settings = serde_json::json!({"dim": 16, "buckets": 512, "seed": 3});
    let mut enc = reg.encoder("hashbow", &settings).unwrap();
    let texts = ["Super Bowl 50 was an American football game", "", "Who won Super Bowl 50?"];
    let a = enc.encode(&texts, Role::Passage, None, false).unwrap();
    assert_eq!(a.size(), vec![3, 16]);
    assert_eq!(a.kind(), Kind::Float);
    let b = enc.encode(&texts, Role::Passage, None, false).unwrap();
    assert!(a.equal(&b), "same input, same output");
    let mut again = reg.encoder("hashbow", &settings).unwrap();
    assert!(a.equal(&again.encode(&texts, Role::Query, Some("squad"), false).unwrap()), "same seed, same weights");
    assert_eq!(enc.info().unwrap()["dim"], 16);
}

#[test]
fn gradients_flow_back_through_the_abi() {
    let reg = Registry::discover(&[Source::File(hashbow_plugin())]).unwrap();
    let mut enc = reg.encoder("hashbow", &serde_json::json!({"dim": 8, "buckets": 64})).unwrap();
    let params = enc.parameters().unwrap();
    assert_eq!(params.len(), 1);
    let (name, weight) = &params[0];
    assert_eq!(name, "embedding.weight");
    assert!(weight.requires_grad());

    let q = enc.encode(&["alpha beta"], Role::Query, None, true).unwrap();
    let p = enc.encode(&["alpha gamma", "delta"], Role::Passage, None, true).unwrap();
    let scores = q.matmul(&p.tr());
    let loss = scores.log_softmax(-1, Kind::Float).get(0).get(0).neg();
    loss.backward();
    let grad = weight.grad();
    assert!(grad.defined(), "the parameter handed out shares .grad with the plugin's weight");
    let touched = grad.abs().sum_dim_intlist(1, false, Kind::Float).gt(0.0).sum(Kind::Int64).int64_value(&[]);
    assert!((1..=5).contains(&touched), "only the rows of the words used get gradient, got {touched}");

    // One optimizer step through a second plugin changes the encoder's output.
    let before = enc.encode(&["alpha"], Role::Query, None, false).unwrap();
    let reg2 = Registry::discover(&[Source::Dir(release_dir())]).unwrap();
    let mut opt = reg2.optimizer("adamw", &serde_json::json!({})).unwrap();
    let ctx = rak_core::plugin::StepContext { lr: 0.1, ..Default::default() };
    rak_core::plugin::optimizer_step(opt.as_mut(), &[(name.clone(), weight.shallow_clone())], vec![("t".into(), 0.0, vec![(name.clone(), grad)])], ctx).unwrap();
    let after = enc.encode(&["alpha"], Role::Query, None, false).unwrap();
    assert!(!before.allclose(&after, 1e-6, 1e-6, false));
}

#[test]
fn save_writes_a_checkpoint_directory() {
    let reg = Registry::discover(&[Source::File(hashbow_plugin())]).unwrap();
    let enc = reg.encoder("hashbow", &serde_json::json!({"dim": 4, "buckets": 8})).unwrap();
    let dir = TempDir::new("hashbow-save");
    enc.save(&dir.path().join("ckpt")).unwrap();
    let t = tch::Tensor::read_safetensors(dir.path().join("ckpt/model.safetensors")).unwrap();
    assert_eq!(t[0].1.size(), vec![8, 4]);
}
