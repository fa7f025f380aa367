//! Index benchmark driven by `bench/index_vs_faiss.py` (which also runs faiss on the same files).
//!
//! bench_index flat  BASE.npy QUERIES.npy GT.npy K
//! bench_index hnsw  BASE.npy QUERIES.npy GT.npy K M EF_CONSTRUCTION EF1,EF2,... [native|hnsw_rs [REPEAT]]
//!
//! Each ef is timed REPEAT times (default 1) and the median kept.
//!
//! GT.npy holds the exact top-K rows per query (as float32). Prints one JSON object on stdout.
//! Threads: RAYON_NUM_THREADS (HNSW, Rust flat) and tch::set_num_threads from RAK_THREADS.

mod common;

use common::recall;
use rak_retrieval::index::{FlatBackend, FlatIndex, HnswBuilder, HnswIndex, HnswParams};
use rak_retrieval::npy::NpyF32;
use std::path::Path;
use std::time::Instant;

fn peak_rss_mib() -> f64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| l.split_whitespace().nth(1)).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0) / 1024.0
}


fn main() -> anyhow::Result<()> {
    rak_core::malloc::keep_freed_buffers(); // as `host` does
    let a: Vec<String> = std::env::args().collect();
    let threads: i32 = std::env::var("RAK_THREADS").ok().and_then(|v| v.parse().ok()).unwrap_or(2);
    tch::set_num_threads(threads);
    let (mode, base, queries, gt, k) = (&a[1], NpyF32::open(Path::new(&a[2]))?, NpyF32::open(Path::new(&a[3]))?, NpyF32::open(Path::new(&a[4]))?, a[5].parse::<usize>()?);
    let d = base.dim();
    let nq = queries.rows();
    let ids: Vec<String> = (0..base.rows()).map(|i| i.to_string()).collect();
    let mut out = serde_json::json!({"n": base.rows(), "dim": d, "nq": nq, "k": k, "threads": threads});
    match mode.as_str() {
        "flat" => {
            // The matrix already read as `base`, not read a second time.
            let flat = FlatIndex::new(base.into_values(), d, ids)?;
            let t = Instant::now();
            let hits = flat.search_with(FlatBackend::Torch, queries.data(), d, k)?;
            let s = t.elapsed().as_secs_f64();
            out["flat_torch"] = serde_json::json!({"seconds": s, "qps": nq as f64 / s, "recall": recall(&hits, &gt, k)});
            // The Rust scan is memory-bound per query; time it on a slice of the queries.
            let nr = nq.min(100);
            let t = Instant::now();
            let hits = flat.search_with(FlatBackend::Rust, &queries.data()[..nr * d], d, k)?;
            let s = t.elapsed().as_secs_f64();
            out["flat_rust"] = serde_json::json!({"queries": nr, "seconds": s, "qps": nr as f64 / s, "recall": recall(&hits, &gt, k)});
        }
        "hnsw" => {
            let (m, efc) = (a[6].parse()?, a[7].parse()?);
            let efs: Vec<usize> = a[8].split(',').map(|v| v.parse()).collect::<Result<_, _>>()?;
            let builder: HnswBuilder = a.get(9).map_or(Ok(HnswBuilder::Native), |b| b.parse())?;
            let t = Instant::now();
            // RAK_BENCH_REUSE=DIR: load the index from DIR if it is there, else build and save it
            // there (for search-only experiments; the build time is then the load time).
            let reuse = std::env::var_os("RAK_BENCH_REUSE").filter(|v| !v.is_empty()).map(std::path::PathBuf::from);
            let mut h = match &reuse {
                Some(dir) if dir.exists() => HnswIndex::load(dir)?,
                // The index takes `base` over (one copy of the matrix, as `host index build`).
                _ => HnswIndex::build_owned(base.into_values(), d, ids, HnswParams { m, ef_construction: efc, ef_search: efs[0] }, builder, &|_| ())?,
            };
            if let Some(dir) = reuse.filter(|d| !d.exists()) {
                h.save(&dir)?;
            }
            let build = t.elapsed().as_secs_f64();
            out["build_seconds"] = build.into();
            let mut runs = vec![];
            let repeat: usize = a.get(10).map_or(Ok(1), |r| r.parse())?;
            for ef in efs {
                h.set_ef_search(ef)?;
                let mut times = vec![];
                let mut hits = vec![];
                let mut stats = Default::default();
                for _ in 0..repeat.max(1) {
                    let t = Instant::now();
                    (hits, stats) = h.search_with_stats(queries.data(), d, k)?;
                    times.push(t.elapsed().as_secs_f64());
                }
                times.sort_by(f64::total_cmp);
                let s = times[times.len() / 2];
                let ndis = stats.distances as f64 / nq as f64;
                runs.push(serde_json::json!({"ef": ef, "qps": nq as f64 / s, "recall": recall(&hits, &gt, k), "ndis": ndis}));
            }
            out["search"] = runs.into();
            out["m"] = m.into();
            out["ef_construction"] = efc.into();
            out["builder"] = builder.to_string().into();
        }
        _ => anyhow::bail!("mode must be flat or hnsw"),
    }
    out["peak_rss_mib"] = peak_rss_mib().into();
    println!("{out}");
    Ok(())
}
