//! `hashbow`: a tiny trainable encoder that hashes words into buckets and averages their
//! learned vectors (an `EmbeddingBag`). It exists to show, and test, the plugin ABI from the
//! outside: embeddings come back through the ABI and gradients flow back into its weights.

use anyhow::{bail, Context, Result};
use rak_core::abi::Role;
use rak_core::plugin::{Encoder, PluginInfo};
use serde_json::{json, Value};
use std::path::Path;
use tch::{nn, Device, Kind, Tensor};

pub struct HashBow {
    vs: nn::VarStore,
    weight: Tensor,
    buckets: i64,
    dim: i64,
}

impl PluginInfo for HashBow {
    const NAME: &'static str = "hashbow";

    fn settings_schema() -> Value {
        json!({
            "dim": {"type": "int", "default": 32, "help": "embedding size"},
            "buckets": {"type": "int", "default": 4096, "help": "hash buckets"},
            "seed": {"type": "int", "default": 0, "help": "initialisation seed"},
        })
    }

    fn create(settings: Value) -> Result<Self> {
        let get = |k: &str, d: i64| settings.get(k).and_then(Value::as_i64).unwrap_or(d);
        let (dim, buckets, seed) = (get("dim", 32), get("buckets", 4096), get("seed", 0));
        if dim <= 0 || buckets <= 0 {
            bail!("hashbow: dim and buckets must be positive (got {dim}, {buckets})");
        }
        let vs = nn::VarStore::new(Device::Cpu);
        // Seeded locally, not with tch::manual_seed: the global RNG is shared with the host and
        // every other plugin, so two instances created concurrently would race for it.
        let init = Tensor::from_slice(&normal_samples(seed as u64, (buckets * dim) as usize)).view([buckets, dim]);
        let weight = (vs.root() / "embedding").var_copy("weight", &init);
        Ok(HashBow { vs, weight, buckets, dim })
    }
}

/// Standard normal samples from a splitmix64 stream (Box-Muller).
fn normal_samples(seed: u64, n: usize) -> Vec<f32> {
    let mut state = seed;
    let mut uniform = move || {
        state = state.wrapping_add(0x9e3779b97f4a7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    };
    (0..n)
        .map(|_| {
            let (u1, u2) = (uniform().max(f64::MIN_POSITIVE), uniform());
            ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
        })
        .collect()
}

/// FNV-1a: stable across runs and platforms, unlike std's randomised hasher.
fn bucket(word: &str, buckets: i64) -> i64 {
    let h = word.bytes().fold(0xcbf29ce484222325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100000001b3));
    (h % buckets as u64) as i64
}

impl Encoder for HashBow {
    fn encode(&mut self, texts: &[&str], _role: Role, _task: Option<&str>, train: bool) -> Result<Tensor> {
        let mut ids = Vec::new();
        let mut offsets = Vec::with_capacity(texts.len());
        for text in texts {
            offsets.push(ids.len() as i64);
            let before = ids.len();
            for word in text.split(|c: char| !c.is_alphanumeric()).filter(|w| !w.is_empty()) {
                ids.push(bucket(&word.to_lowercase(), self.buckets));
            }
            if ids.len() == before {
                ids.push(0); // an empty text still gets a vector
            }
        }
        let _no_grad = (!train).then(tch::no_grad_guard);
        let (out, _, _, _) = Tensor::embedding_bag::<Tensor>(
            &self.weight,
            &Tensor::from_slice(&ids),
            &Tensor::from_slice(&offsets),
            false,
            1, // mean
            false,
            None,
            false,
        );
        Ok(out)
    }

    fn parameters(&self) -> Result<Vec<(String, Tensor)>> {
        Ok(self.vs.variables().into_iter().collect())
    }

    fn info(&self) -> Result<Value> {
        Ok(json!({"dim": self.dim, "parameters": self.buckets * self.dim}))
    }

    fn save(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).with_context(|| format!("{}: cannot create", dir.display()))?;
        let tensors = vec![("embedding.weight".to_string(), self.weight.detach().to_kind(Kind::Float))];
        rak_core::models::weights::save_safetensors(&dir.join("model.safetensors"), &tensors)?;
        let config = json!({"model_type": "hashbow", "dim": self.dim, "buckets": self.buckets});
        rak_core::fsutil::write_bytes(&dir.join("config.json"), config.to_string().as_bytes())
    }
}

rak_core::export_encoder!(HashBow);
