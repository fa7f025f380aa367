#!/usr/bin/env python3
"""Accuracy with 95% bootstrap intervals and paired comparisons against closed book, for the
results files of scripts/experiments/augment_minikilt.sh (issue 21; docs/RESULTS.md).

    scripts/experiments/augment_stats.py OUT [data/minikilt]
    scripts/experiments/augment_stats.py --pool OUT1 OUT2 ...   # BETWEEN pooled over targets

Reads OUT/TASK-RETRIEVER.jsonl (one record per question, as `host augment` writes them) for
TASK in mc, shortqa and every RETRIEVER found (`none` is closed book). For each run:
- accuracy over every question asked, a failed item counted wrong (the headline), with a 95%
  percentile bootstrap interval (10,000 resamples of the questions, seed 0);
- against closed book on the same questions: the difference with a paired bootstrap interval
  (the same resampled questions for both) and McNemar's exact test on the discordant pairs.
For short answers, the questions are also split by whether the passages the prompt showed
hold a gold alias (PopQA's rule, the one answers are judged by: an alias as written,
lower-cased or capitalised, as a substring), with the same paired comparison on each part:
what passages that hold the answer gain, and what passages that do not hold it cost.
Then the retrievers against each other (BETWEEN below, where both ran), paired the same way.
--pool adds each BETWEEN difference up over several targets' OUT folders (the mean over
question x target pairs), resampling questions (all targets of a question together, since the
targets answer the same questions and their errors go together); its McNemar p treats the
pairs as independent and is only a guide.
Standard library only.
"""
import json
import math
import random
import sys
from pathlib import Path

RESAMPLES = 10_000
# (run, against) pairs compared directly: AAR's question (LM-preferred against human
# positives) and each trained retriever against the one it started from.
BETWEEN = [("aar", "human"), ("aar", "minilm"), ("replug", "human"), ("replug", "minilm"),
           ("human", "minilm"), ("trained", "minilm"), ("minilm", "bm25")]


def read_jsonl(path):
    """Records of a JSON-lines file; a last line torn by a killed writer is left out."""
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    out = []
    for i, line in enumerate(lines):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise SystemExit(f"{path}:{i + 1}: not JSON")
    return out


def correct_by_id(path):
    """Question id -> 1 if answered right, 0 if wrong or failed (a failure counts wrong)."""
    return {r["_id"]: int(bool(r.get("correct")) and r.get("error") is None) for r in read_jsonl(path)}


def bootstrap(values, stat, seed=0):
    """95% percentile interval of `stat` over resamples of `values` (a list of items)."""
    rng = random.Random(seed)
    n = len(values)
    stats = sorted(stat([values[rng.randrange(n)] for _ in range(n)]) for _ in range(RESAMPLES))
    return stats[int(0.025 * RESAMPLES)], stats[int(0.975 * RESAMPLES) - 1]


def mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def mcnemar_exact(b, c):
    """Two-sided exact McNemar p-value: b and c are the discordant counts."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(b, c) + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired(base, run, ids):
    """(difference, interval, p, b, c) of run minus base over `ids`."""
    pairs = [(base[i], run[i]) for i in ids]
    diff = mean([r - b for b, r in pairs])
    lo, hi = bootstrap(pairs, lambda s: mean([r - b for b, r in s]))
    b = sum(1 for x, y in pairs if x == 1 and y == 0)
    c = sum(1 for x, y in pairs if x == 0 and y == 1)
    return diff, (lo, hi), mcnemar_exact(b, c), b, c


def aliases_in(text, aliases):
    """PopQA's containment, as host augment judges answers (REFERENCE §6)."""
    forms = set()
    for a in aliases:
        a = a.strip()
        if a:
            forms.update({a, a.lower(), a[:1].upper() + a[1:].lower()})
    return any(f in text for f in forms)


def holds_answer(out, data, task, retriever):
    """Question id -> whether the passages its prompt showed hold a gold alias."""
    if task != "shortqa":
        return None
    probes = {q["_id"]: q["answers"] for q in read_jsonl(data / "shortqa/dev.jsonl")}
    recs = read_jsonl(out / f"{task}-{retriever}.jsonl")
    wanted = {p for r in recs for p in r.get("passages_shown", r["passages"])}
    texts = {}
    with open(data / "corpus.jsonl", encoding="utf-8") as f:
        for line in f:
            d = json.loads(line)
            if d["_id"] in wanted:
                texts[d["_id"]] = d["title"] + "\n" + d["text"]
    return {r["_id"]: any(aliases_in(texts.get(p, ""), probes[r["_id"]]) for p in r.get("passages_shown", r["passages"])) for r in recs}


def fmt(x):
    return f"{x:.3f}"


def pool(outs):
    """The BETWEEN pairs over every target in `outs` that ran both, question-clustered."""
    for task in ["mc", "shortqa"]:
        print(f"\n{task}, retrievers against each other, pooled over {', '.join(o.name for o in outs)}:\n")
        print("| run | against | targets | pairs | difference [95%] | McNemar p, as if independent (against right only / run right only) |")
        print("|---|---|---:|---:|---|---|")
        for a, b in BETWEEN:
            diffs = {}  # question id -> run minus against, one entry per target
            used = 0
            for out in outs:
                fa, fb = out / f"{task}-{a}.jsonl", out / f"{task}-{b}.jsonl"
                if not (fa.exists() and fb.exists()):
                    continue
                used += 1
                run, base = correct_by_id(fa), correct_by_id(fb)
                for i in run:
                    if i in base:
                        diffs.setdefault(i, []).append(run[i] - base[i])
            if not diffs:
                continue
            clusters = list(diffs.values())
            total = lambda cs: sum(map(sum, cs)) / sum(map(len, cs))
            lo, hi = bootstrap(clusters, total)
            flat = [d for c in clusters for d in c]
            nb, nc = flat.count(-1), flat.count(1)
            print(f"| {a} | {b} | {used} | {len(flat)} | {total(clusters):+.3f} [{lo:+.3f}, {hi:+.3f}] | {mcnemar_exact(nb, nc):.2g} ({nb} / {nc}) |")


def main(argv):
    if not argv:
        raise SystemExit(__doc__)
    if argv[0] == "--pool":
        return pool([Path(a) for a in argv[1:]])
    out = Path(argv[0])
    data = Path(argv[1] if len(argv) > 1 else "data/minikilt")
    for task in ["mc", "shortqa"]:
        runs = sorted(p.stem[len(task) + 1:] for p in out.glob(f"{task}-*.jsonl"))
        if "none" not in runs:
            continue
        base = correct_by_id(out / f"{task}-none.jsonl")
        print(f"\n**{task}** ({out}; failed items count wrong; 95% bootstrap intervals)\n")
        print("| passages | questions | accuracy [95%] | vs closed book, same questions [95%] | McNemar p (closed right only / passages right only) |")
        print("|---|---:|---|---|---|")
        for r in ["none"] + [x for x in runs if x != "none"]:
            run = correct_by_id(out / f"{task}-{r}.jsonl")
            ids = sorted(run)
            acc = mean([run[i] for i in ids])
            lo, hi = bootstrap([run[i] for i in ids], mean)
            row = f"| {r} | {len(ids)} | {fmt(acc)} [{fmt(lo)}, {fmt(hi)}] |"
            common = [i for i in ids if i in base]
            if r == "none" or not common:
                row += " — | — |"
            else:
                d, (dlo, dhi), p, b, c = paired(base, run, common)
                row += f" {d:+.3f} [{dlo:+.3f}, {dhi:+.3f}] ({len(common)}) | {p:.2g} ({b} / {c}) |"
            print(row)
        between(out, task, runs)
        if task != "shortqa":
            continue
        print("\nShort answers split by whether the shown passages hold a gold alias (same questions, closed book against passages):\n")
        print("| passages | part | questions | closed book | with passages | difference [95%] | McNemar p |")
        print("|---|---|---:|---:|---:|---|---|")
        for r in [x for x in runs if x != "none"]:
            run = correct_by_id(out / f"{task}-{r}.jsonl")
            holds = holds_answer(out, data, task, r)
            for part, want in [("passages hold an alias", True), ("they do not", False)]:
                ids = [i for i in sorted(run) if i in base and holds.get(i) == want]
                if not ids:
                    continue
                d, (dlo, dhi), p, _, _ = paired(base, run, ids)
                print(f"| {r} | {part} | {len(ids)} | {fmt(mean([base[i] for i in ids]))} | {fmt(mean([run[i] for i in ids]))} | {d:+.3f} [{dlo:+.3f}, {dhi:+.3f}] | {p:.2g} |")


def between(out, task, runs):
    """The BETWEEN pairs that both ran, on the questions both answered."""
    pairs = [(a, b) for a, b in BETWEEN if a in runs and b in runs]
    if not pairs:
        return
    print(f"\n{task}, retrievers against each other (same questions):\n")
    print("| run | against | questions | difference [95%] | McNemar p (against right only / run right only) |")
    print("|---|---|---:|---|---|")
    for a, b in pairs:
        run, base = correct_by_id(out / f"{task}-{a}.jsonl"), correct_by_id(out / f"{task}-{b}.jsonl")
        ids = sorted(i for i in run if i in base)
        if not ids:
            continue
        d, (dlo, dhi), p, nb, nc = paired(base, run, ids)
        print(f"| {a} | {b} | {len(ids)} | {d:+.3f} [{dlo:+.3f}, {dhi:+.3f}] | {p:.2g} ({nb} / {nc}) |")


if __name__ == "__main__":
    main(sys.argv[1:])
