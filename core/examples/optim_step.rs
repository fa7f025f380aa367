//! The optimizers' own work per step, without the model: AdamW (sum of 4 task gradients,
//! clipping, update) and T-SAGE (exact and lean) on tensors of all-MiniLM-L6-v2's shapes
//! (22.6M parameters) with random gradients, 90% of whose word-embedding rows are zero as in
//! a real batch. The numbers in docs/BENCHMARKS.md ("the optimizer's work alone") come from
//! it; it builds against any commit with this API, so a change can be measured before and
//! after.
//!
//!   cargo run --release -p rak-core --example optim_step [adamw|exact|lean ...]
use rak_core::optim::tsage::{Form, TSage, TSageConfig};
use rak_core::optim::{clip_grad_norm, AdamW, AdamWConfig, GradSum};
use rak_core::plugin::StepContext;
use std::time::Instant;
use tch::{Device, Kind, Tensor};

const TASKS: i64 = 4;
const STEPS: u64 = 6;

fn minilm_shapes() -> Vec<(String, Vec<i64>)> {
    let mut v: Vec<(String, Vec<i64>)> = vec![
        ("embeddings.word_embeddings.weight".into(), vec![30522, 384]),
        ("embeddings.position_embeddings.weight".into(), vec![512, 384]),
        ("embeddings.token_type_embeddings.weight".into(), vec![2, 384]),
        ("embeddings.LayerNorm.weight".into(), vec![384]),
        ("embeddings.LayerNorm.bias".into(), vec![384]),
    ];
    for l in 0..6 {
        for (n, s) in [
            ("q", vec![384, 384]), ("q.bias", vec![384]), ("k", vec![384, 384]), ("k.bias", vec![384]),
            ("v", vec![384, 384]), ("v.bias", vec![384]), ("o", vec![384, 384]), ("o.bias", vec![384]),
            ("ln1.weight", vec![384]), ("ln1.bias", vec![384]), ("intermediate", vec![1536, 384]),
            ("intermediate.bias", vec![1536]), ("output", vec![384, 1536]), ("output.bias", vec![384]),
            ("ln2.weight", vec![384]), ("ln2.bias", vec![384]),
        ] {
            v.push((format!("encoder.layer.{l}.{n}"), s));
        }
    }
    v
}

fn task_gradients(params: &[(String, Tensor)], task: i64) -> Vec<(String, Tensor)> {
    params
        .iter()
        .map(|(n, p)| {
            let g = Tensor::randn(p.size(), (Kind::Float, Device::Cpu)) * 1e-3;
            if n.ends_with("word_embeddings.weight") {
                let rows = Tensor::rand([p.size()[0], 1], (Kind::Float, Device::Cpu)).lt(0.1 + 0.01 * task as f64);
                (n.clone(), g * rows)
            } else {
                (n.clone(), g)
            }
        })
        .collect()
}

fn lend(g: &[(String, Tensor)]) -> Vec<(String, Tensor)> {
    g.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect()
}

fn main() {
    tch::manual_seed(0);
    let params: Vec<(String, Tensor)> = minilm_shapes().into_iter().map(|(n, s)| (n, Tensor::randn(s, (Kind::Float, Device::Cpu)) * 0.05)).collect();
    let p: i64 = params.iter().map(|(_, t)| t.numel() as i64).sum();
    println!("P = {p}, {TASKS} tasks, {} threads, {STEPS} steps (the first after burn-in's)", tch::get_num_threads());
    let tasks: Vec<String> = (0..TASKS).map(|t| format!("task{t}")).collect();
    let grads: Vec<Vec<(String, Tensor)>> = (0..TASKS).map(|t| task_gradients(&params, t)).collect();
    let ctx = |step| StepContext { step, total_steps: 100, warmup_steps: 1, lr: 1e-5, tasks: tasks.clone(), max_grad_norm: Some(1.0), ..Default::default() };
    let which: Vec<String> = std::env::args().skip(1).collect();
    let wanted = |name: &str| which.is_empty() || which.iter().any(|w| w == name);
    if wanted("adamw") {
        let mut adam = AdamW::new(AdamWConfig::default());
        let mut sum = GradSum::default();
        for step in 0..STEPS {
            let t0 = Instant::now();
            for g in &grads {
                sum.add(lend(g)).unwrap();
            }
            let mut g = sum.take();
            clip_grad_norm(&mut g, 1.0).unwrap();
            let t1 = Instant::now();
            adam.step(&params, &g, &ctx(step)).unwrap();
            println!("adamw step {step}: sum + clip {:.3} s, update {:.3} s, total {:.3} s", (t1 - t0).as_secs_f64(), t1.elapsed().as_secs_f64(), t0.elapsed().as_secs_f64());
        }
    }
    for (name, form) in [("exact", Form::Exact), ("lean", Form::Lean)] {
        if !wanted(name) {
            continue;
        }
        let mut opt = TSage::new(TSageConfig { form, ..Default::default() }).unwrap();
        for step in 0..STEPS {
            let t0 = Instant::now();
            opt.begin_step(lend(&params), ctx(step)).unwrap();
            let begin = t0.elapsed().as_secs_f64();
            let mut per_task = Vec::new();
            for (t, g) in grads.iter().enumerate() {
                let a = Instant::now();
                opt.task_gradients(&tasks[t], lend(g)).unwrap();
                per_task.push(format!("{:.3}", a.elapsed().as_secs_f64()));
            }
            let f = Instant::now();
            opt.finish_step().unwrap();
            println!(
                "{name} step {step}: begin {begin:.3} s, tasks [{}] s, finish {:.3} s, total {:.3} s",
                per_task.join(" "),
                f.elapsed().as_secs_f64(),
                t0.elapsed().as_secs_f64()
            );
        }
    }
}
