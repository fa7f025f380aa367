//! `host index build|info`: dense (flat, HNSW) indexes from `host encode` output, and a BM25
//! index from a corpus.

use anyhow::{bail, Context, Result};
use rak_retrieval::data::beir;
use rak_retrieval::index::{self, Bm25Index, FlatIndex, HnswBuilder, HnswIndex, HnswParams};
use rak_retrieval::npy::{self, NpyF32};
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, clap::Subcommand)]
pub enum IndexCmd {
    /// Build an index directory.
    Build(BuildArgs),
    /// Describe an index directory (its index.json).
    Info { index: PathBuf },
}

#[derive(Debug, Clone, clap::Args)]
pub struct BuildArgs {
    /// `flat` (exact inner product), `hnsw` (approximate, maximum inner product) or `bm25`.
    #[arg(long, default_value = "flat")]
    pub kind: String,
    /// Directory with embeddings.npy and ids.txt (from `host encode`), for flat and hnsw.
    #[arg(long)]
    pub embeddings: Option<PathBuf>,
    /// BEIR corpus.jsonl, for bm25.
    #[arg(long)]
    pub corpus: Option<PathBuf>,
    /// The index directory to write (replaced atomically).
    #[arg(long)]
    pub output: PathBuf,
    /// HNSW links per node (faiss M).
    #[arg(long, default_value_t = HnswParams::default().m)]
    pub m: usize,
    /// HNSW candidate list while building.
    #[arg(long, default_value_t = HnswParams::default().ef_construction)]
    pub ef_construction: usize,
    /// HNSW candidate list while searching (stored; `host search --ef-search` overrides).
    #[arg(long, default_value_t = HnswParams::default().ef_search)]
    pub ef_search: usize,
    /// HNSW graph builder: `native` (hnswlib's algorithm on flat arrays) or `hnsw_rs`.
    #[arg(long, default_value_t = HnswBuilder::default())]
    pub hnsw_builder: HnswBuilder,
}

pub fn run(cmd: &IndexCmd) -> Result<serde_json::Value> {
    match cmd {
        IndexCmd::Info { index } => index::info(index),
        IndexCmd::Build(args) => build(args),
    }
}

/// Read `embeddings.npy` + `ids.txt`, checking they agree.
pub fn read_embeddings(dir: &Path) -> Result<(NpyF32, Vec<String>)> {
    let vectors = NpyF32::open(&dir.join("embeddings.npy"))?;
    let ids = npy::read_ids(&dir.join("ids.txt"))?;
    if ids.len() != vectors.rows() {
        bail!(
            "{}: {} ids but {} has {} rows; re-run host encode",
            dir.join("ids.txt").display(),
            ids.len(),
            dir.join("embeddings.npy").display(),
            vectors.rows()
        );
    }
    Ok((vectors, ids))
}

fn build(args: &BuildArgs) -> Result<serde_json::Value> {
    let meta = match args.kind.as_str() {
        "flat" | "hnsw" => {
            let dir = args.embeddings.as_ref().context("--embeddings DIR is required for flat and hnsw indexes")?;
            let (vectors, ids) = read_embeddings(dir)?;
            if args.kind == "flat" {
                let idx = FlatIndex::new(vectors.data().to_vec(), vectors.dim(), ids)?;
                idx.save(&args.output)?;
                idx.meta().clone()
            } else {
                let params = HnswParams { m: args.m, ef_construction: args.ef_construction, ef_search: args.ef_search };
                params.validate()?;
                eprintln!(
                    "index: building HNSW over {} vectors (m={}, ef_construction={}, builder {})",
                    vectors.rows(),
                    params.m,
                    params.ef_construction,
                    args.hnsw_builder
                );
                let bar = super::encode::progress(vectors.rows() as u64, "hnsw");
                let idx = HnswIndex::build_with_progress(vectors.data(), vectors.dim(), ids, params, args.hnsw_builder, &|done| bar.set_position(done as u64))?;
                bar.finish_and_clear();
                idx.save(&args.output)?;
                idx.meta().clone()
            }
        }
        "bm25" => {
            let corpus = args.corpus.as_ref().context("--corpus FILE is required for a bm25 index")?;
            let passages: Vec<_> = beir::read_corpus(corpus)?.collect::<Result<_>>()?;
            let idx = Bm25Index::build(&args.output, passages.iter().map(|p| (&p.id, &p.title, &p.text)))?;
            idx.meta().clone()
        }
        other => bail!("--kind {other:?}: expected flat, hnsw or bm25"),
    };
    Ok(serde_json::to_value(meta)?)
}
