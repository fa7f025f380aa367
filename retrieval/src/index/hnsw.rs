//! Approximate maximum-inner-product search with an HNSW graph.
//!
//! Dense retrievers (DPR, TACO, …) score unnormalised vectors, so the graph must rank by inner
//! product, not cosine (hnsw_rs's `DistDot`, `1 - <a, b>`, is only right for unit vectors).
//! The textbook fix, the MIPS→L2 reduction (append `sqrt(M² - |x|²)` to base vectors, 0 to
//! queries), is exact in theory but the graph navigates badly: on 20k 64-d vectors with norms
//! varying 10x it gave recall@10 of 0.13 at ef = 128 in hnsw_rs *and* in faiss (IndexHNSWFlat,
//! L2), against 0.98 for a graph built on inner product. So, like faiss's
//! `METRIC_INNER_PRODUCT` and hnswlib's `ip`, the graph uses inner product itself as the
//! (non-metric) distance.
//!
//! Two builders produce the same graph format ([`HnswBuilder`]):
//! - `native` (default, `hnsw_build.rs`): hnswlib's algorithm on flat arrays with per-node
//!   locks. It builds about 3x faster than hnsw_rs on the same cores.
//! - `hnsw_rs`: the hnsw_rs crate's parallel insertion, with distance `C - <a, b>`
//!   (`C = M²`, `M` the largest base norm; queries are scaled to norm `M` during the walk so
//!   that Cauchy-Schwarz keeps distances ≥ 0, which hnsw_rs asserts). hnsw_rs calls
//!   `std::process::exit` or panics on some bad inputs (more than 256 connections, NaN or
//!   negative distances), so everything is validated here first.
//!
//! Search never uses hnsw_rs: it allocated an `Arc`, took a read lock and inserted into a hash
//! set per visited node and ran 6.7x fewer queries per second than faiss. The graph is kept in
//! flat arrays ([`Graph`]: layer 0 as CSR, upper layers per node); search walks them with a
//! generation-stamped visited table (one for the greedy descent through the upper layers, one
//! for layer 0: no node is scored twice within either), scoring the unvisited neighbours of a
//! node four at a time (AVX-512 or AVX2; whole rows prefetched ahead when the vectors outgrow
//! the cache). Returned scores are the inner products computed on the way. The same arrays are the on-disk format, so loading
//! never runs hnsw_rs's loader (which exits the process on some corrupt files) and every
//! neighbour id is bounds-checked on load.
//!
//! Files: `index.json`, `ids.txt`, `vectors.npy` (`[count, dim]` `<f4`) and `graph.bin`
//! (little-endian: magic `RAKHNSW1`, u64 n, u32 entry, u8 level[n], u64 offset[n + 1] and
//! u32 neighbour[..] of layer 0, then for each node of level ≥ 1 and each of its upper layers
//! u32 count and u32 neighbour[count]).

use super::hnsw_build::{self, beam_search, greedy, BuiltGraph, Scorer, SCRATCH};
use super::{check_ids, check_matrix, check_queries, simd, Hit, IndexMeta, Scored};
use crate::aligned::AlignedVec;
use crate::npy::{self, NpyF32};
use anyhow::{bail, Context, Result};
use hnsw_rs::prelude::{Distance, Hnsw};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use std::path::Path;

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

/// The work a search did, summed over its queries.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct SearchStats {
    pub queries: usize,
    /// Inner products computed while walking the graph, all layers, the entry point's not
    /// counted, as faiss's `hnsw_stats.ndis`; except that faiss's greedy descent scores a
    /// node again each time it meets it (and counts it), ours only once.
    pub distances: usize,
}

/// Which code builds the graph (see the module comment); search is the same for both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HnswBuilder {
    /// hnswlib's algorithm on flat arrays (`hnsw_build.rs`).
    #[default]
    Native,
    /// The hnsw_rs crate.
    HnswRs,
}

impl std::str::FromStr for HnswBuilder {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "native" => Ok(Self::Native),
            "hnsw_rs" | "hnsw-rs" => Ok(Self::HnswRs),
            _ => bail!("unknown HNSW builder {s:?}: expected native or hnsw_rs"),
        }
    }
}

impl std::fmt::Display for HnswBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Native => "native",
            Self::HnswRs => "hnsw_rs",
        })
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
    /// Absent in indexes written before the native builder existed.
    #[serde(default = "builder_hnsw_rs")]
    builder: HnswBuilder,
}

fn builder_hnsw_rs() -> HnswBuilder {
    HnswBuilder::HnswRs
}

pub struct HnswIndex {
    graph: Graph,
    /// `[len, dim]` row-major, checked finite; owned, never memory-mapped (see `npy::NpyF32`);
    /// cache-line aligned (see `aligned`: the build is memory-bound).
    vectors: AlignedVec,
    dim: usize,
    params: HnswParams,
    max_norm: f32,
    nb_layer: usize,
    builder: HnswBuilder,
    ids: Vec<String>,
    meta: IndexMeta,
    dot: simd::Kernel,
    dot4: simd::Kernel4,
}

/// The HNSW graph in flat arrays, nodes numbered by row.
struct Graph {
    n: usize,
    entry: u32,
    level: Vec<u8>,
    /// Layer 0 as CSR.
    offsets: Vec<u64>,
    neighbours: Vec<u32>,
    /// `upper[node][l - 1]`: neighbours on layer `l ≥ 1` (empty for nodes of level 0).
    upper: Vec<Vec<Vec<u32>>>,
}

const MAGIC: &[u8; 8] = b"RAKHNSW1";

/// Upper-layer links to lower-level nodes dropped by the last build (for tests and benches).
#[doc(hidden)]
pub static DROPPED_LINKS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

fn log_dropped(n: usize) {
    DROPPED_LINKS.store(n, std::sync::atomic::Ordering::Relaxed);
}

impl Graph {
    fn from_built(b: BuiltGraph) -> Self {
        Self::from_lists(b.entry, b.level, b.links)
    }

    /// `lists[node][layer]` for layers `0..=level[node]`.
    fn from_lists(entry: u32, level: Vec<u8>, lists: Vec<Vec<Vec<u32>>>) -> Self {
        let n = level.len();
        let mut offsets = Vec::with_capacity(n + 1);
        offsets.push(0u64);
        let mut neighbours = Vec::with_capacity(lists.iter().map(|l| l.first().map_or(0, Vec::len)).sum());
        let mut upper = Vec::with_capacity(n);
        for mut l in lists {
            if l.is_empty() {
                l.push(Vec::new());
            }
            neighbours.extend_from_slice(&l[0]);
            offsets.push(neighbours.len() as u64);
            l.remove(0);
            upper.push(l);
        }
        Self { n, entry, level, offsets, neighbours, upper }
    }

    /// Copy the graph out of hnsw_rs (DataId = row).
    fn from_hnsw_rs(h: &Hnsw<'static, f32, InnerProductDist>, n: usize) -> Result<Self> {
        let mut level = vec![0u8; n];
        let mut lists: Vec<Vec<Vec<u32>>> = vec![Vec::new(); n];
        let mut seen = 0usize;
        for p in h.get_point_indexation() {
            let row = p.get_origin_id();
            if row >= n {
                bail!("hnsw_rs returned point id {row} for {n} vectors");
            }
            let l = p.get_point_id().0;
            level[row] = l;
            let nb = p.get_neighborhood_id();
            lists[row] = nb.iter().take(l as usize + 1).map(|layer| layer.iter().filter(|x| x.d_id < n).map(|x| x.d_id as u32).collect()).collect();
            seen += 1;
        }
        if seen != n {
            bail!("hnsw_rs graph holds {seen} points, {n} were inserted");
        }
        // hnsw_rs can leave a link on layer l to a node whose level is below l (seen in
        // 0.3.5); such a link cannot be followed on that layer, so it is dropped.
        let mut dropped = 0usize;
        for l in lists.iter_mut() {
            for (li, layer) in l.iter_mut().enumerate().skip(1) {
                let before = layer.len();
                layer.retain(|&v| level[v as usize] as usize >= li);
                dropped += before - layer.len();
            }
        }
        if dropped > 0 {
            log_dropped(dropped);
        }
        let top = *level.iter().max().unwrap_or(&0);
        let entry = level.iter().position(|&l| l == top).unwrap_or(0) as u32;
        Ok(Self::from_lists(entry, level, lists))
    }

    fn layer0(&self, node: u32) -> &[u32] {
        let i = node as usize;
        &self.neighbours[self.offsets[i] as usize..self.offsets[i + 1] as usize]
    }

    fn write(&self, path: &Path) -> Result<()> {
        let mut b: Vec<u8> = Vec::with_capacity(16 + self.n * 13 + self.neighbours.len() * 4);
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&(self.n as u64).to_le_bytes());
        b.extend_from_slice(&self.entry.to_le_bytes());
        b.extend_from_slice(&self.level);
        for o in &self.offsets {
            b.extend_from_slice(&o.to_le_bytes());
        }
        for v in &self.neighbours {
            b.extend_from_slice(&v.to_le_bytes());
        }
        for layers in &self.upper {
            for l in layers {
                b.extend_from_slice(&(l.len() as u32).to_le_bytes());
                for v in l {
                    b.extend_from_slice(&v.to_le_bytes());
                }
            }
        }
        rak_core::fsutil::write_bytes(path, &b)
    }

    fn read(path: &Path, n_expected: usize) -> Result<Self> {
        let b = std::fs::read(path).with_context(|| format!("{}: cannot read", path.display()))?;
        let damaged = |what: &str| anyhow::anyhow!("{}: damaged graph ({what}); rebuild the index", path.display());
        let mut pos = 0usize;
        let mut take = |len: usize| -> Result<&[u8]> {
            let s = b.get(pos..pos.checked_add(len).ok_or_else(|| damaged("length overflow"))?).ok_or_else(|| damaged("truncated"))?;
            pos += len;
            Ok(s)
        };
        if take(8)? != MAGIC {
            return Err(damaged("bad magic"));
        }
        let n = u64::from_le_bytes(take(8)?.try_into().unwrap()) as usize;
        if n != n_expected {
            return Err(damaged(&format!("{n} nodes, index.json says {n_expected}")));
        }
        let entry = u32::from_le_bytes(take(4)?.try_into().unwrap());
        let level = take(n)?.to_vec();
        let offsets: Vec<u64> = take((n + 1).checked_mul(8).ok_or_else(|| damaged("size"))?)?.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap())).collect();
        if offsets[0] != 0 || offsets.windows(2).any(|w| w[0] > w[1]) {
            return Err(damaged("offsets"));
        }
        let m0 = offsets[n] as usize;
        let neighbours: Vec<u32> = take(m0.checked_mul(4).ok_or_else(|| damaged("size"))?)?.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect();
        let mut upper = Vec::with_capacity(n);
        for &l in &level {
            let mut layers = Vec::with_capacity(l as usize);
            for _ in 0..l {
                let cnt = u32::from_le_bytes(take(4)?.try_into().unwrap()) as usize;
                layers.push(take(cnt.checked_mul(4).ok_or_else(|| damaged("size"))?)?.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect::<Vec<u32>>());
            }
            upper.push(layers);
        }
        if pos != b.len() {
            return Err(damaged("trailing bytes"));
        }
        let g = Self { n, entry, level, offsets, neighbours, upper };
        let bad = |v: &u32| *v as usize >= n;
        if n == 0 || g.entry as usize >= n || g.neighbours.iter().any(bad) || g.upper.iter().flatten().flatten().any(bad) {
            return Err(damaged("neighbour id out of range"));
        }
        let top = *g.level.iter().max().unwrap();
        if g.level[g.entry as usize] != top {
            return Err(damaged("entry point is not on the top layer"));
        }
        // A node listed on layer l must exist on layer l.
        for (node, layers) in g.upper.iter().enumerate() {
            for (li, l) in layers.iter().enumerate() {
                if l.iter().any(|&v| (g.level[v as usize] as usize) < li + 1) {
                    return Err(damaged(&format!("node {node} links to a node absent from layer {}", li + 1)));
                }
            }
        }
        Ok(g)
    }
}

impl HnswIndex {
    /// Build over `vectors` (`[ids.len(), dim]`, row-major) with the native builder,
    /// inserting in parallel on rayon's global pool (`RAYON_NUM_THREADS` sets its size).
    pub fn build(vectors: &[f32], dim: usize, ids: Vec<String>, params: HnswParams) -> Result<Self> {
        Self::build_with(vectors, dim, ids, params, HnswBuilder::Native)
    }

    /// [`build`](Self::build) with a choice of graph builder.
    pub fn build_with(vectors: &[f32], dim: usize, ids: Vec<String>, params: HnswParams, builder: HnswBuilder) -> Result<Self> {
        Self::build_with_progress(vectors, dim, ids, params, builder, &|_| ())
    }

    /// [`build_with`](Self::build_with), calling `progress(points inserted)` now and then
    /// (the native builder only; from any thread). The index keeps a copy of `vectors`;
    /// [`build_owned`](Self::build_owned) takes them instead.
    pub fn build_with_progress(
        vectors: &[f32],
        dim: usize,
        ids: Vec<String>,
        params: HnswParams,
        builder: HnswBuilder,
        progress: &(dyn Fn(usize) + Sync),
    ) -> Result<Self> {
        params.validate()?;
        Self::build_owned(AlignedVec::from_slice(vectors), dim, ids, params, builder, progress)
    }

    /// [`build_with_progress`](Self::build_with_progress) over vectors the index takes over:
    /// the graph is built on them and they are what the index searches, so a build holds one
    /// copy of the matrix, not two (the hnsw_rs builder keeps its own copy while it runs).
    pub fn build_owned(
        vectors: AlignedVec,
        dim: usize,
        ids: Vec<String>,
        params: HnswParams,
        builder: HnswBuilder,
        progress: &(dyn Fn(usize) + Sync),
    ) -> Result<Self> {
        params.validate()?;
        let n = check_matrix("embeddings", &vectors, dim)?;
        check_ids(&ids, n)?;
        if n > i32::MAX as usize {
            bail!("{n} vectors: an HNSW index holds at most {}", i32::MAX);
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
        // empty: the level of a point is drawn with scale 1/ln(m)); kept for parity with it.
        let nb_layer = MAX_LAYERS;
        let graph = match builder {
            HnswBuilder::Native => Graph::from_built(hnsw_build::build(&vectors, dim, params.m, params.ef_construction, progress)),
            HnswBuilder::HnswRs => {
            let hnsw = Hnsw::<f32, InnerProductDist>::new(params.m, n, nb_layer, params.ef_construction, InnerProductDist::new(max_norm));
            // Insert in chunks so that rayon's work queue stays small.
            const CHUNK: usize = 50_000;
            for (c, chunk) in vectors.chunks(CHUNK * dim).enumerate() {
                let items: Vec<(&[f32], usize)> = chunk.chunks_exact(dim).enumerate().map(|(i, v)| (v, c * CHUNK + i)).collect();
                hnsw.parallel_insert_slice(&items);
            }
            Graph::from_hnsw_rs(&hnsw, n)?
            }
        };
        let meta = IndexMeta::new("hnsw", dim, n, "ip", serde_json::json!({}));
        let mut idx = Self {
            graph,
            vectors,
            dim,
            params,
            max_norm,
            nb_layer,
            builder,
            ids,
            meta,
            dot: simd::dot_kernel(),
            dot4: simd::dot4_kernel(),
        };
        idx.meta.params = idx.stored_params(0);
        Ok(idx)
    }

    fn stored_params(&self, graph_bytes: u64) -> serde_json::Value {
        serde_json::to_value(StoredParams {
            params: self.params,
            nb_layer: self.nb_layer,
            max_norm: self.max_norm,
            graph_distance: match self.builder {
                HnswBuilder::Native => "inner product".into(),
                HnswBuilder::HnswRs => "inner product (max_norm^2 - <a,b> in hnsw_rs)".into(),
            },
            graph_bytes,
            builder: self.builder,
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
    pub fn builder(&self) -> HnswBuilder {
        self.builder
    }
    /// Change the search-time candidate list size (must be ≥ 1).
    pub fn set_ef_search(&mut self, ef: usize) -> Result<()> {
        HnswParams { ef_search: ef, ..self.params }.validate()?;
        self.params.ef_search = ef;
        Ok(())
    }

    /// The (approximately) `k` largest inner products per query (`[nq, dim]`), best first,
    /// queries in parallel. Scores are exact inner products.
    pub fn search(&self, queries: &[f32], dim: usize, k: usize) -> Result<Vec<Vec<Hit>>> {
        Ok(self.search_with_stats(queries, dim, k)?.0)
    }

    /// [`search`](Self::search), also counting the work done: the number to compare with
    /// faiss's `hnsw_stats.ndis`, free of timing noise.
    pub fn search_with_stats(&self, queries: &[f32], dim: usize, k: usize) -> Result<(Vec<Vec<Hit>>, SearchStats)> {
        let nq = check_queries(queries, dim, self.dim, k)?;
        if nq == 0 {
            return Ok((vec![], SearchStats::default()));
        }
        let ef = self.params.ef_search.max(k);
        let (hits, distances): (Vec<Vec<Hit>>, Vec<usize>) = queries.par_chunks(dim).map(|q| self.search_one(q, k, ef)).unzip();
        Ok((hits, SearchStats { queries: nq, distances: distances.iter().sum() }))
    }

    /// The hits for one query and the number of vectors scored on the way.
    fn search_one(&self, q: &[f32], k: usize, ef: usize) -> (Vec<Hit>, usize) {
        let g = &self.graph;
        let s = Scorer { data: &self.vectors, dim: self.dim, dot: self.dot, dot4: self.dot4 };
        SCRATCH.with(|sc| {
            let sc = &mut *sc.borrow_mut();
            // Greedy descent through the upper layers, then a beam search on layer 0.
            let before = sc.distances;
            let (mut cur, mut cur_s) = (g.entry, s.score(q, g.entry));
            sc.start_walk(g.n, g.entry);
            for layer in (1..=g.level[cur as usize] as usize).rev() {
                (cur, cur_s) = greedy(&s, q, cur, cur_s, sc, |v, out| {
                    out.clear();
                    out.extend_from_slice(&g.upper[v as usize][layer - 1]);
                });
            }
            let best = beam_search(&s, q, cur, cur_s, ef, g.n, sc, |v, _| Some(g.layer0(v)));
            let mut hits: Vec<Hit> = best.into_iter().map(|Scored(score, v)| Hit { row: v as usize, score }).collect();
            hits.sort_by(|a, b| b.score.total_cmp(&a.score).then(a.row.cmp(&b.row)));
            hits.truncate(k);
            (hits, sc.distances - before)
        })
    }

    /// Write to `dir` atomically (`graph.bin`, `vectors.npy`, `ids.txt`, `index.json`).
    pub fn save(&self, dir: &Path) -> Result<()> {
        super::write_dir_atomically(dir, |tmp| {
            let gp = tmp.join("graph.bin");
            self.graph.write(&gp)?;
            let graph_bytes = std::fs::metadata(&gp)?.len();
            npy::write_f32(&tmp.join("vectors.npy"), &self.vectors, self.dim)?;
            npy::write_ids(&tmp.join("ids.txt"), &self.ids)?;
            let mut meta = self.meta.clone();
            meta.params = self.stored_params(graph_bytes);
            meta.write(tmp)
        })
    }

    /// Load an index written by [`save`](Self::save). The vectors are read into memory and
    /// checked again: another program may have replaced `vectors.npy` since it was written,
    /// and a NaN would outrank every score.
    pub fn load(dir: &Path) -> Result<Self> {
        let meta = IndexMeta::read(dir)?;
        meta.expect_kind(dir, "hnsw")?;
        let sp: StoredParams = serde_json::from_value(meta.params.clone()).with_context(|| format!("{}: bad params in index.json", dir.display()))?;
        sp.params.validate().with_context(|| format!("{}: index.json", dir.display()))?;
        let ids = npy::read_ids(&dir.join("ids.txt"))?;
        check_ids(&ids, meta.count).with_context(|| dir.display().to_string())?;
        let path = dir.join("vectors.npy");
        let vectors = NpyF32::open(&path)?;
        if meta.dim == 0 {
            bail!("{}: index.json says the vectors are 0-d", dir.display());
        }
        if vectors.rows() != meta.count || vectors.dim() != meta.dim {
            bail!("{}: index.json says ({}, {}), vectors.npy is ({}, {})", dir.display(), meta.count, meta.dim, vectors.rows(), vectors.dim());
        }
        let vectors = vectors.into_values();
        check_matrix(&path.display().to_string(), &vectors, meta.dim)?;
        let graph = Graph::read(&dir.join("graph.bin"), meta.count)?;
        Ok(Self {
            graph,
            vectors,
            dim: meta.dim,
            params: sp.params,
            max_norm: sp.max_norm,
            nb_layer: sp.nb_layer,
            builder: sp.builder,
            ids,
            meta,
            dot: simd::dot_kernel(),
            dot4: simd::dot4_kernel(),
        })
    }
}
