#!/usr/bin/env python3
"""Peer baseline for docs/RESULTS.md: the mini-KILT train splits trained for a fixed wall-clock
time with sentence-transformers' own trainer, the way a user of that library would do it.

    .venv/bin/python scripts/experiments/peer_st.py --seconds 600 \
        --negatives runs/minikilt/taco-s42/negatives-episode-0.json \
        --out runs/minikilt/peer-st-s42 [--seed 42] [--model .cache/models/all-MiniLM-L6-v2] \
        [--data data/minikilt] [--max-steps N] [--threads 2]

Needs sentence-transformers' `train` extra in the venv (accelerate, datasets): scripts/experiments/requirements.txt.

Recipe (plain multitask training, no task information anywhere):
  - model: a sentence-transformers checkpoint (all-MiniLM-L6-v2), model.max_seq_length = 128
    (our recipes' max_length), queries and passages through the same model.
  - data: the union of the four tasks' train splits (squad, wikidata, fever, vitaminc) as one
    dataset of (anchor, positive, negative) rows, shuffled by the trainer's batch sampler with
    --seed (a user concatenates the tasks and lets the trainer shuffle: no per-task sampling or
    balancing, so squad, the largest task, dominates the batches).
      anchor    the query text as is (no task prefix)
      positive  the first gold passage listed in qrels.train.tsv (score >= 1) that is in the corpus
      negative  the top-ranked BM25 negative for that query, from our trainer's saved negatives
                file (--negatives; gold already removed there). Queries absent from that file
                (our trainer dropped them: no gold passage in the corpus) are skipped.
    Passages are given as a (title, text) pair, which sentence-transformers tokenises as a BERT
    text pair ([CLS] title [SEP] text [SEP], truncation "longest_first"): the form that gave
    identical embeddings to our `dpr` encoder (docs/RESULTS.md, "MiniLM: host against
    sentence-transformers + exact search"; scripts/fixtures/st_exact_search.py).
  - SentenceTransformerTrainer, MultipleNegativesRankingLoss (defaults: cosine similarity,
    scale 20; in-batch negatives plus the hard negatives of the batch), batch 32,
    BatchSamplers.NO_DUPLICATES (the sampler the library recommends for this loss: many squad
    queries share a gold passage, and a duplicate in the batch would be a false negative),
    AdamW (the trainer's default, weight decay 0), lr 2e-5, linear warm-up over the first 10% of
    the steps then linear decay to 0, max_grad_norm 1.0 (trainer default), fp32 on CPU, 2 threads.
  - time budget: the run trains for --seconds of training loop and its learning rate follows
    the same linear warm-up and decay laid over the time budget instead of a step count: at
    each step, lr = 2e-5 · min(f / 0.1, (1 - f) / 0.9) with f the fraction of the budget
    elapsed (a callback sets it before the optimizer step; the trainer's own scheduler is
    "constant"). Training stops at the step end nearest --seconds, where the rate is within a
    step's share of 0, so the peer uses its whole budget whatever the machine's speed. (A step
    count estimated from timed steps, as this script did up to 2026-11-26, came out 12% short:
    the first steps are slower than the run's mean.) --max-steps N instead trains exactly N steps with the
    step-count schedule (to repeat a run).
  - throughput depends on what else runs on the machine: peer_run.json records steps/s and the
    load averages. On a loaded 2-core machine, 2 torch threads can be slower than 1 (--threads).
  - no checkpoints, no evaluation during training; the final model is saved with
    SentenceTransformer.save (the 6.2 format our `dpr` encoder reads: modules.json, 1_Pooling,
    2_Normalize, max_seq_length) into a temporary directory next to --out, with peer_run.json
    (steps, examples, seconds, hyper-parameters, versions), and renamed to --out.

Times reported separately: data loading (corpus, queries, qrels, negatives, dataset), model
loading, and the training loop (the budget).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import shutil
import signal
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch

TASKS = ["squad", "wikidata", "fever", "vitaminc"]
BATCH_SIZE = 32
LEARNING_RATE = 2e-5
WARMUP_RATIO = 0.1
MAX_SEQ_LENGTH = 128
LOGGING_STEPS = 10


def log(msg):
    print(f"[peer_st {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def first_gold(qrels_path, corpus):
    """query id -> the first passage listed for it with score >= 1 that is in the corpus."""
    gold, missing = {}, 0
    with open(qrels_path, encoding="utf-8") as f:
        for row in csv.DictReader(f, delimiter="\t"):
            if int(row["score"]) < 1 or row["query-id"] in gold:
                continue
            if row["corpus-id"] in corpus:
                gold[row["query-id"]] = row["corpus-id"]
            else:
                missing += 1
    return gold, missing


def load_rows(data_dir: Path, negatives_path: Path):
    corpus = {r["_id"]: (r.get("title") or "", r["text"]) for r in read_jsonl(data_dir / "corpus.jsonl")}
    neg_file = json.loads(negatives_path.read_text(encoding="utf-8"))
    negatives = neg_file["negatives"]
    rows, stats = [], {}
    for task in TASKS:
        tdir = data_dir / "tasks" / task
        queries = read_jsonl(tdir / "queries.train.jsonl")
        gold, gold_missing = first_gold(tdir / "qrels.train.tsv", corpus)
        task_negs = negatives.get(task, {})
        st = {"queries": len(queries), "used": 0, "no_gold_in_corpus": 0, "not_in_negatives_file": 0,
              "no_negative": 0, "gold_rows_not_in_corpus": gold_missing}
        for q in queries:
            qid = q["_id"]
            if qid not in gold:
                st["no_gold_in_corpus"] += 1
                continue
            if qid not in task_negs:
                st["not_in_negatives_file"] += 1
                continue
            negs = [p for p in task_negs[qid] if p in corpus and p != gold[qid]]
            if not negs:
                st["no_negative"] += 1
                continue
            pos, neg = corpus[gold[qid]], corpus[negs[0]]
            # (title, text) pairs: a text pair for the tokenizer, as our dpr encoder encodes passages.
            rows.append({"anchor": q["text"], "positive": [pos[0], pos[1]], "negative": [neg[0], neg[1]]})
            st["used"] += 1
        stats[task] = st
    meta = {k: v for k, v in neg_file.items() if k != "negatives"}
    return rows, stats, meta, len(corpus)


class TimeBudget:
    """Stops training at the step end nearest `seconds` of training loop; prints progress; times steps."""

    def __init__(self, seconds=None, print_every_s=30.0, time_schedule=False):
        from transformers import TrainerCallback

        outer = self

        class _CB(TrainerCallback):
            def on_train_begin(self, args, state, control, **kw):
                outer.t0 = time.monotonic()
                outer.last_print = outer.t0

            def on_step_begin(self, args, state, control, optimizer=None, **kw):
                if not outer.time_schedule:
                    return control
                lr = time_schedule_lr((time.monotonic() - outer.t0) / outer.seconds)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                outer.last_lr = lr
                return control

            def on_step_end(self, args, state, control, **kw):
                now = time.monotonic()
                outer.step_ends.append(now)
                elapsed = now - outer.t0
                # Stop at the step end nearest the budget: when half a (mean) step more would
                # reach it, so the loop ends within half a step of --seconds either way.
                mean_step = elapsed / max(state.global_step, 1)
                if outer.seconds is not None and elapsed + 0.5 * mean_step >= outer.seconds:
                    control.should_training_stop = True
                    outer.stopped_by_time = state.global_step < state.max_steps
                if now - outer.last_print >= outer.print_every_s:
                    outer.last_print = now
                    sps = state.global_step / elapsed if elapsed > 0 else 0.0
                    of = "" if outer.time_schedule else f"/{state.max_steps}"
                    log(f"step {state.global_step}{of}  {elapsed:.0f}s  {sps:.3f} steps/s  "
                        f"loss {outer.last_loss}  lr {outer.last_lr}")
                return control

            def on_log(self, args, state, control, logs=None, **kw):
                if logs and outer.time_schedule and "learning_rate" in logs:
                    # The trainer logs its constant scheduler's rate; the rate in force is ours.
                    logs["learning_rate"] = outer.last_lr
                if logs:
                    if "loss" in logs:
                        outer.last_loss = round(float(logs["loss"]), 4)
                        outer.losses.append({"step": state.global_step, "loss": float(logs["loss"])})
                    if "learning_rate" in logs and not outer.time_schedule:
                        outer.last_lr = float(logs["learning_rate"])

        self.callback = _CB()
        self.seconds = seconds
        self.print_every_s = print_every_s
        self.time_schedule = time_schedule
        self.t0 = None
        self.step_ends = []
        self.stopped_by_time = False
        self.last_loss = None
        self.last_lr = None
        self.losses = []


class CountingCollator:
    """Wraps the trainer's collator to record the size of every batch it builds, in order. The
    dataloader runs one batch ahead (accelerate looks ahead for the end of the epoch), so the
    examples trained on are the first `global_step` batches, not all of them."""

    def __init__(self, inner):
        self.inner = inner
        self.sizes = []

    def __getattr__(self, name):  # the trainer reads the collator's settings (valid_label_columns, ...)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __call__(self, features):
        self.sizes.append(len(features))
        return self.inner(features)


def make_trainer(model, dataset, output_dir, seed, max_steps, callbacks, time_schedule):
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
    from sentence_transformers.sentence_transformer import losses
    from sentence_transformers.base.sampler import BatchSamplers

    args = SentenceTransformerTrainingArguments(
        output_dir=str(output_dir),
        max_steps=max_steps,
        per_device_train_batch_size=BATCH_SIZE,
        learning_rate=LEARNING_RATE,
        # The time schedule sets the rate itself before each step (TimeBudget).
        lr_scheduler_type="constant" if time_schedule else "linear",
        warmup_steps=0 if time_schedule else WARMUP_RATIO,  # transformers 5: a float in [0, 1) is a ratio of the total steps
        batch_sampler=BatchSamplers.NO_DUPLICATES,
        seed=seed,
        save_strategy="no",
        eval_strategy="no",
        logging_strategy="steps",
        logging_steps=LOGGING_STEPS,
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        dataloader_num_workers=0,
    )
    loss = losses.MultipleNegativesRankingLoss(model)
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=dataset, loss=loss,
                                         callbacks=callbacks)
    counter = CountingCollator(trainer.data_collator)
    trainer.data_collator = counter
    return trainer, counter, loss


def time_schedule_lr(fraction):
    """The step schedule's linear warm-up (first 10%) and decay to 0, over the budget's fraction."""
    f = min(max(fraction, 0.0), 1.0)
    return LEARNING_RATE * min(f / WARMUP_RATIO, (1.0 - f) / (1.0 - WARMUP_RATIO))


def _enum(v):
    return str(getattr(v, "value", v))


def versions():
    import accelerate
    import datasets
    import numpy
    import sentence_transformers
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "sentence_transformers": sentence_transformers.__version__,
            "accelerate": accelerate.__version__, "datasets": datasets.__version__, "numpy": numpy.__version__}


def _terminate(signum, frame):
    raise SystemExit(f"peer_st: signal {signum}")  # runs the cleanup of the temporary directory


def main():
    signal.signal(signal.SIGTERM, _terminate)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, required=True, help="wall-clock budget of the training loop")
    ap.add_argument("--negatives", required=True, help="our trainer's negatives-episode-*.json")
    ap.add_argument("--out", required=True, help="output model directory (must not exist)")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--model", default=".cache/models/all-MiniLM-L6-v2")
    ap.add_argument("--data", default="data/minikilt")
    ap.add_argument("--max-steps", type=int, default=None,
                    help="train this many steps with the step-count LR schedule (default: the schedule over --seconds)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    if out.exists():
        sys.exit(f"peer_st: {out} exists; remove it or pick another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    tmp.mkdir()
    try:
        run(args, out, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(args, out, tmp):
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer

    t = time.monotonic()
    rows, stats, neg_meta, corpus_size = load_rows(Path(args.data), Path(args.negatives))
    dataset = Dataset.from_list(rows)
    data_seconds = time.monotonic() - t
    log(f"data: {len(rows)} training rows from {corpus_size} passages in {data_seconds:.1f}s; "
        + ", ".join(f"{k} {v['used']}/{v['queries']}" for k, v in stats.items()))

    t = time.monotonic()
    model = SentenceTransformer(args.model, device="cpu")
    model.max_seq_length = MAX_SEQ_LENGTH
    model_seconds = time.monotonic() - t

    # The time schedule needs no step count: the cap is never reached, the budget stops the run.
    time_schedule = args.max_steps is None
    max_steps = 10**7 if time_schedule else args.max_steps
    log("LR schedule over the time budget" if time_schedule else f"max_steps {max_steps} (given)")

    load_before = os.getloadavg()
    budget = TimeBudget(seconds=args.seconds, time_schedule=time_schedule)
    trainer, counter, loss = make_trainer(model, dataset, tmp / "trainer", args.seed, max_steps, [budget.callback],
                                          time_schedule)
    log(f"training: {len(dataset)} rows, batch {BATCH_SIZE}, budget {args.seconds:.0f}s")
    t = time.monotonic()
    result = trainer.train()
    train_seconds = time.monotonic() - t
    load_after = os.getloadavg()
    loop_seconds = (budget.step_ends[-1] - budget.t0) if budget.step_ends else 0.0
    steps = trainer.state.global_step
    examples = sum(counter.sizes[:steps])
    if time_schedule:
        final_lr = budget.last_lr
    else:
        final_lr = trainer.lr_scheduler.get_last_lr()[0] if trainer.lr_scheduler is not None else None
    log(f"done: {steps} steps in {loop_seconds:.1f}s ({steps / max(loop_seconds, 1e-9):.3f} steps/s), "
        f"{examples} examples, stopped by {'time' if budget.stopped_by_time else 'max_steps'}, "
        f"final lr {final_lr}")

    t = time.monotonic()
    model_dir = tmp / "model"
    model.save(str(model_dir))
    save_seconds = time.monotonic() - t

    targs = trainer.args
    record = {
        "what": "peer baseline: sentence-transformers' own trainer on the mini-KILT train splits, fixed wall-clock",
        "command": sys.argv,
        "steps": steps,
        "lr_schedule": "linear warm-up and decay over the time budget" if time_schedule else f"linear over {max_steps} steps",
        "stopped_by": "time" if budget.stopped_by_time else "max_steps",
        "examples_seen": examples,
        "epochs": round(examples / len(dataset), 4),
        "final_learning_rate": final_lr,
        "train_loss_mean": result.training_loss,
        "loss_log": budget.losses,
        "seconds": {
            "budget": args.seconds,
            "training_loop": round(loop_seconds, 3),
            "trainer_train_call": round(train_seconds, 3),
            "data_loading": round(data_seconds, 3),
            "model_loading": round(model_seconds, 3),
            "save": round(save_seconds, 3),
        },
        "steps_per_second": round(steps / loop_seconds, 4) if loop_seconds else None,
        "data": {
            "data_dir": str(args.data), "tasks": TASKS, "rows": len(dataset), "per_task": stats,
            "negatives_file": str(args.negatives), "negatives_source": neg_meta,
            "positive": "first gold listed in qrels.train.tsv (score >= 1) that is in the corpus",
            "negative": "top-ranked passage of the negatives file (1 per query)",
            "passage_format": "(title, text) text pair, truncation longest_first",
            "query_format": "query text as is, no task prefix",
            "mixing": "union of the tasks, shuffled by the batch sampler (no per-task sampling)",
        },
        "hyper_parameters": {
            "model": str(args.model), "seed": args.seed, "max_seq_length": model.max_seq_length,
            "batch_size": BATCH_SIZE, "batch_sampler": _enum(targs.batch_sampler),
            "loss": type(loss).__name__, "loss_scale": loss.scale,
            "similarity": getattr(loss.similarity_fct, "__name__", str(loss.similarity_fct)),
            "hard_negatives_per_query": 1, "learning_rate": targs.learning_rate,
            "lr_scheduler_type": "linear over the time budget" if time_schedule else _enum(targs.lr_scheduler_type),
            "warmup_ratio": WARMUP_RATIO,
            "warmup": f"{WARMUP_RATIO:.0%} of the " + ("time budget" if time_schedule else "steps"),
            "optimizer": _enum(targs.optim), "weight_decay": targs.weight_decay,
            "adam_betas": [targs.adam_beta1, targs.adam_beta2], "adam_epsilon": targs.adam_epsilon,
            "max_grad_norm": targs.max_grad_norm, "gradient_accumulation_steps": targs.gradient_accumulation_steps,
            "precision": "fp32", "device": "cpu", "torch_threads": torch.get_num_threads(),
            "dataloader_drop_last": targs.dataloader_drop_last,
        },
        "versions": versions(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    # steps/s depends on what else runs on the machine: 1/5/15-minute load averages
                    "loadavg_before_training": [round(x, 2) for x in load_before],
                    "loadavg_after_training": [round(x, 2) for x in load_after]},
    }
    (model_dir / "peer_run.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    os.rename(model_dir, out)
    log(f"saved {out} ({save_seconds:.1f}s)")


if __name__ == "__main__":
    main()
