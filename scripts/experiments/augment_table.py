#!/usr/bin/env python3
"""The accuracy tables of scripts/experiments/augment_minikilt.sh (docs/RESULTS.md).

    scripts/experiments/augment_table.py runs/augment [data/minikilt]

Reads OUT/TASK-RETRIEVER.summary.json for the accuracy tables. For short answers it also
reads the records and the corpus to show where passages can move a small model at all: the
questions whose retrieved passages hold a gold alias (by the same containment rule the
answers are scored with), their accuracy with and without passages, and how many answers
are copied from the passages (an answer of three or more characters found in them), and
how many first lines are empty. The passages are read whole, as the recipe sends them
(`max_chars = 0`); of a record whose prompt was cut to fit the context only the passages it
still showed (`passages_shown`) count, the last of them whole. For multiple choice it adds how
often each run answered the most common letter, how many answers got a floor value for a
letter missing from the top log-probabilities, and the accuracy of always answering "A".
"""
import statistics
from collections import Counter
import json
import sys
from pathlib import Path

from augment_stats import aliases_in, read_jsonl

NAMES = {
    "none": "closed book",
    "bm25": "BM25, k = 3",
    "minilm": "MiniLM, k = 3",
    "trained": "trained (TRAINED), k = 3",
    # scripts/experiments/aar_minikilt.sh's retrievers
    "human": "MiniLM fine-tuned on gold positives, k = 3",
    "aar": "AAR from SmolLM2, k = 3",
    "replug": "REPLUG-LSR from SmolLM2, k = 3",
}


def accuracy_tables(out):
    for task in ["mc", "shortqa"]:
        rows = []
        for r in NAMES:
            p = out / f"{task}-{r}.summary.json"
            if p.exists() and p.stat().st_size > 0:
                rows.append((r, json.loads(p.read_text())))
        if not rows:
            continue
        subjects = sorted(rows[0][1]["accuracy"]["per_subject"])
        model = rows[0][1].get("model") or "the server's model"
        print(f"\n**{task}** (mini-KILT dev; model {model} at {rows[0][1].get('base_url', '?')})\n")
        cols = subjects + (["macro"] if len(subjects) > 1 else [])
        print("| passages | items | failed | " + " | ".join(cols) + " |")
        print("|---|---:|---:|" + "---:|" * len(cols))
        for r, s in rows:
            acc = s["accuracy"]
            cells = [f'{acc["per_subject"][x]["accuracy"]:.3f}' for x in subjects]
            if len(subjects) > 1:
                cells.append(f'{acc["macro"]:.3f}')
            print(f"| {NAMES[r]} | {s['items']} | {s['failed']} | " + " | ".join(cells) + " |")


def shown(record):
    """The passages a record's prompt showed: all retrieved, unless the prompt was cut."""
    return record.get("passages_shown", record["passages"])


def mc_analysis(out, data):
    gold = read_jsonl(data / "mc/dev.jsonl")
    by_subject = {}
    for q in gold:
        by_subject.setdefault(q["subject"], []).append(q["answer"] == 0)
    rows = []
    for r in NAMES:
        p = out / f"mc-{r}.jsonl"
        if p.exists():
            recs = [x for x in read_jsonl(p) if x["error"] is None]
            if recs:
                rows.append((r, recs))
    if not rows:
        return
    counts = ", ".join(f"{k} {len(v)}" for k, v in sorted(by_subject.items()))
    always_a = statistics.mean(sum(v) / len(v) for v in by_subject.values())
    print(f"\n**mc, what the answers are** (questions per subject: {counts}; always \"A\": macro {always_a:.3f}, "
          + ", ".join(f"{k} {sum(v) / len(v):.3f}" for k, v in sorted(by_subject.items())) + ")\n")
    print("| passages | answered | most common answer | its count | other answers right | floored |")
    print("|---|---:|---|---:|---:|---:|")
    for r, recs in rows:
        letter, n = Counter(x["answer"] for x in recs).most_common(1)[0]
        others = [x for x in recs if x["answer"] != letter]
        floored = sum(any(x.get("floored") or []) for x in recs)
        print(f"| {NAMES[r]} | {len(recs)} | {letter} | {n} | {sum(x['correct'] for x in others)} of {len(others)} | {floored} |")


def empty_first_lines(out):
    rows = []
    for r in NAMES:
        p = out / f"shortqa-{r}.jsonl"
        if p.exists():
            recs = [x for x in read_jsonl(p) if x["error"] is None]
            rows.append((r, len(recs), sum(not (x.get("answer") or "").strip() for x in recs)))
    if rows:
        print("\n**shortqa, empty first lines** (the answer is the first line; an empty one is wrong)\n")
        print("| passages | answered | empty first lines |")
        print("|---|---:|---:|")
        for r, n, empty in rows:
            print(f"| {NAMES[r]} | {n} | {empty} |")


def passage_analysis(out, data):
    closed_path = out / "shortqa-none.jsonl"
    if not closed_path.exists():
        return
    # Questions answered (no error record) in every run compared.
    closed = {r["_id"]: r for r in read_jsonl(closed_path) if r["error"] is None}
    aliases = {q["_id"]: q["answers"] for q in read_jsonl(data / "shortqa/dev.jsonl")}
    wanted = set()
    runs = {}
    for r in [x for x in NAMES if x != "none"]:
        p = out / f"shortqa-{r}.jsonl"
        if p.exists():
            runs[r] = [x for x in read_jsonl(p) if x["error"] is None and x["_id"] in closed]
            wanted.update(pid for x in runs[r] for pid in shown(x))
    if not runs:
        return
    text = {}
    with open(data / "corpus.jsonl", encoding="utf-8") as f:
        for line in f:
            p = json.loads(line)
            if p["_id"] in wanted:
                text[p["_id"]] = f'{p.get("title", "")}\n{p["text"]}'
    print("\n**shortqa, where the passages hold an answer** (same questions, closed book beside)\n")
    print("| passages | answered | passages hold an alias | accuracy there, with passages | closed book on them | answers copied from passages | copied and right | closed book right on those |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r, recs in runs.items():
        hold = with_acc = closed_acc = copied = copied_right = copied_closed = 0
        for x in recs:
            ctx = "\n".join(text.get(pid, "") for pid in shown(x))
            ans = (x.get("answer") or "").strip().rstrip(".")
            if len(ans) >= 3 and ans.lower() in ctx.lower():
                copied += 1
                copied_right += bool(x["correct"])
                copied_closed += bool(closed[x["_id"]]["correct"])
            # The rule answers are judged by (PopQA's; augment_stats.aliases_in).
            if aliases_in(ctx, aliases.get(x["_id"], [])):
                hold += 1
                with_acc += bool(x["correct"])
                closed_acc += bool(closed[x["_id"]]["correct"])
        n = len(recs)
        frac = lambda a, b: f"{a / b:.3f}" if b else "-"
        print(f"| {NAMES[r]} | {n} | {hold} ({frac(hold, n)}) | {frac(with_acc, hold)} | {frac(closed_acc, hold)} | {copied} | {copied_right} | {copied_closed} |")


def main():
    out = Path(sys.argv[1])
    data = Path(sys.argv[2] if len(sys.argv) > 2 else "data/minikilt")
    accuracy_tables(out)
    mc_analysis(out, data)
    empty_first_lines(out)
    passage_analysis(out, data)


if __name__ == "__main__":
    main()
