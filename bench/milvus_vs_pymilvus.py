#!/usr/bin/env python3
"""The Milvus index backend (milvus-sdk-rust, through rak-retrieval's MilvusIndex) against
pymilvus doing the same on the same server, side by side.

    . scripts/env.sh && cargo build --release -p rak-retrieval --example bench_milvus --example bench_index
    .venv/bin/pip install -r bench/requirements.txt      # pymilvus
    python bench/milvus_vs_pymilvus.py [--n 100000] [--nq 1000] [--ann ivf_flat]
    bench/milvus_standalone.sh --ann hnsw     # HNSW: Milvus standalone (see that script)

The server: milvus-lite 2.5.1's (scripts/milvus.sh, 127.0.0.1; a state folder of its own under
.cache/bench/milvus), or --uri. Data: the vectors of bench/index_vs_faiss.py (N base and NQ
queries of width 384 with a 64-d latent and varying norms; cached under .cache/bench/), ground
truth exact inner product (numpy). Each side, in turn, on a fresh collection:
- build: every row written in requests of 4 MiB of vectors (pymilvus: MilvusClient.insert of
  row dicts from the matrix in memory, as its docs show; ours: upserts of columns streamed
  from the .npy file), flushed, indexed (IP), loaded and counted (count(*));
- search: top K, one query per request, then 256 per request; recall@K against exact.
The comparison is of the clients and their requests on one server: both get the same hits.
milvus-lite refuses HNSW and searches small collections exactly whatever their index
(docs/BENCHMARKS.md), so ANN recall at chosen parameters needs a standalone server (--uri;
bench/milvus_standalone.sh starts one). With --ann hnsw, this project's own HNSW index
(bench_index, the same M, efConstruction and ef) is measured on the same data beside them.
"""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from index_vs_faiss import make_data, recall  # noqa: E402
from machine import describe  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSERT_BYTES = 4 << 20


def pymilvus_side(uri, name, base, queries, k, ann, nlist, nprobe, m, ef_construction, ef_search):
    from pymilvus import DataType, MilvusClient

    c = MilvusClient(uri=uri)
    if c.has_collection(name):
        c.drop_collection(name)
    n, d = base.shape
    t = time.perf_counter()
    schema = c.create_schema(auto_id=False)
    schema.add_field("row", DataType.INT64, is_primary=True)
    schema.add_field("vec", DataType.FLOAT_VECTOR, dim=d)
    c.create_collection(name, schema=schema)
    step = max(1, INSERT_BYTES // (4 * d))
    for s in range(0, n, step):
        c.insert(name, [{"row": i, "vec": base[i].tolist()} for i in range(s, min(n, s + step))])
    c.flush(name)
    params = c.prepare_index_params()
    index_type, build, search = {
        "flat": ("FLAT", {}, {}),
        "ivf_flat": ("IVF_FLAT", {"nlist": nlist}, {"nprobe": nprobe}),
        "hnsw": ("HNSW", {"M": m, "efConstruction": ef_construction}, {"ef": max(ef_search, k)}),
    }[ann]
    params.add_index(field_name="vec", index_type=index_type, metric_type="IP", params=build)
    c.create_index(name, params)
    c.load_collection(name)
    count = c.query(name, output_fields=["count(*)"], consistency_level="Strong")[0]["count(*)"]
    build_s = time.perf_counter() - t
    assert count == n, (count, n)
    sp = {"metric_type": "IP", "params": search}
    t = time.perf_counter()
    one = [c.search(name, data=[q.tolist()], limit=k, search_params=sp)[0] for q in queries]
    one_s = time.perf_counter() - t
    t = time.perf_counter()
    batched = []
    for s in range(0, len(queries), 256):
        batched.extend(c.search(name, data=queries[s:s + 256].tolist(), limit=k, search_params=sp))
    batched_s = time.perf_counter() - t
    c.drop_collection(name)
    rows = lambda res: [[h["id"] for h in r] for r in res]  # noqa: E731
    return {"build_s": build_s, "rows_per_s": n / build_s, "qps_batch1": len(queries) / one_s,
            "qps_batch256": len(queries) / batched_s, "one": rows(one), "batched": rows(batched)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--nq", type=int, default=1000)
    ap.add_argument("--d", type=int, default=384)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--ann", default="ivf_flat", choices=["flat", "ivf_flat", "hnsw"])
    ap.add_argument("--nlist", type=int, default=256)
    ap.add_argument("--nprobe", type=int, default=16)
    # HnswParams' defaults but ef, here lower so that recall is not 1 at this size.
    ap.add_argument("--m", type=int, default=32)
    ap.add_argument("--ef-construction", type=int, default=200)
    ap.add_argument("--ef-search", type=int, default=32)
    ap.add_argument("--uri", help="a Milvus server of your own (default: start milvus-lite)")
    ap.add_argument("--server", help="what --uri is, for the report")
    args = ap.parse_args()

    cache = os.path.join(ROOT, ".cache", "bench")
    os.makedirs(cache, exist_ok=True)
    base_path = os.path.join(cache, f"base-{args.n}-{args.d}.npy")
    q_path = os.path.join(cache, f"queries-{args.nq}-{args.d}.npy")
    if not os.path.exists(base_path):
        make_data(base_path, args.n, args.d, seed=1)
    if not os.path.exists(q_path):
        make_data(q_path, args.nq, args.d, seed=2)
    base, queries = np.load(base_path), np.load(q_path)
    gt = np.argsort(-(queries @ base.T), axis=1)[:, :args.k]
    gt_path = os.path.join(cache, f"gt-milvus-{args.n}-{args.nq}-{args.k}.npy")
    np.save(gt_path, gt.astype(np.float32))

    env = dict(os.environ, MILVUS_STATE_DIR=os.path.join(cache, "milvus"))
    uri = args.uri or subprocess.run([os.path.join(ROOT, "scripts/milvus.sh"), "start"], env=env,
                                     check=True, capture_output=True, text=True).stdout.strip()
    try:
        ext = {"ivf_flat": [args.nlist, args.nprobe], "hnsw": [args.m, args.ef_construction, args.ef_search]}.get(args.ann, [])
        ours = json.loads(subprocess.run(
            [os.path.join(ROOT, "target/release/examples/bench_milvus"), uri, "bench_rak", base_path, q_path,
             gt_path, str(args.k), args.ann, *map(str, ext)], check=True, stdout=subprocess.PIPE, text=True).stdout)
        py = pymilvus_side(uri, "bench_pymilvus", base, queries, args.k, args.ann, args.nlist, args.nprobe,
                           args.m, args.ef_construction, args.ef_search)
        py["recall_batch1"] = recall(py.pop("one"), gt, args.k)
        py["recall_batch256"] = recall(py.pop("batched"), gt, args.k)
    finally:
        if not args.uri:
            subprocess.run([os.path.join(ROOT, "scripts/milvus.sh"), "stop"], env=env, check=False)
    local = None
    if args.ann == "hnsw":
        # This project's HNSW on the same data and parameters (one search thread per core).
        local = json.loads(subprocess.run(
            [os.path.join(ROOT, "target/release/examples/bench_index"), "hnsw", base_path, q_path, gt_path,
             str(args.k), str(args.m), str(args.ef_construction), str(max(args.ef_search, args.k))],
            check=True, stdout=subprocess.PIPE, text=True).stdout)
    out = {"machine": describe(), "server": args.server or args.uri or "milvus-lite 2.5.1 (scripts/milvus.sh)",
           "n": args.n, "nq": args.nq, "d": args.d, "k": args.k, "ann": args.ann, "nlist": args.nlist,
           "nprobe": args.nprobe, "m": args.m, "ef_construction": args.ef_construction, "ef_search": args.ef_search,
           "rak": ours, "pymilvus": py, "rak_local_hnsw": local,
           "ratios": {"build_speed": ours["rows_per_s"] / py["rows_per_s"],
                      "qps_batch1": ours["qps_batch1"] / py["qps_batch1"],
                      "qps_batch256": ours["qps_batch256"] / py["qps_batch256"]}}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
