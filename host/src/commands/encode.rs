//! `host encode`: a JSONL file of passages or queries → `embeddings.npy` + `ids.txt`.
//!
//! The input is cut into parts of `--part-size` lines. Each finished part is written
//! atomically under `OUTPUT/parts/`, so a killed run restarts where it stopped; `--shard-id`
//! / `--shard-num` spread the parts over processes or machines. When every part is there, they
//! are joined into `OUTPUT/embeddings.npy` and `OUTPUT/ids.txt` (again atomically) and the parts
//! are removed. Within a part, texts are batched by token length (the encoder's
//! `token_lengths`, falling back to characters): each batch then pads to a similar length,
//! which saves a quarter of the work on mini-KILT compared with sorting by characters.

use crate::registry::Registry;
use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use rak_core::abi::Role;
use rak_retrieval::data::beir;
use rak_core::encoders::passage_string;
use rak_retrieval::npy::{self, NpyF32, NpyWriter};
use rak_core::plugin::Encoder;
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

fn parts_dir(out: &Path) -> PathBuf {
    out.join("parts")
}

fn part_paths(out: &Path, part: usize) -> (PathBuf, PathBuf) {
    let dir = parts_dir(out);
    (dir.join(format!("part-{part:06}.npy")), dir.join(format!("part-{part:06}.ids.txt")))
}

/// What a run's parts were made with; a restart must match it.
fn manifest(args: &EncodeArgs, lines: usize) -> Result<Value> {
    let meta = std::fs::metadata(&args.input).with_context(|| format!("{}: cannot read", args.input.display()))?;
    Ok(json!({
        "input": std::fs::canonicalize(&args.input)?,
        "input_bytes": meta.len(),
        "lines": lines,
        "encoder": args.encoder,
        "model": std::fs::canonicalize(&args.model).unwrap_or(args.model.clone()),
        "role": args.role,
        "task": args.task,
        "max_length": args.model_args.max_length,
        "bf16": args.model_args.bf16,
        "encoder_settings": args.model_args.encoder_settings,
        "part_size": args.part_size,
    }))
}

fn count_records(path: &Path) -> Result<usize> {
    use std::io::BufRead;
    let file = std::fs::File::open(path).with_context(|| format!("{}: cannot open", path.display()))?;
    let mut n = 0;
    for line in std::io::BufReader::with_capacity(1 << 20, file).lines() {
        if !line.with_context(|| format!("{}: cannot read", path.display()))?.trim().is_empty() {
            n += 1;
        }
    }
    Ok(n)
}

/// `(id, text)` records, streamed.
type Records = Box<dyn Iterator<Item = Result<(String, String)>>>;

/// Iterate `(id, text)` of the input, as the role reads it.
fn records(args: &EncodeArgs) -> Result<Records> {
    Ok(match args.role {
        Role::Passage => Box::new(beir::read_corpus(&args.input)?.map(|r| r.map(|p| (p.id, passage_string(&p.title, &p.text))))),
        Role::Query => Box::new(beir::read_queries(&args.input)?.map(|r| r.map(|q| (q.id, q.text)))),
    })
}

pub fn run(registry: &Registry, args: &EncodeArgs) -> Result<()> {
    if args.shard_num == 0 || args.shard_id >= args.shard_num {
        bail!("--shard-id must be below --shard-num (got {} of {})", args.shard_id, args.shard_num);
    }
    if args.model_args.batch_size == 0 || args.part_size == 0 {
        bail!("--batch-size and --part-size must be positive");
    }
    let final_npy = args.output.join("embeddings.npy");
    let lines = count_records(&args.input)?;
    if lines == 0 {
        bail!("{}: empty input (no records)", args.input.display());
    }
    let manifest = manifest(args, lines)?;
    let manifest_path = parts_dir(&args.output).join("manifest.json");
    // `encode.json` is written last: its presence (with this run's settings) means done.
    let done_path = args.output.join("encode.json");
    if let Ok(text) = std::fs::read_to_string(&done_path) {
        if serde_json::from_str::<Value>(&text).ok() == Some(manifest.clone()) {
            eprintln!("encode: {} is already complete", final_npy.display());
            return Ok(());
        }
        bail!("{} already holds embeddings made differently; choose another --output or delete it", args.output.display());
    }
    match std::fs::read_to_string(&manifest_path) {
        Ok(text) => {
            let old: Value = serde_json::from_str(&text).with_context(|| format!("{}: corrupt", manifest_path.display()))?;
            if old != manifest {
                bail!(
                    "{} holds parts of a run with other settings or another input; choose another --output or delete it",
                    args.output.display()
                );
            }
        }
        Err(_) => {
            if final_npy.exists() {
                bail!("{} already holds an embeddings.npy; choose another --output or delete it", args.output.display());
            }
            std::fs::create_dir_all(parts_dir(&args.output))
                .with_context(|| format!("{}: cannot create", args.output.display()))?;
            rak_core::fsutil::write_bytes(&manifest_path, serde_json::to_string_pretty(&manifest)?.as_bytes())?
        }
    }

    let num_parts = lines.div_ceil(args.part_size);
    let mine: Vec<usize> = (0..num_parts).filter(|p| p % args.shard_num == args.shard_id).collect();
    let todo: Vec<usize> = mine.iter().copied().filter(|&p| !part_paths(&args.output, p).0.exists()).collect();
    let todo_lines: usize = todo.iter().map(|&p| args.part_size.min(lines - p * args.part_size)).sum();
    if todo.len() < mine.len() {
        eprintln!("encode: resuming, {} of this shard's {} parts already done", mine.len() - todo.len(), mine.len());
    }

    if !todo.is_empty() {
        let settings = encoder_settings(&args.model, &args.model_args)?;
        let mut encoder = registry.encoder(&args.encoder, &settings)?;
        let bar = progress(todo_lines as u64, "encode");
        let mut records = records(args)?;
        let mut part = 0;
        loop {
            let chunk: Vec<(String, String)> = records.by_ref().take(args.part_size).collect::<Result<_>>()?;
            if chunk.is_empty() {
                break;
            }
            if todo.contains(&part) {
                let (npy_path, ids_path) = part_paths(&args.output, part);
                let rows = encode_sorted(encoder.as_mut(), &chunk, args, &bar)?;
                let dim = rows.len() / chunk.len();
                let ids: Vec<&str> = chunk.iter().map(|(id, _)| id.as_str()).collect();
                npy::write_ids(&ids_path, &ids)?;
                npy::write_f32(&npy_path, &rows, dim)?; // written last: its presence marks the part done
            }
            part += 1;
        }
        bar.finish_and_clear();
    }

    let present = (0..num_parts).filter(|&p| part_paths(&args.output, p).0.exists()).count();
    if present < num_parts {
        eprintln!("encode: shard {}/{} done; {present} of {num_parts} parts present, the last shard to finish joins them", args.shard_id, args.shard_num);
        return Ok(());
    }
    join_parts(&args.output, num_parts)?;
    rak_core::fsutil::write_bytes(&done_path, serde_json::to_string_pretty(&manifest)?.as_bytes())?;
    let _ = std::fs::remove_dir_all(parts_dir(&args.output));
    eprintln!("encode: {lines} embeddings in {}", final_npy.display());
    Ok(())
}

/// Encode one part in length-sorted batches; rows come back in input order, row-major f32.
fn encode_sorted(encoder: &mut dyn Encoder, chunk: &[(String, String)], args: &EncodeArgs, bar: &ProgressBar) -> Result<Vec<f32>> {
    let texts: Vec<&str> = chunk.iter().map(|(_, t)| t.as_str()).collect();
    let lengths = match encoder.token_lengths(&texts, args.role, args.task.as_deref())? {
        Some(tokens) if tokens.len() == texts.len() => tokens,
        _ => texts.iter().map(|t| t.len()).collect(),
    };
    let mut order: Vec<usize> = (0..chunk.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(lengths[i]));
    let mut out: Vec<f32> = Vec::new();
    let mut dim = 0;
    for batch in order.chunks(args.model_args.batch_size) {
        let texts: Vec<&str> = batch.iter().map(|&i| chunk[i].1.as_str()).collect();
        let emb = encoder.encode(&texts, args.role, args.task.as_deref(), false)?;
        let emb = emb.to_kind(tch::Kind::Float).to_device(tch::Device::Cpu).contiguous();
        let size = emb.size();
        if size.len() != 2 || size[0] != texts.len() as i64 {
            bail!("encoder {} returned shape {size:?} for {} texts", args.encoder, texts.len());
        }
        if dim == 0 {
            dim = size[1] as usize;
            out = vec![0.0; chunk.len() * dim];
        }
        let flat: Vec<f32> = Vec::<f32>::try_from(emb.view([-1]))?;
        for (row, &i) in batch.iter().enumerate() {
            out[i * dim..(i + 1) * dim].copy_from_slice(&flat[row * dim..(row + 1) * dim]);
        }
        bar.inc(texts.len() as u64);
    }
    Ok(out)
}

fn join_parts(out: &Path, num_parts: usize) -> Result<()> {
    let mut ids: Vec<String> = Vec::new();
    let first = NpyF32::open(&part_paths(out, 0).0)?;
    let mut writer = NpyWriter::create(&out.join("embeddings.npy"), first.dim())?;
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
    npy::write_ids(&out.join("ids.txt"), &ids)?;
    writer.finish()
}

/// A progress bar on stderr (hidden when stderr is not a terminal).
pub fn progress(len: u64, what: &str) -> ProgressBar {
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template("{prefix} {bar:40} {pos}/{len} [{elapsed_precise}<{eta_precise}, {per_sec}]")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_prefix(what.to_string());
    bar
}
