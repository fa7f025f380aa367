//! Build an index directory: flat, HNSW or Milvus from `encode` output, BM25 from a corpus.

use super::Progress;
use crate::data::beir;
use crate::index::{Bm25Index, Bm25Params, FlatIndex, HnswBuilder, HnswIndex, HnswParams, IndexMeta, MilvusIndex, MilvusParams};
use crate::npy::{self, NpyF32, NpyRows};
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

/// Which index to build, from what.
#[derive(Debug, Clone)]
pub enum IndexSpec {
    /// Exact inner product over the `embeddings.npy` + `ids.txt` in `embeddings`.
    Flat { embeddings: PathBuf },
    /// Approximate maximum inner product (an HNSW graph) over the same.
    Hnsw { embeddings: PathBuf, params: HnswParams, builder: HnswBuilder },
    /// Lexical BM25 over a BEIR `corpus.jsonl`, scored with `params` (stored in `index.json`).
    Bm25 { corpus: PathBuf, params: Bm25Params },
    /// The same vectors loaded into a Milvus collection; the index directory points at it.
    Milvus { embeddings: PathBuf, params: MilvusParams },
}

impl IndexSpec {
    /// From a kind's name (`flat`, `hnsw`, `bm25`) and the inputs it needs, as the CLI and the
    /// services take them.
    pub fn from_kind(
        kind: &str,
        embeddings: Option<PathBuf>,
        corpus: Option<PathBuf>,
        params: HnswParams,
        builder: HnswBuilder,
        bm25: Bm25Params,
    ) -> Result<Self> {
        let embeddings = || embeddings.clone().ok_or_else(|| anyhow::anyhow!("an embeddings directory is required for flat and hnsw indexes"));
        Ok(match kind {
            "flat" => IndexSpec::Flat { embeddings: embeddings()? },
            "hnsw" => IndexSpec::Hnsw { embeddings: embeddings()?, params, builder },
            "bm25" => IndexSpec::Bm25 { corpus: corpus.ok_or_else(|| anyhow::anyhow!("a corpus file is required for a bm25 index"))?, params: bm25 },
            "milvus" => bail!("a milvus index needs a server and a collection: IndexSpec::Milvus"),
            other => bail!("index kind {other:?}: expected flat, hnsw, bm25 or milvus"),
        })
    }
}

/// Read `embeddings.npy` (into memory) + `ids.txt`, checking they agree.
pub fn read_embeddings(dir: &Path) -> Result<(NpyF32, Vec<String>)> {
    let vectors = NpyF32::open(&dir.join("embeddings.npy"))?;
    let ids = read_ids_for(dir, vectors.rows())?;
    Ok((vectors, ids))
}

/// `dir/ids.txt`, which must hold one id per row of `dir/embeddings.npy` (`rows` of them).
fn read_ids_for(dir: &Path, rows: usize) -> Result<Vec<String>> {
    let path = dir.join("ids.txt");
    let ids = npy::read_ids(&path)?;
    if ids.len() != rows {
        bail!("{}: {} ids but {} has {} rows; re-run host encode", path.display(), ids.len(), dir.join("embeddings.npy").display(), rows);
    }
    // A repeated id would take two rows of the index, so a search could return it twice (and
    // fewer than k passages once the run drops the copy), and `host eval` refuses its corpus.
    let mut first = std::collections::HashMap::with_capacity(ids.len());
    for (line, id) in ids.iter().enumerate() {
        if let Some(before) = first.insert(id.as_str(), line) {
            bail!("{}:{}: passage id {id:?} occurs twice (first on line {}); give each passage of the corpus its own id", path.display(), line + 1, before + 1);
        }
    }
    Ok(ids)
}

/// Build the index `spec` asks for into the directory `output` (replaced atomically).
///
/// Memory: a flat index streams the embeddings into its own file, and a Milvus index into its
/// collection (a block of rows in memory at a time); HNSW holds the matrix once (the graph is
/// built on the copy the index keeps); BM25 streams the corpus one passage at a time.
pub fn build_index(spec: &IndexSpec, output: &Path, progress: &dyn Progress) -> Result<IndexMeta> {
    // Before the build, which may take hours (an HNSW graph, a Milvus collection filled): an
    // output that is not the toolkit's to replace is refused now, not once the work is done.
    crate::index::check_replaceable(output)?;
    Ok(match spec {
        IndexSpec::Flat { embeddings } => {
            let npy_path = embeddings.join("embeddings.npy");
            // Only the header now (shape, length); the rows are read while writing the index.
            let rows = NpyRows::open(&npy_path)?.rows();
            let ids = read_ids_for(embeddings, rows)?;
            FlatIndex::build_from_npy(&npy_path, &ids, output)?
        }
        IndexSpec::Hnsw { embeddings, params, builder } => {
            params.validate()?;
            let (vectors, ids) = read_embeddings(embeddings)?;
            let (rows, dim) = (vectors.rows(), vectors.dim());
            progress.log(&format!(
                "index: building HNSW over {rows} vectors (m={}, ef_construction={}, builder {builder})",
                params.m, params.ef_construction
            ));
            progress.start("hnsw", rows as u64);
            let last = std::sync::atomic::AtomicUsize::new(0);
            let report = |done: usize| {
                let before = last.fetch_max(done, std::sync::atomic::Ordering::Relaxed);
                if done > before {
                    progress.inc((done - before) as u64);
                }
            };
            let idx = HnswIndex::build_owned(vectors.into_values(), dim, ids, *params, *builder, &report)?;
            progress.finish();
            idx.save(output)?;
            idx.meta().clone()
        }
        IndexSpec::Milvus { embeddings, params } => {
            let npy_path = embeddings.join("embeddings.npy");
            let ids = read_ids_for(embeddings, NpyRows::open(&npy_path)?.rows())?;
            MilvusIndex::build_from_npy(&npy_path, &ids, params.clone(), output, progress)?
        }
        IndexSpec::Bm25 { corpus, params } => {
            let docs = beir::read_corpus(corpus)?.map(|p| p.map(|p| (p.id, p.title, p.text)));
            Bm25Index::try_build(output, docs, *params).with_context(|| corpus.display().to_string())?.meta().clone()
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A repeated passage id is refused before any index is built: from embeddings, naming
    /// ids.txt and both lines; from a corpus (BM25), naming the file and the record.
    #[test]
    fn a_repeated_passage_id_is_refused_naming_where() {
        let dir = std::env::temp_dir().join(format!("rak-index-dup-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let emb = dir.join("emb");
        std::fs::create_dir_all(&emb).unwrap();
        npy::write_f32(&emb.join("embeddings.npy"), &[1.0, 0.0, 0.0, 1.0, 1.0, 1.0], 2).unwrap();
        npy::write_ids(&emb.join("ids.txt"), &["a", "b", "a"]).unwrap();
        for spec in [IndexSpec::Flat { embeddings: emb.clone() }, IndexSpec::Hnsw { embeddings: emb.clone(), params: HnswParams::default(), builder: HnswBuilder::default() }] {
            let err = format!("{:#}", build_index(&spec, &dir.join("idx"), &super::super::Quiet).unwrap_err());
            assert!(err.contains("ids.txt:3: passage id \"a\" occurs twice (first on line 1)"), "{err}");
            assert!(!dir.join("idx").exists());
        }
        let corpus = dir.join("corpus.jsonl");
        std::fs::write(&corpus, "{\"_id\": \"x\", \"text\": \"one\"}\n{\"_id\": \"y\", \"text\": \"two\"}\n{\"_id\": \"x\", \"text\": \"three\"}\n").unwrap();
        let err = format!("{:#}", build_index(&IndexSpec::Bm25 { corpus: corpus.clone(), params: Bm25Params::default() }, &dir.join("idx"), &super::super::Quiet).unwrap_err());
        assert!(err.contains("corpus.jsonl") && err.contains("passage id \"x\" occurs twice (the second time as record 3)"), "{err}");
        assert!(!dir.join("idx").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
