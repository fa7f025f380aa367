//! `host encode`: a JSONL file of passages or queries → `embeddings.npy` + `ids.txt`
//! (resumable, shardable, safe to run several times at once on one output; see
//! `rak_retrieval::pipeline::encode`).

use super::Bar;
use crate::registry::Registry;
use anyhow::{bail, Context, Result};
use rak_core::abi::Role;
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

/// Settings that name checkpoints (files or directories) whose content makes the embeddings.
const CHECKPOINT_SETTINGS: [&str; 2] = ["model", "passage_model"];

/// What identifies the embeddings an encoder plugin makes with these settings: the plugin,
/// the settings that change embeddings (not the device) and the checkpoint's content. The
/// path alone would not do: a trainer (ANCE episodes) rewrites its checkpoint in place, and
/// re-encoding must not then reuse the old checkpoint's embeddings.
pub fn encoder_identity(encoder: &str, settings: &Value) -> Result<Value> {
    let mut identity = settings_identity(encoder, settings);
    let mut checkpoints = serde_json::Map::new();
    for key in CHECKPOINT_SETTINGS {
        if let Some(path) = settings.get(key).and_then(Value::as_str) {
            checkpoints.insert(key.to_string(), json!(checkpoint_digest(Path::new(path))?));
        }
    }
    identity["checkpoint"] = Value::Object(checkpoints);
    Ok(identity)
}

/// The plugin and the settings that change embeddings (not the device), without the
/// checkpoint's content: for callers that key on the live weights instead (the services).
pub fn settings_identity(encoder: &str, settings: &Value) -> Value {
    let mut s = settings.clone();
    if let Some(obj) = s.as_object_mut() {
        obj.remove("device");
    }
    json!({"plugin": encoder, "settings": s})
}

/// SHA-256 of a checkpoint: of each file under `path` (or of `path` itself), in order of
/// relative path, its path, length and content, streamed. Entries whose names start with a dot
/// are left out (temporary names of atomic writes in progress, `.git`), and so are
/// subdirectories that are `host encode` outputs (they hold `.encode.lock`): their content
/// derives from the checkpoint, and would change its digest on each run if an output were
/// put inside the checkpoint's directory. A `host train` output folder is also its final
/// model: its checkpoints, indexes and logs are not part of that model and are left out
/// (subfolders holding `trainer_state.json`, `index.json` or `analysis.json`, the
/// `episode-N` stages of an ANCE run, `trainer_log.jsonl`, `negatives-*.json`, `run.json` and
/// the stage marks), so encoding with `--model OUT` neither re-reads gigabytes of
/// checkpoints nor changes identity whenever training writes a log line.
pub fn checkpoint_digest(path: &Path) -> Result<String> {
    use sha2::{Digest, Sha256};
    fn visit(hasher: &mut Sha256, path: &Path, rel: &str, depth: usize) -> Result<()> {
        let meta = std::fs::metadata(path).with_context(|| format!("{}: cannot read the checkpoint", path.display()))?;
        if meta.is_dir() {
            // Symbolic links are followed (Hugging Face caches link into blobs/); a loop ends here.
            if depth > 32 {
                bail!("{}: checkpoint directories nest too deep (a symbolic link loop?)", path.display());
            }
            if depth > 0 && [".encode.lock", "trainer_state.json", "index.json", "analysis.json"].iter().any(|f| path.join(f).exists()) {
                return Ok(());
            }
            let mut names: Vec<String> = std::fs::read_dir(path)
                .with_context(|| format!("{}: cannot list the checkpoint", path.display()))?
                .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
                .collect::<std::io::Result<_>>()
                .with_context(|| format!("{}: cannot list the checkpoint", path.display()))?;
            names.retain(|n| {
                !n.starts_with('.')
                    && !["trainer_log.jsonl", "run.json", "stage_done", "final_model_done"].contains(&n.as_str())
                    && !(n.starts_with("negatives-") && n.ends_with(".json"))
                    // An ANCE run's stages: each its own model, not part of the final one.
                    && !(depth == 0 && n.strip_prefix("episode-").is_some_and(|e| e.parse::<u32>().is_ok()))
            });
            names.sort();
            for name in names {
                let child_rel = if rel.is_empty() { name.clone() } else { format!("{rel}/{name}") };
                visit(hasher, &path.join(&name), &child_rel, depth + 1)?;
            }
        } else {
            // The name and length frame the content, so no two different trees hash the same.
            hasher.update(rel.as_bytes());
            hasher.update([0u8]);
            hasher.update(meta.len().to_le_bytes());
            let file = std::fs::File::open(path).with_context(|| format!("{}: cannot read the checkpoint", path.display()))?;
            let copied = std::io::copy(&mut std::io::BufReader::with_capacity(1 << 20, file), hasher)
                .with_context(|| format!("{}: cannot read the checkpoint", path.display()))?;
            if copied != meta.len() {
                bail!("{}: changed while its digest was taken", path.display());
            }
        }
        Ok(())
    }
    let mut hasher = Sha256::new();
    visit(&mut hasher, path, "", 0)?;
    Ok(format!("{:x}", hasher.finalize()))
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
    let make = || registry.encoder(&args.encoder, &settings);
    encode_file(&job, EncoderSource::Lazy(Box::new(make)), &Bar::default())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::checkpoint_digest;
    use std::path::Path;

    fn write(dir: &Path, rel: &str, bytes: &[u8]) {
        let path = dir.join(rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, bytes).unwrap();
    }

    #[test]
    fn the_checkpoint_digest_follows_content_not_place() {
        let root = std::env::temp_dir().join(format!("rak-digest-{}", std::process::id()));
        let (a, b) = (root.join("a"), root.join("b"));
        for dir in [&a, &b] {
            write(dir, "config.json", b"{}");
            write(dir, "query_encoder/model.safetensors", &[1, 2, 3, 4]);
        }
        let digest = checkpoint_digest(&a).unwrap();
        assert_eq!(digest, checkpoint_digest(&b).unwrap(), "same files elsewhere, same digest");

        // Temporary files of a write in progress and encode outputs kept inside do not count.
        write(&a, ".model.safetensors.tmp-42", b"half");
        write(&a, "emb/.encode.lock", b"");
        write(&a, "emb/embeddings.npy", b"rows");
        assert_eq!(digest, checkpoint_digest(&a).unwrap());

        // One byte changed in place, a file renamed, or bytes moved between files: another digest.
        write(&b, "query_encoder/model.safetensors", &[1, 2, 3, 5]);
        assert_ne!(digest, checkpoint_digest(&b).unwrap());
        std::fs::remove_dir_all(&b).unwrap();
        write(&b, "config.json", b"{}");
        write(&b, "query_encoder/model2.safetensors", &[1, 2, 3, 4]);
        assert_ne!(digest, checkpoint_digest(&b).unwrap());
        std::fs::remove_dir_all(&b).unwrap();
        write(&b, "config.json", b"{}\x01");
        write(&b, "query_encoder/model.safetensors", &[2, 3, 4]);
        assert_ne!(digest, checkpoint_digest(&b).unwrap());

        assert!(checkpoint_digest(&root.join("missing")).is_err());
        std::fs::remove_dir_all(&root).unwrap();
    }

    /// A `host train` output folder is the final model plus checkpoints, indexes and logs: only
    /// the model counts.
    #[test]
    fn a_training_output_is_digested_as_its_model() {
        let root = std::env::temp_dir().join(format!("rak-digest-train-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        write(&root, "model.safetensors", b"weights");
        write(&root, "1_Pooling/config.json", b"{}");
        let before = checkpoint_digest(&root).unwrap();
        write(&root, "checkpoint-100/trainer_state.json", b"{}");
        write(&root, "checkpoint-100/model.safetensors", b"older weights");
        write(&root, "bm25-index/index.json", b"{}");
        write(&root, "trainer_log.jsonl", b"{\"step\": 1}\n");
        write(&root, "negatives-episode-0.json", b"{}");
        assert_eq!(checkpoint_digest(&root).unwrap(), before);
        write(&root, "model.safetensors", b"new weights");
        assert_ne!(checkpoint_digest(&root).unwrap(), before);
        std::fs::remove_dir_all(&root).unwrap();
    }
}
