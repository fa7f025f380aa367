//! `host index build|info`: dense (flat, HNSW, Milvus) indexes from `host encode` output, and a
//! BM25 index from a corpus (see `rak_retrieval::pipeline::index`).

use super::Bar;
use anyhow::{bail, Context, Result};
use rak_retrieval::index::{self, Bm25Params, HnswBuilder, HnswParams, MilvusAnn, MilvusParams};
use rak_retrieval::pipeline::index::{build_index, IndexSpec};
use std::path::PathBuf;

#[derive(Debug, Clone, clap::Subcommand)]
pub enum IndexCmd {
    /// Build an index directory.
    Build(BuildArgs),
    /// Describe an index directory (its index.json).
    Info { index: PathBuf },
}

#[derive(Debug, Clone, clap::Args)]
pub struct BuildArgs {
    /// `flat` (exact inner product), `hnsw` (approximate, maximum inner product), `bm25`, or
    /// `milvus` (the vectors in a Milvus collection; the output directory points at it).
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
    /// Milvus: the server (`scripts/milvus.sh start` prints one); its token, if it needs one,
    /// from the environment variable MILVUS_TOKEN.
    #[arg(long)]
    pub uri: Option<String>,
    /// Milvus: the collection to create (one this toolkit made before is replaced).
    #[arg(long)]
    pub collection: Option<String>,
    /// Milvus: the structure it builds: `ivf_flat` (with --nlist, --nprobe), `hnsw` (with --m,
    /// --ef-construction, --ef-search; not on milvus-lite, `scripts/milvus.sh`'s server) or
    /// `flat` (exact).
    #[arg(long, default_value = "ivf_flat")]
    pub ann: String,
    /// Milvus IVF_FLAT: clusters.
    #[arg(long, default_value_t = 128)]
    pub nlist: usize,
    /// Milvus IVF_FLAT: clusters searched (stored; `host search --ef-search` overrides).
    #[arg(long, default_value_t = 16)]
    pub nprobe: usize,
    /// BM25 term-frequency saturation (Pyserini's default; stored in index.json).
    #[arg(long, default_value_t = Bm25Params::default().k1)]
    pub k1: f32,
    /// BM25 length normalisation (Pyserini's default; stored in index.json).
    #[arg(long, default_value_t = Bm25Params::default().b)]
    pub b: f32,
}

pub fn run(cmd: &IndexCmd) -> Result<serde_json::Value> {
    match cmd {
        IndexCmd::Info { index } => index::info(index),
        IndexCmd::Build(args) => {
            let spec = spec(args)?;
            Ok(serde_json::to_value(build_index(&spec, &args.output, &Bar::default())?)?)
        }
    }
}

fn spec(args: &BuildArgs) -> Result<IndexSpec> {
    let params = HnswParams { m: args.m, ef_construction: args.ef_construction, ef_search: args.ef_search };
    if args.kind == "milvus" {
        let ann = match args.ann.as_str() {
            "hnsw" => MilvusAnn::Hnsw { m: args.m, ef_construction: args.ef_construction, ef_search: args.ef_search },
            "ivf_flat" => MilvusAnn::IvfFlat { nlist: args.nlist, nprobe: args.nprobe },
            "flat" => MilvusAnn::Flat,
            other => bail!("--ann {other:?}: expected hnsw, ivf_flat or flat"),
        };
        let (Some(uri), Some(collection), Some(embeddings)) = (&args.uri, &args.collection, &args.embeddings) else {
            bail!("--kind milvus needs --uri URI, --collection NAME and --embeddings DIR");
        };
        let params = MilvusParams { uri: uri.clone(), collection: collection.clone(), ann, build: String::new() };
        return Ok(IndexSpec::Milvus { embeddings: embeddings.clone(), params });
    }
    let bm25 = Bm25Params { k1: args.k1, b: args.b };
    IndexSpec::from_kind(&args.kind, args.embeddings.clone(), args.corpus.clone(), params, args.hnsw_builder, bm25)
        .context("--kind, with --embeddings DIR (flat, hnsw) or --corpus FILE (bm25)")
}
