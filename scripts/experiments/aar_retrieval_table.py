#!/usr/bin/env python3
"""The retrieval table of docs/RESULTS.md's AAR section, from `host eval --per-query` files
(scripts/experiments/aar_minikilt.sh, STAGE=eval, writes DIR/NAME.metrics.json for each
retriever): per task, each metric's mean with a 95% bootstrap interval over queries, then
paired differences between retrievers (the same resampled queries for both sides) for the
comparisons AAR's claim rests on.

    .venv/bin/python scripts/experiments/aar_retrieval_table.py runs/aar/eval [--boot 2000] [--seed 0]

Standard library only, so it runs under any Python 3.
"""
import argparse
import json
import random
from pathlib import Path

ORDER = ["minilm", "human", "aar", "replug", "trained"]
LABELS = {
    "minilm": "MiniLM, zero-shot",
    "human": "human (gold positives)",
    "aar": "AAR from SmolLM2",
    "replug": "REPLUG-LSR from SmolLM2",
    "trained": "trained (multitask)",
}
COLUMNS = [
    ("squad", "mrr@10", "squad MRR@10"),
    ("squad", "rprec_page", "squad page R-prec"),
    ("squad", "answer_acc@5", "squad answer in top 5"),
    ("wikidata", "mrr@10", "wikidata MRR@10"),
    ("wikidata", "rprec_page", "wikidata page R-prec"),
]
PAIRS = [("aar", "human"), ("aar", "minilm"), ("human", "minilm"), ("replug", "human")]


def load(directory):
    systems = {}
    for path in sorted(Path(directory).glob("*.metrics.json")):
        name = path.name.removesuffix(".metrics.json")
        tasks = json.loads(path.read_text())["tasks"]
        missing = [t for t, v in tasks.items() if "per_query" not in v]
        if missing:
            raise SystemExit(f"{path}: no per-query values for {missing} (evaluate with --per-query)")
        systems[name] = {t: v["per_query"] for t, v in tasks.items()}
    if not systems:
        raise SystemExit(f"{directory}: no *.metrics.json")
    return systems


def values(per_query, metric, ids):
    return [per_query[q][metric] for q in ids]


def interval(samples):
    samples = sorted(samples)
    n = len(samples)
    return samples[int(0.025 * (n - 1))], samples[int(0.975 * (n - 1))]


def bootstrap_means(columns, boot, rng):
    """Means of each column over `boot` resamples of the rows (one resample for all columns,
    so differences between columns are paired)."""
    n = len(columns[0])
    out = [[] for _ in columns]
    for _ in range(boot):
        idx = [rng.randrange(n) for _ in range(n)]
        for c, col in enumerate(columns):
            out[c].append(sum(col[i] for i in idx) / n)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("--boot", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    systems = load(args.dir)
    names = [n for n in ORDER if n in systems] + sorted(n for n in systems if n not in ORDER)
    rng = random.Random(args.seed)

    def ids_of(task):
        # The queries every system was evaluated on (all of them, when the runs are complete).
        sets = [set(systems[n][task]) for n in names if task in systems[n]]
        return sorted(set.intersection(*sets)) if sets else []

    print(f"Retrieval on mini-KILT dev; mean [95% bootstrap interval over queries, {args.boot} resamples]")
    print()
    print("| retriever | " + " | ".join(c[2] for c in COLUMNS) + " |")
    print("|---|" + "---:|" * len(COLUMNS))
    for n in names:
        cells = []
        for task, metric, _ in COLUMNS:
            ids = ids_of(task)
            if task not in systems[n] or not ids:
                cells.append("")
                continue
            col = values(systems[n][task], metric, ids)
            lo, hi = interval(bootstrap_means([col], args.boot, rng)[0])
            cells.append(f"{sum(col) / len(col):.4f} [{lo:.3f}, {hi:.3f}]")
        print(f"| {LABELS.get(n, n)} | " + " | ".join(cells) + " |")
    print()
    print("Paired differences (points; the same resampled queries for both retrievers):")
    print()
    print("| difference | " + " | ".join(c[2] for c in COLUMNS) + " |")
    print("|---|" + "---:|" * len(COLUMNS))
    for a, b in PAIRS:
        if a not in systems or b not in systems:
            continue
        cells = []
        for task, metric, _ in COLUMNS:
            ids = ids_of(task)
            if not ids or task not in systems[a] or task not in systems[b]:
                cells.append("")
                continue
            diff = [x - y for x, y in zip(values(systems[a][task], metric, ids), values(systems[b][task], metric, ids))]
            lo, hi = interval(bootstrap_means([diff], args.boot, rng)[0])
            cells.append(f"{100 * sum(diff) / len(diff):+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]")
        print(f"| {a} − {b} | " + " | ".join(cells) + " |")
    counts = {task: len(ids_of(task)) for task in {c[0] for c in COLUMNS}}
    print()
    print("Queries: " + ", ".join(f"{t} {n}" for t, n in sorted(counts.items())))


if __name__ == "__main__":
    main()
