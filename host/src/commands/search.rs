//! `host search`: queries → top-k passages → a TREC run, with a dense index and an encoder
//! plugin, or with a BM25 index (see `rak_retrieval::pipeline::search`).

use super::encode::{encoder_settings, ModelArgs};
use super::Bar;
use crate::registry::Registry;
use anyhow::{bail, Context, Result};
use rak_retrieval::data::{beir, trec};
use rak_retrieval::index::{self, Index};
use rak_retrieval::pipeline::search::{search_queries, SearchOptions};
use std::path::PathBuf;

#[derive(Debug, Clone, clap::Args)]
pub struct SearchArgs {
    /// Index directory (from `host index build`).
    #[arg(long)]
    pub index: PathBuf,
    /// Queries JSONL ({"_id","text"}).
    #[arg(long)]
    pub queries: PathBuf,
    /// Where to write the TREC run (atomically).
    #[arg(long)]
    pub output: PathBuf,
    #[arg(long, default_value_t = 100)]
    pub k: usize,
    /// Use the index as BM25 (lexical); no encoder needed.
    #[arg(long)]
    pub bm25: bool,
    /// Encoder plugin for dense indexes.
    #[arg(long)]
    pub encoder: Option<String>,
    /// Model checkpoint for the encoder: a folder, a Hugging Face Hub id or a known bare name.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Task name (query prefixes / markers).
    #[arg(long)]
    pub task: Option<String>,
    #[command(flatten)]
    pub model_args: ModelArgs,
    /// HNSW candidate list size at search time (a Milvus IVF_FLAT index: clusters searched).
    #[arg(long)]
    pub ef_search: Option<usize>,
    /// The run tag (6th column).
    #[arg(long, default_value = "rak")]
    pub tag: String,
}

pub fn run(registry: &Registry, args: &SearchArgs) -> Result<()> {
    if args.k == 0 {
        bail!("--k must be positive");
    }
    let queries: Vec<_> = beir::read_queries(&args.queries)?.collect::<Result<_>>()?;
    let mut index = index::open(&args.index)?;
    let opts = SearchOptions { k: args.k, task: args.task.clone(), batch_size: args.model_args.batch_size };
    let run = match &mut index {
        Index::Bm25(_) => search_queries(&index, None, &queries, &opts, &Bar::default())?,
        dense => {
            if args.bm25 {
                bail!("{}: --bm25 given but this is a {} index", args.index.display(), dense.meta().kind);
            }
            let name = args.encoder.as_deref().context("--encoder is required for a dense index")?;
            let model = args.model.as_ref().context("--model is required for a dense index")?;
            match (&mut *dense, args.ef_search) {
                (Index::Hnsw(h), Some(ef)) => h.set_ef_search(ef)?,
                (Index::Milvus(m), Some(ef)) => m.set_ef_search(ef),
                _ => {}
            }
            let mut encoder = registry.encoder(name, &encoder_settings(model, &args.model_args)?)?;
            search_queries(dense, Some(encoder.as_mut()), &queries, &opts, &Bar::default())
                .with_context(|| format!("searching {} with encoder {name}", args.index.display()))?
        }
    };
    trec::write_run(&args.output, &run, &args.tag, Some(args.k))
}
