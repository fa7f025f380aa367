#!/usr/bin/env python3
"""Tests of ranking_record.py (standard library only):

    python3 scripts/experiments/test_ranking_record.py

A record written from an encode.json passes its check; another checkpoint, corpus or question
file fails it, naming what changed and the ranking to remove.
"""
import json
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent / "ranking_record.py"


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True)


def encode_json(path, model, corpus):
    path.write_text(json.dumps({"encoder": {"plugin": "dpr", "checkpoint": {"model": model}, "settings": {"model": "m"}},
                                "input_sha256": corpus, "lines": 3}), encoding="utf-8")


class RankingRecord(unittest.TestCase):
    def test_a_record_passes_until_what_made_it_changes(self):
        with tempfile.TemporaryDirectory() as d:
            d = Path(d)
            enc, questions, rec = d / "encode.json", d / "q.jsonl", d / "shortqa-aar.json"
            encode_json(enc, "aaaa", "cccc")
            questions.write_text('{"_id": "q1"}\n', encoding="utf-8")
            self.assertEqual(run("--write", rec, enc, questions).returncode, 0)
            self.assertEqual(json.loads(rec.read_text())["checkpoint"], {"model": "aaaa"})
            self.assertEqual(run("--check", rec, enc, questions).returncode, 0)
            for model, corpus, text, changed in [("bbbb", "cccc", None, "checkpoint"), ("aaaa", "dddd", None, "corpus_sha256"),
                                                 ("aaaa", "cccc", '{"_id": "q2"}\n', "questions_sha256")]:
                encode_json(enc, model, corpus)
                questions.write_text(text or '{"_id": "q1"}\n', encoding="utf-8")
                r = run("--check", rec, enc, questions)
                self.assertNotEqual(r.returncode, 0, changed)
                self.assertIn(changed, r.stderr)
                self.assertIn("shortqa-aar.trec", r.stderr)


if __name__ == "__main__":
    unittest.main()
