#!/usr/bin/env python3
"""Tests of select_table.py (standard library only):

    python3 scripts/experiments/test_select_table.py

On made-up per-query metrics whose differences are known: each system's row, the differences
against a base, and the method's parts signed as WITH − WITHOUT (the task prefix is taco −
taco-noprefix, tempered sampling taco-t4 − taco).
"""
import gzip
import json
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent / "select_table.py"
QUERIES = {"q1": "Page A", "q2": "Page A", "q3": "Page B", "q4": "Page C"}


def write_metrics(out, name, split, base, shift):
    """Query q of task `t` scores base + shift (or shift[q]) in MRR@10 and half that in page
    R-precision."""
    per_query = {}
    for q in QUERIES:
        x = base + (shift[q] if isinstance(shift, dict) else shift)
        per_query[q] = {"mrr@10": x, "rprec_page": x / 2}
    with gzip.open(out / f"{name}.{split}.metrics.json.gz", "wt", encoding="utf-8") as f:
        json.dump({"tasks": {"t": {"per_query": per_query}}}, f)


class SelectTable(unittest.TestCase):
    def table(self, systems):
        with tempfile.TemporaryDirectory() as d:
            d = Path(d)
            out, val = d / "out", d / "val"
            out.mkdir()
            (val / "tasks" / "t").mkdir(parents=True)
            (val / "tasks" / "t" / "queries.val.jsonl").write_text(
                "".join(json.dumps({"_id": q, "pages": [p]}) + "\n" for q, p in QUERIES.items()), encoding="utf-8")
            for name, shift in systems.items():
                write_metrics(out, name, "val", 0.5, shift)
                if name != "zeroshot":
                    (out / name).mkdir()
                    (out / name / "done").write_text("600\n")
            r = subprocess.run([sys.executable, str(SCRIPT), str(out), "--val", str(val), "--resamples", "200"],
                               capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stderr)
            return r.stdout

    def test_parts_are_signed_with_minus_without(self):
        text = self.table({"taco-s42": 0.2, "taco-s43": 0.1, "taco-noprefix-s42": 0.1, "taco-noprefix-s43": 0.1,
                           "taco-t4-s42": 0.0, "taco-t4-s43": 0.0})
        rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if "macro MRR@10 |" in line}
        # The prefix's part: taco − taco-noprefix = (0.15 − 0.10) on average, +10 and 0 points per seed.
        prefix = rows["task prefix (taco − taco-noprefix)"]
        self.assertIn("| +5.00 | +10.00 (s42), +0.00 (s43) | [+5.00, +5.00] | [+5.00, +5.00] |", prefix)
        # Tempered sampling: taco-t4 − taco, the other way round.
        self.assertIn("| -15.00 | -20.00 (s42), -10.00 (s43) |", rows["tempered sampling c = 4, not c = 1 (taco-t4 − taco)"])
        # The same pair in the table against the base taco is METHOD − taco.
        self.assertIn("| taco-noprefix | macro MRR@10 | -5.00 |", text)
        # Systems table: two seeds, mean ± sd of the macro MRR@10.
        self.assertIn("| taco | 42, 43 | 600 | – | 0.6500 ± 0.0707 |", text)

    def test_systems_are_compared_on_the_seeds_both_have(self):
        text = self.table({"taco-s42": 0.2, "taco-s43": 0.1, "taco-t4-s42": 0.0})
        # taco-t4 − taco on seed 42 alone: -20 points, not -15 (taco's two seeds against one).
        self.assertIn("| tempered sampling c = 4, not c = 1 (taco-t4 − taco) | macro MRR@10 | -20.00 | -20.00 (s42) | "
                      "[-20.00, -20.00] |", text)
        self.assertIn("| taco-t4 | macro MRR@10 | -20.00 | -20.00 (s42) |", text)
        self.assertIn("no seed in common", self.table({"taco-s42": 0.1, "taco-noprefix-s43": 0.0}))

    def test_a_pair_s_intervals_are_mirrored_whichever_way_it_is_taken(self):
        # Differences that vary by query: the intervals have width, and pages differ from queries.
        text = self.table({"taco-s42": {"q1": 0.3, "q2": 0.25, "q3": 0.0, "q4": 0.1}, "taco-noprefix-s42": 0.1})
        def intervals(row_start):
            row = next(line for line in text.splitlines() if line.startswith(row_start))
            return [tuple(float(x) for x in cell.strip(" []").split(", ")) for cell in row.strip(" |").split(" | ")[-2:]]
        part = intervals("| task prefix (taco − taco-noprefix) | macro MRR@10 |")
        base = intervals("| taco-noprefix | macro MRR@10 |")
        self.assertEqual(base, [(-hi, -lo) for lo, hi in part])
        (ql, qh), (pl, ph) = part
        self.assertTrue(ql < 6.25 < qh and pl <= 6.25 <= ph, part)
        self.assertNotEqual((ql, qh), (pl, ph))

    def test_parts_missing_a_system_are_left_out(self):
        text = self.table({"taco-s42": 0.1, "taco-noprefix-s42": 0.0})
        self.assertIn("task prefix (taco − taco-noprefix)", text)
        self.assertNotIn("T-SAGE", text)


if __name__ == "__main__":
    unittest.main()
