#!/usr/bin/env python3
"""How cost grows (issue 33, item 6): wall time and peak memory of encode, index build, search
and one training step at several sizes, ours and the Python anchor side by side, as plots.

    . scripts/env.sh && cargo build --release -p rak-host \
        && cargo build --release -p rak-retrieval --example bench_index
    .venv/bin/pip install -r bench/requirements.txt        # faiss-cpu, psutil, matplotlib
    .venv/bin/python bench/growth.py                       # every part, default sizes
    .venv/bin/python bench/growth.py --ops index --index-sizes 100000,300000,1000000
    .venv/bin/python bench/growth.py --plot-only bench/results/growth-DATE.json

Parts (--ops, comma list; each size list is a flag):
  encode  `host encode --encoder dpr` (all-MiniLM-L6-v2) against sentence-transformers' `encode`,
          batch 64, max length 256, on the mini-KILT corpus's passage texts (titles dropped, as
          bench/encode_vs_st.py) repeated to --encode-sizes passages. Time: ours the whole
          command (process start, model load, writing embeddings.npy); sentence-transformers
          its model load plus `encode` (encode_vs_st.py's convention), its whole process (Python
          and torch imports included) kept in the JSON too.
  index   index build and search on synthetic unit vectors of width --dim (--index-sizes rows;
          index_vs_faiss.py's generator, x = z A + 0.1 noise with a 64-d latent z, then scaled
          to unit norm) written as `host encode` writes them (embeddings.npy + ids.txt).
          Build: `host index build --kind hnsw|flat` against faiss IndexHNSWFlat (same M and
          efConstruction, inner product) and IndexFlatIP, each the whole process, writing its
          index to disk. Search: --nq queries, k = 10, all in one batch, each side loading the
          index built above in a fresh process: ours through `bench_index` (the example
          index_vs_faiss.py drives; HNSW loaded from the `host index build` folder via
          RAK_BENCH_REUSE, exact search the flat index's `embeddings.npy`), faiss from
          `read_index`. HNSW is swept over --efs and its time is read at recall@10 = --target
          (interpolated between the two efs around it, as index_vs_faiss.py's qps_at);
          exact search has recall 1. Plotted: seconds per --nq queries.
  step    one DPR training step (bench/train_step.py's part `dpr`: B queries, B gold passages,
          B BM25 negatives, max length 128, AdamW, clipping) at each of --batches: `host train`
          against train_step.py's plain PyTorch loop, median of --steps steps after 2 dropped.
          Peak memory: each side's whole process (/usr/bin/time), model load and, for ours, the
          final save included; the JSON also has each loop's own high-water mark.

Every measurement runs in its own process under /usr/bin/time (peak = that process's maximum
resident set size, libtorch or Python + torch included); each part also records each side's
floor (ours: `host --version`; Python: the worker importing what it imports, then exiting) so the
part a size adds can be read off. Sides alternate which goes first from one size to the next.
Threads: --threads for both sides (OMP, MKL, rayon, faiss). Load average before each measurement
is recorded: this machine is shared, and its speed drifts by 10-30% between minutes.

Writes the raw JSON to --out (default bench/results/growth-DATE.json), PNGs to --img-dir
(default docs/img, growth-<part>.png) and prints a markdown table per part.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from machine import describe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TODAY = time.strftime("%Y-%m-%d")


def ints(s):
    return [int(float(v)) for v in s.split(",") if v]


def thread_env(threads):
    n = str(threads)
    return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "RAYON_NUM_THREADS": n, "RAYON_RS_NUM_CPUS": n,
            "RAK_THREADS": n, "TOKENIZERS_PARALLELISM": "true"}


def vm_hwm_mib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return None


# --- measuring one process ----------------------------------------------------------------------

def measure(cmd, env, log):
    """Run `cmd` under /usr/bin/time; return its peak RSS (MiB), wall seconds, the JSON object on
    the last line of its stdout (if any) and the load average before it started."""
    fd, tfile = tempfile.mkstemp(prefix="growth-time-")
    os.close(fd)
    load = os.getloadavg()[0]
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    with open(log, "a") as err:
        p = subprocess.run(["/usr/bin/time", "-f", "%M %e", "-o", tfile, *cmd], env=env,
                           stdout=subprocess.PIPE, stderr=err, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        with open(log, errors="replace") as f:
            tail = f.read()[-3000:]
        sys.exit(f"failed ({p.returncode}): {' '.join(cmd)}\n{tail}")
    with open(tfile) as f:
        line = f.read().strip().splitlines()[-1]
    os.unlink(tfile)
    kb = int(line.split()[0])
    # A worker prints one JSON line last; `host` pretty-prints one object as its whole output.
    out = None
    try:
        out = json.loads(p.stdout)
    except json.JSONDecodeError:
        lines = [l for l in p.stdout.strip().splitlines() if l.startswith("{") and l.endswith("}")]
        if lines:
            out = json.loads(lines[-1])
    return {"peak_rss_mib": round(kb / 1024, 1), "wall_s": round(wall, 3), "load_avg_1m": load}, out


def me(*args):
    return [sys.executable, os.path.abspath(__file__), *args]


# --- workers: the Python anchors, each run as its own process ------------------------------------

def worker_floor(a):
    """Import what the given part's anchor imports, then exit: that side's memory floor."""
    if a.part == "encode":
        import torch  # noqa: F401
        from sentence_transformers import SentenceTransformer  # noqa: F401
    elif a.part == "index":
        import faiss  # noqa: F401
    elif a.part == "step":
        import torch  # noqa: F401
        import transformers  # noqa: F401
    print(json.dumps({"vm_hwm_mib": vm_hwm_mib()}))


def worker_st_encode(a):
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(a.threads)
    texts = [json.loads(l)["text"] for l in open(a.input)]
    t0 = time.perf_counter()
    st = SentenceTransformer(a.model, device="cpu")
    st.max_seq_length = a.max_length
    t1 = time.perf_counter()
    emb = st.encode(texts, batch_size=a.batch_size, convert_to_numpy=True)
    t2 = time.perf_counter()
    if a.save:
        np.save(a.save, emb)
    print(json.dumps({"seconds": t2 - t0, "load_s": t1 - t0, "encode_s": t2 - t1, "vm_hwm_mib": vm_hwm_mib()}))


def worker_faiss_build(a):
    import faiss

    faiss.omp_set_num_threads(a.threads)
    xb = np.load(os.path.join(a.input, "embeddings.npy"), mmap_mode="r")
    t0 = time.perf_counter()
    if a.kind == "hnsw":
        index = faiss.IndexHNSWFlat(xb.shape[1], a.m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = a.efc
    else:
        index = faiss.IndexFlatIP(xb.shape[1])
    for s in range(0, xb.shape[0], 100_000):
        index.add(np.ascontiguousarray(xb[s : s + 100_000]))
    t1 = time.perf_counter()
    faiss.write_index(index, a.output)
    print(json.dumps({"build_s": t1 - t0, "seconds": time.perf_counter() - t0, "vm_hwm_mib": vm_hwm_mib()}))


def recall(found, gt, k):
    return float(np.mean([len(set(f[:k]) & set(g[:k])) / k for f, g in zip(found, gt)]))


def worker_faiss_search(a):
    import faiss

    faiss.omp_set_num_threads(a.threads)
    index = faiss.read_index(a.input)
    xq = np.load(a.queries)
    out = {"nq": xq.shape[0], "k": a.k}
    if a.kind == "flat":
        t = time.perf_counter()
        _, ids = index.search(xq, a.k)
        s = time.perf_counter() - t
        if a.write_gt:
            np.save(a.gt + ".tmp.npy", ids.astype(np.float32))
            os.replace(a.gt + ".tmp.npy", a.gt)
        gt = np.load(a.gt).astype(np.int64)
        out["search"] = [{"qps": xq.shape[0] / s, "recall": recall(ids, gt, a.k)}]
    else:
        gt = np.load(a.gt).astype(np.int64)
        runs = []
        for ef in a.efs:
            index.hnsw.efSearch = ef
            times = []
            for _ in range(a.repeat):
                t = time.perf_counter()
                _, ids = index.search(xq, a.k)
                times.append(time.perf_counter() - t)
            runs.append({"ef": ef, "qps": xq.shape[0] / float(np.median(times)), "recall": recall(ids, gt, a.k)})
        out["search"] = runs
    out["vm_hwm_mib"] = vm_hwm_mib()
    print(json.dumps(out))


def train_args(a):
    """The namespace bench/train_step.py's functions read."""
    return argparse.Namespace(host=os.path.abspath(a.host), model=os.path.abspath(a.model),
                              corpus=os.path.abspath(a.corpus), task_dir=os.path.abspath(a.task_dir),
                              threads=a.threads, device="cpu", bf16=False, negatives=a.negatives)


def worker_torch_step(a):
    import train_step as ts

    ts.BATCH = a.batch
    ta = train_args(a)
    import torch

    torch.set_num_threads(a.threads)
    max_steps = a.steps + ts.SKIP
    triples = ts.load_triples(ta, a.negatives, ts.DPR_TASKS[0], max_steps * a.batch)
    r = ts.torch_loop(ta, triples, max_steps)
    r["loop_peak_rss_mib"] = vm_hwm_mib()
    print(json.dumps(r))


# --- the parts ----------------------------------------------------------------------------------

def host_floor(a, log):
    m, _ = measure([a.host, "--version"], dict(os.environ), log)
    return m["peak_rss_mib"]


def py_floor(a, part, env, log):
    m, _ = measure(me("--worker", "floor", "--part", part), env, log)
    return m["peak_rss_mib"]


def part_encode(a, work, log):
    env = dict(os.environ, **thread_env(a.threads))
    rows = [json.loads(l) for l in open(a.corpus)]
    res = {"batch_size": 64, "max_length": 256, "corpus_passages": len(rows),
           "floor_ours_mib": host_floor(a, log), "floor_anchor_mib": py_floor(a, "encode", env, log), "points": []}
    for i, n in enumerate(a.encode_sizes):
        plain = os.path.join(work, f"encode-{n}.jsonl")
        with open(plain, "w") as f:
            for j in range(n):
                r = rows[j % len(rows)]
                f.write(json.dumps({"_id": f"{r['_id']}#{j // len(rows)}", "title": "", "text": r["text"]}) + "\n")
        out_dir = os.path.join(work, f"encode-{n}-ours")
        st_npy = os.path.join(work, f"encode-{n}-st.npy")
        ours_cmd = [a.host, "encode", "--encoder", "dpr", "--model", a.model, "--input", plain, "--output", out_dir,
                    "--batch-size", "64", "--max-length", "256", "--part-size", "1000000"]
        st_cmd = me("--worker", "st-encode", "--input", plain, "--model", a.model, "--threads", str(a.threads),
                    "--batch-size", "64", "--max-length", "256", "--save", st_npy)
        sides = [("ours", ours_cmd), ("anchor", st_cmd)]
        pt = {"size": n}
        for name, cmd in sides if i % 2 == 0 else sides[::-1]:
            m, out = measure(cmd, env, log)
            if name == "ours":
                pt["ours"] = {**m, "seconds": m["wall_s"]}
            else:
                pt["anchor"] = {**m, "seconds": round(out["seconds"], 3), "load_s": round(out["load_s"], 3),
                                "encode_s": round(out["encode_s"], 3)}
        ours = np.load(os.path.join(out_dir, "embeddings.npy"))
        pt["max_abs_diff"] = float(np.abs(ours - np.load(st_npy)).max())
        shutil.rmtree(out_dir, ignore_errors=True)
        for p in (plain, st_npy):
            os.unlink(p)
        print(json.dumps({"encode": pt}), flush=True)
        res["points"].append(pt)
    return res


def unit_vectors(path, n, dim, seed):
    """index_vs_faiss.py's synthetic vectors, then scaled to unit norm (cached)."""
    from index_vs_faiss import make_data

    if os.path.exists(path) and np.load(path, mmap_mode="r").shape == (n, dim):
        return
    tmp = path + ".raw.npy"
    make_data(tmp, n, dim, seed)
    x = np.load(tmp, mmap_mode="r+")
    for s in range(0, n, 100_000):
        x[s : s + 100_000] /= np.linalg.norm(x[s : s + 100_000], axis=1, keepdims=True)
    x.flush()
    del x
    os.replace(tmp, path)


def at_recall(runs, target):
    """Seconds-per-query rate at recall `target`: interpolated between the two efs around it; if
    every ef is above it, the fastest (marked `above`); None if none reaches it."""
    pts = sorted((r["recall"], r["qps"], r["ef"]) for r in runs)
    for (r0, q0, _), (r1, q1, _) in zip(pts, pts[1:]):
        if r0 <= target <= r1 and r1 > r0:
            return {"qps": q0 + (target - r0) / (r1 - r0) * (q1 - q0), "how": "interpolated"}
    ok = [p for p in pts if p[0] >= target]
    if ok:
        best = max(ok, key=lambda p: p[1])
        return {"qps": best[1], "how": f"ef {best[2]} (recall {best[0]:.3f}, above the target at every ef)"}
    return None


def part_index(a, work, log):
    env = dict(os.environ, **thread_env(a.threads))
    cache = os.path.join(ROOT, ".cache", "bench", "growth")
    os.makedirs(cache, exist_ok=True)
    target_dir = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    bench_index = os.path.join(target_dir, "release", "examples", "bench_index")
    if not os.path.exists(bench_index):
        sys.exit(f"{bench_index} missing: cargo build --release -p rak-retrieval --example bench_index")
    queries = os.path.join(cache, f"queries-{a.nq}x{a.dim}.npy")
    unit_vectors(queries, a.nq, a.dim, seed=2)
    efs = ",".join(map(str, a.efs))
    floors = {"floor_ours_mib": host_floor(a, log), "floor_anchor_mib": py_floor(a, "index", env, log)}
    build = {"m": a.m, "ef_construction": a.efc, **floors, "points": []}
    search = {"nq": a.nq, "k": a.k, "efs": a.efs, "target_recall": a.target, "repeat": a.repeat, **floors, "points": []}
    for i, n in enumerate(a.index_sizes):
        emb = os.path.join(cache, f"emb-{n}x{a.dim}")
        os.makedirs(emb, exist_ok=True)
        unit_vectors(os.path.join(emb, "embeddings.npy"), n, a.dim, seed=1)
        ids = os.path.join(emb, "ids.txt")
        if not os.path.exists(ids) or sum(1 for _ in open(ids)) != n:
            with open(ids + ".tmp", "w") as f:
                f.writelines(f"{j}\n" for j in range(n))
            os.replace(ids + ".tmp", ids)
        gt = os.path.join(work, f"gt-{n}.npy")
        flip = i % 2 == 1
        bpt, spt = {"size": n}, {"size": n}
        for kind in ("flat", "hnsw"):
            ours_dir = os.path.join(work, f"{kind}-{n}-ours")
            faiss_file = os.path.join(work, f"{kind}-{n}.faiss")
            ours_cmd = [a.host, "index", "build", "--kind", kind, "--embeddings", emb, "--output", ours_dir]
            if kind == "hnsw":
                ours_cmd += ["--m", str(a.m), "--ef-construction", str(a.efc), "--ef-search", str(a.efs[0])]
            sides = [("ours", ours_cmd),
                     ("anchor", me("--worker", "faiss-build", "--kind", kind, "--input", emb, "--output", faiss_file,
                                   "--m", str(a.m), "--efc", str(a.efc), "--threads", str(a.threads)))]
            for name, cmd in sides[::-1] if flip else sides:
                m, out = measure(cmd, env, log)
                bpt[f"{kind}_{name}"] = {**m, "seconds": m["wall_s"], **({"build_s": round(out["build_s"], 3)} if name == "anchor" else {})}
            # Search: faiss flat first in every size (it writes the ground truth).
            faiss_s = me("--worker", "faiss-search", "--kind", kind, "--input", faiss_file, "--queries", queries,
                         "--gt", gt, "--k", str(a.k), "--efs", efs, "--repeat", str(a.repeat), "--threads", str(a.threads))
            if kind == "flat":
                faiss_s.append("--write-gt")
                ours_s = [bench_index, "flat", os.path.join(emb, "embeddings.npy"), queries, gt, str(a.k)]
                ours_env = env
                sides = [("anchor", faiss_s), ("ours", ours_s)]
            else:
                # The index comes from the `host index build` folder; BASE (only its width and row
                # count are used when the index is loaded) is the small queries file, so the
                # process holds one copy of the vectors, the index's.
                ours_s = [bench_index, "hnsw", queries, queries, gt, str(a.k), str(a.m), str(a.efc), efs, "native", str(a.repeat)]
                ours_env = dict(env, RAK_BENCH_REUSE=ours_dir)
                sides = [("ours", ours_s), ("anchor", faiss_s)]
                if flip:
                    sides = sides[::-1]
            for name, cmd in sides:
                m, out = measure(cmd, ours_env if name == "ours" else env, log)
                if name == "ours" and kind == "flat":
                    runs = [{"qps": out["flat_torch"]["qps"], "recall": out["flat_torch"]["recall"]}]
                else:
                    runs = out["search"]
                r = {**m, "search": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in x.items()} for x in runs]}
                if kind == "flat":
                    r["qps"] = runs[0]["qps"]
                else:
                    hit = at_recall(runs, a.target)
                    r["qps"] = hit["qps"] if hit else None
                    r["qps_how"] = hit["how"] if hit else f"recall {a.target} not reached at ef {a.efs[-1]}"
                r["seconds"] = round(a.nq / r["qps"], 4) if r["qps"] else None
                spt[f"{kind}_{name}"] = r
            shutil.rmtree(ours_dir, ignore_errors=True)
            os.unlink(faiss_file)
        os.unlink(gt)
        if not a.keep_data:
            shutil.rmtree(emb, ignore_errors=True)
        print(json.dumps({"build": bpt}), flush=True)
        print(json.dumps({"search": spt}), flush=True)
        build["points"].append(bpt)
        search["points"].append(spt)
    return build, search


def part_step(a, work, log):
    import train_step as ts

    env = dict(os.environ, **thread_env(a.threads))
    ta = train_args(a)
    ts.BATCH = 8
    seed, neg_info = ts.seed_dir(ta, work, ts.DPR_TASKS)
    negatives = ts.negatives_file(seed)
    res = {"steps": a.steps, "skipped_steps": ts.SKIP, "max_length": ts.MAX_LENGTH, "negatives": neg_info,
           "floor_ours_mib": host_floor(a, log), "floor_anchor_mib": py_floor(a, "step", env, log), "points": []}
    for i, b in enumerate(a.batches):
        torch_cmd = me("--worker", "torch-step", "--batch", str(b), "--steps", str(a.steps), "--negatives", negatives,
                       "--threads", str(a.threads), "--model", a.model, "--corpus", a.corpus, "--task-dir", a.task_dir,
                       "--host", a.host)
        pt = {"size": b}
        order = ["ours", "anchor"] if i % 2 == 0 else ["anchor", "ours"]
        for name in order:
            if name == "ours":
                ts.BATCH = b
                load = os.getloadavg()[0]
                r = ts.run_host(ta, work, f"dpr-b{b}", ts.DPR_TASKS, "adamw", {"weight_decay": ts.WEIGHT_DECAY},
                                a.steps + ts.SKIP, seed)
                pt["ours"] = {"seconds": r["median_s"], "steps_s": r["steps"], "peak_rss_mib": r["peak_rss_mib"],
                              "loop_peak_rss_mib": r["loop_peak_rss_mib"], "wall_s": r["wall_s"], "load_avg_1m": load,
                              "problems": r["problems"]}
                for p in r["problems"]:
                    print(f"WARNING: ours, batch {b}: {p}", file=sys.stderr)
            else:
                m, out = measure(torch_cmd, env, log)
                pt["anchor"] = {**m, "seconds": out["median_s"], "steps_s": out["steps"],
                                "loop_peak_rss_mib": round(out["loop_peak_rss_mib"], 1), "optimizer": out["optimizer"]}
        print(json.dumps({"step": pt}), flush=True)
        res["points"].append(pt)
    return res


# --- plots and tables ---------------------------------------------------------------------------

SERIES = {
    "encode": [("ours", "ours: host encode", "C0", "-"), ("anchor", "sentence-transformers encode", "C1", "-")],
    "build": [("hnsw_ours", "ours: host index build --kind hnsw", "C0", "-"), ("hnsw_anchor", "faiss IndexHNSWFlat", "C1", "-"),
              ("flat_ours", "ours: host index build --kind flat", "C0", "--"), ("flat_anchor", "faiss IndexFlatIP", "C1", "--")],
    "search": [("hnsw_ours", "ours: HNSW", "C0", "-"), ("hnsw_anchor", "faiss HNSW", "C1", "-"),
               ("flat_ours", "ours: exact", "C0", "--"), ("flat_anchor", "faiss exact", "C1", "--")],
    "step": [("ours", "ours: host train", "C0", "-"), ("anchor", "PyTorch loop", "C1", "-")],
}
TITLES = {
    "encode": ("Encode (MiniLM-L6, batch 64)", "passages", "seconds (whole command / load + encode)"),
    "build": ("Index build (384-d unit vectors)", "vectors", "seconds (whole process)"),
    "search": ("Search (1,000 queries, k = 10)", "vectors in the index", "seconds for the queries"),
    "step": ("One DPR training step (max length 128)", "batch (queries; 2x passages)", "seconds per step (median)"),
}


def plot(result, img_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogFormatterSciNotation, NullFormatter

    class Plain(LogFormatterSciNotation):
        """Label the ticks matplotlib would label, as plain numbers (0.3, 2, 1500)."""

        def __call__(self, x, pos=None):
            return f"{x:g}" if super().__call__(x, pos) else ""

    os.makedirs(img_dir, exist_ok=True)
    written = []
    for part, series in SERIES.items():
        if part not in result:
            continue
        r = result[part]
        pts = r["points"]
        if not pts:
            continue
        fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
        title, xlabel, ylabel = TITLES[part]
        if part == "search":
            title += f"; HNSW at recall@10 = {r['target_recall']}"
        if part == "build":
            title += f"; HNSW M = {r['m']}, efConstruction = {r['ef_construction']}"
        sizes = [p["size"] for p in pts]
        for key, label, color, style in series:
            xs = [p["size"] for p in pts if p.get(key) and p[key].get("seconds")]
            ts_ = [p[key]["seconds"] for p in pts if p.get(key) and p[key].get("seconds")]
            ms = [(p["size"], p[key]["peak_rss_mib"]) for p in pts if p.get(key) and p[key].get("peak_rss_mib")]
            if xs:
                ax_t.plot(xs, ts_, style, color=color, marker="o", label=label)
            if ms:
                ax_m.plot([x for x, _ in ms], [y for _, y in ms], style, color=color, marker="o", label=label)
        # A grey guide through ours' largest point, proportional to size: where a curve leaves it, it bends.
        first = series[0][0]
        big = [p for p in pts if p.get(first) and p[first].get("seconds")]
        if len(big) >= 2:
            x1, y1 = big[-1]["size"], big[-1][first]["seconds"]
            ax_t.plot([sizes[0], sizes[-1]], [y1 * sizes[0] / x1, y1 * sizes[-1] / x1], ":", color="grey", label="proportional to size")
        for fkey, color in (("floor_ours_mib", "C0"), ("floor_anchor_mib", "C1")):
            if r.get(fkey):
                ax_m.axhline(r[fkey], color=color, lw=0.8, alpha=0.5, ls=":")
        ax_m.plot([], [], ":", color="grey", label="floor (process with nothing done)")
        for ax in (ax_t, ax_m):
            ax.set_xscale("log")
            ax.set_xticks(sizes)
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_xlabel(xlabel)
            ax.grid(True, which="both", alpha=0.3)
        ax_t.set_yscale("log")
        ax_t.yaxis.set_major_formatter(Plain())
        ax_t.yaxis.set_minor_formatter(Plain(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
        ax_t.set_ylabel(ylabel)
        ax_t.set_title("time")
        if max(sizes) / min(sizes) >= 10:
            ax_m.set_yscale("log")
            ax_m.yaxis.set_major_formatter(Plain())
            ax_m.yaxis.set_minor_formatter(Plain(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
        ax_m.set_ylabel("peak RSS, MiB (whole process)")
        ax_m.set_title("peak memory")
        ax_t.legend(fontsize=7)
        ax_m.legend(fontsize=7)
        m = result.get("machine", {})
        fig.suptitle(f"{title}\n{result.get('date', '')}, {result.get('threads')} threads, {m.get('cpu_model', '')}", fontsize=9)
        fig.tight_layout()
        path = os.path.join(img_dir, f"growth-{part}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def fmt(v, f=".2f"):
    return "" if v is None else format(v, f)


def tables(result):
    out = []
    for part, series in SERIES.items():
        if part not in result:
            continue
        r = result[part]
        keys = [k for k, *_ in series]
        out.append(f"\n{TITLES[part][0]}: seconds (ratio ours / anchor), peak RSS MiB\n")
        head = ["size"] + [f"{k} s" for k in keys] + [f"{k} MiB" for k in keys]
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "---:|" * len(head))
        for p in r["points"]:
            secs = [fmt((p.get(k) or {}).get("seconds"), ".3f") for k in keys]
            for j in range(0, len(keys), 2):
                o, an = (p.get(keys[j]) or {}).get("seconds"), (p.get(keys[j + 1]) or {}).get("seconds")
                if o and an:
                    secs[j] += f" ({o / an:.2f})"
            mib = [fmt((p.get(k) or {}).get("peak_rss_mib"), ".0f") for k in keys]
            out.append("| " + " | ".join([f"{p['size']:,}"] + secs + mib) + " |")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default="encode,index,step", help="comma list of: encode, index (build and search), step")
    ap.add_argument("--encode-sizes", type=ints, default=[500, 1000, 2000, 4000])
    ap.add_argument("--index-sizes", type=ints, default=[10_000, 30_000, 100_000, 300_000])
    ap.add_argument("--batches", type=ints, default=[8, 16, 32, 64, 128])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--nq", type=int, default=1000)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--m", type=int, default=16, help="HNSW M (as bench/index_vs_faiss.py)")
    ap.add_argument("--efc", type=int, default=100, help="HNSW efConstruction")
    ap.add_argument("--efs", type=ints, default=[16, 32, 64, 128, 256, 512], help="HNSW efSearch sweep")
    ap.add_argument("--target", type=float, default=0.95, help="recall@10 at which HNSW search is compared")
    ap.add_argument("--repeat", type=int, default=3, help="HNSW: time each ef this many times, keep the median")
    ap.add_argument("--steps", type=int, default=5, help="training: measured steps per run (2 more are dropped)")
    ap.add_argument("--keep-data", action="store_true", help="keep the synthetic vectors under .cache/bench/growth/")
    ap.add_argument("--host", default=os.path.join(ROOT, "target/release/host"))
    ap.add_argument("--model", default=os.path.join(ROOT, ".cache/models/all-MiniLM-L6-v2"))
    ap.add_argument("--corpus", default=os.path.join(ROOT, "data/minikilt/corpus.jsonl"))
    ap.add_argument("--task-dir", default=os.path.join(ROOT, "data/minikilt/tasks"))
    ap.add_argument("--negatives", help=argparse.SUPPRESS)  # worker: the BM25 negatives file
    ap.add_argument("--out", default=os.path.join(ROOT, "bench/results", f"growth-{TODAY}.json"))
    ap.add_argument("--img-dir", default=os.path.join(ROOT, "docs/img"))
    ap.add_argument("--plot-only", metavar="RESULT.json", help="only redraw the plots (and tables) of an earlier run")
    # Worker mode (this script re-invoked for each Python-side measurement).
    ap.add_argument("--worker", choices=["floor", "st-encode", "faiss-build", "faiss-search", "torch-step"])
    ap.add_argument("--part"), ap.add_argument("--input"), ap.add_argument("--output"), ap.add_argument("--save")
    ap.add_argument("--queries"), ap.add_argument("--gt"), ap.add_argument("--kind")
    ap.add_argument("--write-gt", action="store_true")
    ap.add_argument("--batch-size", type=int, default=64), ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--batch", type=int)
    a = ap.parse_args()
    if a.worker:
        return {"floor": worker_floor, "st-encode": worker_st_encode, "faiss-build": worker_faiss_build,
                "faiss-search": worker_faiss_search, "torch-step": worker_torch_step}[a.worker](a)
    if a.plot_only:
        result = json.load(open(a.plot_only))
        for p in plot(result, a.img_dir):
            print("wrote", p)
        print(tables(result))
        return
    for k in ("host", "model", "corpus", "task_dir"):
        setattr(a, k, os.path.abspath(getattr(a, k)))
    ops = set(a.ops.split(","))
    if ops - {"encode", "index", "step"}:
        sys.exit(f"--ops: unknown {ops - {'encode', 'index', 'step'}}")
    work = tempfile.mkdtemp(prefix="bench-growth-")
    log = os.path.join(work, "stderr.log")
    t0 = time.time()
    result = {"date": TODAY, "threads": a.threads, "config": {k: v for k, v in vars(a).items() if v is not None},
              "machine": describe(), "load_avg_start": os.getloadavg()}
    try:
        if "encode" in ops:
            result["encode"] = part_encode(a, work, log)
        if "index" in ops:
            result["build"], result["search"] = part_index(a, work, log)
        if "step" in ops:
            result["step"] = part_step(a, work, log)
    finally:
        if os.path.exists(log):
            shutil.copyfile(log, os.path.join(tempfile.gettempdir(), f"growth-{TODAY}-stderr.log"))
        shutil.rmtree(work, ignore_errors=True)
    result["load_avg_end"] = os.getloadavg()
    result["total_s"] = round(time.time() - t0, 1)
    import torch

    result["torch"] = torch.__version__
    try:
        import faiss

        result["faiss"] = faiss.__version__
    except ImportError:
        pass
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(tables(result))
    for p in plot(result, a.img_dir):
        print("wrote", p)
    print(f"wrote {a.out} ({result['total_s']:.0f} s)")


if __name__ == "__main__":
    sys.exit(main())
