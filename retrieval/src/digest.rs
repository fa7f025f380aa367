//! SHA-256 of file contents: what caches and resumable outputs are keyed on, so that a file
//! rewritten in place (same path, even the same size) is never served results made from its
//! old content.

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::io::{BufRead, BufReader};
use std::path::Path;

/// The hex SHA-256 of a file's bytes and its number of non-blank lines (blank as the data
/// readers skip them: nothing but whitespace), in one streamed pass.
pub fn file_digest_and_lines(path: &Path) -> Result<(String, usize)> {
    let file = std::fs::File::open(path).with_context(|| format!("{}: cannot open", path.display()))?;
    let mut reader = BufReader::with_capacity(1 << 20, file);
    let mut hasher = Sha256::new();
    let (mut line, mut lines) = (Vec::new(), 0usize);
    loop {
        line.clear();
        if reader.read_until(b'\n', &mut line).with_context(|| format!("{}: cannot read", path.display()))? == 0 {
            break;
        }
        hasher.update(&line);
        if !String::from_utf8_lossy(&line).trim().is_empty() {
            lines += 1;
        }
    }
    Ok((hex(&hasher.finalize()), lines))
}

/// The hex SHA-256 of a file's bytes.
pub fn file_digest(path: &Path) -> Result<String> {
    Ok(file_digest_and_lines(path)?.0)
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
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

/// The plugin and the settings that change embeddings (not the device, nor whether the
/// built-in encoders tokenise ahead), without the checkpoint's content: for callers that key
/// on the live weights instead (the services).
pub fn settings_identity(encoder: &str, settings: &Value) -> Value {
    let mut s = settings.clone();
    if let Some(obj) = s.as_object_mut() {
        obj.remove("device");
        obj.remove("tokenize_ahead");
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digest_follows_content_and_counts_non_blank_lines() {
        let dir = std::env::temp_dir().join(format!("rak-digest-file-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let a = dir.join("a.jsonl");
        std::fs::write(&a, b"{\"x\": 1}\n\n  \n{\"x\": 2}").unwrap();
        let (d, lines) = file_digest_and_lines(&a).unwrap();
        assert_eq!(lines, 2);
        // sha256 of the empty string, as a known value.
        let empty = dir.join("empty");
        std::fs::write(&empty, b"").unwrap();
        assert_eq!(file_digest(&empty).unwrap(), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
        // Same size, one byte changed in place: another digest.
        std::fs::write(&a, b"{\"x\": 1}\n\n  \n{\"x\": 3}").unwrap();
        assert_ne!(file_digest(&a).unwrap(), d);
        assert!(file_digest(&dir.join("missing")).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[cfg(test)]
mod checkpoint_tests {
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

    /// An AAR output used as a model (`host aar-train` keys its stages on it through the
    /// host's `checkpoint_digest` service) is its model files, not its run's records (stages/
    /// with its analysis.json, checkpoints, dot files).
    #[test]
    fn the_model_digest_leaves_out_the_runs_records() {
        let dir = std::env::temp_dir().join(format!("aar-digest-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("stages/train/checkpoint-1")).unwrap();
        std::fs::write(dir.join("model.safetensors"), b"weights").unwrap();
        std::fs::write(dir.join("config.json"), b"{}").unwrap();
        let before = checkpoint_digest(&dir).unwrap();
        std::fs::write(dir.join("stages/analysis.json"), b"{}").unwrap();
        std::fs::write(dir.join("stages/lock"), b"42").unwrap();
        std::fs::write(dir.join("stages/summary.json"), b"{}").unwrap();
        std::fs::write(dir.join("stages/train/checkpoint-1/trainer_state.json"), b"{}").unwrap();
        std::fs::write(dir.join(".model.safetensors.tmp-1"), b"half").unwrap();
        assert_eq!(checkpoint_digest(&dir).unwrap(), before, "the run's records changed the model's identity");
        std::fs::write(dir.join("model.safetensors"), b"other weights").unwrap();
        assert_ne!(checkpoint_digest(&dir).unwrap(), before, "the weights are the model");
        let _ = std::fs::remove_dir_all(&dir);
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
