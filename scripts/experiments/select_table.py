#!/usr/bin/env python3
"""Tables of scripts/experiments/recipe_select.sh's runs (issue 32, item 5; docs/RESULTS.md,
"Recipes chosen on a validation split"): each system on the validation split, the unseen-page
probe and dev, each system against a base, and the method's parts, with 95% intervals.

    python3 scripts/experiments/select_table.py runs/select [--val runs/minikilt-val]
        [--base taco --base peer-st] [--budget 600] [--resamples 2000]

Reads OUT/NAME.SPLIT.metrics.json.gz (`host eval --per-query`, gzipped; NAME is METHOD-sSEED, or zeroshot),
OUT/NAME/done (the training command's seconds), OUT/recipes/METHOD.toml (max_steps) or the
peer's OUT/NAME/peer_run.json (steps), and VAL/tasks/TASK/queries.SPLIT.jsonl (gold pages).

1. Systems, per split: the seeds, the mean training seconds (marked † when a run is more than
   10% off --budget: not an equal-time run), the steps, each task's MRR@10 and the macro MRR@10
   and page R-precision, mean ± sd over the seeds.
2. Differences, per base and split: METHOD − BASE in macro MRR@10 and macro page R-precision
   (the mean over tasks of each task's mean; scores in points), the mean over the seeds both
   systems have (all of a system's seeds when the other has none, as zeroshot) and each seed's
   own difference, and two 95% percentile bootstrap intervals of the
   difference of the seed-averaged scores, resampled within each task: of the queries, and of
   the gold pages (all queries of a page together: the unseen probe holds few pages, and
   queries on one page do not vary independently). Neither interval counts the spread over
   training seeds; the per-seed differences show it. Each comparison draws its resamples from a
   generator seeded by the split and the pair, so A − B and B − A get mirrored intervals and a
   row does not change when other systems are added.
3. The method's parts, per split: each part as WITH − WITHOUT (PARTS below: the task prefix is
   taco − taco-noprefix, tempered sampling taco-t4 − taco), the same columns as 2.
Standard library only.
"""
import argparse
import gzip
import json
import random
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

METRICS = [("mrr@10", "MRR@10"), ("rprec_page", "page R-precision")]
# Rows in this order (others after them, by name).
ORDER = ["zeroshot", "peer-st", "naive", "naive-peerlike", "taco", "taco-noprefix", "taco-notsage",
         "taco-stepneg", "taco-t4"]
# The method's parts (issue 32, item 5): (part, the system with it, the system without it).
PARTS = [("task prefix", "taco", "taco-noprefix"), ("T-SAGE, not AdamW", "taco", "taco-notsage"),
         ("task-scoped negatives, not the step's", "taco", "taco-stepneg"),
         ("tempered sampling c = 4, not c = 1", "taco-t4", "taco")]
SPLIT_TITLES = {"val": "validation split", "unseen": "unseen-page probe", "dev": "dev (the report)"}


def load_runs(out):
    """{split: {method: {seed: {task: {qid: {metric: value}}}}}}"""
    runs = defaultdict(lambda: defaultdict(dict))
    for p in sorted(out.glob("*.metrics.json.gz")):
        stem = p.name[: -len(".metrics.json.gz")]
        name, _, split = stem.rpartition(".")
        if not name:
            continue
        m = re.fullmatch(r"(.+)-s(\d+)", name)
        method, seed = (m.group(1), int(m.group(2))) if m else (name, None)
        with gzip.open(p, "rt", encoding="utf-8") as f:
            data = json.load(f)
        tasks = {}
        for t, v in data["tasks"].items():
            if "per_query" not in v:
                sys.exit(f"{p}: no per-query values (host eval --per-query)")
            tasks[t] = v["per_query"]
        runs[split][method][seed] = tasks
    return runs


def ordered(methods):
    return sorted(methods.items(), key=lambda kv: (ORDER.index(kv[0]) if kv[0] in ORDER else len(ORDER), kv[0]))


def pages_of(val, split, task):
    """query id -> its first gold page (the query itself when it names none)."""
    path = val / "tasks" / task / f"queries.{split}.jsonl"
    out = {}
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                rec = json.loads(line)
                pages = rec.get("pages") or []
                out[rec["_id"]] = pages[0] if pages else "query:" + rec["_id"]
    return out


def macro(tasks, metric):
    return statistics.mean(statistics.mean(q[metric] for q in pq.values()) for pq in tasks.values())


def train_info(out, method, seeds):
    secs, steps = [], []
    for s in seeds:
        if s is None:
            continue
        d = out / f"{method}-s{s}"
        if (d / "done").exists():
            secs.append(float((d / "done").read_text().strip()))
        peer = d / "peer_run.json"
        if peer.exists():
            steps.append(json.loads(peer.read_text())["steps"])
    recipe = out / "recipes" / f"{method}.toml"
    if not steps and recipe.exists():
        m = re.search(r"^max_steps = (\d+)", recipe.read_text(), re.M)
        steps = [int(m.group(1))] if m else []
    return secs, steps


def fmt(values, scale=1.0, digits=4):
    values = [v * scale for v in values]
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def seed_mean(by_seed, task, metric):
    """qid -> the query's score averaged over the seeds."""
    qids = by_seed[next(iter(by_seed))][task].keys()
    return {q: statistics.mean(run[task][q][metric] for run in by_seed.values()) for q in qids}


def intervals(a, b, tasks, metric, clusters, resamples, rng):
    """95% percentile intervals of the macro difference, resampling queries, then pages."""
    per_task = []
    for t in tasks:
        sa, sb = seed_mean(a, t, metric), seed_mean(b, t, metric)
        common = sorted(set(sa) & set(sb))
        if len(common) != len(sa) or len(common) != len(sb):
            sys.exit(f"task {t}: the two systems were evaluated on different queries")
        d = [sa[q] - sb[q] for q in common]
        groups = defaultdict(lambda: [0.0, 0])
        for q, x in zip(common, d):
            g = groups[clusters[t].get(q, q)]
            g[0] += x
            g[1] += 1
        per_task.append((d, list(groups.values())))
    out = []
    for by_page in (False, True):
        stats = []
        for _ in range(resamples):
            total = 0.0
            for d, groups in per_task:
                if by_page:
                    pick = rng.choices(groups, k=len(groups))
                    total += sum(g[0] for g in pick) / sum(g[1] for g in pick)
                else:
                    total += sum(rng.choices(d, k=len(d))) / len(d)
            stats.append(total / len(per_task))
        stats.sort()
        # Symmetric ranks, so that B − A's interval is exactly A − B's mirrored.
        k = int(0.025 * resamples)
        out.append((stats[k], stats[resamples - 1 - k]))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path, help="recipe_select.sh's OUT")
    ap.add_argument("--val", type=Path, default=Path("runs/minikilt-val"), help="the carved data (gold pages)")
    ap.add_argument("--base", action="append", help="compare every system with this one (repeatable; default taco and peer-st)")
    ap.add_argument("--budget", type=float, default=600.0, help="the training budget in seconds (recipe_select.sh's BUDGET)")
    ap.add_argument("--resamples", type=int, default=2000)
    args = ap.parse_args(argv)
    bases = args.base or ["taco", "peer-st"]
    runs = load_runs(args.out)
    if not runs:
        sys.exit(f"{args.out}: no *.SPLIT.metrics.json.gz")
    splits = [s for s in ("val", "unseen", "dev") if s in runs] + sorted(s for s in runs if s not in SPLIT_TITLES)

    for split in splits:
        methods = runs[split]
        tasks = sorted(next(iter(next(iter(methods.values())).values())))
        print(f"\n**Systems on the {SPLIT_TITLES.get(split, split)}** (MRR@10 per task; mean ± sd over seeds)\n")
        print("| system | seeds | train s | steps | " + " | ".join(tasks) + " | macro MRR@10 | macro page R-prec |")
        print("|---|---:|---:|---:|" + "---:|" * (len(tasks) + 2))
        for method, by_seed in ordered(methods):
            seeds = sorted(by_seed, key=lambda s: -1 if s is None else s)
            secs, steps = train_info(args.out, method, seeds)
            off = any(abs(s - args.budget) > 0.1 * args.budget for s in secs)
            t = f"{statistics.mean(secs):.0f}{' †' if off else ''}" if secs else "–"
            st = f"{statistics.mean(steps):.0f}" if steps else "–"
            cells = [fmt([statistics.mean(q["mrr@10"] for q in by_seed[s][task].values()) for s in seeds]) for task in tasks]
            mac = [fmt([macro(by_seed[s], k) for s in seeds]) for k, _ in METRICS]
            seed_txt = ", ".join(str(s) for s in seeds if s is not None) or "–"
            print(f"| {method} | {seed_txt} | {t} | {st} | " + " | ".join(cells + mac) + " |")

    for base in bases:
        for split in splits:
            methods = runs[split]
            if base not in methods:
                continue
            tasks = sorted(next(iter(methods[base].values())))
            clusters = {t: pages_of(args.val, split, t) for t in tasks}
            print(f"\n**METHOD − {base} on the {SPLIT_TITLES.get(split, split)}** (points; 95% bootstrap "
                  f"intervals of the seed-averaged difference, {args.resamples} resamples within each task)\n")
            print("| system | metric | Δ (mean over seeds) | Δ per seed | 95% CI, queries | 95% CI, pages |")
            print("|---|---|---:|---|---|---|")
            b = methods[base]
            for method, a in ordered(methods):
                if method != base:
                    print_difference(method, (method, a), (base, b), tasks, clusters, args.resamples, split)

    for split in splits:
        methods = runs[split]
        parts = [(name, w, wo) for name, w, wo in PARTS if w in methods and wo in methods]
        if not parts:
            continue
        tasks = sorted(next(iter(methods[parts[0][1]].values())))
        clusters = {t: pages_of(args.val, split, t) for t in tasks}
        print(f"\n**The method's parts on the {SPLIT_TITLES.get(split, split)}** (WITH − WITHOUT, points; "
              f"95% bootstrap intervals as above)\n")
        print("| part (with − without) | metric | Δ (mean over seeds) | Δ per seed | 95% CI, queries | 95% CI, pages |")
        print("|---|---|---:|---|---|---|")
        for name, w, wo in parts:
            print_difference(f"{name} ({w} − {wo})", (w, methods[w]), (wo, methods[wo]), tasks, clusters,
                             args.resamples, split)


def print_difference(label, named_a, named_b, tasks, clusters, resamples, split):
    """Two table rows (one per metric): A − B over the seeds both have, per seed, and the intervals."""
    (name_a, a), (name_b, b) = named_a, named_b
    if None not in a and None not in b:
        common = set(a) & set(b)
        if not common:
            print(f"| {label} | – | no seed in common | – | – | – |")
            return
        a, b = {s: a[s] for s in common}, {s: b[s] for s in common}
    for key, title in METRICS:
        # Seeded by the split and the pair, not its order: A − B and B − A resample alike.
        rng = random.Random("|".join([split, key] + sorted([name_a, name_b])))
        ma = {s: macro(r, key) for s, r in a.items()}
        mb = {s: macro(r, key) for s, r in b.items()}
        delta = 100 * (statistics.mean(ma.values()) - statistics.mean(mb.values()))
        paired = [f"{100 * (ma[s] - mb[s]):+.2f} (s{s})" for s in sorted(set(ma) & set(mb)) if s is not None]
        (ql, qh), (pl, ph) = intervals(a, b, tasks, key, clusters, resamples, rng)
        print(f"| {label} | macro {title} | {delta:+.2f} | {', '.join(paired) or '–'} | "
              f"[{100 * ql:+.2f}, {100 * qh:+.2f}] | [{100 * pl:+.2f}, {100 * ph:+.2f}] |")


if __name__ == "__main__":
    main()
