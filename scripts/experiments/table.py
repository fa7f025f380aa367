"""Markdown tables of `host eval` metrics files (from scripts/experiments/minikilt.sh and the
quick start): page R-precision and MRR@10 per task and macro, mean ± sd over the seeds of a
method (files named METHOD-sSEED.metrics.json; any other name is its own row). The
single-TASK runs of minikilt.sh (one model per task, each evaluated on its own task) make
one row, "one model per task", whose macro is the mean of the four.

    .venv/bin/python scripts/experiments/table.py runs/minikilt/*.metrics.json
"""
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

METRICS = [("rprec_page", "page R-precision"), ("mrr@10", "MRR@10")]


def per_task(path):
    m = json.loads(Path(path).read_text())
    out = {t: v["metrics"] for t, v in m["tasks"].items()}
    out["macro"] = m["macro"]
    return out


def fmt(values):
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"


def main(paths):
    rows = defaultdict(list)
    singles = defaultdict(dict)  # seed -> task -> metrics
    for p in paths:
        name = Path(p).name.removesuffix(".metrics.json")
        method = re.sub(r"-s\d+$", "", name)
        if method.startswith("single-"):
            singles[name[len(method):]].update({t: m for t, m in per_task(p).items() if t != "macro"})
            continue
        rows[method].append(per_task(p))
    for seed, tasks in singles.items():
        keys = next(iter(tasks.values())).keys()
        tasks["macro"] = {k: statistics.mean(m[k] for m in tasks.values()) for k in keys}
        rows["one model per task"].append(tasks)
    tasks = sorted({t for runs in rows.values() for r in runs for t in r if t != "macro"}) + ["macro"]
    for key, title in METRICS:
        print(f"\n**{title}** (mini-KILT dev)\n")
        print("| system | seeds | " + " | ".join(tasks) + " |")
        print("|---|---:|" + "---:|" * len(tasks))
        for method, runs in rows.items():
            cells = [fmt([r[t][key] for r in runs]) for t in tasks]
            print(f"| {method} | {len(runs)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
