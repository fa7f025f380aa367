#!/usr/bin/env python3
"""Peak RSS of `host index build` (flat, HNSW, BM25) on synthetic data.

    . scripts/env.sh && cargo build --release -p rak-host
    python bench/index_memory.py                       # 1M x 384, flat and hnsw
    python bench/index_memory.py --kinds flat,bm25 --n 200000 --corpus-mb 200
    python bench/index_memory.py --host /tmp/old/host  # another build of host, e.g. before a change

Data (cached under --workdir, default .cache/bench/memory/): N random normal vectors of width
DIM scaled to unit norm, written as embeddings.npy + ids.txt (what `host encode` writes); for
bm25 a corpus.jsonl of --corpus-mb MB made of 1 MB passages of random words.

Each build runs under /usr/bin/time, whose "maximum resident set size" is the child's
getrusage ru_maxrss. It counts every resident page of the process, libtorch's included: the
`host --version` line is that floor (about 0.46 GiB here), so "above floor" is what the build
itself added. Prints one JSON object per run and a table.
"""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_vectors(d, n, dim, seed=0):
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, "embeddings.npy")
    if os.path.exists(path) and np.load(path, mmap_mode="r").shape == (n, dim):
        return
    rng = np.random.default_rng(seed)
    out = np.lib.format.open_memmap(path + ".tmp.npy", mode="w+", dtype="<f4", shape=(n, dim))
    for s in range(0, n, 100_000):
        x = rng.standard_normal((min(n, s + 100_000) - s, dim), dtype=np.float32)
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        out[s : s + len(x)] = x
    out.flush()
    del out
    with open(os.path.join(d, "ids.txt"), "w") as f:
        f.writelines(f"doc{i}\n" for i in range(n))
    os.replace(path + ".tmp.npy", path)


def make_corpus(path, mb, seed=0):
    if os.path.exists(path) and os.path.getsize(path) >= mb * 1_000_000:
        return
    rng = np.random.default_rng(seed)
    words = ["w%d" % i for i in range(50_000)]
    with open(path + ".tmp", "w") as f:
        for i in range(mb):
            text = " ".join(rng.choice(words, 180_000))  # about 1 MB
            f.write(json.dumps({"_id": f"d{i}", "title": f"doc {i}", "text": text}) + "\n")
    os.replace(path + ".tmp", path)


def measure(cmd):
    t = time.time()
    p = subprocess.run(["/usr/bin/time", "-f", "RSS_KB=%M", *cmd], capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
    kb = int([l for l in p.stderr.splitlines() if l.startswith("RSS_KB=")][-1].split("=")[1])
    return kb / 1024, time.time() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default=os.path.join(ROOT, "target/release/host"))
    ap.add_argument("--kinds", default="flat,hnsw")
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--corpus-mb", type=int, default=200)
    # The graph's size depends on m, not on ef_construction, which only sets the build time.
    ap.add_argument("--m", type=int, default=32)
    ap.add_argument("--ef-construction", type=int, default=40)
    ap.add_argument("--workdir", default=os.path.join(ROOT, ".cache/bench/memory"))
    a = ap.parse_args()

    emb = os.path.join(a.workdir, f"emb-{a.n}x{a.dim}")
    corpus = os.path.join(a.workdir, f"corpus-{a.corpus_mb}mb.jsonl")
    out = os.path.join(a.workdir, "index")
    floor, _ = measure([a.host, "--version"])
    rows = [{"kind": "host --version", "peak_rss_mib": round(floor)}]
    for kind in a.kinds.split(","):
        if kind == "bm25":
            make_corpus(corpus, a.corpus_mb)
            cmd = [a.host, "index", "build", "--kind", "bm25", "--corpus", corpus, "--output", out]
            size = os.path.getsize(corpus)
        else:
            make_vectors(emb, a.n, a.dim)
            cmd = [a.host, "index", "build", "--kind", kind, "--embeddings", emb, "--output", out]
            if kind == "hnsw":
                cmd += ["--m", str(a.m), "--ef-construction", str(a.ef_construction)]
            size = os.path.getsize(os.path.join(emb, "embeddings.npy"))
        rss, secs = measure(cmd)
        row = {"kind": kind, "input_mib": round(size / 2**20), "peak_rss_mib": round(rss),
               "above_floor_mib": round(rss - floor), "seconds": round(secs, 1), "cmd": " ".join(cmd)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(f"\n{'kind':<16}{'input MiB':>10}{'peak RSS MiB':>14}{'above floor':>13}{'seconds':>9}")
    for r in rows:
        print(f"{r['kind']:<16}{r.get('input_mib', ''):>10}{r['peak_rss_mib']:>14}{r.get('above_floor_mib', ''):>13}{r.get('seconds', ''):>9}")


if __name__ == "__main__":
    main()
