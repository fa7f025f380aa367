#!/usr/bin/env python3
"""What made a committed ranking (scripts/experiments/aar_minikilt.sh, STAGE=rank): the encoder's
checkpoint digest and the corpus's SHA-256, as the corpus embeddings' encode.json records them,
and the SHA-256 of the questions file. A ranking whose model is not kept cannot be checked
later unless this is written beside it.

    ranking_record.py --write RECORD ENCODE_JSON QUESTIONS   # after the search
    ranking_record.py --check RECORD ENCODE_JSON QUESTIONS   # exit 1, naming what differs

Standard library only.
"""
import argparse
import hashlib
import json
import os
import sys


def record(encode_json, questions):
    enc = json.load(open(encode_json, encoding="utf-8"))
    with open(questions, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    return {
        "encoder": enc["encoder"]["plugin"],
        "checkpoint": enc["encoder"]["checkpoint"],
        "corpus_sha256": enc["input_sha256"],
        "questions_sha256": digest,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true")
    mode.add_argument("--check", action="store_true")
    ap.add_argument("record")
    ap.add_argument("encode_json")
    ap.add_argument("questions")
    a = ap.parse_args()
    now = record(a.encode_json, a.questions)
    if a.write:
        tmp = a.record + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps(now, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, a.record)
        return
    kept = json.load(open(a.record, encoding="utf-8"))
    differ = [k for k in sorted(set(kept) | set(now)) if kept.get(k) != now.get(k)]
    if differ:
        for k in differ:
            print(f"{a.record}: {k} was {kept.get(k)!r}, is now {now.get(k)!r}", file=sys.stderr)
        ranking = a.record[: -len(".json")] + ".trec" if a.record.endswith(".json") else "the ranking"
        sys.exit(f"{ranking} was made by another model, corpus or question set than the one here: remove it (and its .json) to rank again")


if __name__ == "__main__":
    main()
