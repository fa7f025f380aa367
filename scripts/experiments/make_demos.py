#!/usr/bin/env python3
"""Few-shot demonstrations for `host augment --task shortqa` (configs/augment/chat.toml),
drawn from mini-KILT's wikidata *training* queries, never from what the probes ask.

    scripts/experiments/make_demos.py [--n 15] [--per-relation 2] [--seed 0] \
        [--train data/minikilt/tasks/wikidata/queries.train.jsonl] \
        [--dev data/minikilt/shortqa/dev.jsonl] \
        [--output configs/augment/demos/shortqa-wikidata-train.jsonl]

configs/augment/demos/shortqa-wikidata-train.jsonl was made with the defaults above. PopQA's
API runs used 15 demonstrations; these are its counterpart on mini-KILT:

- the training queries are read in id order and shuffled with Python's random.Random(seed);
- kept: a query with exactly one answer (a demonstration shows one answer, and a list of
  several, as "The official language of ASEAN is", would teach the first of them only), whose
  gold page is the page of no shortqa dev question and whose text is no dev question's;
- spread over relations: the relation is the query with its page's title taken out ("The
  country of {X} is", "{X} shares a border with"; a title with a trailing "(...)" is also
  tried without it); a query whose relation cannot be told is left out; at most
  `--per-relation` queries per relation, the first in the shuffled order;
- the first `--n` so kept are written, in that order, in the shortqa input format
  (retrieval/src/data/probes.rs): {"_id", "question", "answers", "pages"}, the _id the
  training query's own ("wikidata:N").

Standard library only. It checks what it wrote (no page or question of shortqa dev, at most
`--per-relation` per relation, `--n` lines) and fails otherwise; host's unit tests check the
committed file against shortqa dev too.
"""
import argparse
import collections
import json
import os
import random
import re
import sys


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def relation(text, pages):
    """The query with its page's title replaced by {X}, or None when no title is found in it."""
    for page in pages:
        for title in (page, re.sub(r"\s*\([^()]*\)$", "", page)):
            if title and title in text:
                return text.replace(title, "{X}", 1)
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=15)
    ap.add_argument("--per-relation", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train", default="data/minikilt/tasks/wikidata/queries.train.jsonl")
    ap.add_argument("--dev", default="data/minikilt/shortqa/dev.jsonl")
    ap.add_argument("--output", default="configs/augment/demos/shortqa-wikidata-train.jsonl")
    args = ap.parse_args()

    dev = read_jsonl(args.dev)
    dev_pages = {p for d in dev for p in d.get("pages", [])}
    dev_questions = {d["question"].strip().lower() for d in dev}

    def number(q):
        tail = q["_id"].rsplit(":", 1)[-1]
        return (0, int(tail), q["_id"]) if tail.isdigit() else (1, 0, q["_id"])

    train = sorted(read_jsonl(args.train), key=number)
    random.Random(args.seed).shuffle(train)

    per_relation = collections.Counter()
    demos = []
    for q in train:
        if len(demos) == args.n:
            break
        answers = [a for a in q["answers"] if a.strip()]
        if len(answers) != 1 or not q.get("pages"):
            continue
        if set(q["pages"]) & dev_pages or q["text"].strip().lower() in dev_questions:
            continue
        rel = relation(q["text"], q["pages"])
        if rel is None or per_relation[rel] >= args.per_relation:
            continue
        per_relation[rel] += 1
        demos.append({"_id": q["_id"], "question": q["text"], "answers": answers, "pages": q["pages"], "relation": rel})

    if len(demos) < args.n:
        sys.exit(f"make_demos.py: only {len(demos)} training queries qualify; asked for {args.n}")
    assert not any(set(d["pages"]) & dev_pages for d in demos), "a demonstration's page is a dev question's"
    assert not any(d["question"].strip().lower() in dev_questions for d in demos), "a demonstration is a dev question"
    assert max(collections.Counter(d["relation"] for d in demos).values()) <= args.per_relation

    os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as f:
        for d in demos:
            f.write(json.dumps({k: d[k] for k in ("_id", "question", "answers", "pages")}, ensure_ascii=False) + "\n")
    for d in demos:
        print(f"{d['_id']}\t{d['relation']}\t{d['answers'][0]}", file=sys.stderr)
    print(f"make_demos.py: {len(demos)} demonstrations over {len(per_relation)} relations -> {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
