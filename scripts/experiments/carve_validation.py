#!/usr/bin/env python3
"""Carve a validation split and an unseen-page probe out of mini-KILT's train splits (issue 32,
item 5): recipe choices are made on them, never on dev, which stays the report.

    python3 scripts/experiments/carve_validation.py [--data data/minikilt] [--out runs/minikilt-val]

Writes a mini-KILT directory that `host train` (`[data] task_dir = "OUT/tasks"`, `split =
"train"`), `host search`/`host eval` (the split's files) and scripts/experiments/peer_st.py
(`--data OUT`) read like the pack itself:

    OUT/corpus.jsonl                          a symbolic link to the pack's corpus
    OUT/tasks/<task>/queries.train.jsonl      train minus validation minus unseen-page queries
    OUT/tasks/<task>/queries.val.jsonl        validation: queries picked by a hash of their id
    OUT/tasks/<task>/queries.unseen.jsonl     every train query whose gold touches a held-out page
    OUT/tasks/<task>/queries.dev.jsonl        the pack's dev, copied as is
    (and qrels.<split>.tsv beside each: the pack's rows of those queries, in the pack's order)
    OUT/STATS.json                            sizes, pages, the held-out pages, the parameters

How the splits are made (standard library only; the same inputs and parameters give the same
bytes):
  1. A query's gold pages are its `pages` together with the titles of its qrels passages.
  2. Held-out pages: every page of some task's train gold is ranked by SHA-256 of
     "SALT/page/TITLE". Task by task (in name order), pages are taken from the top of that
     ranking, among the pages of that task's train queries, until at least --unseen-frac of
     the task's train queries touch a held-out page. One page set for all tasks: a page held
     out for one task is held out for every task, as the pack's own page split is, so no
     task trains on a page another task probes.
  3. unseen = every train query (of any task) with a held-out page among its gold pages. The
     queries left no longer name any held-out page, so none is trained on as a positive (a
     held-out page's passages can still be drawn as BM25 negatives: the corpus is shared).
  4. val = of the queries left, the first k by SHA-256 of "SALT/val/TASK/QUERY-ID", with
     k = max(--val-frac of them, min(--val-min, --val-cap of them)): 10%, raised towards
     300 queries where the task is large enough, never more than a quarter of it.
     Validation queries are about pages that training does see (the pack splits by page);
     the unseen probe is the page-disjoint one, as dev is.
  5. train = the rest. The script checks before it writes that train, val and unseen
     partition the pack's train split, that no val or unseen id is in train, and that no
     train query's gold touches a held-out page.

OUT is replaced only if an earlier run of this script made it (its STATS.json says so);
anything else there is refused. It is written under a temporary name and renamed.
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

BUILDER = "carve_validation-v1"
SPLITS_OUT = ("train", "val", "unseen")


def fail(msg):
    sys.exit(f"carve_validation: {msg}")


def rank(salt, *parts):
    """A stable pseudo-random position: the first 8 bytes of SHA-256 of SALT/part/part..."""
    key = "/".join((salt,) + parts).encode("utf-8")
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "big")


def read_queries(path):
    """[(id, raw line, record)] in file order; raw lines are copied out unchanged."""
    out, seen = [], set()
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                qid = rec["_id"]
            except (ValueError, KeyError, TypeError) as e:
                fail(f"{path}:{n}: not a query record ({e})")
            if qid in seen:
                fail(f"{path}:{n}: query id {qid!r} appears twice")
            seen.add(qid)
            out.append((qid, line if line.endswith("\n") else line + "\n", rec))
    return out


def read_qrels(path):
    """(header line, [(query id, corpus id, raw line)]) in file order."""
    with open(path, encoding="utf-8", newline="") as f:
        lines = f.readlines()
    if not lines:
        fail(f"{path}: empty (expected a header 'query-id<TAB>corpus-id<TAB>score')")
    header = lines[0] if lines[0].endswith("\n") else lines[0] + "\n"
    if header.rstrip("\r\n").split("\t")[:2] != ["query-id", "corpus-id"]:
        fail(f"{path}:1: expected the header 'query-id<TAB>corpus-id<TAB>score'")
    rows = []
    for n, line in enumerate(lines[1:], 2):
        if not line.strip():
            continue
        cols = line.rstrip("\r\n").split("\t")
        if len(cols) < 3:
            fail(f"{path}:{n}: expected 3 tab-separated columns")
        rows.append((cols[0], cols[1], line if line.endswith("\n") else line + "\n"))
    return header, rows


def corpus_titles(path):
    titles = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                titles[rec["_id"]] = rec.get("title") or ""
            except (ValueError, KeyError, TypeError) as e:
                fail(f"{path}:{n}: not a passage record ({e})")
    return titles


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def load_task(task_dir, task, titles):
    """The task's train queries with their gold pages, and its qrels."""
    queries = read_queries(task_dir / "queries.train.jsonl")
    header, qrels = read_qrels(task_dir / "qrels.train.tsv")
    ids = {qid for qid, _, _ in queries}
    gold = {qid: set(rec.get("pages") or []) for qid, _, rec in queries}
    for qid, pid, _ in qrels:
        if qid not in ids:
            fail(f"{task_dir / 'qrels.train.tsv'}: query {qid!r} is not in queries.train.jsonl")
        if titles.get(pid):
            gold[qid].add(titles[pid])
    return queries, header, qrels, gold


def choose_held_out(tasks, gold_of, salt, frac):
    """Pages ranked by hash; per task, taken from the top of the ranking until `frac` of its
    train queries touch one. Returns the held-out pages and the order they were taken in."""
    held, order = set(), []
    for task in tasks:
        gold = gold_of[task]
        need = frac * len(gold)
        pages = sorted({p for ps in gold.values() for p in ps}, key=lambda p: (rank(salt, "page", p), p))
        touched = sum(1 for ps in gold.values() if ps & held)
        for p in pages:
            if touched >= need:
                break
            if p in held:
                continue
            held.add(p)
            order.append({"page": p, "for_task": task})
            touched = sum(1 for ps in gold.values() if ps & held)
    return held, order


def val_size(n, frac, minimum, cap):
    return min(n, max(round(frac * n), min(minimum, int(cap * n))))


def carve(data, salt, unseen_frac, val_frac, val_min, val_cap):
    """{task: {split: (query lines, qrels lines)}} plus the statistics; nothing written."""
    task_root = data / "tasks"
    tasks = sorted(e.name for e in task_root.iterdir() if e.is_dir())
    if not tasks:
        fail(f"{task_root}: no task folders")
    titles = corpus_titles(data / "corpus.jsonl")
    loaded = {t: load_task(task_root / t, t, titles) for t in tasks}
    gold_of = {t: loaded[t][3] for t in tasks}
    held, held_order = choose_held_out(tasks, gold_of, salt, unseen_frac)

    out, stats = {}, {}
    for t in tasks:
        queries, header, qrels, gold = loaded[t]
        unseen = {qid for qid, _, _ in queries if gold[qid] & held}
        rest = [qid for qid, _, _ in queries if qid not in unseen]
        k = val_size(len(rest), val_frac, val_min, val_cap)
        val = set(sorted(rest, key=lambda q: (rank(salt, "val", t, q), q))[:k])
        train = {q for q in rest if q not in val}
        # The guarantees the splits exist for, checked on what is about to be written.
        assert not (train & val) and not (train & unseen) and not (val & unseen)
        assert train | val | unseen == {qid for qid, _, _ in queries}
        leaked = sorted(q for q in train if gold[q] & held)
        if leaked:
            fail(f"task {t}: train queries {leaked[:3]} touch a held-out page (a bug)")
        members = {"train": train, "val": val, "unseen": unseen}
        out[t] = {}
        stats[t] = {"pack_train_queries": len(queries)}
        for split, ids in members.items():
            q_lines = [line for qid, line, _ in queries if qid in ids]
            r_lines = [header] + [line for qid, _, line in qrels if qid in ids]
            out[t][split] = (q_lines, r_lines)
            pages = {p for q in ids for p in gold[q]}
            stats[t][split] = {"queries": len(ids), "qrels": len(r_lines) - 1, "pages": len(pages)}
        stats[t]["unseen"]["held_out_pages_touched"] = len({p for q in unseen for p in gold[q] & held})
    return tasks, out, stats, sorted(held), held_order


def write_tree(tmp, data, tasks, out, stats, held, held_order, params):
    (tmp / "tasks").mkdir(parents=True)
    corpus = (data / "corpus.jsonl").resolve()
    # Relative to the folder the link lives in; tmp is renamed within its parent, so it holds.
    os.symlink(os.path.relpath(corpus, tmp.resolve()), tmp / "corpus.jsonl")
    for t in tasks:
        d = tmp / "tasks" / t
        d.mkdir()
        for split, (q_lines, r_lines) in out[t].items():
            (d / f"queries.{split}.jsonl").write_text("".join(q_lines), encoding="utf-8")
            with open(d / f"qrels.{split}.tsv", "w", encoding="utf-8", newline="") as f:
                f.write("".join(r_lines))
        src = data / "tasks" / t
        for name in ("queries.dev.jsonl", "qrels.dev.tsv"):
            if (src / name).exists():
                shutil.copyfile(src / name, d / name)
    record = {
        "builder": BUILDER,
        "what": "mini-KILT train splits carved into train / val / unseen (issue 32, item 5); dev copied as is",
        "source": str(data),
        "corpus_sha256": sha256_file(data / "corpus.jsonl"),
        "parameters": params,
        "tasks": stats,
        "held_out_pages": held,
        "held_out_order": held_order,
    }
    (tmp / "STATS.json").write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    for root, dirs, files in os.walk(tmp):
        for name in files:
            p = Path(root) / name
            if not p.is_symlink():
                with open(p, "rb") as f:
                    os.fsync(f.fileno())


def made_by_us(path):
    try:
        return json.loads((path / "STATS.json").read_text(encoding="utf-8")).get("builder") == BUILDER
    except (OSError, ValueError):
        return False


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="data/minikilt", help="the mini-KILT pack (corpus.jsonl, tasks/)")
    ap.add_argument("--out", default="runs/minikilt-val", help="output directory (replaced only if this script made it)")
    ap.add_argument("--salt", default="minikilt-val-v1", help="the hashes' salt: another salt, another carving")
    ap.add_argument("--unseen-frac", type=float, default=0.10,
                    help="per task, at least this share of its train queries goes to the unseen-page probe")
    ap.add_argument("--val-frac", type=float, default=0.10)
    ap.add_argument("--val-min", type=int, default=300, help="validation raised towards this many queries a task")
    ap.add_argument("--val-cap", type=float, default=0.25, help="... but never above this share of the task")
    args = ap.parse_args(argv)

    data, out_dir = Path(args.data), Path(args.out)
    for need in ("corpus.jsonl", "tasks"):
        if not (data / need).exists():
            fail(f"--data {data}: not a mini-KILT directory (no {need})")
    for name, v in (("--unseen-frac", args.unseen_frac), ("--val-frac", args.val_frac), ("--val-cap", args.val_cap)):
        if not 0.0 <= v < 1.0:
            fail(f"{name} {v}: expected a fraction in [0, 1)")
    if args.val_min < 0:
        fail(f"--val-min {args.val_min}: expected a count >= 0")
    if out_dir.exists() and not made_by_us(out_dir):
        fail(f"--out {out_dir}: exists and was not made by this script (no STATS.json of {BUILDER}); "
             "pick another --out or remove it yourself")
    if out_dir.resolve() == data.resolve() or data.resolve() in out_dir.resolve().parents:
        fail(f"--out {out_dir}: inside --data {data}")

    params = {"salt": args.salt, "unseen_frac": args.unseen_frac, "val_frac": args.val_frac,
              "val_min": args.val_min, "val_cap": args.val_cap}
    tasks, out, stats, held, held_order = carve(data, args.salt, args.unseen_frac, args.val_frac,
                                                args.val_min, args.val_cap)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
    try:
        write_tree(tmp, data, tasks, out, stats, held, held_order, params)
        if out_dir.exists():
            os.rename(out_dir, old)
        os.rename(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    fd = os.open(out_dir.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

    print(f"{out_dir}: {len(held)} held-out pages")
    print("| task | pack train | train | val | unseen (pages) |")
    print("|---|---:|---:|---:|---:|")
    for t in tasks:
        s = stats[t]
        print(f"| {t} | {s['pack_train_queries']} | {s['train']['queries']} | {s['val']['queries']} | "
              f"{s['unseen']['queries']} ({s['unseen']['held_out_pages_touched']}) |")


if __name__ == "__main__":
    main()
