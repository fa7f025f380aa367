#!/usr/bin/env python3
"""Tests of carve_validation.py (standard library only):

    python3 scripts/experiments/test_carve_validation.py

On a small pack made here, and on data/minikilt when it is there: train, val and unseen
partition each task's train split; no val or unseen query, and no held-out page, reaches
train; a second run gives the same bytes; a folder the script did not make is refused.
"""
import csv
import json
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SCRIPT = HERE / "carve_validation.py"


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True)


def ids(path):
    return [json.loads(line)["_id"] for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def qrels(path):
    with open(path, encoding="utf-8", newline="") as f:
        return [(r["query-id"], r["corpus-id"]) for r in csv.DictReader(f, delimiter="\t")]


def gold_pages(task_dir, split, titles):
    pages = {}
    for line in (task_dir / f"queries.{split}.jsonl").read_text(encoding="utf-8").splitlines():
        rec = json.loads(line)
        pages[rec["_id"]] = set(rec.get("pages") or [])
    for q, p in qrels(task_dir / f"qrels.{split}.tsv"):
        if titles.get(p):
            pages[q].add(titles[p])
    return pages


def check_carving(test, pack, out):
    """The guarantees, read back from the files written."""
    titles = {}
    for line in (pack / "corpus.jsonl").read_text(encoding="utf-8").splitlines():
        rec = json.loads(line)
        titles[rec["_id"]] = rec.get("title") or ""
    stats = json.loads((out / "STATS.json").read_text(encoding="utf-8"))
    held = set(stats["held_out_pages"])
    test.assertTrue(held, "no page held out")
    test.assertEqual((out / "corpus.jsonl").resolve(), (pack / "corpus.jsonl").resolve())
    for task_dir in sorted((pack / "tasks").iterdir()):
        t = task_dir.name
        o = out / "tasks" / t
        split_ids = {s: ids(o / f"queries.{s}.jsonl") for s in ("train", "val", "unseen")}
        sets = {s: set(v) for s, v in split_ids.items()}
        pack_ids = ids(task_dir / "queries.train.jsonl")
        test.assertEqual(sorted(pack_ids), sorted(sum(split_ids.values(), [])), t)
        test.assertFalse(sets["train"] & sets["val"], t)
        test.assertFalse(sets["train"] & sets["unseen"], t)
        test.assertFalse(sets["val"] & sets["unseen"], t)
        for s in ("train", "val", "unseen"):
            test.assertEqual({q for q, _ in qrels(o / f"qrels.{s}.tsv")}, sets[s], f"{t} {s}")
            test.assertEqual(stats["tasks"][t][s]["queries"], len(sets[s]))
        pages = gold_pages(o, "train", titles)
        test.assertFalse({p for ps in pages.values() for p in ps} & held, f"{t}: a held-out page in train")
        unseen = gold_pages(o, "unseen", titles)
        test.assertTrue(all(ps & held for ps in unseen.values()), f"{t}: an unseen query on no held-out page")
        val = gold_pages(o, "val", titles)
        test.assertFalse({p for ps in val.values() for p in ps} & held, f"{t}: a held-out page in val")
        for name in ("queries.dev.jsonl", "qrels.dev.tsv"):
            test.assertEqual((o / name).read_bytes(), (task_dir / name).read_bytes())


def make_pack(root):
    """Two tasks sharing pages; one query's gold page known only from its qrels."""
    corpus = []
    for i in range(40):
        corpus += [{"_id": f"p{i}:0", "title": f"Page {i}", "text": "a"}, {"_id": f"p{i}:1", "title": f"Page {i}", "text": "b"}]
    (root / "tasks").mkdir(parents=True)
    (root / "corpus.jsonl").write_text("".join(json.dumps(c) + "\n" for c in corpus), encoding="utf-8")
    for t, n in (("alpha", 120), ("beta", 60)):
        d = root / "tasks" / t
        d.mkdir()
        qs, rows = [], ["query-id\tcorpus-id\tscore\n"]
        for i in range(n):
            page = (i * 7 + len(t)) % 40
            pages = [] if i % 5 == 0 else [f"Page {page}"]  # every fifth names its page only through qrels
            qs.append(json.dumps({"_id": f"{t}:{i}", "text": f"q {i}", "answers": [], "pages": pages}) + "\n")
            rows.append(f"{t}:{i}\tp{page}:{i % 2}\t1\n")
        (d / "queries.train.jsonl").write_text("".join(qs), encoding="utf-8")
        (d / "qrels.train.tsv").write_text("".join(rows), encoding="utf-8")
        (d / "queries.dev.jsonl").write_text(json.dumps({"_id": f"{t}:dev", "text": "d", "pages": []}) + "\n")
        (d / "qrels.dev.tsv").write_text(f"query-id\tcorpus-id\tscore\n{t}:dev\tp0:0\t1\n")


class CarveTest(unittest.TestCase):
    def test_small_pack(self):
        with tempfile.TemporaryDirectory() as tmp:
            pack, out = Path(tmp) / "pack", Path(tmp) / "runs" / "val"
            make_pack(pack)
            r = run("--data", pack, "--out", out, "--val-min", 20)
            self.assertEqual(r.returncode, 0, r.stderr)
            check_carving(self, pack, out)
            stats = json.loads((out / "STATS.json").read_text())
            for t, n in (("alpha", 120), ("beta", 60)):
                self.assertGreaterEqual(stats["tasks"][t]["unseen"]["queries"], 0.1 * n)
            # val: 10% raised towards 20, capped at a quarter: beta keeps at least 10% too.
            rest = 120 - stats["tasks"]["alpha"]["unseen"]["queries"]
            self.assertEqual(stats["tasks"]["alpha"]["val"]["queries"], max(round(0.1 * rest), min(20, rest // 4)))
            before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
            r = run("--data", pack, "--out", out, "--val-min", 20)  # replaces its own output
            self.assertEqual(r.returncode, 0, r.stderr)
            after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
            self.assertEqual(before, after)
            self.assertEqual(list(out.parent.iterdir()), [out], "a temporary left behind")

    def test_salt_changes_the_carving(self):
        with tempfile.TemporaryDirectory() as tmp:
            pack = Path(tmp) / "pack"
            make_pack(pack)
            a, b = Path(tmp) / "a", Path(tmp) / "b"
            self.assertEqual(run("--data", pack, "--out", a).returncode, 0)
            self.assertEqual(run("--data", pack, "--out", b, "--salt", "other").returncode, 0)
            self.assertNotEqual(ids(a / "tasks/alpha/queries.val.jsonl"), ids(b / "tasks/alpha/queries.val.jsonl"))

    def test_refuses_a_folder_it_did_not_make(self):
        with tempfile.TemporaryDirectory() as tmp:
            pack, out = Path(tmp) / "pack", Path(tmp) / "mine"
            make_pack(pack)
            out.mkdir()
            (out / "keep.txt").write_text("not the script's")
            r = run("--data", pack, "--out", out)
            self.assertNotEqual(r.returncode, 0)
            self.assertIn("--out", r.stderr)
            self.assertEqual((out / "keep.txt").read_text(), "not the script's")

    def test_bad_input_names_the_file(self):
        with tempfile.TemporaryDirectory() as tmp:
            pack = Path(tmp) / "pack"
            make_pack(pack)
            with open(pack / "tasks/beta/queries.train.jsonl", "a") as f:
                f.write("{not json\n")
            r = run("--data", pack, "--out", Path(tmp) / "out")
            self.assertNotEqual(r.returncode, 0)
            self.assertIn("beta/queries.train.jsonl:61", r.stderr)
            self.assertNotIn("Traceback", r.stderr)

    @unittest.skipUnless((ROOT / "data/minikilt/corpus.jsonl").exists(), "no data/minikilt")
    def test_minikilt(self):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "minikilt-val"
            r = run("--data", ROOT / "data/minikilt", "--out", out)
            self.assertEqual(r.returncode, 0, r.stderr)
            check_carving(self, ROOT / "data/minikilt", out)


if __name__ == "__main__":
    unittest.main()
