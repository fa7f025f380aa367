//! `host encode`: a JSONL file of passages or queries → `embeddings.npy` + `ids.txt`
//! (resumable, shardable, safe to run several times at once on one output; see
//! `rak_retrieval::pipeline::encode`).

use super::Bar;
use crate::registry::Registry;
use anyhow::{bail, Context, Result};
use rak_core::abi::Role;
use rak_retrieval::digest::encoder_identity;
use rak_retrieval::pipeline::encode::{encode_file, EncodeJob, EncoderSource};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

/// Everything `host encode` needs, as parsed from the command line.
#[derive(Debug, Clone, clap::Args)]
pub struct EncodeArgs {
    /// Encoder plugin (dpr, taser, taco, ...).
    #[arg(long)]
    pub encoder: String,
    /// Model checkpoint directory.
    #[arg(long)]
    pub model: PathBuf,
    /// Input JSONL: BEIR corpus lines ({"_id","title","text"}) or queries ({"_id","text"}).
    #[arg(long)]
    pub input: PathBuf,
    /// Output directory for embeddings.npy and ids.txt.
    #[arg(long)]
    pub output: PathBuf,
    /// Encode as passages or as queries.
    #[arg(long, default_value = "passage")]
    pub role: Role,
    /// Task name for query prefixes / markers.
    #[arg(long)]
    pub task: Option<String>,
    #[command(flatten)]
    pub model_args: ModelArgs,
    /// Which shard of the parts this process encodes.
    #[arg(long, default_value_t = 0)]
    pub shard_id: usize,
    /// How many processes share the work.
    #[arg(long, default_value_t = 1)]
    pub shard_num: usize,
    /// Lines per part (the unit of resumption).
    #[arg(long, default_value_t = 4096)]
    pub part_size: usize,
}

/// How an encoder runs: the flags `encode` and `search` share.
#[derive(Debug, Clone, clap::Args)]
pub struct ModelArgs {
    #[arg(long, default_value_t = 64)]
    pub batch_size: usize,
    /// Max tokens per text (default: the encoder's).
    #[arg(long)]
    pub max_length: Option<usize>,
    /// `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Run the model in bfloat16 (GPU).
    #[arg(long)]
    pub bf16: bool,
    /// Extra encoder settings as a JSON object.
    #[arg(long)]
    pub encoder_settings: Option<String>,
}

/// Encoder settings for checkpoint `model` from the common flags plus `--encoder-settings`.
pub fn encoder_settings(model: &Path, m: &ModelArgs) -> Result<Value> {
    let (max_length, device, bf16) = (m.max_length, m.device.as_str(), m.bf16);
    let mut s = match m.encoder_settings.as_deref() {
        Some(text) => serde_json::from_str(text).context("--encoder-settings is not a JSON object")?,
        None => json!({}),
    };
    if !s.is_object() {
        bail!("--encoder-settings must be a JSON object");
    }
    s["model"] = json!(model);
    s["device"] = json!(device);
    if bf16 {
        s["bf16"] = json!(true);
    }
    if let Some(n) = max_length {
        s["max_length"] = json!(n);
        s["query_max_length"] = json!(n);
    }
    Ok(s)
}

pub fn run(registry: &Registry, args: &EncodeArgs) -> Result<()> {
    let settings = encoder_settings(&args.model, &args.model_args)?;
    let job = EncodeJob {
        input: args.input.clone(),
        output: args.output.clone(),
        role: args.role,
        task: args.task.clone(),
        batch_size: args.model_args.batch_size,
        shard_id: args.shard_id,
        shard_num: args.shard_num,
        part_size: args.part_size,
        encoder_identity: encoder_identity(&args.encoder, &settings)?,
    };
    let make = || {
        let encoder = registry.encoder(&args.encoder, &settings)?;
        checkpoint_unchanged(&args.encoder, &settings, &job.encoder_identity)?;
        Ok(encoder)
    };
    encode_file(&job, EncoderSource::Lazy(Box::new(make)), &Bar::default())?;
    Ok(())
}

/// The identity is taken before the model is loaded (a finished output loads none): if the
/// checkpoint was rewritten in between (a trainer saving in place), the loaded weights are
/// not the ones the identity names, and their embeddings must not be filed under it.
pub fn checkpoint_unchanged(encoder: &str, settings: &Value, identity: &Value) -> Result<()> {
    if &encoder_identity(encoder, settings)? != identity {
        let model = settings.get("model").and_then(Value::as_str).unwrap_or("the checkpoint");
        bail!("{model} changed while the encoder was being loaded (a run writing to it?); encode again once it is finished");
    }
    Ok(())
}
