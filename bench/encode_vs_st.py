"""Encoding speed: `host encode` (dpr plugin) against sentence-transformers, side by side.

Same machine, same run, same model (all-MiniLM-L6-v2), same libtorch (the project venv's
torch 2.11), same thread count, batch size and max length, same texts (mini-KILT corpus
passage texts, titles dropped so both encode exactly the same strings). Both sort by length
before batching: sentence-transformers by characters, `host encode` by tokens. Reports passages/s
of each, their ratio, and the largest difference between the two sets of embeddings.

  .venv/bin/python bench/encode_vs_st.py [--limit N] [--batch-size 64] [--max-length 256] [--bf16]
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", default=os.path.join(ROOT, "data/minikilt/corpus.jsonl"))
    ap.add_argument("--model", default=os.path.join(ROOT, ".cache/models/all-MiniLM-L6-v2"))
    ap.add_argument("--limit", type=int, default=0, help="first N passages (0: all)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--host", default=os.path.join(ROOT, "target/release/host"))
    ap.add_argument("--bf16", action="store_true", help="both in bf16 (ours --bf16, sentence-transformers' model cast to bfloat16): on a CPU with AMX, its bf16 matrix units")
    args = ap.parse_args()

    rows = [json.loads(l) for l in open(args.corpus)]
    if args.limit:
        rows = rows[: args.limit]
    texts = [r["text"] for r in rows]
    work = tempfile.mkdtemp(prefix="bench-encode-")
    plain = os.path.join(work, "corpus.jsonl")
    with open(plain, "w") as f:
        for r, t in zip(rows, texts):
            f.write(json.dumps({"_id": r["_id"], "title": "", "text": t}) + "\n")

    # Ours first, in its own process, while nothing else runs.
    out_dir = os.path.join(work, "ours")
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    cmd = [args.host, "encode", "--encoder", "dpr", "--model", args.model, "--input", plain, "--output", out_dir,
           "--batch-size", str(args.batch_size), "--max-length", str(args.max_length), "--part-size", "1000000"] + (["--bf16"] if args.bf16 else [])
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stderr=subprocess.DEVNULL)
    ours_s = time.perf_counter() - t0
    ours = np.load(os.path.join(out_dir, "embeddings.npy"))

    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    st = SentenceTransformer(args.model, device="cpu")
    st.max_seq_length = args.max_length
    if args.bf16:
        st = st.to(torch.bfloat16)
    ref = st.encode(texts, batch_size=args.batch_size, convert_to_numpy=True)
    st_s = time.perf_counter() - t0

    result = {
        "passages": len(texts),
        "batch_size": args.batch_size,
        "max_length": args.max_length,
        "threads": args.threads,
        "bf16": args.bf16,
        "host_encode_s": round(ours_s, 2),
        "sentence_transformers_s": round(st_s, 2),
        "host_passages_per_s": round(len(texts) / ours_s, 2),
        "st_passages_per_s": round(len(texts) / st_s, 2),
        "speedup": round(st_s / ours_s, 3),
        "max_abs_diff": float(np.abs(ours - ref).max()),
        "torch": torch.__version__,
        "machine": describe(),
        "note": "both timings include loading the model; ours also includes process start",
    }
    print(json.dumps(result, indent=1))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
