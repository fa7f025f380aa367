//! Encode a JSONL file of passages or queries into `embeddings.npy` + `ids.txt`.
//!
//! The input is cut into parts of `part_size` lines. Each finished part is written
//! atomically under `OUTPUT/parts/`, so a killed run restarts where it stopped; `shard_id` /
//! `shard_num` spread the parts over processes or machines. When every part is there, they
//! are joined into `OUTPUT/embeddings.npy` and `OUTPUT/ids.txt` (again atomically) and the parts
//! are removed. Within a part, texts are batched by token length (the encoder's
//! `token_lengths`, falling back to characters): each batch then pads to a similar length,
//! which saves a quarter of the work on mini-KILT compared with sorting by characters.
//!
//! Several processes may work on one output at once (shards started together, or a relaunch
//! while the first run still goes), so two kinds of exclusive `flock` locks, which the kernel
//! drops when a process dies, keep them apart:
//! - `OUTPUT/.encode.lock` is held while checking or writing `parts/manifest.json` and
//!   `encode.json`, and for the whole join. Whoever takes it second sees the first one's
//!   result, so exactly one process joins and the others report the output complete. A
//!   process that finds it taken waits (with a log line) rather than failing: the holder only
//!   checks files or joins, which is short next to encoding.
//! - `parts/part-NNNNNN.lock` is held while encoding that part. A process that finds it taken
//!   skips the part (its holder writes it and, if it is the last, joins), so a relaunch of a
//!   shard that is still running shares the remaining parts with it instead of encoding them
//!   twice.
//!
//! The locks need `flock` to work across the processes involved: one machine, or a shared
//! file system that supports it.

use super::Progress;
use crate::data::beir;
use crate::npy::{self, NpyF32, NpyWriter};
use anyhow::{bail, Context, Result};
use rak_core::abi::Role;
use rak_core::encoders::passage_string;
use rak_core::plugin::Encoder;
use serde_json::{json, Value};
use std::fs::{File, OpenOptions, TryLockError};
use std::path::{Path, PathBuf};

/// Texts per encoder call unless a job says otherwise (`host encode --batch-size`'s default).
pub const DEFAULT_BATCH_SIZE: usize = 64;

/// One encoding job.
#[derive(Debug, Clone)]
pub struct EncodeJob {
    /// BEIR corpus lines (`{"_id","title","text"}`) or queries (`{"_id","text"}`).
    pub input: PathBuf,
    /// The directory that receives `embeddings.npy` and `ids.txt`.
    pub output: PathBuf,
    pub role: Role,
    /// Task name for query prefixes / markers.
    pub task: Option<String>,
    pub batch_size: usize,
    /// Which shard of the parts this process encodes, of `shard_num`.
    pub shard_id: usize,
    pub shard_num: usize,
    /// Lines per part (the unit of resumption).
    pub part_size: usize,
    /// What makes these embeddings (encoder, settings, checkpoint): a restart, or an output
    /// that is already complete, must have been made by the same.
    pub encoder_identity: Value,
}

impl EncodeJob {
    /// A job with the defaults of `host encode` (one shard, parts of 4,096, batches of 64).
    pub fn new(input: &Path, output: &Path, role: Role, encoder_identity: Value) -> Self {
        EncodeJob {
            input: input.to_path_buf(),
            output: output.to_path_buf(),
            role,
            task: None,
            batch_size: DEFAULT_BATCH_SIZE,
            shard_id: 0,
            shard_num: 1,
            part_size: 4096,
            encoder_identity,
        }
    }
}

/// The encoder a job runs.
pub enum EncoderSource<'a> {
    /// An encoder the caller already holds (e.g. a model being trained).
    Ready(&'a mut dyn Encoder),
    /// Made only if there is work left: a finished or fully resumed run loads no model.
    Lazy(Box<dyn FnOnce() -> Result<Box<dyn Encoder>> + 'a>),
}

/// How a job ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EncodeOutcome {
    /// `embeddings.npy` and `ids.txt` hold all `rows`.
    Complete { rows: usize },
    /// They already did, from an earlier run with the same settings; nothing was encoded.
    AlreadyComplete { rows: usize },
    /// This shard's parts are done; other shards still have parts to write (the last to
    /// finish joins them).
    ShardDone { present: usize, parts: usize },
}

fn parts_dir(out: &Path) -> PathBuf {
    out.join("parts")
}

fn part_paths(out: &Path, part: usize) -> (PathBuf, PathBuf) {
    let dir = parts_dir(out);
    (dir.join(format!("part-{part:06}.npy")), dir.join(format!("part-{part:06}.ids.txt")))
}

/// What a run's parts were made with; a restart must match it. The input is keyed by its
/// content: a file rewritten in place, even to the same size and line count, is a new input.
fn manifest(job: &EncodeJob, input_sha256: &str, lines: usize) -> Result<Value> {
    Ok(json!({
        "input_sha256": input_sha256,
        "lines": lines,
        "encoder": job.encoder_identity,
        "role": job.role,
        "task": job.task,
        "part_size": job.part_size,
    }))
}

/// `(id, text)` records, streamed.
type Records = Box<dyn Iterator<Item = Result<(String, String)>>>;

/// Iterate `(id, text)` of the input, as the role reads it.
fn records(job: &EncodeJob) -> Result<Records> {
    Ok(match job.role {
        Role::Passage => Box::new(beir::read_corpus(&job.input)?.map(|r| r.map(|p| (p.id, passage_string(&p.title, &p.text))))),
        Role::Query => Box::new(beir::read_queries(&job.input)?.map(|r| r.map(|q| (q.id, q.text)))),
    })
}

/// Run `job` (see the module docs).
pub fn encode_file(job: &EncodeJob, encoder: EncoderSource<'_>, progress: &dyn Progress) -> Result<EncodeOutcome> {
    if job.shard_num == 0 || job.shard_id >= job.shard_num {
        bail!("shard id must be below the number of shards (got {} of {})", job.shard_id, job.shard_num);
    }
    if job.batch_size == 0 || job.part_size == 0 {
        bail!("batch size and part size must be positive");
    }
    let final_npy = job.output.join("embeddings.npy");
    let (input_sha256, lines) = crate::digest::file_digest_and_lines(&job.input)?;
    if lines == 0 {
        bail!("{}: empty input (no records)", job.input.display());
    }
    let manifest = manifest(job, &input_sha256, lines)?;
    let manifest_path = parts_dir(&job.output).join("manifest.json");
    // `encode.json` is written last: its presence (with this run's settings) means done.
    let done_path = job.output.join("encode.json");
    // Before the lock file is made in it, and again under the lock (where another process's
    // manifest is whole).
    check_output_is_ours(&job.output)?;
    std::fs::create_dir_all(&job.output).with_context(|| format!("{}: cannot create", job.output.display()))?;
    {
        let _lock = lock_output(&job.output, progress)?;
        check_output_is_ours(&job.output)?;
        if let Some(rows) = finished(job, &manifest, lines)? {
            progress.log(&format!("encode: {} is already complete", final_npy.display()));
            return Ok(EncodeOutcome::AlreadyComplete { rows });
        }
        match std::fs::read_to_string(&manifest_path) {
            Ok(text) => {
                let old: Value = serde_json::from_str(&text).with_context(|| format!("{}: corrupt", manifest_path.display()))?;
                if old != manifest {
                    bail!(
                        "{} holds parts of a run with other settings, another input or another checkpoint; choose another output directory or delete it",
                        job.output.display()
                    );
                }
            }
            Err(_) => {
                if final_npy.exists() {
                    bail!("{} already holds an embeddings.npy; choose another output directory or delete it", job.output.display());
                }
                std::fs::create_dir_all(parts_dir(&job.output)).with_context(|| format!("{}: cannot create", job.output.display()))?;
                rak_core::fsutil::write_bytes(&manifest_path, serde_json::to_string_pretty(&manifest)?.as_bytes())?
            }
        }
    }

    let num_parts = lines.div_ceil(job.part_size);
    let mine: Vec<usize> = (0..num_parts).filter(|p| p % job.shard_num == job.shard_id).collect();
    let todo: Vec<usize> = mine.iter().copied().filter(|&p| !part_paths(&job.output, p).0.exists()).collect();
    let todo_lines: usize = todo.iter().map(|&p| job.part_size.min(lines - p * job.part_size)).sum();
    if todo.len() < mine.len() {
        progress.log(&format!("encode: resuming, {} of this shard's {} parts already done", mine.len() - todo.len(), mine.len()));
    }

    // A first pass skips parts another live process has claimed; then this process waits for
    // those claims and encodes whatever their holder did not finish (it may have died), so a
    // process never reports its shard done while one of its parts is missing.
    let mut encoder = LiveEncoder::new(encoder);
    let mut pending = todo.clone();
    let mut wait = false;
    if !pending.is_empty() {
        progress.start("encode", todo_lines as u64);
    }
    while let Some(&last) = pending.last() {
        let mut busy = Vec::new();
        let mut records = records(job)?;
        for part in 0..=last {
            let chunk: Vec<(String, String)> = records.by_ref().take(job.part_size).collect::<Result<_>>()?;
            if chunk.is_empty() {
                bail!("{}: ended early (changed while encoding?)", job.input.display());
            }
            if !pending.contains(&part) {
                continue;
            }
            let _claim = match claim_part(&job.output, part, wait)? {
                Claim::Mine(lock) => lock,
                Claim::Busy => {
                    busy.push(part);
                    continue;
                }
                // `parts/` is gone: another process joined everything.
                Claim::Gone => {
                    busy.clear();
                    break;
                }
            };
            let (npy_path, ids_path) = part_paths(&job.output, part);
            // Re-checked under the claim: another process may have written it since `todo`
            // was listed, or finished the whole output.
            if npy_path.exists() || done_path.exists() {
                continue;
            }
            let texts: Vec<&str> = chunk.iter().map(|(_, t)| t.as_str()).collect();
            let (rows, dim) = encode_texts(encoder.get()?, &texts, job.role, job.task.as_deref(), job.batch_size, progress)?;
            let ids: Vec<&str> = chunk.iter().map(|(id, _)| id.as_str()).collect();
            npy::write_ids(&ids_path, &ids)?;
            npy::write_f32(&npy_path, &rows, dim)?; // written last: its presence marks the part done
        }
        if !busy.is_empty() {
            progress.log(&format!("encode: waiting for another process encoding {} of this shard's parts", busy.len()));
        }
        pending = busy;
        wait = true;
    }
    progress.finish();

    // The last process to write a part sees them all here: each writes its parts before
    // taking the lock, and the lock orders the checks.
    let _lock = lock_output(&job.output, progress)?;
    if let Some(rows) = finished(job, &manifest, lines)? {
        progress.log(&format!("encode: {rows} embeddings in {} (joined by another process)", final_npy.display()));
        return Ok(EncodeOutcome::Complete { rows });
    }
    let present = (0..num_parts).filter(|&p| part_paths(&job.output, p).0.exists()).count();
    if present < num_parts {
        progress.log(&format!(
            "encode: shard {}/{} done; {present} of {num_parts} parts present, the last shard to finish joins them",
            job.shard_id, job.shard_num
        ));
        return Ok(EncodeOutcome::ShardDone { present, parts: num_parts });
    }
    join_parts(&job.output, num_parts)?;
    rak_core::fsutil::write_bytes(&done_path, serde_json::to_string_pretty(&manifest)?.as_bytes())?;
    remove_parts(&job.output);
    progress.log(&format!("encode: {lines} embeddings in {}", final_npy.display()));
    Ok(EncodeOutcome::Complete { rows: lines })
}

/// With the output lock held: `Some(rows)` if `encode.json` says this very job is done (then
/// parts left by a run killed before it removed them are removed), an error if it says the
/// output was made differently, `None` if it is not done.
fn finished(job: &EncodeJob, manifest: &Value, lines: usize) -> Result<Option<usize>> {
    let Ok(text) = std::fs::read_to_string(job.output.join("encode.json")) else { return Ok(None) };
    if serde_json::from_str::<Value>(&text).ok().as_ref() != Some(manifest) {
        bail!(
            "{} already holds embeddings made differently (other settings, another input or another checkpoint); choose another output directory or delete it",
            job.output.display()
        );
    }
    // Nobody writes parts once encode.json exists (writers re-check it under their claim).
    remove_parts(&job.output);
    Ok(Some(lines))
}

/// Refuse an output folder that holds files but nothing that says `encode` made it
/// (`encode.json`, or `parts/manifest.json` of a run in progress): the join would write
/// `embeddings.npy` and `ids.txt` over files of the same names, and files of someone else's
/// would end up beside ours. Its own lock file, and a `parts/` left empty (or holding only a
/// temporary file) by a run killed before it wrote the manifest, do not count.
fn check_output_is_ours(out: &Path) -> Result<()> {
    let entries = match std::fs::read_dir(out) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).with_context(|| format!("{}: cannot list", out.display())),
    };
    // The manifest first: a finishing run writes encode.json and then removes parts/, so a
    // manifest found gone means encode.json is there by the next look. In the other order a
    // run finishing between the two looks would leave neither seen (a concurrent join, which
    // makes this check before taking the lock, then refused a finished output as foreign).
    if parts_dir(out).join("manifest.json").exists() || out.join("encode.json").exists() {
        return Ok(());
    }
    let only_temporaries = |dir: &Path| std::fs::read_dir(dir).is_ok_and(|d| d.flatten().all(|e| e.file_name().to_string_lossy().starts_with('.')));
    let foreign: Vec<String> = entries
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n != ".encode.lock" && !(n == "parts" && only_temporaries(&parts_dir(out))))
        .collect();
    if !foreign.is_empty() {
        let mut shown: Vec<&str> = foreign.iter().take(5).map(String::as_str).collect();
        if foreign.len() > shown.len() {
            shown.push("...");
        }
        bail!(
            "{}: holds files that host encode did not write ({}); it writes embeddings.npy, ids.txt and parts/ there, so it takes only an empty or new directory, or one of its own outputs: choose another output directory",
            out.display(),
            shown.join(", ")
        );
    }
    Ok(())
}

/// Remove `parts/` once joined: only the files a run writes there (parts, their ids and
/// locks, the manifest, and their temporary files), then the folder if that emptied it.
fn remove_parts(out: &Path) {
    let dir = parts_dir(out);
    let Ok(entries) = std::fs::read_dir(&dir) else { return };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let bare = name.trim_start_matches('.');
        let ours = bare.starts_with("part-") || bare.starts_with("manifest.json");
        if ours && e.file_type().is_ok_and(|t| t.is_file()) {
            let _ = std::fs::remove_file(e.path());
        }
    }
    // Fails, and keeps the folder, when something else is left in it.
    let _ = std::fs::remove_dir(&dir);
}

/// Remove what `encode` writes in `out` (`embeddings.npy`, `ids.txt`, `encode.json`, its lock,
/// `parts/` as [`remove_parts`] does, and their temporary files), then `out` itself if that
/// emptied it. Anything else there is someone else's and kept: its names (relative to `out`)
/// are returned, for the caller to warn about.
pub fn remove_output(out: &Path) -> Vec<String> {
    const WRITTEN: [&str; 3] = ["embeddings.npy", "ids.txt", "encode.json"];
    let Ok(entries) = std::fs::read_dir(out) else { return Vec::new() };
    let mut kept = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let file = e.file_type().is_ok_and(|t| t.is_file());
        if name == "parts" && e.file_type().is_ok_and(|t| t.is_dir()) {
            remove_parts(out);
            if let Ok(left) = std::fs::read_dir(parts_dir(out)) {
                kept.extend(left.flatten().map(|l| format!("parts/{}", l.file_name().to_string_lossy())));
            }
            continue;
        }
        // `.embeddings.npy.partial`, `.embeddings.npy.join-PID`, `.ids.txt.tmp-PID`, ...
        let temporary = |w: &str| name.strip_prefix('.').and_then(|t| t.strip_prefix(w)).is_some_and(|t| t.starts_with('.'));
        let ours = WRITTEN.contains(&name.as_str()) || name == ".encode.lock" || WRITTEN.iter().any(|w| temporary(*w));
        if ours && file {
            let _ = std::fs::remove_file(e.path());
        } else {
            kept.push(name);
        }
    }
    kept.sort();
    // Fails, and keeps the folder, when something else is left in it.
    let _ = std::fs::remove_dir(out);
    kept
}

/// Open (creating) `path` for locking.
fn lock_file(path: &Path) -> std::io::Result<File> {
    OpenOptions::new().create(true).truncate(false).write(true).open(path)
}

/// Take the output's lock, waiting for another process that holds it. Released on drop.
fn lock_output(out: &Path, progress: &dyn Progress) -> Result<File> {
    let path = out.join(".encode.lock");
    // Never removed: a process waiting on a removed file's lock would not exclude the next
    // one, which locks a new file under the same name.
    let file = lock_file(&path).with_context(|| format!("{}: cannot create", path.display()))?;
    match file.try_lock() {
        Ok(()) => {}
        Err(TryLockError::WouldBlock) => {
            progress.log(&format!("encode: waiting for another process that is encoding into {}", out.display()));
            file.lock().with_context(|| format!("{}: cannot lock", path.display()))?;
        }
        Err(TryLockError::Error(e)) => return Err(e).with_context(|| format!("{}: cannot lock", path.display())),
    }
    Ok(file)
}

enum Claim {
    /// This process holds the part's lock until the file is dropped.
    Mine(File),
    /// Another process is encoding the part.
    Busy,
    /// `parts/` no longer exists: the output was joined.
    Gone,
}

/// Take the lock of `part`: waiting for it when `wait`, else only if it is free.
fn claim_part(out: &Path, part: usize, wait: bool) -> Result<Claim> {
    let path = parts_dir(out).join(format!("part-{part:06}.lock"));
    let file = match lock_file(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Claim::Gone),
        Err(e) => return Err(e).with_context(|| format!("{}: cannot create", path.display())),
    };
    if wait {
        file.lock().with_context(|| format!("{}: cannot lock", path.display()))?;
        // The holder may have finished everything and removed `parts/` meanwhile.
        return Ok(if parts_dir(out).exists() { Claim::Mine(file) } else { Claim::Gone });
    }
    match file.try_lock() {
        Ok(()) => Ok(Claim::Mine(file)),
        Err(TryLockError::WouldBlock) => Ok(Claim::Busy),
        Err(TryLockError::Error(e)) => Err(e).with_context(|| format!("{}: cannot lock", path.display())),
    }
}

/// The job's encoder, made on first use: a process whose parts all turn out done or claimed
/// by others never loads a model.
struct LiveEncoder<'a> {
    source: Option<EncoderSource<'a>>,
    owned: Option<Box<dyn Encoder>>,
}

impl<'a> LiveEncoder<'a> {
    fn new(source: EncoderSource<'a>) -> Self {
        LiveEncoder { source: Some(source), owned: None }
    }

    fn get(&mut self) -> Result<&mut dyn Encoder> {
        if let Some(EncoderSource::Lazy(_)) = self.source {
            let Some(EncoderSource::Lazy(make)) = self.source.take() else { unreachable!() };
            self.owned = Some(make()?);
        }
        Ok(match (&mut self.source, &mut self.owned) {
            (Some(EncoderSource::Ready(e)), _) => &mut **e,
            (_, Some(e)) => e.as_mut(),
            _ => unreachable!("the encoder is either lent or made"),
        })
    }
}

/// Encode texts in length-sorted batches without gradients; returns the rows in input order,
/// row-major f32, and their width. Batching by length changes no embedding (an encoder's
/// output for a text must not depend on its batchmates), only the padding work.
pub fn encode_texts(
    encoder: &mut dyn Encoder,
    texts: &[&str],
    role: Role,
    task: Option<&str>,
    batch_size: usize,
    progress: &dyn Progress,
) -> Result<(Vec<f32>, usize)> {
    let lengths = match encoder.token_lengths(texts, role, task)? {
        Some(tokens) if tokens.len() == texts.len() => tokens,
        _ => texts.iter().map(|t| t.len()).collect(),
    };
    let mut order: Vec<usize> = (0..texts.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(lengths[i]));
    let mut out: Vec<f32> = Vec::new();
    let mut dim = 0;
    let batches: Vec<&[usize]> = order.chunks(batch_size.max(1)).collect();
    for (at, batch) in batches.iter().enumerate() {
        let batch_texts: Vec<&str> = batch.iter().map(|&i| texts[i]).collect();
        if let Some(next) = batches.get(at + 1) {
            // Tokenised (by an encoder that can) while this batch runs on the device.
            let next: Vec<&str> = next.iter().map(|&i| texts[i]).collect();
            encoder.prepare(&next, role, task)?;
        }
        let emb = encoder.encode(&batch_texts, role, task, false)?;
        let flat = embedding_rows(&emb, batch_texts.len())?;
        let width = flat.len() / batch_texts.len();
        if dim == 0 {
            dim = width;
            out = vec![0.0; texts.len() * dim];
        } else if width != dim {
            bail!("the encoder returned rows of width {width} after rows of width {dim}");
        }
        for (row, &i) in batch.iter().enumerate() {
            out[i * dim..(i + 1) * dim].copy_from_slice(&flat[row * dim..(row + 1) * dim]);
        }
        progress.inc(batch_texts.len() as u64);
    }
    Ok((out, dim))
}

/// Check an encoder's output for `n` texts (a defined `[n, dim]` tensor, `dim > 0`) and copy it
/// to the CPU as row-major f32.
pub fn embedding_rows(emb: &tch::Tensor, n: usize) -> Result<Vec<f32>> {
    if !emb.defined() {
        bail!("the encoder returned an undefined tensor for {n} texts");
    }
    let size = emb.size();
    if size.len() != 2 || size[0] != n as i64 || size[1] <= 0 {
        bail!("the encoder returned shape {size:?} for {n} texts (expected [{n}, dim])");
    }
    let emb = emb.detach().to_kind(tch::Kind::Float).to_device(tch::Device::Cpu).contiguous();
    Ok(Vec::<f32>::try_from(emb.view([-1]))?)
}

/// Join the parts into `embeddings.npy` and `ids.txt`; the caller holds the output lock.
fn join_parts(out: &Path, num_parts: usize) -> Result<()> {
    remove_stale_temporaries(out);
    // A name of this process's own (not `NpyWriter`'s fixed `.embeddings.npy.partial`), moved
    // into place once whole: even a joiner that somehow ran beside another could not write
    // into the other's file.
    let tmp = out.join(format!(".embeddings.npy.join-{}", std::process::id()));
    let mut ids: Vec<String> = Vec::new();
    let first = NpyF32::open(&part_paths(out, 0).0)?;
    let mut writer = NpyWriter::create(&tmp, first.dim())?;
    drop(first);
    for p in 0..num_parts {
        let (npy_path, ids_path) = part_paths(out, p);
        let part = NpyF32::open(&npy_path)?;
        let part_ids = npy::read_ids(&ids_path)?;
        if part_ids.len() != part.rows() {
            bail!("{}: {} ids for {} rows in {}", ids_path.display(), part_ids.len(), part.rows(), npy_path.display());
        }
        writer.append(part.data())?;
        ids.extend(part_ids);
    }
    writer.finish()?;
    let npy_path = out.join("embeddings.npy");
    if let Err(e) = std::fs::rename(&tmp, &npy_path) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e).with_context(|| format!("{}: cannot move into place", npy_path.display()));
    }
    // As `NpyWriter::finish` does for its own rename: a crash must not lose this one.
    File::open(out).and_then(|d| d.sync_all()).with_context(|| format!("{}: cannot sync the directory to disk", out.display()))?;
    npy::write_ids(&out.join("ids.txt"), &ids)
}

/// Remove temporary files that killed joins left in `out`. Only the holder of the output lock
/// writes these names, so with the lock held any that exist are stale.
fn remove_stale_temporaries(out: &Path) {
    let Ok(entries) = std::fs::read_dir(out) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let stem = name.trim_start_matches('.');
        if name.starts_with('.') && ["embeddings.npy", "ids.txt", "encode.json"].iter().any(|s| stem.starts_with(s)) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Tensor;

    /// Records each call: `("prepare" | "encode", texts)`; embeds a text as its length.
    #[derive(Default)]
    struct Recording(Vec<(&'static str, Vec<String>)>);

    impl Encoder for Recording {
        fn encode(&mut self, texts: &[&str], _: Role, _: Option<&str>, _: bool) -> Result<Tensor> {
            self.0.push(("encode", texts.iter().map(|t| t.to_string()).collect()));
            let v: Vec<f32> = texts.iter().map(|t| t.len() as f32).collect();
            Ok(Tensor::from_slice(&v).view([texts.len() as i64, 1]))
        }
        fn prepare(&mut self, texts: &[&str], _: Role, _: Option<&str>) -> Result<()> {
            self.0.push(("prepare", texts.iter().map(|t| t.to_string()).collect()));
            Ok(())
        }
        fn parameters(&self) -> Result<Vec<(String, Tensor)>> {
            Ok(Vec::new())
        }
        fn info(&self) -> Result<Value> {
            Ok(json!({"dim": 1, "parameters": 0}))
        }
        fn save(&self, _: &Path) -> Result<()> {
            Ok(())
        }
    }

    /// Each batch after the first is announced, exactly as it is then encoded, before the batch
    /// ahead of it is encoded; the rows come back in input order.
    #[test]
    fn each_batch_is_announced_while_the_one_before_is_encoded() {
        let texts = ["a", "bbbb", "cc", "ddddd", "e"];
        let mut enc = Recording::default();
        let (rows, dim) = encode_texts(&mut enc, &texts, Role::Passage, None, 2, &super::super::Quiet).unwrap();
        assert_eq!((rows, dim), (vec![1.0, 4.0, 2.0, 5.0, 1.0], 1));
        let calls: Vec<(&str, Vec<&str>)> = enc.0.iter().map(|(c, t)| (*c, t.iter().map(String::as_str).collect())).collect();
        assert_eq!(
            calls,
            vec![
                ("prepare", vec!["cc", "a"]),
                ("encode", vec!["ddddd", "bbbb"]),
                ("prepare", vec!["e"]),
                ("encode", vec!["cc", "a"]),
                ("encode", vec!["e"]),
            ]
        );
    }
}
