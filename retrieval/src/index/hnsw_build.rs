//! HNSW graph construction on flat arrays, in parallel (the algorithm of hnswlib and faiss).
//!
//! Why not hnsw_rs's builder: it links points through `Arc`s in `RwLock`ed lists and allocates
//! per visited candidate, and on 200k × 384 it built 3.2× slower than faiss on the same two
//! cores. Here every node owns a fixed block of link slots (`1 + 2M` on layer 0, `1 + M` on
//! each upper layer: a count, then neighbour ids) in one array of atomics, guarded by a
//! per-node mutex. A thread holds at most one node lock at a time (read a list, or rewrite
//! one), so insertions cannot deadlock; the relaxed atomics make the racy-but-locked
//! accesses plain loads and stores while keeping the code free of `unsafe`.
//!
//! Similarity is the inner product (larger is closer), used directly as HNSW's non-metric
//! distance, like faiss's `METRIC_INNER_PRODUCT`; see `hnsw.rs` for why not the MIPS→L2
//! reduction. Neighbours are chosen with the usual heuristic (keep a candidate only if it is
//! closer to the new point than to every neighbour already kept). A new point takes up to `2M`
//! links on layer 0 and `M` above, and lists are capped at the same sizes (faiss's choice;
//! hnswlib gives a new point only `M` on layer 0, which cost recall: 0.980 against 0.987 at
//! ef 256 on 200k × 384).

use super::simd;
use super::Scored;
use rayon::prelude::*;
use std::cell::RefCell;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering::Relaxed};
use std::sync::Mutex;

/// The graph a build produces: per node its level and, per layer `0..=level`, its neighbours.
pub(crate) struct BuiltGraph {
    pub entry: u32,
    pub level: Vec<u8>,
    /// `links[node][layer]`.
    pub links: Vec<Vec<Vec<u32>>>,
}

/// Highest level a node may draw (levels are geometric with ratio 1/M, so this is never hit
/// in practice; it bounds the per-node storage).
const MAX_LEVEL: u8 = 15;

struct Builder<'a> {
    s: Scorer<'a>,
    m: usize,
    m0: usize,
    ef: usize,
    level: Vec<u8>,
    /// Layer 0: node `i` owns `[i * (1 + m0), (i + 1) * (1 + m0))`: count, then links.
    l0: Vec<AtomicU32>,
    /// Upper layers: node `i` owns `level[i]` blocks of `1 + m` from `up_start[i]`.
    up_start: Vec<usize>,
    up: Vec<AtomicU32>,
    locks: Vec<Mutex<()>>,
    /// Entry point and the top level; held for a whole insertion by a point that will raise
    /// the top level.
    entry: Mutex<(u32, u8)>,
}

/// Per-thread scratch for graph walks (building and searching): a visited table stamped with a
/// generation number, and buffers.
#[derive(Default)]
pub(super) struct Scratch {
    /// One byte per node, as faiss's `VisitedTable`: a quarter of the cache footprint of a
    /// u32 stamp, at the price of clearing the table once every 255 walks.
    stamp: Vec<u8>,
    gen: u8,
    links: Vec<u32>,
    fresh: Vec<u32>,
    scores: Vec<f32>,
    cands: BinaryHeap<Scored<u32>>,
    best: BinaryHeap<Reverse<Scored<u32>>>,
    /// Vectors scored by walks on this thread, for search statistics.
    pub distances: usize,
}

thread_local! {
    pub(super) static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Inner products of a query with rows of a row-major matrix.
#[derive(Clone, Copy)]
pub(super) struct Scorer<'a> {
    pub data: &'a [f32],
    pub dim: usize,
    pub dot: simd::Kernel,
    pub dot4: simd::Kernel4,
}

impl Scorer<'_> {
    pub fn row(&self, i: u32) -> &[f32] {
        let s = i as usize * self.dim;
        &self.data[s..s + self.dim]
    }
    pub fn score(&self, q: &[f32], i: u32) -> f32 {
        (self.dot)(q, self.row(i))
    }
}

/// Greedy walk on one layer from `(ep, ep_s)` to a local maximum of `<q, x>`.
/// `links(node, out)` fills `out` with the node's neighbours on that layer. Nodes stamped in
/// the current generation are skipped: call [`Scratch::start_walk`] once before a descent
/// (a node scored earlier in the descent scored at most the running best, which only grows,
/// so skipping it changes nothing).
pub(super) fn greedy(s: &Scorer, q: &[f32], mut ep: u32, mut ep_s: f32, sc: &mut Scratch, mut links: impl FnMut(u32, &mut Vec<u32>)) -> (u32, f32) {
    debug_assert!(sc.stamp.get(ep as usize).is_some_and(|&s| s == sc.gen), "greedy without start_walk");
    loop {
        links(ep, &mut sc.links);
        let gen = sc.gen;
        sc.fresh.clear();
        for &v in &sc.links {
            if sc.stamp[v as usize] != gen {
                sc.stamp[v as usize] = gen;
                sc.fresh.push(v);
            }
        }
        simd::dot_many(s.dot, s.dot4, q, s.data, s.dim, &sc.fresh, &mut sc.scores);
        sc.distances += sc.fresh.len();
        let mut moved = false;
        for (&v, &sv) in sc.fresh.iter().zip(&sc.scores) {
            if sv > ep_s {
                (ep, ep_s, moved) = (v, sv, true);
            }
        }
        if !moved {
            return (ep, ep_s);
        }
    }
}

/// Beam search on one layer from `(ep, ep_s)` over a graph of `n` nodes: up to `ef` nodes with
/// the largest `<q, x>`, unordered. `links(node, out)` either returns the node's neighbours
/// (a finished graph: no copy) or fills `out` with them under a lock and returns `None`.
#[allow(clippy::too_many_arguments)]
pub(super) fn beam_search<'g>(
    s: &Scorer,
    q: &[f32],
    ep: u32,
    ep_s: f32,
    ef: usize,
    n: usize,
    sc: &mut Scratch,
    mut links: impl FnMut(u32, &mut Vec<u32>) -> Option<&'g [u32]>,
) -> Vec<Scored<u32>> {
    let gen = sc.next_gen(n);
    sc.stamp[ep as usize] = gen;
    // The heaps live in the scratch so that a query costs no allocations but its result.
    let mut cands = std::mem::take(&mut sc.cands);
    let mut best = std::mem::take(&mut sc.best);
    cands.clear();
    best.clear();
    cands.push(Scored(ep_s, ep));
    best.push(Reverse(Scored(ep_s, ep)));
    while let Some(Scored(sn, node)) = cands.pop() {
        if best.len() >= ef && sn < best.peek().unwrap().0 .0 {
            break;
        }
        let direct = links(node, &mut sc.links);
        sc.fresh.clear();
        for &v in direct.unwrap_or(&sc.links) {
            if sc.stamp[v as usize] != gen {
                sc.stamp[v as usize] = gen;
                sc.fresh.push(v);
            }
        }
        simd::dot_many(s.dot, s.dot4, q, s.data, s.dim, &sc.fresh, &mut sc.scores);
        sc.distances += sc.fresh.len();
        for (&v, &sv) in sc.fresh.iter().zip(&sc.scores) {
            if best.len() < ef || sv > best.peek().unwrap().0 .0 {
                cands.push(Scored(sv, v));
                best.push(Reverse(Scored(sv, v)));
                if best.len() > ef {
                    best.pop();
                }
            }
        }
    }
    let found = best.iter().map(|r| r.0).collect();
    (sc.cands, sc.best) = (cands, best);
    found
}

impl Scratch {
    /// Start a greedy descent from `entry` in a graph of `n` nodes: a fresh generation with
    /// `entry` marked visited.
    pub(super) fn start_walk(&mut self, n: usize, entry: u32) {
        let gen = self.next_gen(n);
        self.stamp[entry as usize] = gen;
    }

    /// A fresh generation of the visited table for a graph of `n` nodes.
    fn next_gen(&mut self, n: usize) -> u8 {
        if self.stamp.len() < n {
            self.stamp = vec![0; n];
            self.gen = 0;
        }
        self.gen = self.gen.wrapping_add(1);
        if self.gen == 0 {
            self.stamp.fill(0);
            self.gen = 1;
        }
        self.gen
    }
}

/// Nodes by level, highest first, in a seeded random order within a level.
fn insertion_order(level: &[u8], seed: u64) -> Vec<u32> {
    let mut order: Vec<u32> = (0..level.len() as u32).collect();
    let mut s = seed;
    for i in (1..order.len()).rev() {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let j = ((s >> 33) % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    order.sort_by_key(|&v| std::cmp::Reverse(level[v as usize]));
    order
}

/// A geometric level per node, `floor(-ln(U) / ln(M))`, from a fixed seed (splitmix64), so a
/// build is reproducible up to thread interleaving.
fn draw_levels(n: usize, m: usize, seed: u64) -> Vec<u8> {
    let ml = 1.0 / (m as f64).ln();
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            let u = ((z >> 11) as f64 + 0.5) / (1u64 << 53) as f64; // in (0, 1)
            ((-u.ln() * ml).floor() as u64).min(MAX_LEVEL as u64) as u8
        })
        .collect()
}

/// Build the graph over `n = data.len() / dim` vectors with `m` links per node and layer and
/// `ef` candidates per insertion, on rayon's current pool; `progress(points inserted)` is
/// called every few thousand points.
pub(crate) fn build(data: &[f32], dim: usize, m: usize, ef: usize, progress: &(dyn Fn(usize) + Sync)) -> BuiltGraph {
    let n = data.len() / dim;
    let level = draw_levels(n, m, 0x5EED_4A7C_0DE5_1234);
    let m0 = 2 * m;
    let mut up_start = Vec::with_capacity(n);
    let mut total = 0usize;
    for &l in &level {
        up_start.push(total);
        total += l as usize * (1 + m);
    }
    // Highest levels first, so that the upper layers are complete before the bulk of the
    // points descends through them; shuffled within a level, because rows often come in
    // corpus order (passages of one article side by side), and inserting near-duplicates
    // back to back gave a graph that scored 7% more vectors per query on mini-KILT for the
    // same recall (faiss shuffles for the same reason).
    let order = insertion_order(&level, 0x0DDE_5EED);
    let first = order.first().copied().unwrap_or(0);
    let zeros = |len: usize| (0..len).map(|_| AtomicU32::new(0)).collect::<Vec<_>>();
    let b = Builder {
        s: Scorer { data, dim, dot: simd::dot_kernel(), dot4: simd::dot4_kernel() },
        m,
        m0,
        ef,
        l0: zeros(n * (1 + m0)),
        up: zeros(total),
        up_start,
        locks: (0..n).map(|_| Mutex::new(())).collect(),
        entry: Mutex::new((first, level.get(first as usize).copied().unwrap_or(0))),
        level,
    };
    let done = AtomicUsize::new(1);
    // One parallel pass per level (the first point is the entry already).
    let same_level = |x: &u32, y: &u32| b.level[*x as usize] == b.level[*y as usize];
    for group in order.get(1..).unwrap_or(&[]).chunk_by(same_level) {
        group.par_iter().with_min_len(64).for_each(|&i| {
            b.insert(i);
            let d = done.fetch_add(1, Relaxed) + 1;
            if d.is_multiple_of(4096) {
                progress(d);
            }
        });
    }
    progress(n);
    b.finish()
}

impl Builder<'_> {
    fn block(&self, node: u32, layer: usize) -> &[AtomicU32] {
        if layer == 0 {
            let s = node as usize * (1 + self.m0);
            &self.l0[s..s + 1 + self.m0]
        } else {
            let s = self.up_start[node as usize] + (layer - 1) * (1 + self.m);
            &self.up[s..s + 1 + self.m]
        }
    }

    /// Copy a node's links on `layer` into `out` (under its lock).
    fn read_links(&self, node: u32, layer: usize, out: &mut Vec<u32>) {
        let block = self.block(node, layer);
        out.clear();
        let _g = self.locks[node as usize].lock().unwrap_or_else(|p| p.into_inner());
        let c = block[0].load(Relaxed) as usize;
        out.extend(block[1..=c].iter().map(|a| a.load(Relaxed)));
    }

    fn write_links(block: &[AtomicU32], links: &[u32]) {
        block[0].store(links.len() as u32, Relaxed);
        for (slot, &v) in block[1..].iter().zip(links) {
            slot.store(v, Relaxed);
        }
    }

    fn insert(&self, cur: u32) {
        let q = self.s.row(cur);
        let my_level = self.level[cur as usize];
        let mut top_guard = None;
        let (entry, top) = {
            let g = self.entry.lock().unwrap_or_else(|p| p.into_inner());
            let e = *g;
            // Inserting by level, highest first, makes this unreachable; kept so that the entry
            // stays on the top layer whatever the order.
            if my_level > e.1 {
                top_guard = Some(g); // this point becomes the entry: keep others out of the top
            }
            e
        };
        SCRATCH.with(|sc| {
            let sc = &mut *sc.borrow_mut();
            let (mut ep, mut ep_s) = (entry, self.s.score(q, entry));
            sc.start_walk(self.level.len(), entry);
            // Greedy descent through the layers above this point's own.
            for layer in (my_level as usize + 1..=top as usize).rev() {
                (ep, ep_s) = greedy(&self.s, q, ep, ep_s, sc, |v, out| self.read_links(v, layer, out));
            }
            // Choose the neighbours on every layer first, top down...
            let mut chosen_per_layer = Vec::with_capacity(my_level as usize + 1);
            for layer in (0..=my_level.min(top) as usize).rev() {
                let found = beam_search(&self.s, q, ep, ep_s, self.ef, self.level.len(), sc, |v, out| {
                    self.read_links(v, layer, out);
                    None
                });
                let chosen = self.select(q, &found, if layer == 0 { self.m0 } else { self.m });
                if let Some(best) = chosen.first() {
                    (ep, ep_s) = (best.1, best.0);
                }
                chosen_per_layer.push((layer, chosen.iter().map(|s| s.1).collect::<Vec<u32>>()));
            }
            // ...then link bottom up. Other threads can reach `cur` on a layer only through
            // the back-links made there, and by then its own lists on that layer and every
            // layer below are in place. (Linking top down, as the sequential algorithm does, let
            // a concurrent insertion descend into `cur` on layer 0 before `cur` had any links
            // there, find nothing else, and end up with `cur` as its only neighbour.)
            for (layer, ids) in chosen_per_layer.into_iter().rev() {
                self.add_links(cur, layer, &ids, &mut sc.links);
                for &nb in &ids {
                    self.add_links(nb, layer, &[cur], &mut sc.links);
                }
            }
        });
        if let Some(mut g) = top_guard {
            *g = (cur, my_level);
        }
    }

    /// Add `new` to `node`'s list on `layer` (under its lock); when that overflows the list's
    /// capacity, keep what the neighbour heuristic picks from old and new together.
    fn add_links(&self, node: u32, layer: usize, new: &[u32], buf: &mut Vec<u32>) {
        let cap = if layer == 0 { self.m0 } else { self.m };
        let block = self.block(node, layer);
        let _g = self.locks[node as usize].lock().unwrap_or_else(|p| p.into_inner());
        let c = block[0].load(Relaxed) as usize;
        buf.clear();
        buf.extend(block[1..=c].iter().map(|a| a.load(Relaxed)));
        for &v in new {
            if v != node && !buf.contains(&v) {
                buf.push(v);
            }
        }
        if buf.len() <= cap {
            Self::write_links(block, buf);
            return;
        }
        let base = self.s.row(node);
        let mut cands: Vec<Scored<u32>> = buf.iter().map(|&v| Scored(self.s.score(base, v), v)).collect();
        cands.sort_unstable_by(|a, b| b.cmp(a));
        let kept: Vec<u32> = self.select_sorted(&cands, cap).iter().map(|s| s.1).collect();
        Self::write_links(block, &kept);
    }

    /// The neighbour heuristic over the candidates of a search around `q`: at most `m`, best
    /// first. Scores are recomputed with the one-vector kernel: the search's four-at-a-time
    /// kernel sums in another order, and the heuristic's comparisons must not hinge on the
    /// last bit (with duplicate vectors they are exact ties).
    fn select(&self, q: &[f32], found: &[Scored<u32>], m: usize) -> Vec<Scored<u32>> {
        let mut sorted: Vec<Scored<u32>> = found.iter().map(|s| Scored(self.s.score(q, s.1), s.1)).collect();
        sorted.sort_unstable_by(|a, b| b.cmp(a));
        self.select_sorted(&sorted, m)
    }

    /// Keep a candidate (best first) only if no kept one is closer to it than the base point
    /// is: this spreads links over directions instead of clustering them.
    fn select_sorted(&self, sorted: &[Scored<u32>], m: usize) -> Vec<Scored<u32>> {
        if sorted.len() <= m {
            return sorted.to_vec();
        }
        let mut kept: Vec<Scored<u32>> = Vec::with_capacity(m);
        for &c in sorted {
            if kept.len() >= m {
                break;
            }
            let cv = self.s.row(c.1);
            if kept.iter().all(|k| self.s.score(cv, k.1) <= c.0) {
                kept.push(c);
            }
        }
        kept
    }

    fn finish(self) -> BuiltGraph {
        let n = self.level.len();
        let entry = self.entry.lock().unwrap_or_else(|p| p.into_inner()).0;
        let links = (0..n as u32)
            .map(|i| {
                (0..=self.level[i as usize] as usize)
                    .map(|layer| {
                        let b = self.block(i, layer);
                        let c = b[0].load(Relaxed) as usize;
                        b[1..=c].iter().map(|a| a.load(Relaxed)).collect()
                    })
                    .collect()
            })
            .collect();
        BuiltGraph { entry, level: self.level, links }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Unit vectors: on them inner product is cosine, a proper similarity, so the layer-0
    /// graph should connect everything. (With varying norms, short vectors lose every in-link
    /// to longer ones, as in any inner-product graph; they are rarely anyone's top hit.)
    fn data(n: usize, d: usize) -> Vec<f32> {
        let mut s = 42u64;
        let mut v: Vec<f32> = (0..n * d)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            })
            .collect();
        for row in v.chunks_mut(d) {
            let norm = row.iter().map(|x| x * x).sum::<f32>().sqrt();
            row.iter_mut().for_each(|x| *x /= norm);
        }
        v
    }

    #[test]
    fn graph_invariants() {
        let (n, d, m) = (2_000, 16, 6);
        // More threads than cores, so that insertions interleave.
        let pool = rayon::ThreadPoolBuilder::new().num_threads(4).build().unwrap();
        let g = pool.install(|| build(&data(n, d), d, m, 40, &|_| ()));
        assert_eq!(g.links.len(), n);
        let top = *g.level.iter().max().unwrap();
        assert_eq!(g.level[g.entry as usize], top, "entry is on the top layer");
        for (i, layers) in g.links.iter().enumerate() {
            assert_eq!(layers.len(), g.level[i] as usize + 1);
            for (l, links) in layers.iter().enumerate() {
                assert!(links.len() <= if l == 0 { 2 * m } else { m }, "node {i} layer {l}: {} links", links.len());
                let mut u = links.clone();
                u.sort_unstable();
                u.dedup();
                assert_eq!(u.len(), links.len(), "node {i} layer {l}: duplicate links");
                for &v in links {
                    assert_ne!(v as usize, i, "self link");
                    assert!(g.level[v as usize] as usize >= l, "node {i} links to {v} absent from layer {l}");
                }
            }
        }
        // Every node is reachable from the entry on layer 0.
        let mut seen = vec![false; n];
        let mut stack = vec![g.entry];
        seen[g.entry as usize] = true;
        while let Some(v) = stack.pop() {
            for &w in &g.links[v as usize][0] {
                if !std::mem::replace(&mut seen[w as usize], true) {
                    stack.push(w);
                }
            }
        }
        let reached = seen.iter().filter(|s| **s).count();
        assert_eq!(reached, n, "{reached} of {n} reachable");
    }

    #[test]
    fn duplicate_vectors_keep_their_links() {
        // Every inner product ties: the heuristic must keep ties, not prune on rounding noise.
        let (n, d, m) = (300, 40, 4);
        let g = build(&vec![0.25; n * d], d, m, 16, &|_| ());
        let mean = g.links.iter().map(|l| l[0].len()).sum::<usize>() as f64 / n as f64;
        assert!(mean >= m as f64, "mean layer-0 degree {mean}");
    }

    #[test]
    fn insertion_order_is_a_permutation_by_level() {
        let level = draw_levels(5_000, 4, 3);
        let order = insertion_order(&level, 9);
        let mut sorted = order.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..5_000).collect::<Vec<u32>>());
        assert!(order.windows(2).all(|w| level[w[0] as usize] >= level[w[1] as usize]), "highest levels first");
        // Shuffled within a level: the level-0 rows are not in row order.
        let zeros: Vec<u32> = order.iter().copied().filter(|&v| level[v as usize] == 0).collect();
        assert!(zeros.windows(2).filter(|w| w[0] < w[1]).count() < zeros.len() * 3 / 4);
    }

    #[test]
    fn levels_are_geometric() {
        let lv = draw_levels(100_000, 16, 1);
        let above = |l: u8| lv.iter().filter(|&&x| x >= l).count() as f64 / lv.len() as f64;
        // P(level ≥ 1) = 1/M, P(level ≥ 2) = 1/M².
        assert!((above(1) - 1.0 / 16.0).abs() < 0.005, "{}", above(1));
        assert!((above(2) - 1.0 / 256.0).abs() < 0.001, "{}", above(2));
    }
}
