#!/usr/bin/env python3
"""How often NCE meets a copy of a query's positive in a step (docs/RESULTS.md, "Copies of a
positive in the batch"): expected counts for a step of BATCH queries drawn with tasks in
proportion to their size (temperature 1, as naive-peerlike), uniformly within each task.

    scripts/experiments/count_copies.py NEGATIVES_JSON [data/minikilt] [BATCH]

NEGATIVES_JSON is a run's negatives-episode-0.json (one mined hard negative per query).
Prints, per pair of tasks, the expected (query, copy) pairs a step: a copy is another query's
positive or hard negative that is this query's first gold passage; and, per task, the
expected unordered pairs of its queries on one gold passage. Standard library only.
"""
import collections
import json
import sys
from pathlib import Path

TASKS = ["squad", "wikidata", "fever", "vitaminc"]


def first_gold(path):
    q2p = {}
    for line in path.read_text().split("\n")[1:]:
        if line.strip():
            q, p, *_ = line.split("\t")
            q2p.setdefault(q, p)
    return q2p


def main(argv):
    if not argv:
        raise SystemExit(__doc__)
    negatives = json.loads(Path(argv[0]).read_text())["negatives"]
    data = Path(argv[1] if len(argv) > 1 else "data/minikilt")
    batch = int(argv[2]) if len(argv) > 2 else 32
    pos = {t: first_gold(data / "tasks" / t / "qrels.train.tsv") for t in TASKS}
    total_queries = sum(len(pos[t]) for t in TASKS)
    per_step = {t: batch * len(pos[t]) / total_queries for t in TASKS}
    pos_count = {t: collections.Counter(pos[t].values()) for t in TASKS}
    neg_count = {t: collections.Counter(v[0] for v in negatives.get(t, {}).values() if v) for t in TASKS}
    total = 0.0
    print("(query task, copy's task): expected (query, copy) pairs a step")
    for t in TASKS:
        for u in TASKS:
            nt, nu = len(pos[t]), len(pos[u])
            same_pos = sum(c * pos_count[u].get(p, 0) for p, c in pos_count[t].items()) - (nt if t == u else 0)
            as_negative = sum(c * neg_count[u].get(p, 0) for p, c in pos_count[t].items())
            e = per_step[t] * per_step[u] * (same_pos + as_negative) / (nt * nu)
            total += e
            if e >= 0.005:
                print(f"  {t}, {u}: {e:.3f}")
    print(f"all: {total:.2f} (query, copy) pairs in a step of {batch}")
    for t in TASKS:
        n, b = len(pos[t]), per_step[t]
        share = sum(c * (c - 1) for c in pos_count[t].values()) / (n * (n - 1))
        print(f"{t}: {b:.1f} queries a step; {b * (b - 1) / 2 * share:.2f} unordered pairs of them on one gold passage")


if __name__ == "__main__":
    main(sys.argv[1:])
