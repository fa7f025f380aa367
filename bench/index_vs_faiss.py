#!/usr/bin/env python3
"""rak-retrieval indexes vs faiss-cpu on the same vectors, side by side.

    . scripts/env.sh && cargo build --release -p rak-retrieval --example bench_index
    python bench/index_vs_faiss.py --n 200000 --threads 2
    python bench/index_vs_faiss.py --base-npy EMB/embeddings.npy --queries-npy Q/embeddings.npy

Data (deterministic, cached under .cache/bench/): N base and NQ query vectors of width 384,
x = z @ A + 0.1 * noise with z ~ N(0, I_64) (a 64-d latent, like real embeddings' low intrinsic
dimension), then each vector scaled by exp(0.25 * N(0, 1)) so norms vary: maximum inner product
differs from cosine. Ground truth: faiss IndexFlatIP (exact).

Each measurement runs in its own process (this script re-invoked as a worker, or the Rust
example) so that peak RSS (VmHWM) is per system.

HNSW on both sides builds the graph on inner product (faiss: IndexHNSWFlat(d, M,
METRIC_INNER_PRODUCT); rak-retrieval: HnswIndex, see retrieval/src/index/hnsw.rs for why not the MIPS->L2
reduction). Same M, efConstruction, efSearch sweep, k, threads; all queries in one batch. Each ef is timed
--repeat times and the median kept; the summary compares the fastest ef of each system whose
recall@10 reaches --target (the recall-QPS frontier at that recall).
"""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

from machine import describe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def peak_rss_mib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def make_data(path, n, d, seed):
    rng = np.random.default_rng(seed)
    a = np.random.default_rng(12345).standard_normal((64, d), dtype=np.float32) / 8.0
    out = np.lib.format.open_memmap(path + ".tmp.npy", mode="w+", dtype="<f4", shape=(n, d))
    for s in range(0, n, 100_000):
        e = min(n, s + 100_000)
        z = rng.standard_normal((e - s, 64), dtype=np.float32)
        x = z @ a + 0.1 * rng.standard_normal((e - s, d), dtype=np.float32)
        x *= np.exp(0.25 * rng.standard_normal((e - s, 1))).astype(np.float32)
        out[s:e] = x
    out.flush()
    del out
    os.replace(path + ".tmp.npy", path)


def recall(found, gt, k):
    return float(np.mean([len(set(f[:k]) & set(g[:k])) / k for f, g in zip(found, gt)]))


def worker(args):
    import faiss

    faiss.omp_set_num_threads(args.threads)
    xb = np.load(args.base, mmap_mode="r")
    xq = np.load(args.queries)
    k = args.k
    out = {"n": xb.shape[0], "dim": xb.shape[1], "nq": xq.shape[0], "k": k, "threads": args.threads}
    if args.worker == "flat":
        index = faiss.IndexFlatIP(xb.shape[1])
        index.add(np.ascontiguousarray(xb))
        t = time.perf_counter()
        _, ids = index.search(xq, k)
        s = time.perf_counter() - t
        np.save(args.gt + ".tmp.npy", ids.astype(np.float32))
        os.replace(args.gt + ".tmp.npy", args.gt)
        out["flat_faiss"] = {"seconds": s, "qps": xq.shape[0] / s}
    else:
        gt = np.load(args.gt).astype(np.int64)
        t = time.perf_counter()
        index = faiss.IndexHNSWFlat(xb.shape[1], args.m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = args.efc
        for s in range(0, xb.shape[0], 100_000):
            index.add(np.ascontiguousarray(xb[s : s + 100_000]))
        out["build_seconds"] = time.perf_counter() - t
        qa = xq
        runs = []
        for ef in args.efs:
            index.hnsw.efSearch = ef
            times = []
            for _ in range(args.repeat):
                faiss.cvar.hnsw_stats.reset()
                t = time.perf_counter()
                _, ids = index.search(qa, k)
                times.append(time.perf_counter() - t)
            s = float(np.median(times))
            # Vectors scored per query, all layers (the number our side reports as ndis).
            ndis = faiss.cvar.hnsw_stats.ndis / xq.shape[0]
            runs.append({"ef": ef, "qps": xq.shape[0] / s, "recall": recall(ids, gt, k), "ndis": ndis})
        out["search"] = runs
    out["peak_rss_mib"] = peak_rss_mib()
    print(json.dumps(out))


def run(cmd, env=None):
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    r = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True, env=env)
    return json.loads(r.stdout.strip().splitlines()[-1])


def best_at(runs, target):
    """The fastest run whose recall reaches the target (the recall-QPS frontier at that recall)."""
    ok = [r for r in runs if r["recall"] >= target]
    return max(ok, key=lambda r: r["qps"]) if ok else None


def qps_at(runs, target, key="qps"):
    """QPS (or another per-ef number) at exactly the target recall, interpolated linearly
    between the two sweep points around it (ef sweeps are coarse, so the first ef past the
    target flatters nobody)."""
    pts = sorted((r["recall"], r[key]) for r in runs if key in r)
    for (r0, q0), (r1, q1) in zip(pts, pts[1:]):
        if r0 <= target <= r1 and r1 > r0:
            return q0 + (target - r0) / (r1 - r0) * (q1 - q0)
    return None


def median_of_rounds(runs):
    """One side's result with build time, peak RSS and each ef's QPS and recall the median over
    rounds (all rounds use the same ef list)."""
    out = dict(runs[0])
    out["build_seconds"] = float(np.median([r["build_seconds"] for r in runs]))
    out["peak_rss_mib"] = float(np.median([r["peak_rss_mib"] for r in runs]))
    out["search"] = [
        {"ef": row["ef"],
         "qps": float(np.median([r["search"][i]["qps"] for r in runs])),
         "recall": float(np.median([r["search"][i]["recall"] for r in runs])),
         **({"ndis": float(np.median([r["search"][i]["ndis"] for r in runs]))} if "ndis" in row else {})}
        for i, row in enumerate(runs[0]["search"])
    ]
    return out


def median_flat(runs):
    """One side's exact-search result with QPS and seconds the median over rounds."""
    out = dict(runs[0])
    for key in ("flat_faiss", "flat_torch", "flat_rust"):
        if key in out:
            out[key] = dict(out[key], qps=float(np.median([r[key]["qps"] for r in runs])),
                            seconds=float(np.median([r[key]["seconds"] for r in runs])))
    out["peak_rss_mib"] = float(np.median([r["peak_rss_mib"] for r in runs]))
    return out


def summarize(res, target):
    ff, rf = res.get("faiss_flat"), res.get("rak_flat")
    if ff and rf:
        a, b = ff["flat_faiss"]["qps"], rf["flat_torch"]["qps"]
        print(f"exact search QPS: rak {b:.0f} faiss {a:.0f} ratio {b / a:.2f}", file=sys.stderr)
    f, r = res.get("faiss_hnsw"), res.get("rak_hnsw")
    if not (f and r):
        return
    print(f"build: rak {r['build_seconds']:.1f}s faiss {f['build_seconds']:.1f}s "
          f"ratio {r['build_seconds'] / f['build_seconds']:.2f}x", file=sys.stderr)
    fa, ra = best_at(f["search"], target), best_at(r["search"], target)
    if fa and ra:
        print(f"QPS at recall>={target}: rak {ra['qps']:.0f} (ef {ra['ef']}, R {ra['recall']:.3f}) "
              f"faiss {fa['qps']:.0f} (ef {fa['ef']}, R {fa['recall']:.3f}) ratio {ra['qps'] / fa['qps']:.2f}",
              file=sys.stderr)
    fi, ri = qps_at(f["search"], target), qps_at(r["search"], target)
    if fi and ri:
        print(f"QPS interpolated at recall {target}: rak {ri:.0f} faiss {fi:.0f} ratio {ri / fi:.2f}", file=sys.stderr)
    # Deterministic (no timing noise): vectors scored per query at the target recall.
    fn, rn = qps_at(f["search"], target, "ndis"), qps_at(r["search"], target, "ndis")
    if fn and rn:
        print(f"distances per query at recall {target}: rak {rn:.0f} faiss {fn:.0f} ratio {rn / fn:.2f}", file=sys.stderr)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=200_000)
    p.add_argument("--nq", type=int, default=1000)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--m", type=int, default=16)
    p.add_argument("--efc", type=int, default=100)
    p.add_argument("--efs", type=lambda s: [int(v) for v in s.split(",")], default=[16, 32, 64, 128, 256])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--target", type=float, default=0.98)
    p.add_argument("--repeat", type=int, default=3, help="time each ef this many times; report the median")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every measurement (exact search, HNSW build and search) this many times, "
                        "alternating which side goes first; the median of the rounds is kept (this VM's "
                        "speed drifts by 10-30%% between minutes, which one pass per side cannot tell "
                        "from a real difference)")
    p.add_argument("--rak-builder", default="native", help="native or hnsw_rs")
    p.add_argument("--skip", default="", help="comma list of: flat, faiss-hnsw, rak-hnsw")
    p.add_argument("--worker", choices=["flat", "hnsw"])
    p.add_argument("--base"), p.add_argument("--queries"), p.add_argument("--gt")
    p.add_argument("--base-npy", help="real base vectors ([n, d] float32 .npy) instead of synthetic ones")
    p.add_argument("--queries-npy", help="real query vectors, with --base-npy")
    p.add_argument("--summarize", metavar="RESULT.json", help="only print the summary of an earlier run's output")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.summarize:
        return summarize(json.load(open(args.summarize)), args.target)

    cache = os.path.join(ROOT, ".cache", "bench")
    os.makedirs(cache, exist_ok=True)
    if args.base_npy:
        base, queries = os.path.abspath(args.base_npy), os.path.abspath(args.queries_npy)
        args.n, args.dim = np.load(base, mmap_mode="r").shape
        args.nq = np.load(queries, mmap_mode="r").shape[0]
        tag = os.path.basename(os.path.dirname(base)) or "real"
        gt = os.path.join(cache, f"gt-{tag}-{args.n}x{args.dim}-q{args.nq}-k{args.k}.npy")
    else:
        base = os.path.join(cache, f"base-{args.n}x{args.dim}.npy")
        queries = os.path.join(cache, f"queries-{args.nq}x{args.dim}.npy")
        gt = os.path.join(cache, f"gt-{args.n}x{args.dim}-q{args.nq}-k{args.k}.npy")
        if not os.path.exists(base):
            make_data(base, args.n, args.dim, seed=1)
        if not os.path.exists(queries):
            make_data(queries, args.nq, args.dim, seed=2)
    me = [sys.executable, os.path.abspath(__file__), "--base", base, "--queries", queries, "--gt", gt,
          "--k", str(args.k), "--threads", str(args.threads), "--m", str(args.m), "--efc", str(args.efc),
          "--efs", ",".join(map(str, args.efs)), "--repeat", str(args.repeat)]
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    rust = [os.path.join(target, "release", "examples", "bench_index")]
    env = dict(os.environ, RAYON_NUM_THREADS=str(args.threads), RAK_THREADS=str(args.threads),
               OMP_NUM_THREADS=str(args.threads))
    skip = set(args.skip.split(","))
    res = {"config": vars(args) | {"cpu": os.cpu_count()}, "machine": describe()}
    sides = []
    if "flat" in skip:
        if not os.path.exists(gt):
            run(me + ["--worker", "flat"], env)  # the exact search writes the ground truth
    else:
        # First in round 0, so that the ground truth exists before anything reads it.
        sides.append(("faiss_flat", me + ["--worker", "flat"]))
        sides.append(("rak_flat", rust + ["flat", base, queries, gt, str(args.k)]))
    if "faiss-hnsw" not in skip:
        sides.append(("faiss_hnsw", me + ["--worker", "hnsw"]))
    if "rak-hnsw" not in skip:
        sides.append(("rak_hnsw", rust + ["hnsw", base, queries, gt, str(args.k), str(args.m), str(args.efc),
                                          ",".join(map(str, args.efs)), args.rak_builder, str(args.repeat)]))
    rounds = []
    for r in range(args.rounds):
        order = sides if r % 2 == 0 else sides[::-1]
        rounds.append({name: run(cmd, env) for name, cmd in order})
    for name, _ in sides:
        runs = [rd[name] for rd in rounds]
        res[name] = median_flat(runs) if name.endswith("_flat") else median_of_rounds(runs)
    if args.rounds > 1:
        res["rounds"] = rounds
    print(json.dumps(res, indent=1))
    summarize(res, args.target)


if __name__ == "__main__":
    main()
