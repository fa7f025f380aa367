#!/usr/bin/env python3
"""Helpers of bench/gpu_check.sh (run on the GPU machine with its python3: torch, transformers,
sentence-transformers).

  --tokenizer DIR --out W          W/model: a MiniLM-shaped BERT with random weights (seed 0)
                                   and dropout off, MiniLM's tokenizer and sentence-transformers
                                   files (mean pooling, normalised); W/bm25 is built by the
                                   script; W/recipe.toml trains it on squad + fever.
  --compare A B --tolerance T      max |A - B| over the weights of two trained models; exit 1 if > T
  --moved START F32 BF16           the bf16 run's weights: float32, finite, moved like float32's
  --aar F32 BF16                   two aar-train runs' white-box scores (stages/score/scores.jsonl)
                                   and scoring rates: bf16 against float32 on the same passages
  --speed-models W               W/speed-{minilm,base}-d{0,0.1}: random BERTs of MiniLM-L6's and
                                   BERT-base's shapes (hidden 768, 12 layers, 12 heads, intermediate
                                   3072), dropout off and 0.1 (the same weights), MiniLM's tokenizer
                                   and sentence-transformers files (pooling dimension the hidden size);
                                   with --tokenizer DIR
  --speed-table FILE...          the speed step's table from bench/train_step.py's JSON outputs
  --st MODEL --device D --corpus C --host H
                                   host encode (timed, second run) against sentence-transformers'
                                   encode of the same passages on the same device: embeddings
                                   and passages per second
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch


def weights(d):
    from safetensors.torch import load_file
    return load_file(str(Path(d) / "model.safetensors"))


def make(tokenizer, out):
    from transformers import BertConfig, BertModel
    out = Path(out)
    cfg = json.loads((Path(tokenizer) / "config.json").read_text())
    cfg["hidden_dropout_prob"] = 0.0
    cfg["attention_probs_dropout_prob"] = 0.0
    torch.manual_seed(0)
    model = BertModel(BertConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "transformers_version")}))
    (out / "model").mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out / "model"), safe_serialization=True)
    for f in Path(tokenizer).iterdir():
        if f.name != "config.json":
            (shutil.copytree if f.is_dir() else shutil.copy)(f, out / "model" / f.name)
    repo = Path(__file__).resolve().parents[1]
    (out / "recipe.toml").write_text(f"""[model]
encoder = "dpr"
settings = {{ max_length = 128 }}
[data]
corpus = "{repo}/data/minikilt/corpus.jsonl"
task_dir = "{repo}/data/minikilt/tasks"
tasks = ["squad", "fever"]
bm25_index = "{out}/bm25"
[train]
optim = "adamw"
learning_rate = 1e-4
per_device_train_batch_size = 16
warmup_ratio = 0.0
score_scale = 20.0
hard_negatives = 1
negative_depth = 20
logging_steps = 1
save_steps = 100
seed = 1
""")
    print(f"model and recipe in {out}")


SHAPES = {
    "minilm": {},
    "base": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072},
}


def speed_models(tokenizer, out):
    """Random BERTs of both shapes, each with dropout off and 0.1 (links to one set of weights)."""
    from transformers import BertConfig, BertModel
    out = Path(out)
    base_cfg = json.loads((Path(tokenizer) / "config.json").read_text())
    for shape, over in SHAPES.items():
        cfg = {k: v for k, v in base_cfg.items() if k not in ("architectures", "transformers_version")}
        cfg.update(over)
        weights_dir = out / f"speed-{shape}-weights"
        torch.manual_seed(0)
        BertModel(BertConfig(**cfg)).save_pretrained(str(weights_dir), safe_serialization=True)
        for drop in ("0", "0.1"):
            d = out / f"speed-{shape}-d{drop}"
            d.mkdir(parents=True, exist_ok=True)
            (d / "model.safetensors").symlink_to(weights_dir / "model.safetensors")
            for f in Path(tokenizer).iterdir():
                if f.name in ("config.json", "model.safetensors"):
                    continue
                (shutil.copytree if f.is_dir() else shutil.copy)(f, d / f.name)
            c = dict(cfg, hidden_dropout_prob=float(drop), attention_probs_dropout_prob=float(drop), architectures=["BertModel"])
            (d / "config.json").write_text(json.dumps(c, indent=1))
            # Pooling over the model's own hidden size (MiniLM's files say 384).
            pool = d / "1_Pooling" / "config.json"
            if pool.exists():
                pc = json.loads(pool.read_text())
                pc["word_embedding_dimension"] = cfg["hidden_size"]
                pool.write_text(json.dumps(pc, indent=1))
    print(f"speed models in {out}")
    return True


def speed_table(files):
    """The speed step's table: ours against the PyTorch loop, one row per run."""
    print("| model (random weights) | dropout | dtype | ours s/step | PyTorch s/step | ours / PyTorch |")
    print("|---|---|---|---:|---:|---:|")
    ok = True
    for f in files:
        name = Path(f).stem
        try:
            r = json.loads(Path(f).read_text())
        except (OSError, ValueError):
            r = {}  # the row failed or timed out before writing its result
        d = r.get("dpr")
        if not d:
            print(f"| {name}: no result | | | | | |")
            ok = False
            continue
        shape = "BERT-base shape" if "-base-" in name else "MiniLM-L6 shape"
        drop = "0.1" if "-d0.1" in name else "off"
        problems = d["ours"].get("problems") or []
        print(f"| {shape} | {drop} | {'bf16 autocast' if r.get('bf16') else 'float32'} | {d['ours']['median_s']:.4f} | "
              f"{d['torch']['median_s']:.4f} | {d['ours_over_torch']:.3f}{' (' + '; '.join(problems) + ')' if problems else ''} |")
    return ok


def compare(a, b, tol):
    wa, wb = weights(a), weights(b)
    worst = max(((wa[k].double() - wb[k].double()).abs().max().item(), k) for k in wa)
    ok = worst[0] <= tol
    print(f"{'OK' if ok else 'FAIL'}: max |{Path(a).name} - {Path(b).name}| = {worst[0]:.3e} at {worst[1]} (tolerance {tol:g})")
    return ok


def moved(start, f32, bf16):
    w0, wf, wb = weights(start), weights(f32), weights(bf16)
    bad = [k for k, v in wb.items() if v.dtype != torch.float32 or not torch.isfinite(v).all()]
    keys = [k for k in wf if k in w0]
    df = torch.cat([(wf[k].double() - w0[k].double()).flatten() for k in keys])
    db = torch.cat([(wb[k].double() - w0[k].double()).flatten() for k in keys])
    cos = (df @ db / (df.norm() * db.norm())).item()
    ratio = (db.norm() / df.norm()).item()
    ok = not bad and db.norm() > 1e-3 and 0.8 < ratio < 1.25 and cos > 0.3
    print(f"{'OK' if ok else 'FAIL'}: bf16 update norm {db.norm():.4e} (float32 {df.norm():.4e}, ratio {ratio:.3f}), cosine {cos:.3f}; not float32 or not finite: {bad[:3]}")
    return ok


def aar(f32, bf16):
    def run(d):
        recs = {}
        for line in open(Path(d) / "stages/score/scores.jsonl", encoding="utf-8"):
            r = json.loads(line)
            recs[r["query_id"]] = dict(zip(r["passages"], r["scores"]))
        summary = json.loads((Path(d) / "stages/summary.json").read_text())
        return recs, summary.get("scoring", {})
    (a, sa), (b, sb) = run(f32), run(bf16)
    diffs, same_top, queries, missing = [], 0, 0, 0
    for q, sc in a.items():
        other = b.get(q, {})
        pairs = [(p, s, other.get(p)) for p, s in sc.items() if s is not None]
        if not pairs or any(t is None for _, _, t in pairs):
            missing += 1
            continue
        queries += 1
        diffs += [abs(s - t) for _, s, t in pairs]
        top = lambda i: {p for p, *_ in sorted(pairs, key=lambda x: -x[i])[:2]}
        same_top += top(1) == top(2)
    for name, s in (("float32", sa), ("bf16", sb)):
        print(f"{name}: scored {s.get('scored')} passages in {s.get('seconds')} s, {s.get('scored_per_second')} passages/s")
    if not diffs:
        print("FAIL: no query scored by both runs")
        return False
    ok = missing == 0 and max(diffs) < 0.1 and same_top >= 0.8 * queries
    print(f"{'OK' if ok else 'FAIL'}: {queries} queries scored by both ({missing} not); |bf16 - float32| max {max(diffs):.3e}, "
          f"mean {sum(diffs) / len(diffs):.3e}; same top 2 on {same_top} of {queries}")
    return ok


def st(model, device, corpus, host):
    from sentence_transformers import SentenceTransformer
    rows = [json.loads(l) for l in open(corpus, encoding="utf-8") if l.strip()]
    out = Path(model).parent / "emb-timed"
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.time()
    subprocess.run([host, "encode", "--encoder", "dpr", "--model", model, "--device", device, "--batch-size", "128",
                    "--input", corpus, "--output", str(out)], check=True, stderr=subprocess.DEVNULL)
    ours_s = time.time() - t0
    ids = (out / "ids.txt").read_text().split("\n")
    import numpy as np
    ours = np.load(out / "embeddings.npy")
    m = SentenceTransformer(model, device=device)
    m.max_seq_length = 256
    texts = [[r.get("title") or "", r["text"]] if r.get("title") else r["text"] for r in rows]
    m.encode(texts[:256], batch_size=128)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.time()
    theirs = m.encode(texts, batch_size=128, convert_to_numpy=True, normalize_embeddings=False)
    if device == "cuda":
        torch.cuda.synchronize()
    st_s = time.time() - t0
    order = {r["_id"]: i for i, r in enumerate(rows)}
    theirs = theirs[[order[i] for i in ids if i]]
    diff = float(np.abs(ours - theirs).max())
    n = len(rows)
    print(f"host encode: {n / ours_s:.0f} passages/s ({ours_s:.1f} s, the whole command: start, model load, tokenising, writing)")
    print(f"sentence-transformers encode: {n / st_s:.0f} passages/s ({st_s:.1f} s, the model loaded and warm)")
    print(f"{'OK' if diff < 2e-3 else 'FAIL'}: max |host - sentence-transformers| = {diff:.2e} over {n} passages (time ratio host/st {ours_s / st_s:.2f})")
    return diff < 2e-3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer")
    ap.add_argument("--out")
    ap.add_argument("--compare", nargs=2)
    ap.add_argument("--tolerance", type=float, default=1e-4)
    ap.add_argument("--moved", nargs=3)
    ap.add_argument("--aar", nargs=2)
    ap.add_argument("--speed-models")
    ap.add_argument("--speed-table", nargs="+")
    ap.add_argument("--st")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--corpus")
    ap.add_argument("--host")
    a = ap.parse_args()
    if a.speed_models:
        ok = speed_models(a.tokenizer, a.speed_models)
    elif a.speed_table:
        ok = speed_table(a.speed_table)
    elif a.tokenizer:
        make(a.tokenizer, a.out)
        ok = True
    elif a.compare:
        ok = compare(*a.compare, a.tolerance)
    elif a.moved:
        ok = moved(*a.moved)
    elif a.aar:
        ok = aar(*a.aar)
    else:
        ok = st(a.st, a.device, a.corpus, a.host)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
