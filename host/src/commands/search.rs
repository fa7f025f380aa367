//! `host search`: queries → top-k passages → a TREC run, with a dense index and an encoder
//! plugin, or with a BM25 index.

use super::encode::{encoder_settings, progress, ModelArgs};
use crate::registry::Registry;
use anyhow::{bail, Context, Result};
use rak_core::abi::Role;
use rak_retrieval::data::{beir, trec, Run};
use rak_retrieval::index::{self, Index};
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
    /// Model checkpoint for the encoder.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Task name (query prefixes / markers).
    #[arg(long)]
    pub task: Option<String>,
    #[command(flatten)]
    pub model_args: ModelArgs,
    /// HNSW candidate list size at search time.
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
    let mut run = Run::new();
    let bar = progress(queries.len() as u64, "search");
    match &mut index {
        Index::Bm25(bm25) => {
            for q in &queries {
                run.insert(q.id.clone(), bm25.search(&q.text, args.k)?.into_iter().map(|(id, s)| (id, s as f64)).collect());
                bar.inc(1);
            }
        }
        dense => {
            if args.bm25 {
                bail!("{}: --bm25 given but this is a {} index", args.index.display(), dense.meta().kind);
            }
            let name = args.encoder.as_deref().context("--encoder is required for a dense index")?;
            let model = args.model.as_ref().context("--model is required for a dense index")?;
            if let (Index::Hnsw(h), Some(ef)) = (&mut *dense, args.ef_search) {
                h.set_ef_search(ef)?;
            }
            let settings = encoder_settings(model, &args.model_args)?;
            let mut encoder = registry.encoder(name, &settings)?;
            let dim = dense.meta().dim;
            for batch in queries.chunks(args.model_args.batch_size.max(1)) {
                let texts: Vec<&str> = batch.iter().map(|q| q.text.as_str()).collect();
                let emb = encoder.encode(&texts, Role::Query, args.task.as_deref(), false)?;
                let emb = emb.to_kind(tch::Kind::Float).to_device(tch::Device::Cpu).contiguous();
                let qdim = emb.size().get(1).copied().unwrap_or(0) as usize;
                if qdim != dim {
                    bail!("{}: the index holds {dim}-d vectors but encoder {name} makes {qdim}-d queries", args.index.display());
                }
                let flat: Vec<f32> = Vec::<f32>::try_from(emb.view([-1]))?;
                let (hits, ids) = match &*dense {
                    Index::Flat(f) => (f.search(&flat, dim, args.k)?, f.ids()),
                    Index::Hnsw(h) => (h.search(&flat, dim, args.k)?, h.ids()),
                    Index::Bm25(_) => unreachable!("handled above"),
                };
                for (q, hits) in batch.iter().zip(hits) {
                    run.insert(q.id.clone(), hits.into_iter().map(|h| (ids[h.row].clone(), h.score as f64)).collect());
                }
                bar.inc(batch.len() as u64);
            }
        }
    }
    bar.finish_and_clear();
    trec::write_run(&args.output, &run, &args.tag, Some(args.k))
}
