//! `faulty`: an encoder that misbehaves in the way its settings ask, for the host's fault
//! tests. `{"fault": "undefined"}` returns an undefined tensor, `"short"` one row too few,
//! `"panic"` panics on the `panic_at`-th encode call (1-based) halfway through updating its
//! state, `"inf_gradient"` trains a one-element parameter whose gradient is infinite (the
//! embeddings are the lengths plus `sqrt(w - w)`: finite values, an infinite derivative),
//! `"libtorch"` makes libtorch throw (a panicking tch call with shapes that do not
//! multiply), `"rewrite_on_load"` rewrites `weights.bin` in its `model` folder while it is being
//! created (a trainer saving over the checkpoint at that moment); otherwise it returns each text's length in every column of a `[n, 4]` tensor.

use anyhow::Result;
use rak_core::abi::Role;
use rak_core::plugin::{Encoder, PluginInfo};
use serde_json::{json, Value};
use std::path::Path;
use tch::Tensor;

pub struct Faulty {
    fault: String,
    panic_at: u64,
    calls: u64,
    /// Kept equal to `calls` except inside a call that panics.
    calls_done: u64,
    /// `inf_gradient`'s parameter.
    w: Tensor,
}

impl PluginInfo for Faulty {
    const NAME: &'static str = "faulty";

    fn settings_schema() -> Value {
        json!({
            "fault": {"type": "string", "default": "none", "help": "none, undefined, short, panic, inf_gradient, libtorch or rewrite_on_load"},
            "panic_at": {"type": "int", "default": 1, "help": "which encode call panics"},
        })
    }

    fn create(settings: Value) -> Result<Self> {
        let fault = settings["fault"].as_str().unwrap_or("none").to_string();
        let panic_at = settings["panic_at"].as_u64().unwrap_or(1);
        if fault == "rewrite_on_load" {
            let model = settings["model"].as_str().ok_or_else(|| anyhow::anyhow!("faulty: rewrite_on_load needs a model folder"))?;
            std::fs::write(Path::new(model).join("weights.bin"), format!("rewritten by process {}", std::process::id()))?;
        }
        let w = Tensor::ones([1], (tch::Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
        Ok(Faulty { fault, panic_at, calls: 0, calls_done: 0, w })
    }
}

impl Encoder for Faulty {
    fn encode(&mut self, texts: &[&str], _role: Role, _task: Option<&str>, _train: bool) -> Result<Tensor> {
        self.calls += 1;
        if self.fault == "panic" && self.calls == self.panic_at {
            panic!("faulty: panic on call {}", self.calls);
        }
        if self.fault == "libtorch" {
            let _ = Tensor::ones([2, 3], (tch::Kind::Float, tch::Device::Cpu)).matmul(&Tensor::ones([4, 4], (tch::Kind::Float, tch::Device::Cpu)));
        }
        assert_eq!(self.calls, self.calls_done + 1, "state is consistent");
        self.calls_done = self.calls;
        let lengths: Vec<f32> = texts.iter().map(|t| t.len() as f32).collect();
        let rows = Tensor::from_slice(&lengths).view([-1, 1]).repeat([1, 4]);
        Ok(match self.fault.as_str() {
            "undefined" => Tensor::new(),
            "short" => rows.narrow(0, 0, (texts.len() as i64 - 1).max(0)),
            "inf_gradient" => rows + (&self.w - self.w.detach()).sqrt(),
            _ => rows,
        })
    }

    fn parameters(&self) -> Result<Vec<(String, Tensor)>> {
        Ok(if self.fault == "inf_gradient" { vec![("w".to_string(), self.w.shallow_clone())] } else { Vec::new() })
    }

    fn info(&self) -> Result<Value> {
        Ok(json!({"dim": 4, "parameters": 0, "calls": self.calls}))
    }

    fn save(&self, _dir: &Path) -> Result<()> {
        anyhow::bail!("faulty: nothing to save")
    }
}

rak_core::export_encoder!(Faulty);
