//! Exact maximum-inner-product search by scanning every vector.
//!
//! Files: `index.json`, `embeddings.npy` (`[count, dim]` `<f4`, read into memory and checked
//! on load), `ids.txt`.

use super::{check_ids, check_matrix, check_queries, check_rows, simd, Hit, IndexMeta, Scored};
use crate::aligned::AlignedVec;
use crate::npy::{self, NpyF32, NpyRows, NpyWriter};
use anyhow::{Context, Result};
use rayon::prelude::*;
use std::path::Path;
use tch::{Device, Kind, Tensor};

/// How [`FlatIndex`] computes scores. Both are exact (f32 accumulation; the order of additions
/// differs, so scores can differ in the last bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FlatBackend {
    /// A libtorch GEMM per block of rows (oneDNN for batches of 128 queries or more, else
    /// `matmul`), then a running top-k per query: fast for query batches.
    #[default]
    Torch,
    /// A plain Rust scan with AVX-512 or AVX2 dot products, queries in parallel (rayon).
    Rust,
}

pub struct FlatIndex {
    /// `[len, dim]` row-major, checked finite. Owned, never memory-mapped: see `npy::NpyF32`;
    /// cache-line aligned: see `aligned`.
    vectors: AlignedVec,
    dim: usize,
    ids: Vec<String>,
    meta: IndexMeta,
}

impl FlatIndex {
    /// An in-memory index over `vectors` (`[ids.len(), dim]`, row-major; a `Vec<f32>` is
    /// copied into an aligned buffer).
    pub fn new(vectors: impl Into<AlignedVec>, dim: usize, ids: Vec<String>) -> Result<Self> {
        let vectors = vectors.into();
        let rows = check_matrix("embeddings", &vectors, dim)?;
        check_ids(&ids, rows)?;
        let meta = IndexMeta::new("flat", dim, rows, "ip", serde_json::json!({}));
        Ok(Self { vectors, dim, ids, meta })
    }

    /// An index over an `.npy` file of embeddings, read into memory (a copy: a file mapped
    /// from a user's directory could change or shrink under us, see `npy::NpyF32`).
    pub fn from_npy(embeddings: &Path, ids: Vec<String>) -> Result<Self> {
        let arr = NpyF32::open(embeddings)?;
        let (rows, dim) = (arr.rows(), arr.dim());
        let vectors = arr.into_values();
        check_matrix(&embeddings.display().to_string(), &vectors, dim)?;
        check_ids(&ids, rows).with_context(|| embeddings.display().to_string())?;
        let meta = IndexMeta::new("flat", dim, rows, "ip", serde_json::json!({}));
        Ok(Self { vectors, dim, ids, meta })
    }

    /// Write a flat index over the `.npy` file `embeddings` to `dir` (atomically) without
    /// holding the matrix in memory: rows are streamed from the file into the index's own
    /// `embeddings.npy` a block at a time, each block checked (finite, see `check_matrix`)
    /// before it is written. The memory needed is one block, whatever the file's size.
    pub fn build_from_npy(embeddings: &Path, ids: &[String], dir: &Path) -> Result<IndexMeta> {
        let mut rows = NpyRows::open(embeddings)?;
        let (n, dim) = (rows.rows(), rows.dim());
        let what = embeddings.display().to_string();
        if dim == 0 {
            anyhow::bail!("{what}: dimension is 0");
        }
        if n == 0 {
            anyhow::bail!("{what}: no vectors (empty embeddings)");
        }
        check_ids(ids, n).with_context(|| what.clone())?;
        let meta = IndexMeta::new("flat", dim, n, "ip", serde_json::json!({}));
        super::write_dir_atomically(dir, |tmp| {
            let mut out = NpyWriter::create(&tmp.join("embeddings.npy"), dim)?;
            // Blocks of about 16 MiB: few system calls, and small next to a large matrix.
            let block = ((16 << 20) / (4 * dim)).max(1);
            let mut buf = Vec::new();
            loop {
                let first = rows.position();
                if rows.read_rows(block, &mut buf)? == 0 {
                    break;
                }
                // The copy in `buf` is what is checked and written, even if the file changes.
                check_rows(&what, &buf, dim, first)?;
                out.append(&buf)?;
            }
            out.finish()?;
            npy::write_ids(&tmp.join("ids.txt"), ids)?;
            meta.write(tmp)
        })?;
        Ok(meta)
    }

    /// Write the index to `dir` (atomically: built under a temporary name, then renamed).
    pub fn save(&self, dir: &Path) -> Result<()> {
        super::write_dir_atomically(dir, |tmp| {
            npy::write_f32(&tmp.join("embeddings.npy"), self.vectors(), self.dim)?;
            npy::write_ids(&tmp.join("ids.txt"), &self.ids)?;
            self.meta.write(tmp)
        })
    }

    /// Open an index written by [`save`](Self::save) or [`build_from_npy`](Self::build_from_npy).
    /// The embeddings are read into memory and checked again: another program may have
    /// replaced the file since it was written, and a NaN would outrank every score.
    pub fn load(dir: &Path) -> Result<Self> {
        let meta = IndexMeta::read(dir)?;
        meta.expect_kind(dir, "flat")?;
        let path = dir.join("embeddings.npy");
        let arr = NpyF32::open(&path)?;
        let ids = npy::read_ids(&dir.join("ids.txt"))?;
        check_ids(&ids, arr.rows()).with_context(|| dir.display().to_string())?;
        if arr.rows() == 0 || arr.dim() == 0 {
            anyhow::bail!("{}: embeddings.npy is empty ({} x {})", dir.display(), arr.rows(), arr.dim());
        }
        if arr.dim() != meta.dim || arr.rows() != meta.count {
            anyhow::bail!("{}: index.json says ({}, {}), embeddings.npy is ({}, {})", dir.display(), meta.count, meta.dim, arr.rows(), arr.dim());
        }
        let dim = arr.dim();
        let vectors = arr.into_values();
        check_matrix(&path.display().to_string(), &vectors, dim)?;
        Ok(Self { vectors, dim, ids, meta })
    }

    pub fn vectors(&self) -> &[f32] {
        &self.vectors
    }
    pub fn dim(&self) -> usize {
        self.dim
    }
    pub fn len(&self) -> usize {
        self.ids.len()
    }
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }
    pub fn ids(&self) -> &[String] {
        &self.ids
    }
    pub fn meta(&self) -> &IndexMeta {
        &self.meta
    }

    /// The `k` rows with the largest inner product for each query (`[nq, dim]` row-major),
    /// best first.
    pub fn search(&self, queries: &[f32], dim: usize, k: usize) -> Result<Vec<Vec<Hit>>> {
        self.search_with(FlatBackend::Torch, queries, dim, k)
    }

    pub fn search_with(&self, backend: FlatBackend, queries: &[f32], dim: usize, k: usize) -> Result<Vec<Vec<Hit>>> {
        let nq = check_queries(queries, dim, self.dim, k)?;
        if nq == 0 {
            return Ok(vec![]);
        }
        let k = k.min(self.len());
        match backend {
            FlatBackend::Torch => self.search_torch(queries, nq, k),
            FlatBackend::Rust => Ok(self.search_rust(queries, k)),
        }
    }

    fn search_torch(&self, queries: &[f32], nq: usize, k: usize) -> Result<Vec<Vec<Hit>>> {
        let d = self.dim;
        // Batches of at most 4,096 queries (as faiss), so that a score block of ≥ 1,024 rows
        // stays within 16 MiB however many queries come in.
        const QUERY_BATCH: usize = 4096;
        if nq > QUERY_BATCH {
            let mut hits = Vec::with_capacity(nq);
            for batch in queries.chunks(QUERY_BATCH * d) {
                hits.extend(self.search_torch(batch, batch.len() / d, k)?);
            }
            return Ok(hits);
        }
        let _guard = tch::no_grad_guard();
        let base = self.vectors();
        let n = self.len();
        let q = Tensor::from_slice(queries).view([nq as i64, d as i64]);
        // Score blocks of at most 4M floats (16 MiB): reused from the heap, not mapped afresh
        // (see rak_core::malloc), and close to the caches for the scan that follows.
        let block = ((4usize << 20) / nq).clamp(1024, 1 << 18).min(n);
        // One running top-k per query across blocks, as faiss does: once a query's heap is full
        // almost every score fails a single comparison with its k-th best. (libtorch `topk`
        // per block, then merging the candidates, took about as long as the matmul itself.)
        let mut best: Vec<TopK> = (0..nq).map(|_| TopK::new(k)).collect();
        for start in (0..n).step_by(block) {
            let rows = block.min(n - start);
            let slice = &base[start * d..(start + rows) * d];
            // Safety: `slice` outlives `b` (dropped at the end of this iteration) and libtorch
            // only reads it (matmul); the block is not copied.
            let b = unsafe { Tensor::f_from_blob(slice.as_ptr() as *const u8, &[rows as i64, d as i64], &[d as i64, 1], Kind::Float, Device::Cpu) }?;
            let scores = block_scores(&q, &b)?;
            anyhow::ensure!(
                scores.size() == [nq as i64, rows as i64] && scores.kind() == Kind::Float && scores.is_contiguous() && scores.device() == Device::Cpu,
                "block scores are {:?} {:?} on {:?}",
                scores.size(),
                scores.kind(),
                scores.device()
            );
            // Safety: `scores` is a contiguous f32 CPU tensor of nq × rows elements (checked
            // above) that lives until the end of this iteration and is not written meanwhile.
            let scores: &[f32] = unsafe { std::slice::from_raw_parts(scores.data_ptr() as *const f32, nq * rows) };
            best.par_iter_mut().zip(scores.par_chunks(rows)).for_each(|(top, row)| top.push_scan(start, row));
        }
        Ok(best.into_iter().map(TopK::into_sorted).collect())
    }

    fn search_rust(&self, queries: &[f32], k: usize) -> Vec<Vec<Hit>> {
        let dot = simd::dot_kernel();
        let base = self.vectors();
        queries
            .par_chunks(self.dim)
            .map(|q| {
                let mut best = TopK::new(k);
                for (row, x) in base.chunks_exact(self.dim).enumerate() {
                    best.push(row, dot(q, x));
                }
                best.into_sorted()
            })
            .collect()
    }
}

/// Below this many queries `matmul` is faster than packing each block for oneDNN.
const ONEDNN_MIN_QUERIES: i64 = 128;

/// `q · bᵀ` (`[nq, rows]`, contiguous). On CPU in f32, for batches of at least
/// [`ONEDNN_MIN_QUERIES`], the block is packed for libtorch's oneDNN GEMM and multiplied there:
/// 0.80-0.93 s against 1.33-1.49 s for `matmul` (MKL `sgemm`) on 1,000 queries × 200k rows ×
/// 384 (AMD Zen 4, 2 threads), about 180 against 110 GFLOP/s. Packing costs a pass over the
/// block, which only a large batch repays: at 200k rows oneDNN took 219-230 ms against
/// 246-264 ms for 128 queries, but 182-219 against 128-156 ms for 64 and 128-134 against
/// 36-38 ms for one.
fn block_scores(q: &Tensor, b: &Tensor) -> Result<Tensor> {
    use rak_core::models::onednn;
    if q.size()[0] >= ONEDNN_MIN_QUERIES && onednn::usable(Device::Cpu, Kind::Float) {
        match onednn::Dense::pack(b, None, q.size()[0]).and_then(|w| w.forward(q, onednn::Epilogue::None)) {
            Ok(s) => return Ok(s.f_contiguous()?),
            Err(e) => onednn::warn_once(&e),
        }
    }
    Ok(q.f_matmul(&b.tr())?.f_contiguous()?)
}

/// A bounded min-heap of the best `k` hits.
pub(crate) struct TopK {
    k: usize,
    heap: std::collections::BinaryHeap<std::cmp::Reverse<Scored<usize>>>,
}

impl TopK {
    pub(crate) fn new(k: usize) -> Self {
        Self { k, heap: std::collections::BinaryHeap::with_capacity(k + 1) }
    }
    #[inline]
    pub(crate) fn push(&mut self, row: usize, score: f32) {
        if self.heap.len() < self.k {
            self.heap.push(std::cmp::Reverse(Scored(score, row)));
        } else if let Some(min) = self.heap.peek() {
            if Scored(score, row) > min.0 {
                self.heap.pop();
                self.heap.push(std::cmp::Reverse(Scored(score, row)));
            }
        }
    }
    /// Push `scores[j]` as row `first_row + j`, for ascending rows after every row pushed so
    /// far. Blocks of 16 scores are tested against the current k-th best with one vectorised
    /// maximum; ties never replace (an earlier row wins a tie).
    pub(crate) fn push_scan(&mut self, first_row: usize, scores: &[f32]) {
        let mut floor = self.floor();
        for (c, chunk) in scores.chunks(16).enumerate() {
            if chunk.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s)) <= floor && self.heap.len() >= self.k {
                continue;
            }
            for (j, &s) in chunk.iter().enumerate() {
                if self.heap.len() < self.k || s > floor {
                    self.push(first_row + c * 16 + j, s);
                    floor = self.floor();
                }
            }
        }
    }

    /// The k-th best score so far (−∞ until there are k).
    fn floor(&self) -> f32 {
        match self.heap.peek() {
            Some(min) if self.heap.len() >= self.k => min.0 .0,
            _ => f32::NEG_INFINITY,
        }
    }

    pub(crate) fn into_sorted(self) -> Vec<Hit> {
        // into_sorted_vec is ascending in Reverse order = descending score.
        self.heap.into_sorted_vec().into_iter().map(|std::cmp::Reverse(Scored(s, r))| Hit { row: r, score: s }).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn push_scan_keeps_the_best_k_and_earlier_rows_on_ties() {
        let mut top = TopK::new(3);
        // 40 scores (more than two blocks of 16), then a second call continuing the rows.
        let first: Vec<f32> = (0..40).map(|i| (i % 7) as f32).collect();
        top.push_scan(0, &first);
        top.push_scan(40, &[6.0, 9.0, 6.0]);
        let got: Vec<(usize, f32)> = top.into_sorted().iter().map(|h| (h.row, h.score)).collect();
        // 9 at row 41; then the two earliest 6s (rows 6 and 13), not the later ones.
        assert_eq!(got, vec![(41, 9.0), (6, 6.0), (13, 6.0)]);
        // Fewer scores than k: all of them, best first.
        let mut few = TopK::new(5);
        few.push_scan(10, &[1.0, 3.0]);
        assert_eq!(few.into_sorted().iter().map(|h| h.row).collect::<Vec<_>>(), vec![11, 10]);
    }
}
