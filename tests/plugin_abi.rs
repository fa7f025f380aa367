//! Built-in plugins through the real ABI: discovery from the host's folder, and the `adamw`
//! optimizer matching tch's own AdamW step for step.

use rak_core::plugin::{optimizer_step, StepContext};
use rak_e2e::*;
use rak_host::{Registry, Source};
use tch::nn::{self, OptimizerConfig};
use tch::{Device, Kind, Tensor};

fn registry() -> Registry {
    let _ = plugin_file("rak_optim_adamw");
    Registry::discover(&[Source::Dir(release_dir())]).expect("discover plugins")
}

#[test]
fn plugins_list_shows_adamw_from_its_so() {
    let out = host(&["plugins", "list"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let line = stdout(&out).lines().find(|l| l.starts_with("adamw")).map(String::from).expect("adamw listed");
    assert!(line.contains("optimizer") && line.contains("librak_optim_adamw.so"), "{line}");
}

#[test]
fn inspect_reports_metadata_and_verdict() {
    let file = plugin_file("rak_optim_adamw");
    let out = host(&["plugins", "inspect", file.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(v["compatible"], true);
    assert_eq!(v["metadata"]["name"], "adamw");
    assert_eq!(v["metadata"]["kind"], "optimizer");
    assert_eq!(v["metadata"]["abi_version"], rak_core::abi::ABI_VERSION);
    assert_eq!(v["metadata"]["libtorch_version"], rak_core::LIBTORCH_VERSION);
    assert_eq!(v["metadata"]["tch_version"], rak_core::TCH_VERSION);
    assert_eq!(v["metadata"]["target"], rak_core::TARGET);
    assert_eq!(v["settings"]["beta2"]["default"], 0.999);
}

#[test]
fn doctor_reports_libtorch_and_search_path() {
    let out = host(&["doctor"]);
    assert!(out.status.success());
    let text = stdout(&out);
    assert!(text.contains(rak_core::LIBTORCH_VERSION), "{text}");
    assert!(text.contains("cuda available") && text.contains(release_dir().to_str().unwrap()), "{text}");
}

/// Five AdamW steps through the ABI equal five steps of tch's (libtorch's C++) AdamW.
#[test]
fn adamw_plugin_matches_tch_adamw() {
    tch::manual_seed(7);
    let shapes: [&[i64]; 3] = [&[16, 8], &[8], &[3, 4, 5]];
    let (lr, wd) = (1e-2, 0.05);

    let vs = nn::VarStore::new(Device::Cpu);
    let reference: Vec<Tensor> =
        shapes.iter().enumerate().map(|(i, s)| vs.root().var(&format!("p{i}"), s, nn::Init::Randn { mean: 0., stdev: 1. })).collect();
    let mut tch_opt = nn::AdamW { beta1: 0.9, beta2: 0.999, wd, eps: 1e-8, amsgrad: false }.build(&vs, lr).unwrap();

    let ours: Vec<(String, Tensor)> = reference.iter().enumerate().map(|(i, t)| (format!("p{i}"), t.detach().copy())).collect();
    let ctx = StepContext { lr, ..Default::default() };
    let named = |g: &[Tensor]| -> Vec<(String, Tensor)> { g.iter().enumerate().map(|(i, t)| (format!("p{i}"), t.shallow_clone())).collect() };
    let mut plugin =
        registry().optimizer("adamw", &serde_json::json!({"weight_decay": wd})).expect("create adamw through the ABI");

    for _ in 0..5 {
        let grads: Vec<Tensor> = shapes.iter().map(|s| Tensor::randn(*s, (Kind::Float, Device::Cpu))).collect();
        // Reference: make the gradient appear through autograd, then step.
        tch_opt.zero_grad();
        let loss = reference.iter().zip(&grads).map(|(p, g)| (p * g).sum(Kind::Float)).fold(Tensor::from(0f32), |a, b| a + b);
        loss.backward();
        tch_opt.step();
        // Through the ABI, with the same gradients as one task.
        optimizer_step(plugin.as_mut(), &ours, vec![("t".into(), 0.0, named(&grads))], ctx.clone()).unwrap();
    }
    for (a, (_, b)) in reference.iter().zip(&ours) {
        let diff = (a - b).abs().max().double_value(&[]);
        assert!(diff < 1e-6, "max abs difference {diff}");
    }

    // State survives a save/load round trip into a fresh instance.
    let state = plugin.state().unwrap();
    assert_eq!(state.len(), 3 * shapes.len(), "a step count and two moments per parameter");
    let mut fresh = registry().optimizer("adamw", &serde_json::json!({"weight_decay": wd})).unwrap();
    fresh.load_state(state).unwrap();
    let g: Vec<Tensor> = shapes.iter().map(|s| Tensor::ones(*s, (Kind::Float, Device::Cpu))).collect();
    let a: Vec<(String, Tensor)> = ours.iter().map(|(n, t)| (n.clone(), t.copy())).collect();
    optimizer_step(plugin.as_mut(), &ours, vec![("t".into(), 0.0, named(&g))], ctx.clone()).unwrap();
    optimizer_step(fresh.as_mut(), &a, vec![("t".into(), 0.0, named(&g))], ctx).unwrap();
    for ((_, x), (_, y)) in ours.iter().zip(&a) {
        assert!((x - y).abs().max().double_value(&[]) < 1e-7);
    }
}

/// Several tasks: adamw steps on the sum of the task gradients.
#[test]
fn adamw_sums_task_gradients() {
    let p1 = Tensor::randn([4, 4], (Kind::Float, Device::Cpu));
    let p2 = p1.copy();
    let g1 = Tensor::randn([4, 4], (Kind::Float, Device::Cpu));
    let g2 = Tensor::randn([4, 4], (Kind::Float, Device::Cpu));
    let reg = registry();
    let mut a = reg.optimizer("adamw", &serde_json::json!({})).unwrap();
    let mut b = reg.optimizer("adamw", &serde_json::json!({})).unwrap();
    let ctx = StepContext { lr: 1e-3, tasks: vec!["x".into(), "y".into()], ..Default::default() };
    let w = |t: &Tensor| vec![("w".to_string(), t.copy())];
    optimizer_step(a.as_mut(), &w(&p1).into_iter().map(|(n, _)| (n, p1.shallow_clone())).collect::<Vec<_>>(), vec![("x".into(), 0.0, w(&g1)), ("y".into(), 0.0, w(&g2))], ctx.clone()).unwrap();
    optimizer_step(b.as_mut(), &[("w".to_string(), p2.shallow_clone())], vec![("xy".into(), 0.0, w(&(&g1 + &g2)))], ctx).unwrap();
    assert!((&p1 - &p2).abs().max().double_value(&[]) < 1e-7);
}

/// Layer-wise learning-rate factors and weight-decay exclusions apply by parameter name.
#[test]
fn adamw_applies_lr_scale_and_no_decay_by_name() {
    let reg = registry();
    let mut opt = reg.optimizer("adamw", &serde_json::json!({"weight_decay": 0.1})).unwrap();
    let params: Vec<(String, Tensor)> =
        ["a", "b", "c"].iter().map(|n| (n.to_string(), Tensor::ones([2], (Kind::Float, Device::Cpu)))).collect();
    let grads: Vec<(String, Tensor)> = params.iter().map(|(n, _)| (n.clone(), Tensor::ones([2], (Kind::Float, Device::Cpu)))).collect();
    let ctx = StepContext {
        lr: 0.1,
        lr_scale: [("b".to_string(), 0.5)].into(),
        no_weight_decay: ["c".to_string()].into(),
        ..Default::default()
    };
    optimizer_step(opt.as_mut(), &params, vec![("t".into(), 0.0, grads)], ctx).unwrap();
    // First AdamW step moves by lr (m̂/√v̂ = 1), after decay by (1 - lr·wd).
    let v = |i: usize| params[i].1.double_value(&[0]);
    assert!((v(0) - (1.0 * (1.0 - 0.1 * 0.1) - 0.1)).abs() < 1e-6, "{}", v(0));
    assert!((v(1) - (1.0 * (1.0 - 0.05 * 0.1) - 0.05)).abs() < 1e-6, "{}", v(1));
    assert!((v(2) - (1.0 - 0.1)).abs() < 1e-6, "{}", v(2));
    let state = opt.state().unwrap();
    assert!(state.iter().any(|(n, _)| n == "exp_avg/b"), "state is keyed by parameter name");
}

#[test]
fn plugin_errors_come_back_naming_the_plugin() {
    let reg = registry();
    let err = reg.optimizer("adamw", &serde_json::json!({"beta3": 1})).err().expect("unknown setting rejected");
    let msg = format!("{err:#}");
    assert!(msg.contains("adamw") && msg.contains("beta3") && msg.contains("librak_optim_adamw.so"), "{msg}");

    // A shape mismatch inside libtorch panics in the plugin; it comes back as an error.
    let mut opt = reg.optimizer("adamw", &serde_json::json!({})).unwrap();
    let p = Tensor::zeros([3], (Kind::Float, Device::Cpu));
    let g = Tensor::zeros([5], (Kind::Float, Device::Cpu));
    let err = optimizer_step(opt.as_mut(), &[("p".into(), p)], vec![("t".into(), 0.0, vec![("p".into(), g)])], StepContext::default())
        .expect_err("shape mismatch is an error");
    assert!(format!("{err:#}").contains("adamw"), "{err:#}");

    let err = reg.optimizer("nope", &serde_json::json!({})).err().unwrap();
    assert!(format!("{err:#}").contains("adamw"), "the message lists the loaded optimizers: {err:#}");
}
