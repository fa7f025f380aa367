//! Passage indexes: exact inner product ([`FlatIndex`]), approximate maximum inner product
//! ([`HnswIndex`], an HNSW graph), lexical BM25 ([`Bm25Index`], tantivy), and vectors kept in a
//! Milvus server ([`MilvusIndex`]).
//!
//! Every index lives in a directory holding `index.json` ([`IndexMeta`]) beside its own files;
//! [`open`] reads any of them. Directories are built under a temporary name and renamed into
//! place ([`write_dir_atomically`]), so a killed `host index` never leaves one that looks whole;
//! each lists what it wrote (`.written.json`), and an existing directory is replaced only if it
//! holds nothing else.

mod bm25;
mod flat;
mod hnsw;
mod hnsw_build;
mod milvus;
mod simd;

pub use bm25::{Bm25Index, Bm25Params};
pub use flat::{FlatBackend, FlatIndex};
pub use hnsw::{HnswBuilder, HnswIndex, HnswParams, InnerProductDist, SearchStats, DROPPED_LINKS};
pub use milvus::{MilvusAnn, MilvusIndex, MilvusParams};

use anyhow::{bail, Context, Result};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// One search hit of a dense index: the row in the index (see `ids()`) and its inner product.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Hit {
    pub row: usize,
    pub score: f32,
}

/// A score with its row, ordered by score (f32 total order) and, on ties, lower row first: the
/// heap key of every top-k search.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Scored<R>(pub f32, pub R);

impl<R: Ord> Eq for Scored<R> {}

impl<R: Ord> PartialOrd for Scored<R> {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}

impl<R: Ord> Ord for Scored<R> {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&o.0).then(o.1.cmp(&self.1))
    }
}

/// `index.json`: what `host index info` prints.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct IndexMeta {
    /// `flat`, `hnsw`, `bm25` or `milvus`.
    pub kind: String,
    /// Vector width (0 for bm25).
    pub dim: usize,
    /// Number of vectors / documents.
    pub count: usize,
    /// `ip` (inner product, larger is better) or `bm25`.
    pub metric: String,
    /// Kind-specific build parameters.
    pub params: serde_json::Value,
    /// `rak-core <version>`.
    pub created_by: String,
}

impl IndexMeta {
    pub(crate) fn new(kind: &str, dim: usize, count: usize, metric: &str, params: serde_json::Value) -> Self {
        Self { kind: kind.into(), dim, count, metric: metric.into(), params, created_by: created_by() }
    }
    pub fn read(dir: &Path) -> Result<Self> {
        let p = dir.join("index.json");
        let text = std::fs::read_to_string(&p).with_context(|| format!("{}: cannot read (is {} an index directory?)", p.display(), dir.display()))?;
        serde_json::from_str(&text).with_context(|| format!("{}: not a valid index.json", p.display()))
    }
    pub(crate) fn write(&self, dir: &Path) -> Result<()> {
        rak_core::fsutil::write_bytes(&dir.join("index.json"), serde_json::to_string_pretty(self)?.as_bytes())
    }
    pub(crate) fn expect_kind(&self, dir: &Path, kind: &str) -> Result<()> {
        if self.kind != kind {
            bail!("{}: is a {} index, not {kind}", dir.display(), self.kind);
        }
        Ok(())
    }
}

pub fn created_by() -> String {
    format!("rak-core {}", env!("CARGO_PKG_VERSION"))
}

/// Any index, as found on disk.
pub enum Index {
    Flat(FlatIndex),
    Hnsw(HnswIndex),
    Bm25(Bm25Index),
    /// Boxed: its client and runtime make it the largest by far.
    Milvus(Box<MilvusIndex>),
}

/// Open the index in `dir`, whatever its kind.
pub fn open(dir: &Path) -> Result<Index> {
    let meta = IndexMeta::read(dir)?;
    Ok(match meta.kind.as_str() {
        "flat" => Index::Flat(FlatIndex::load(dir)?),
        "hnsw" => Index::Hnsw(HnswIndex::load(dir)?),
        "bm25" => Index::Bm25(Bm25Index::open(dir)?),
        "milvus" => Index::Milvus(Box::new(MilvusIndex::load(dir)?)),
        k => bail!("{}: unknown index kind {k:?} (expected flat, hnsw, bm25 or milvus)", dir.display()),
    })
}

/// `index.json` of the index in `dir`, as JSON (for `host index info`), without loading it.
pub fn info(dir: &Path) -> Result<serde_json::Value> {
    Ok(serde_json::to_value(IndexMeta::read(dir)?)?)
}

impl Index {
    pub fn meta(&self) -> &IndexMeta {
        match self {
            Index::Flat(i) => i.meta(),
            Index::Hnsw(i) => i.meta(),
            Index::Bm25(i) => i.meta(),
            Index::Milvus(i) => i.meta(),
        }
    }
    pub fn info(&self) -> serde_json::Value {
        serde_json::to_value(self.meta()).expect("IndexMeta serializes")
    }
}

/// Build a directory under a temporary sibling name, then rename it to `dir`. An existing `dir`
/// is replaced only after the new one is complete, and only if it is one this function wrote
/// and holds nothing else ([`check_replaceable`]): a directory of the user's, or files the user
/// put into an index or checkpoint, are never removed (when they appear during the build, the
/// finished build is kept under its temporary name, which the error gives). Every file in the new directory is
/// fsynced before the rename and the parent directory after it (see `rak_core::fsutil`). Then
/// the leftovers of killed runs that wrote `dir` before (`.NAME.tmp-PID`, `.NAME.old-PID` of
/// processes that are gone) are removed.
pub fn write_dir_atomically(dir: &Path, build: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    use rak_core::fsutil;
    // Before the build, which may take hours, and again before the old directory is moved.
    check_replaceable(dir)?;
    let tmp = fsutil::temp_path(dir);
    let parent = match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    std::fs::create_dir_all(parent).with_context(|| format!("{}: cannot create directory", parent.display()))?;
    if tmp.exists() {
        // Ours by name: left by an earlier process that had this same id.
        std::fs::remove_dir_all(&tmp).with_context(|| format!("{}: cannot remove stale temporary directory", tmp.display()))?;
    }
    std::fs::create_dir(&tmp).with_context(|| format!("{}: cannot create directory", tmp.display()))?;
    if let Err(e) = build(&tmp).and_then(|()| record_written(&tmp)).and_then(|()| sync_tree(&tmp)) {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    let old: Option<PathBuf> = if dir.exists() {
        if let Err(e) = check_replaceable(dir) {
            // Files were put into `dir` while the build ran (which may have taken hours): keep
            // the finished build for the user rather than throw it away.
            return Err(e.context(KeptBuild { at: tmp }));
        }
        let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let old = dir.with_file_name(format!(".{name}.old-{}", std::process::id()));
        std::fs::rename(dir, &old).with_context(|| format!("{}: cannot move the old index aside", dir.display()))?;
        Some(old)
    } else {
        None
    };
    if let Err(e) = std::fs::rename(&tmp, dir) {
        // Put the old index back rather than leave it under a name the next run removes.
        if let Some(old) = &old {
            let _ = std::fs::rename(old, dir);
        }
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e).with_context(|| format!("{}: cannot move into place", dir.display()));
    }
    fsutil::sync_dir(parent)?;
    if let Some(old) = old {
        let _ = std::fs::remove_dir_all(old);
    }
    // Only now: a killed run's `.NAME.old-PID` may hold the only whole copy of the previous
    // index until the new one is in place.
    fsutil::remove_stale_temps(dir);
    Ok(())
}

/// The error of [`write_dir_atomically`] when files appeared in the old directory while the
/// build ran: the finished build is kept at `at` (found with `downcast_ref`), so what it refers
/// to outside the folder (a Milvus collection) must be kept too.
#[derive(Debug)]
pub struct KeptBuild {
    pub at: PathBuf,
}

impl std::fmt::Display for KeptBuild {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the finished build is kept in {} (move it away: the next build of this output removes it)", self.at.display())
    }
}

/// In every directory [`write_dir_atomically`] writes: the paths (relative, `/`-separated) of
/// the files and folders its build wrote. What is not listed there was put in by someone else,
/// and the directory is then neither replaced nor removed ([`remove_written`]).
pub const WRITTEN_FILE: &str = ".written.json";

/// List what the build wrote under `tmp` into `tmp/.written.json`.
fn record_written(tmp: &Path) -> Result<()> {
    let mut entries = Vec::new();
    list_tree(tmp, "", &mut entries)?;
    entries.sort();
    rak_core::fsutil::write_bytes(&tmp.join(WRITTEN_FILE), serde_json::to_string_pretty(&serde_json::json!({"written": entries}))?.as_bytes())
}

/// Every file and folder under `dir`, relative to it; a folder is listed before what it holds.
fn list_tree(dir: &Path, rel: &str, out: &mut Vec<String>) -> Result<()> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("{}: cannot list", dir.display()))? {
        let entry = entry.with_context(|| format!("{}: cannot list", dir.display()))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let path = if rel.is_empty() { name } else { format!("{rel}/{name}") };
        // symlink_metadata: a link is an entry of its own, never followed.
        let is_dir = entry.path().symlink_metadata().map(|m| m.is_dir()).unwrap_or(false);
        out.push(path.clone());
        if is_dir {
            list_tree(&entry.path(), &path, out)?;
        }
    }
    Ok(())
}

/// Names the toolkit's own libraries create in a directory after it was written, which are not
/// in its list: tantivy's lock files (a reader takes `.tantivy-meta.lock`) and the list itself.
fn written_later(rel: &str) -> bool {
    let name = rel.rsplit('/').next().unwrap_or(rel);
    rel == WRITTEN_FILE || (name.starts_with(".tantivy-") && name.ends_with(".lock"))
}

/// Check that `dir` may be replaced or removed: it does not exist, is empty, or holds only what
/// [`write_dir_atomically`] recorded writing there. Otherwise an error that names `dir` and
/// says what in it is not the toolkit's.
pub fn check_replaceable(dir: &Path) -> Result<()> {
    let meta = match std::fs::symlink_metadata(dir) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).with_context(|| format!("{}: cannot read", dir.display())),
    };
    if !meta.is_dir() {
        bail!("{} exists and is not a directory: it is not replaced; choose another output or remove it yourself", dir.display());
    }
    let mut present = Vec::new();
    list_tree(dir, "", &mut present)?;
    if present.is_empty() {
        return Ok(());
    }
    let list = dir.join(WRITTEN_FILE);
    let Ok(text) = std::fs::read_to_string(&list) else {
        if written_before_the_record(dir, &present) {
            return Ok(());
        }
        bail!(
            "{} holds files and no record of what the toolkit wrote there ({WRITTEN_FILE}: it is not an index or checkpoint this toolkit wrote, or one an older version wrote that holds other files too): it is not replaced or removed; choose another output or remove it yourself",
            dir.display()
        );
    };
    let recorded: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", list.display()))?;
    let written: std::collections::HashSet<&str> = recorded["written"].as_array().into_iter().flatten().filter_map(|v| v.as_str()).collect();
    let foreign: Vec<&String> = present.iter().filter(|p| !written.contains(p.as_str()) && !written_later(p)).collect();
    if !foreign.is_empty() {
        let shown: Vec<&str> = foreign.iter().take(5).map(|p| p.as_str()).collect();
        bail!(
            "{} holds {} entries the toolkit did not write there ({}{}): it is not replaced or removed; move them away or choose another output",
            dir.display(),
            foreign.len(),
            shown.join(", "),
            if foreign.len() > shown.len() { ", ..." } else { "" }
        );
    }
    Ok(())
}

/// Whether `dir`, which has no [`WRITTEN_FILE`], is an index or checkpoint an earlier version
/// wrote before that record existed (`present`: all it holds, as [`list_tree`] lists it): every
/// entry is one that kind writes. An index: an `index.json` this toolkit wrote (`created_by`)
/// and the files of its kind; a checkpoint: rak's trainer state file ([`is_trainer_state`])
/// beside the model, tokenizer and optimizer files, and the module folders its `modules.json`
/// names with a module's files in them. Without this an older
/// index could not be rebuilt, nor an older run's checkpoints replaced or removed; anything else
/// in the folder still makes it the user's.
fn written_before_the_record(dir: &Path, present: &[String]) -> bool {
    let other = |rel: &&String| !written_later(rel);
    if let Ok(meta) = IndexMeta::read(dir) {
        if !meta.created_by.starts_with("rak-core ") {
            return false;
        }
        let files: &[&str] = match meta.kind.as_str() {
            "flat" => &["embeddings.npy", "ids.txt"],
            "hnsw" => &["graph.bin", "vectors.npy", "ids.txt"],
            "milvus" => &["ids.txt"],
            "bm25" => &["meta.json", ".managed.json"],
            _ => return false,
        };
        // tantivy's segment files: `<32 hex digits>.<ext>` (and `.<opstamp>.del`).
        let segment = |rel: &str| {
            let (stem, ext) = rel.split_once('.').unwrap_or((rel, ""));
            stem.len() == 32 && stem.bytes().all(|b| b.is_ascii_hexdigit()) && !ext.is_empty() && ext.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'.')
        };
        return present.iter().filter(other).all(|rel| rel == "index.json" || files.contains(&rel.as_str()) || (meta.kind == "bm25" && segment(rel)));
    }
    // The checkpoint files of the trainer (rak-train's OPTIMIZER_FILE, STATE_FILE) and of the
    // encoders' saves (`rak_core::encoders::files`: the model, its tokenizer and settings, and
    // what they copy of a sentence-transformers or T5 checkpoint); a two-tower model's in
    // subfolders.
    const STATE: &str = "trainer_state.json";
    if !is_trainer_state(&dir.join(STATE)) {
        return false;
    }
    let modules = |at: &Path| -> Vec<String> {
        let Ok(text) = std::fs::read_to_string(at.join("modules.json")) else { return Vec::new() };
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) else { return Vec::new() };
        v.as_array().into_iter().flatten().filter_map(|m| m["path"].as_str()).filter(|p| !p.is_empty() && !p.contains('/') && *p != "." && *p != "..").map(str::to_string).collect()
    };
    // What a sentence-transformers module folder holds (`1_Pooling/config.json`, a `2_Dense/`'s
    // config and weights; `2_Normalize/` is empty): any other name there is a file the user put
    // in, not one a save copied.
    const MODULE: &[&str] = &["config.json", "model.safetensors", "pytorch_model.bin"];
    let model_entry = |at: &Path, rel: &str| {
        rak_core::encoders::files::is_model_file(rel) || modules(at).iter().any(|m| rel == m || rel.strip_prefix(m.as_str()).and_then(|r| r.strip_prefix('/')).is_some_and(|f| MODULE.contains(&f)))
    };
    present.iter().filter(other).all(|rel| {
        if [STATE, "optimizer.safetensors", "query_encoder", "passage_encoder"].contains(&rel.as_str()) || model_entry(dir, rel) {
            return true;
        }
        let (tower, rest) = rel.split_once('/').unwrap_or(("", ""));
        ["query_encoder", "passage_encoder"].contains(&tower) && model_entry(&dir.join(tower), rest)
    })
}

/// Whether `path` is a `trainer_state.json` that rak-train's trainer wrote (its `TrainerState`:
/// `step`, `sampler`, `skipped_steps`, `episode`, `config`). Hugging Face's trainer writes a
/// file of the same name into its checkpoints (`global_step`, `log_history`, ...): the name
/// alone would make such a folder pass for one of ours, and a run write into it.
pub fn is_trainer_state(path: &Path) -> bool {
    let Ok(text) = std::fs::read_to_string(path) else { return false };
    serde_json::from_str::<serde_json::Value>(&text).is_ok_and(|v| {
        ["step", "skipped_steps", "episode"].iter().all(|k| v[*k].is_u64()) && !v["sampler"].is_null() && v["config"].is_object()
    })
}

/// Remove a directory [`write_dir_atomically`] wrote, after [`check_replaceable`]: one that
/// holds anything else is refused, not removed.
pub fn remove_written(dir: &Path) -> Result<()> {
    check_replaceable(dir)?;
    match std::fs::remove_dir_all(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e).with_context(|| format!("{}: cannot remove", dir.display())),
        _ => Ok(()),
    }
}

/// fsync every file under `dir`, then the directories themselves. Files written through
/// `fsutil` or `NpyWriter` are synced already (a second fsync of a clean file costs little);
/// tantivy's are not all.
fn sync_tree(dir: &Path) -> Result<()> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("{}: cannot list", dir.display()))? {
        let entry = entry.with_context(|| format!("{}: cannot list", dir.display()))?;
        let ty = entry.file_type()?;
        if ty.is_dir() {
            sync_tree(&entry.path())?;
        } else if ty.is_file() {
            rak_core::fsutil::sync_file(&entry.path())?;
        }
    }
    rak_core::fsutil::sync_dir(dir)
}

/// Check a `[n, dim]` row-major matrix: non-empty, whole rows, finite. `what` names it in errors.
pub(crate) fn check_matrix(what: &str, data: &[f32], dim: usize) -> Result<usize> {
    if dim == 0 {
        bail!("{what}: dimension is 0");
    }
    if data.is_empty() {
        bail!("{what}: no vectors (empty embeddings)");
    }
    if !data.len().is_multiple_of(dim) {
        bail!("{what}: {} values is not a whole number of rows of width {dim}", data.len());
    }
    check_rows(what, data, dim, 0)?;
    Ok(data.len() / dim)
}

/// Check that whole rows of width `dim > 0`, the first numbered `first_row`, are finite with
/// finite squared norms; errors name `what` and the row.
pub(crate) fn check_rows(what: &str, data: &[f32], dim: usize, first_row: usize) -> Result<()> {
    // Finite values with a finite squared norm: then by Cauchy-Schwarz no inner product of two
    // checked vectors overflows f32 (an overflow could give inf - inf = NaN, a score that
    // ranks nowhere sensible).
    // One pass: a NaN or infinite value makes the squared norm non-finite too.
    let bad = |row: &[f32]| !row.iter().map(|v| v * v).sum::<f32>().is_finite();
    if let Some(r) = data.par_chunks(dim).position_first(bad) {
        let row = &data[r * dim..(r + 1) * dim];
        let r = first_row + r;
        if let Some(v) = row.iter().find(|v| !v.is_finite()) {
            bail!("{what}: row {r} holds a non-finite value ({v})");
        }
        bail!("{what}: row {r}: its squared norm overflows f32, and inner products with it could too; scale the vectors down");
    }
    Ok(())
}

/// Check queries against an index of width `index_dim`.
pub(crate) fn check_queries(queries: &[f32], query_dim: usize, index_dim: usize, k: usize) -> Result<usize> {
    if query_dim != index_dim {
        bail!("dimension mismatch: the index holds {index_dim}-d vectors, the queries are {query_dim}-d");
    }
    if k == 0 {
        bail!("k must be at least 1");
    }
    if queries.is_empty() {
        return Ok(0);
    }
    check_matrix("queries", queries, query_dim)
}

/// Check that ids and embeddings agree.
pub(crate) fn check_ids(ids: &[String], rows: usize) -> Result<()> {
    if ids.len() != rows {
        bail!("{} ids for {rows} embeddings: ids.txt and the embeddings must have one line per row", ids.len());
    }
    Ok(())
}
