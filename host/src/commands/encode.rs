//! `host encode`: a JSONL file of passages or queries → `embeddings.npy` + `ids.txt`
//! (resumable, shardable, safe to run several times at once on one output; see
//! `rak_retrieval::pipeline::encode`).

use super::Bar;
use crate::registry::Registry;
use anyhow::{bail, Context, Result};
use rak_core::abi::Role;
use rak_retrieval::digest::encoder_identity;
use rak_retrieval::pipeline::encode::{encode_file, EncodeJob, EncoderSource, DEFAULT_BATCH_SIZE};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

/// Everything `host encode` needs, as parsed from the command line.
#[derive(Debug, Clone, clap::Args)]
pub struct EncodeArgs {
    /// Encoder plugin (dpr, taser, taco, ...).
    #[arg(long)]
    pub encoder: String,
    /// Model checkpoint: a folder, a Hugging Face Hub id (ORG/NAME, from the Hub cache or
    /// downloaded into it) or a well-known bare name (all-MiniLM-L6-v2).
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
    /// Which shard of the parts this process encodes (default: from the scheduler's
    /// environment, see `shard_of`; else 0).
    #[arg(long)]
    pub shard_id: Option<usize>,
    /// How many processes share the work (default: from the environment; else 1). Alone, it
    /// gives the count a Kubernetes Indexed Job's `JOB_COMPLETION_INDEX` lacks.
    #[arg(long)]
    pub shard_num: Option<usize>,
    /// Lines per part (the unit of resumption).
    #[arg(long, default_value_t = 4096)]
    pub part_size: usize,
}

/// How an encoder runs: the flags `encode` and `search` share.
#[derive(Debug, Clone, clap::Args)]
pub struct ModelArgs {
    #[arg(long, default_value_t = DEFAULT_BATCH_SIZE)]
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
    /// The branch, tag or commit of a Hugging Face Hub `--model` (default: main).
    #[arg(long)]
    pub revision: Option<String>,
}

/// The checkpoint folder `--model` names: a folder that exists, else a Hugging Face Hub id or
/// known bare name resolved through the Hub cache (downloaded into it when missing and
/// online); see `rak_hub`. A Hub model is announced on stderr, prefixed by `who`.
pub fn resolve_model(model: &Path, revision: Option<&str>, who: &str) -> Result<PathBuf> {
    let r = rak_hub::resolve(model, revision, who)?;
    if r.hub.is_some() {
        eprintln!("{who}: model {}", r.describe());
    }
    Ok(r.path)
}

/// Encoder settings for checkpoint `model` (a folder, or a Hub id or known name resolved by
/// [`resolve_model`] with `--revision`) from the common flags plus `--encoder-settings`.
pub fn encoder_settings(model: &Path, m: &ModelArgs) -> Result<Value> {
    let model = &resolve_model(model, m.revision.as_deref(), "host")?;
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
    let shard = shard_of(args.shard_id, args.shard_num, |name| std::env::var(name).ok())?;
    if let Some(from) = shard.from {
        eprintln!("host encode: shard {} of {} (from {from})", shard.id, shard.num);
    }
    let job = EncodeJob {
        input: args.input.clone(),
        output: args.output.clone(),
        role: args.role,
        task: args.task.clone(),
        batch_size: args.model_args.batch_size,
        shard_id: shard.id,
        shard_num: shard.num,
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

/// Which shard of the work this process takes.
#[derive(Debug, PartialEq)]
pub struct Shard {
    pub id: usize,
    pub num: usize,
    /// The environment variable the index came from (None: the flags, or one shard).
    pub from: Option<&'static str>,
}

/// The shard from the flags, or else from the environment a scheduler gives each of its
/// processes, so that one command line works unchanged under each (docs/scale-out.md), in this
/// order: a Slurm job array (`SLURM_ARRAY_TASK_ID` counted from `SLURM_ARRAY_TASK_MIN` in steps
/// of `SLURM_ARRAY_TASK_STEP`, of `SLURM_ARRAY_TASK_COUNT`); a Kubernetes Indexed Job
/// (`JOB_COMPLETION_INDEX`, which comes without a count: `--shard-num` gives it); torchrun and
/// other torch.distributed launchers (`RANK` of `WORLD_SIZE`). Nothing: one shard. A Slurm
/// array task that runs torchrun inside takes the array's shard; its ranks then share it
/// through the part locks. `--shard-id 0 --shard-num 1` encodes everything whatever the
/// environment says.
/// `env` reads a variable (a parameter, so tests need not change the process's environment).
pub fn shard_of(flag_id: Option<usize>, flag_num: Option<usize>, env: impl Fn(&str) -> Option<String>) -> Result<Shard> {
    let int = |name: &'static str| -> Result<Option<usize>> {
        match env(name) {
            None => Ok(None),
            Some(v) => v.trim().parse().map(Some).with_context(|| format!("{name}={v:?} is not a whole number")),
        }
    };
    let (id, num, from) = match (flag_id, flag_num) {
        (Some(id), Some(num)) => (id, num, None),
        (Some(_), None) => bail!("--shard-id needs --shard-num"),
        (None, _) => {
            if let Some(task) = int("SLURM_ARRAY_TASK_ID")? {
                let min = int("SLURM_ARRAY_TASK_MIN")?.unwrap_or(0);
                let step = int("SLURM_ARRAY_TASK_STEP")?.unwrap_or(1).max(1);
                let count = int("SLURM_ARRAY_TASK_COUNT")?.context("SLURM_ARRAY_TASK_ID is set but SLURM_ARRAY_TASK_COUNT is not")?;
                let max = int("SLURM_ARRAY_TASK_MAX")?.unwrap_or(min + step * count.saturating_sub(1));
                if task < min || (task - min) % step != 0 || max.checked_sub(min).map(|span| span / step + 1) != Some(count) {
                    bail!(
                        "this Slurm array ({min}-{max}:{step}, {count} tasks, this one {task}) is not evenly spaced: \
                         give --shard-id and --shard-num"
                    );
                }
                agree(flag_num, count, "SLURM_ARRAY_TASK_COUNT")?;
                ((task - min) / step, count, Some("SLURM_ARRAY_TASK_ID"))
            } else if let Some(index) = int("JOB_COMPLETION_INDEX")? {
                let num = flag_num.context(
                    "JOB_COMPLETION_INDEX is set (a Kubernetes Indexed Job) but the Job's completions are not: give them as --shard-num",
                )?;
                (index, num, Some("JOB_COMPLETION_INDEX"))
            } else if let Some(rank) = int("RANK")? {
                let world = int("WORLD_SIZE")?.context("RANK is set but WORLD_SIZE is not")?;
                agree(flag_num, world, "WORLD_SIZE")?;
                (rank, world, Some("RANK"))
            } else if let Some(num) = flag_num {
                bail!("--shard-num {num} needs --shard-id (or a scheduler's index in the environment: docs/scale-out.md)")
            } else {
                (0, 1, None)
            }
        }
    };
    if num == 0 || id >= num {
        let source = from.unwrap_or("--shard-id");
        bail!("shard {id} (from {source}) is not below the shard count {num}");
    }
    Ok(Shard { id, num, from })
}

/// A count from the environment must agree with `--shard-num` when both are given.
fn agree(flag_num: Option<usize>, env_num: usize, name: &str) -> Result<()> {
    match flag_num {
        Some(n) if n != env_num => bail!("--shard-num {n} disagrees with {name}={env_num}"),
        _ => Ok(()),
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn shard(id: Option<usize>, num: Option<usize>, vars: &[(&str, &str)]) -> Result<Shard> {
        shard_of(id, num, |name| vars.iter().find(|(k, _)| *k == name).map(|(_, v)| v.to_string()))
    }

    fn ok(id: usize, num: usize, from: Option<&'static str>) -> Shard {
        Shard { id, num, from }
    }

    fn err(r: Result<Shard>) -> String {
        format!("{:#}", r.expect_err("should be refused"))
    }

    #[test]
    fn flags_win_and_nothing_means_one_shard() {
        assert_eq!(shard(None, None, &[]).unwrap(), ok(0, 1, None));
        assert_eq!(shard(Some(2), Some(3), &[("RANK", "0"), ("WORLD_SIZE", "5")]).unwrap(), ok(2, 3, None));
        assert!(err(shard(Some(1), None, &[])).contains("--shard-id needs --shard-num"));
        assert!(err(shard(None, Some(4), &[])).contains("needs --shard-id"));
        assert!(err(shard(Some(3), Some(3), &[])).contains("not below the shard count 3"));
    }

    #[test]
    fn slurm_arrays_count_from_their_first_index_in_steps() {
        let a = [("SLURM_ARRAY_TASK_ID", "3"), ("SLURM_ARRAY_TASK_COUNT", "4"), ("SLURM_ARRAY_TASK_MIN", "0"), ("SLURM_ARRAY_TASK_MAX", "3")];
        assert_eq!(shard(None, None, &a).unwrap(), ok(3, 4, Some("SLURM_ARRAY_TASK_ID")));
        // --array=1-7:2 gives tasks 1, 3, 5, 7.
        let b = [("SLURM_ARRAY_TASK_ID", "5"), ("SLURM_ARRAY_TASK_COUNT", "4"), ("SLURM_ARRAY_TASK_MIN", "1"), ("SLURM_ARRAY_TASK_MAX", "7"), ("SLURM_ARRAY_TASK_STEP", "2")];
        assert_eq!(shard(None, None, &b).unwrap(), ok(2, 4, Some("SLURM_ARRAY_TASK_ID")));
        // The array wins over torchrun's variables; a count flag must agree with it.
        let mut c = a.to_vec();
        c.extend([("RANK", "1"), ("WORLD_SIZE", "2")]);
        assert_eq!(shard(None, Some(4), &c).unwrap(), ok(3, 4, Some("SLURM_ARRAY_TASK_ID")));
        assert!(err(shard(None, Some(8), &a)).contains("--shard-num 8 disagrees with SLURM_ARRAY_TASK_COUNT=4"));
        // --array=1,2,9: three tasks, not evenly spaced.
        let d = [("SLURM_ARRAY_TASK_ID", "9"), ("SLURM_ARRAY_TASK_COUNT", "3"), ("SLURM_ARRAY_TASK_MIN", "1"), ("SLURM_ARRAY_TASK_MAX", "9")];
        assert!(err(shard(None, None, &d)).contains("not evenly spaced"));
        assert!(err(shard(None, None, &[("SLURM_ARRAY_TASK_ID", "0")])).contains("SLURM_ARRAY_TASK_COUNT is not"));
        let e = [("SLURM_ARRAY_TASK_ID", "5"), ("SLURM_ARRAY_TASK_COUNT", "1"), ("SLURM_ARRAY_TASK_MIN", "5"), ("SLURM_ARRAY_TASK_MAX", "2")];
        assert!(err(shard(None, None, &e)).contains("not evenly spaced"));
        assert!(err(shard(None, None, &[("SLURM_ARRAY_TASK_ID", "x")])).contains("SLURM_ARRAY_TASK_ID=\"x\" is not a whole number"));
    }

    #[test]
    fn kubernetes_indexes_take_their_count_from_the_flag() {
        assert_eq!(shard(None, Some(8), &[("JOB_COMPLETION_INDEX", "7")]).unwrap(), ok(7, 8, Some("JOB_COMPLETION_INDEX")));
        assert!(err(shard(None, None, &[("JOB_COMPLETION_INDEX", "0")])).contains("give them as --shard-num"));
        assert!(err(shard(None, Some(8), &[("JOB_COMPLETION_INDEX", "8")])).contains("not below the shard count 8"));
    }

    #[test]
    fn torchrun_ranks() {
        assert_eq!(shard(None, None, &[("RANK", "1"), ("WORLD_SIZE", "2")]).unwrap(), ok(1, 2, Some("RANK")));
        assert!(err(shard(None, None, &[("RANK", "1")])).contains("WORLD_SIZE is not"));
        assert!(err(shard(None, Some(3), &[("RANK", "1"), ("WORLD_SIZE", "2")])).contains("disagrees with WORLD_SIZE=2"));
    }
}
