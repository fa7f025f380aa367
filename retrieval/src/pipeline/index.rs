//! Build an index directory: flat or HNSW from `encode` output, BM25 from a corpus.

use super::Progress;
use crate::data::beir;
use crate::index::{Bm25Index, FlatIndex, HnswBuilder, HnswIndex, HnswParams, IndexMeta};
use crate::npy::{self, NpyF32};
use anyhow::{bail, Result};
use std::path::{Path, PathBuf};

/// Which index to build, from what.
#[derive(Debug, Clone)]
pub enum IndexSpec {
    /// Exact inner product over the `embeddings.npy` + `ids.txt` in `embeddings`.
    Flat { embeddings: PathBuf },
    /// Approximate maximum inner product (an HNSW graph) over the same.
    Hnsw { embeddings: PathBuf, params: HnswParams, builder: HnswBuilder },
    /// Lexical BM25 over a BEIR `corpus.jsonl`.
    Bm25 { corpus: PathBuf },
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

/// Build the index `spec` asks for into the directory `output` (replaced atomically).
pub fn build_index(spec: &IndexSpec, output: &Path, progress: &dyn Progress) -> Result<IndexMeta> {
    Ok(match spec {
        IndexSpec::Flat { embeddings } => {
            let (vectors, ids) = read_embeddings(embeddings)?;
            let idx = FlatIndex::new(vectors.data().to_vec(), vectors.dim(), ids)?;
            idx.save(output)?;
            idx.meta().clone()
        }
        IndexSpec::Hnsw { embeddings, params, builder } => {
            params.validate()?;
            let (vectors, ids) = read_embeddings(embeddings)?;
            progress.log(&format!(
                "index: building HNSW over {} vectors (m={}, ef_construction={}, builder {builder})",
                vectors.rows(),
                params.m,
                params.ef_construction
            ));
            progress.start("hnsw", vectors.rows() as u64);
            let last = std::sync::atomic::AtomicUsize::new(0);
            let report = |done: usize| {
                let before = last.fetch_max(done, std::sync::atomic::Ordering::Relaxed);
                if done > before {
                    progress.inc((done - before) as u64);
                }
            };
            let idx = HnswIndex::build_with_progress(vectors.data(), vectors.dim(), ids, *params, *builder, &report)?;
            progress.finish();
            idx.save(output)?;
            idx.meta().clone()
        }
        IndexSpec::Bm25 { corpus } => {
            let passages: Vec<_> = beir::read_corpus(corpus)?.collect::<Result<_>>()?;
            let idx = Bm25Index::build(output, passages.iter().map(|p| (&p.id, &p.title, &p.text)))?;
            idx.meta().clone()
        }
    })
}
