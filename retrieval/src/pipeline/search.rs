//! Search an index for a set of queries: dense indexes through an encoder, BM25 by text.

use super::encode::embedding_rows;
use super::Progress;
use crate::data::{Query, Run};
use crate::index::{Hit, Index};
use anyhow::{bail, Context, Result};
use rak_core::abi::Role;
use rak_core::plugin::Encoder;

/// How to search.
#[derive(Debug, Clone)]
pub struct SearchOptions {
    /// Passages per query.
    pub k: usize,
    /// Task name for query prefixes / markers (dense only).
    pub task: Option<String>,
    /// Queries per encoder call (dense only).
    pub batch_size: usize,
}

impl Default for SearchOptions {
    fn default() -> Self {
        SearchOptions { k: 100, task: None, batch_size: 64 }
    }
}

/// The top `opts.k` passages of every query, as a run. A dense index needs `encoder`; BM25
/// ignores it.
pub fn search_queries(
    index: &Index,
    encoder: Option<&mut dyn Encoder>,
    queries: &[Query],
    opts: &SearchOptions,
    progress: &dyn Progress,
) -> Result<Run> {
    if opts.k == 0 {
        bail!("k must be positive");
    }
    let mut run = Run::new();
    progress.start("search", queries.len() as u64);
    match index {
        Index::Bm25(bm25) => {
            for q in queries {
                run.insert(q.id.clone(), bm25.search(&q.text, opts.k)?.into_iter().map(|(id, s)| (id, s as f64)).collect());
                progress.inc(1);
            }
        }
        dense => {
            let encoder = encoder.context("a dense index needs an encoder to embed the queries")?;
            for batch in queries.chunks(opts.batch_size.max(1)) {
                let texts: Vec<&str> = batch.iter().map(|q| q.text.as_str()).collect();
                let emb = encoder.encode(&texts, Role::Query, opts.task.as_deref(), false)?;
                let flat = embedding_rows(&emb, texts.len())?;
                let hits = search_vectors(dense, &flat, flat.len() / texts.len(), opts.k)?;
                for (q, hits) in batch.iter().zip(hits) {
                    run.insert(q.id.clone(), hits.into_iter().map(|(id, s)| (id, s as f64)).collect());
                }
                progress.inc(batch.len() as u64);
            }
        }
    }
    progress.finish();
    Ok(run)
}

/// Search a dense index with query vectors (`[n, dim]` row-major): the top-k `(passage id,
/// inner product)` of each query, best first.
pub fn search_vectors(index: &Index, queries: &[f32], dim: usize, k: usize) -> Result<Vec<Vec<(String, f32)>>> {
    let index_dim = index.meta().dim;
    if dim != index_dim && !matches!(index, Index::Bm25(_)) {
        bail!("the index holds {index_dim}-d vectors but the queries are {dim}-d");
    }
    let (hits, ids): (Vec<Vec<Hit>>, &[String]) = match index {
        Index::Flat(f) => (f.search(queries, dim, k)?, f.ids()),
        Index::Hnsw(h) => (h.search(queries, dim, k)?, h.ids()),
        Index::Milvus(m) => (m.search(queries, dim, k)?, m.ids()),
        Index::Bm25(_) => bail!("a BM25 index is searched by query text, not by vectors"),
    };
    Ok(hits.into_iter().map(|hs| hs.into_iter().map(|h| (ids[h.row].clone(), h.score)).collect()).collect())
}
