//! Approximate maximum-inner-product search with an HNSW graph (hnsw_rs).
//!
//! hnsw_rs's `DistDot` is `1 - <a, b>`: a correct ranking only for unit vectors, while dense
//! retrievers (DPR, TAS-B, …) score unnormalised vectors. The textbook fix, the MIPS→L2
//! reduction (append `sqrt(M² - |x|²)` to base vectors, 0 to queries), is exact in theory but
//! the graph navigates badly: on 20k 64-d vectors with norms varying 10x it gave recall@10 of
//! 0.13 at ef = 128 in hnsw_rs *and* in faiss (IndexHNSWFlat, L2), against 0.98 for a graph
//! built on inner product. So, like faiss's `METRIC_INNER_PRODUCT` and hnswlib's `ip`, the
//! graph uses inner product itself as the (non-metric) distance: `C - <a, b>` with
//! `C = M²` (`M` the largest base norm). hnsw_rs asserts distances are ≥ 0, so queries are
//! scaled to norm `M` for the graph walk (Cauchy-Schwarz then bounds `<a, b>` by `M²`; scaling
//! a query does not change its ranking). Returned scores are exact inner products of the
//! unscaled query, recomputed from the stored vectors.
//!
//! hnsw_rs calls `std::process::exit` or panics on some bad inputs (more than 256 connections,
//! NaN or negative distances, corrupt dumps), so everything is validated here first.
//!
//! Files: `index.json`, `ids.txt`, `hnsw.hnsw.graph` and `hnsw.hnsw.data` (hnsw_rs's dump
//! format, native-endian; their byte sizes are recorded in `index.json` and checked before
//! hnsw_rs reads them).

use super::{check_ids, check_matrix, check_queries, simd, Hit, IndexMeta};
use crate::npy;
use anyhow::{bail, Context, Result};
use hnsw_rs::prelude::{AnnT, Distance, Hnsw, HnswIo};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use std::path::Path;

const BASENAME: &str = "hnsw";
/// hnsw_rs stores the connection count in a byte and exits the process above 256.
const MAX_M: usize = 255;
/// hnsw_rs's own cap on layers; its dump refuses any other count.
const MAX_LAYERS: usize = 16;

/// `C - <a, b>` (never below 0): inner product as an HNSW distance; see the module comment.
#[derive(Clone, Copy)]
pub struct InnerProductDist {
    offset: f32,
    kernel: simd::Kernel,
}

impl InnerProductDist {
    fn new(max_norm: f32) -> Self {
        // A little slack over M² so that rounding never pushes a distance below 0.
        Self { offset: max_norm * max_norm * (1.0 + 1e-4) + f32::MIN_POSITIVE, kernel: simd::dot_kernel() }
    }
}

impl Distance<f32> for InnerProductDist {
    #[inline]
    fn eval(&self, va: &[f32], vb: &[f32]) -> f32 {
        (self.offset - (self.kernel)(va, vb)).max(0.0)
    }
}

/// Build and search parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct HnswParams {
    /// Links per node and layer (hnsw_rs `max_nb_connection`; faiss `M`). 2..=255.
    pub m: usize,
    /// Candidate list size while inserting (`efConstruction`). At least `m`.
    pub ef_construction: usize,
    /// Candidate list size while searching (`efSearch`); raised to `k` when smaller.
    pub ef_search: usize,
}

impl Default for HnswParams {
    fn default() -> Self {
        Self { m: 32, ef_construction: 200, ef_search: 128 }
    }
}

impl HnswParams {
    pub fn validate(&self) -> Result<()> {
        if !(2..=MAX_M).contains(&self.m) {
            bail!("HNSW m = {} is out of range: use 2..={MAX_M} (16-48 is typical)", self.m);
        }
        if self.ef_construction < self.m {
            bail!("HNSW ef_construction = {} must be at least m = {} (100-400 is typical)", self.ef_construction, self.m);
        }
        if self.ef_construction > 100_000 {
            bail!("HNSW ef_construction = {} is unreasonably large (100-400 is typical)", self.ef_construction);
        }
        if self.ef_search == 0 || self.ef_search > 100_000 {
            bail!("HNSW ef_search = {} is out of range: use 1..=100000 (≥ k; 64-512 is typical)", self.ef_search);
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct StoredParams {
    #[serde(flatten)]
    params: HnswParams,
    nb_layer: usize,
    /// The largest base-vector norm.
    max_norm: f32,
    graph_distance: String,
    graph_bytes: u64,
    data_bytes: u64,
}

pub struct HnswIndex {
    hnsw: Hnsw<'static, f32, InnerProductDist>,
    dim: usize,
    params: HnswParams,
    max_norm: f32,
    nb_layer: usize,
    ids: Vec<String>,
    meta: IndexMeta,
    dot: simd::Kernel,
}

impl HnswIndex {
    /// Build over `vectors` (`[ids.len(), dim]`, row-major), inserting in parallel on rayon's
    /// global pool (`RAYON_NUM_THREADS` sets its size).
    pub fn build(vectors: &[f32], dim: usize, ids: Vec<String>, params: HnswParams) -> Result<Self> {
        params.validate()?;
        let n = check_matrix("embeddings", vectors, dim)?;
        check_ids(&ids, n)?;
        if n > i32::MAX as usize {
            bail!("{n} vectors: hnsw_rs indexes at most {} per layer", i32::MAX);
        }
        let max_sq = vectors.par_chunks(dim).map(|x| x.iter().map(|v| v * v).sum::<f32>()).reduce(|| 0.0, f32::max);
        if !max_sq.is_finite() {
            bail!("embeddings: a squared norm overflows f32; scale the vectors down");
        }
        let max_norm = max_sq.sqrt();
        if max_norm == 0.0 {
            bail!("embeddings: every vector is zero");
        }
        // hnsw_rs only dumps graphs declared with its maximum of 16 layers (upper layers stay
        // empty: the level of a point is drawn with scale 1/ln(m)).
        let nb_layer = MAX_LAYERS;
        let hnsw = Hnsw::<f32, InnerProductDist>::new(params.m, n, nb_layer, params.ef_construction, InnerProductDist::new(max_norm));
        // Insert in chunks so that rayon's work queue stays small.
        const CHUNK: usize = 50_000;
        for (c, chunk) in vectors.chunks(CHUNK * dim).enumerate() {
            let items: Vec<(&[f32], usize)> = chunk.chunks_exact(dim).enumerate().map(|(i, v)| (v, c * CHUNK + i)).collect();
            hnsw.parallel_insert_slice(&items);
        }
        let mut hnsw = hnsw;
        hnsw.set_searching_mode(true);
        let meta = IndexMeta::new("hnsw", dim, n, "ip", serde_json::json!({}));
        let mut idx = Self { hnsw, dim, params, max_norm, nb_layer, ids, meta, dot: simd::dot_kernel() };
        idx.meta.params = idx.stored_params(0, 0);
        Ok(idx)
    }

    fn stored_params(&self, graph_bytes: u64, data_bytes: u64) -> serde_json::Value {
        serde_json::to_value(StoredParams {
            params: self.params,
            nb_layer: self.nb_layer,
            max_norm: self.max_norm,
            graph_distance: "max_norm^2 - <a,b>, queries scaled to max_norm".into(),
            graph_bytes,
            data_bytes,
        })
        .expect("params serialize")
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
    pub fn params(&self) -> HnswParams {
        self.params
    }
    /// Change the search-time candidate list size (must be ≥ 1).
    pub fn set_ef_search(&mut self, ef: usize) -> Result<()> {
        HnswParams { ef_search: ef, ..self.params }.validate()?;
        self.params.ef_search = ef;
        Ok(())
    }

    /// The (approximately) `k` largest inner products per query (`[nq, dim]`), best first,
    /// queries in parallel.
    pub fn search(&self, queries: &[f32], dim: usize, k: usize) -> Result<Vec<Vec<Hit>>> {
        let nq = check_queries(queries, dim, self.dim, k)?;
        if nq == 0 {
            return Ok(vec![]);
        }
        let ef = self.params.ef_search.max(k);
        let pi = self.hnsw.get_point_indexation();
        Ok(queries
            .par_chunks(dim)
            .map(|q| {
                let qn = q.iter().map(|v| v * v).sum::<f32>().sqrt();
                let scale = if qn > 0.0 { self.max_norm / qn } else { 1.0 };
                let qs: Vec<f32> = q.iter().map(|v| v * scale).collect();
                let mut hits: Vec<Hit> = self
                    .hnsw
                    .search(&qs, k, ef)
                    .into_iter()
                    .map(|nb| {
                        let score = pi.get_point_data(&nb.p_id).map(|x| (self.dot)(q, &x)).unwrap_or(f32::NEG_INFINITY);
                        Hit { row: nb.d_id, score }
                    })
                    .collect();
                hits.sort_by(|a, b| b.score.total_cmp(&a.score).then(a.row.cmp(&b.row)));
                hits
            })
            .collect())
    }

    /// Write to `dir` atomically (hnsw_rs dump + ids + index.json).
    pub fn save(&self, dir: &Path) -> Result<()> {
        super::write_dir_atomically(dir, |tmp| {
            let name = self.hnsw.file_dump(tmp, BASENAME).with_context(|| format!("{}: hnsw_rs dump failed", tmp.display()))?;
            if name != BASENAME {
                bail!("{}: hnsw_rs dumped under {name:?}, expected {BASENAME:?}", tmp.display());
            }
            let size = |ext: &str| std::fs::metadata(tmp.join(format!("{BASENAME}.hnsw.{ext}"))).map(|m| m.len());
            let (g, d) = (size("graph")?, size("data")?);
            npy::write_ids(&tmp.join("ids.txt"), &self.ids)?;
            let mut meta = self.meta.clone();
            meta.params = self.stored_params(g, d);
            meta.write(tmp)
        })
    }

    /// Load an index written by [`save`](Self::save).
    pub fn load(dir: &Path) -> Result<Self> {
        let meta = IndexMeta::read(dir)?;
        meta.expect_kind(dir, "hnsw")?;
        let sp: StoredParams = serde_json::from_value(meta.params.clone()).with_context(|| format!("{}: bad params in index.json", dir.display()))?;
        sp.params.validate().with_context(|| format!("{}: index.json", dir.display()))?;
        for (ext, want) in [("graph", sp.graph_bytes), ("data", sp.data_bytes)] {
            let p = dir.join(format!("{BASENAME}.hnsw.{ext}"));
            let got = std::fs::metadata(&p).with_context(|| format!("{}: missing", p.display()))?.len();
            if got != want {
                bail!("{}: {got} bytes, index.json recorded {want}: the index is damaged, rebuild it", p.display());
            }
        }
        let ids = npy::read_ids(&dir.join("ids.txt"))?;
        check_ids(&ids, meta.count).with_context(|| dir.display().to_string())?;
        // hnsw_rs's loaded graph borrows its HnswIo (for memory-mapped data, unused here: data
        // is copied in). Leaking the small HnswIo gives the graph a 'static lifetime.
        let loaded = std::panic::catch_unwind(|| {
            let io: &'static mut HnswIo = Box::leak(Box::new(HnswIo::new(dir, BASENAME)));
            io.load_hnsw_with_dist::<f32, InnerProductDist>(InnerProductDist::new(sp.max_norm))
        });
        let mut hnsw = match loaded {
            Ok(Ok(h)) => h,
            Ok(Err(e)) => bail!("{}: hnsw_rs cannot load the graph: {e}", dir.display()),
            Err(_) => bail!("{}: hnsw_rs panicked loading the graph: the index is damaged, rebuild it", dir.display()),
        };
        if hnsw.get_nb_point() != meta.count {
            bail!("{}: graph holds {} points, index.json says {}", dir.display(), hnsw.get_nb_point(), meta.count);
        }
        let gd = hnsw.get_point_indexation().get_data_dimension();
        if gd != meta.dim {
            bail!("{}: graph vectors are {gd}-d, index.json says {}", dir.display(), meta.dim);
        }
        hnsw.set_searching_mode(true);
        Ok(Self {
            hnsw,
            dim: meta.dim,
            params: sp.params,
            max_norm: sp.max_norm,
            nb_layer: sp.nb_layer,
            ids,
            meta,
            dot: simd::dot_kernel(),
        })
    }
}
