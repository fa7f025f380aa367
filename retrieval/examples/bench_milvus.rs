//! Milvus backend benchmark driven by `bench/milvus_vs_pymilvus.py` (which runs pymilvus on the
//! same server and files).
//!
//! bench_milvus URI COLLECTION BASE.npy QUERIES.npy GT.npy K ANN [NLIST NPROBE | M EF_CONSTRUCTION EF_SEARCH]
//!
//! ANN is `flat`, `ivf_flat` (NLIST NPROBE) or `hnsw` (M EF_CONSTRUCTION EF_SEARCH). Times the build (every row written, flushed, indexed, loaded and
//! counted: what `host index build --kind milvus` does after reading the file), then searches
//! one query per request and SEARCH_BATCH (256) per request. GT.npy holds the exact top-K rows
//! per query (as float32). Prints one JSON object on stdout.

mod common;

use common::recall;
use rak_retrieval::index::{Hit, MilvusAnn, MilvusIndex, MilvusParams};
use rak_retrieval::npy::NpyF32;
use rak_retrieval::pipeline::Quiet;
use std::path::Path;
use std::time::Instant;


fn main() -> anyhow::Result<()> {
    let a: Vec<String> = std::env::args().collect();
    let (uri, collection) = (a[1].clone(), a[2].clone());
    let (base, queries, gt) = (NpyF32::open(Path::new(&a[3]))?, NpyF32::open(Path::new(&a[4]))?, NpyF32::open(Path::new(&a[5]))?);
    let k: usize = a[6].parse()?;
    let ann = match a[7].as_str() {
        "flat" => MilvusAnn::Flat,
        "ivf_flat" => MilvusAnn::IvfFlat { nlist: a[8].parse()?, nprobe: a[9].parse()? },
        "hnsw" => MilvusAnn::Hnsw { m: a[8].parse()?, ef_construction: a[9].parse()?, ef_search: a[10].parse()? },
        other => anyhow::bail!("ANN {other}: flat, ivf_flat or hnsw"),
    };
    let (n, dim, nq) = (base.rows(), base.dim(), queries.rows());
    let ids: Vec<String> = (0..n).map(|i| i.to_string()).collect();
    let dir = std::env::temp_dir().join(format!("bench-milvus-{}", std::process::id()));
    drop(base);

    let t = Instant::now();
    MilvusIndex::build_from_npy(Path::new(&a[3]), &ids, MilvusParams { uri, collection, ann, build: String::new() }, &dir, &Quiet)?;
    let build_s = t.elapsed().as_secs_f64();
    let index = MilvusIndex::load(&dir)?;

    let q = queries.into_values();
    let t = Instant::now();
    let mut one: Vec<Vec<Hit>> = Vec::with_capacity(nq);
    for row in q.chunks(dim) {
        one.extend(index.search(row, dim, k)?);
    }
    let one_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let batched = index.search(&q, dim, k)?;
    let batched_s = t.elapsed().as_secs_f64();
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "{}",
        serde_json::json!({
            "n": n, "dim": dim, "nq": nq, "k": k,
            "build_s": build_s, "rows_per_s": n as f64 / build_s,
            "qps_batch1": nq as f64 / one_s, "qps_batch256": nq as f64 / batched_s,
            "recall_batch1": recall(&one, &gt, k), "recall_batch256": recall(&batched, &gt, k),
        })
    );
    Ok(())
}
