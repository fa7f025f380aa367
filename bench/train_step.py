"""Training-step cost: `host train` against a plain PyTorch loop and sentence-transformers' trainer,
and T-SAGE against AdamW, side by side in one run.

Same machine, same run, same model (all-MiniLM-L6-v2), same thread count (OMP, MKL and the
tokenizers' rayon pool all capped at --threads), CPU, float32.

Part `dpr`: one DPR step = 32 mini-KILT squad train queries, each with its gold passage and its top
BM25 negative (64 passages as (title, text) pairs), max length 128, mean pooling + L2
normalisation, dot-product scores [32, 64], cross-entropy with target column 2i (in-batch + hard
negatives NCE), AdamW (lr 2e-5, weight decay 0.01 off biases and LayerNorms, linear decay, no
warm-up), gradient clipping at 1.0. Three implementations:
  - ours: `host train --encoder dpr` with a generated recipe (sampler taco, one task);
  - torch: transformers AutoModel + mean pooling + normalize + torch.optim.AdamW + clip_grad_norm_;
  - st: SentenceTransformerTrainer + MultipleNegativesRankingLoss on (anchor, positive, negative)
    triples (its x20 scale on cosine scores costs nothing); the passages go in as
    "title [SEP] text", which tokenises to the same length as the pair.
torch and st see the same batches in the same order; ours draws its own batches from the same
pool (every squad train query, gold + top BM25 negative), so batch contents differ but the work
per step does not: queries are short and nearly every passage fills the 128 tokens.

Part `tsage`: ours on 4 tasks (squad, wikidata, fever, vitaminc) in every step (sampler taco,
32 queries over the 4 tasks), optimizer adamw, then tsage form "exact", then tsage form "lean".
Per-step time relative to adamw, and peak RSS of each run (/usr/bin/time -v, the whole process
including the final checkpoint save; also the high-water mark when the last step was logged,
polled from /proc/PID/status VmHWM). The extra memory over the adamw run is given in units of
T*P float32 (T tasks, P parameters counted from model.safetensors); the goal is <= 1.25 T*P.

Per-step time: every implementation runs STEPS + 2 steps and the first 2 are dropped; the result
is the median of the rest. Ours: from OUT/trainer_log.jsonl (logging_steps 1), whose
seconds_per_step is the mean since the loop started, so step s took s*m_s - (s-1)*m_(s-1).
torch: each step timed around tokenisation, forward, backward, clipping and the optimizer step.
st: the interval between consecutive on_step_end callbacks (the trainer fetches and tokenises a
batch before on_step_begin, so begin->end would leave tokenisation out; it is recorded too).
No implementation includes model loading or process start.

Hard negatives: for each task set (squad; the 4 tasks) one `host train` run of 1 step
(negative_depth 1) builds the BM25 index and writes negatives-episode-0.json beside its run.json;
both are kept under .cache/bench/train-step/TASKS/ and copied into every timed run's folder of
that task set. `host train` takes a folder holding its own run.json as a run of its own (it refuses
one holding files it did not write) and keeps episode 0's negatives when they were made from the
same corpus, examples and negative settings, so none of the timed runs spends time or memory on
BM25 (a run that mined anyway is flagged), and the Python loops read the same file.

  .venv/bin/python bench/train_step.py [--steps 20] [--threads 2] [--only dpr|tsage]
      [--out bench/results/train-step-DATE.json] [--device cpu|cuda] [--bf16] [--no-st]
      [--profile DIR]

--profile DIR (bench/gpu_profile.sh): ours runs with RAK_STEP_PHASES=1 (each phase's seconds a
step, the device synchronised at each phase's end; the mean over the measured steps goes in the
result as `phases`), then once more under libtorch's profiler (RAK_TORCH_PROFILE=DIR:
host-trace.json), and the PyTorch loop's measured steps run under torch.profiler: DIR gets
torch-profile.txt (operators by device time, then by CPU time), torch-trace.json (a Chrome
trace) and trace-table.md, the two traces side by side (bench/trace_table.py: operators,
kernels, device idle time and waits for the device, a step). Step times under any of these are
inflated by the measuring: compare them with a run without.

--device cuda runs ours, the PyTorch loop and sentence-transformers on the GPU (the torch loop
synchronises before each step's clock stops); --bf16 trains all three with float32 weights
under bf16 autocast (ours `--bf16`, the loop torch.autocast, st's `bf16=True`). --no-st leaves
sentence-transformers out (bench/gpu_check.sh: the GPU machine's copy is another version).
"""
import argparse
import contextlib
import json
import os
import random
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time

from machine import describe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DPR_TASKS = ["squad"]
TSAGE_TASKS = ["squad", "wikidata", "fever", "vitaminc"]
SKIP = 2  # first steps left out of every measurement
BATCH = 32
MAX_LENGTH = 128
LR = 2e-5
WEIGHT_DECAY = 0.01
MAX_GRAD_NORM = 1.0
SEED = 42


def thread_env(threads):
    """Cap every thread pool at `threads`: libtorch (OMP/MKL) and the tokenizers' rayon pool."""
    n = str(threads)
    return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "RAYON_NUM_THREADS": n, "RAYON_RS_NUM_CPUS": n}


def param_count(model_dir):
    """Parameters in model.safetensors: its floating-point tensors (not the integer position_ids
    buffer), from the header's shapes; no tensor is read."""
    with open(os.path.join(model_dir, "model.safetensors"), "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    total = 0
    for name, t in header.items():
        if name == "__metadata__" or not t["dtype"].startswith(("F", "BF")):
            continue
        size = 1
        for d in t["shape"]:
            size *= d
        total += size
    return total


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def summary(step_s):
    """Per-step seconds (the measured steps only) summarised."""
    return {
        "median_s": round(median(step_s), 4),
        "mean_s": round(statistics.fmean(step_s), 4) if step_s else None,
        "min_s": round(min(step_s), 4) if step_s else None,
        "max_s": round(max(step_s), 4) if step_s else None,
        "steps": [round(s, 4) for s in step_s],
    }


# --- ours: host train ---------------------------------------------------------------------------

def toml_value(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + " }"
    return repr(v)


def write_recipe(path, a, tasks, optim, optim_settings, max_steps):
    sections = {
        "model": {"encoder": "dpr", "path": a.model, "settings": {"max_length": MAX_LENGTH}},
        "data": {"corpus": a.corpus, "task_dir": a.task_dir, "tasks": tasks},
        "train": {
            "optim": optim,
            "optim_settings": optim_settings,
            "learning_rate": LR,
            "per_device_train_batch_size": BATCH,
            "max_steps": max_steps,
            # No warm-up: T-SAGE's burn-in is the warm-up, and every measured step must be a full one.
            "warmup_ratio": 0.0,
            "max_grad_norm": MAX_GRAD_NORM,
            "sampler": "taco",
            "temperature": 4.0,
            "hard_negatives": 1,
            # The top BM25 negative (minus gold) is the only one: what the Python loops use too.
            "negative_depth": 1,
            "logging_steps": 1,
            "save_steps": max_steps + 1000,
            "seed": SEED,
        },
    }
    with open(path, "w") as f:
        for name, keys in sections.items():
            f.write(f"[{name}]\n")
            for k, v in keys.items():
                f.write(f"{k} = {toml_value(v)}\n")
            f.write("\n")


SEED_FILES = ("negatives-episode-0.json", "run.json")


def seed_dir(a, work, tasks):
    """A folder holding the BM25 negatives (depth 1) of `tasks` and the run.json of the 1-step
    `host train` run that mined them: .cache/bench/train-step/TASKS/, made once."""
    cache = os.path.join(ROOT, ".cache", "bench", "train-step", "-".join(tasks))
    if all(os.path.exists(os.path.join(cache, f)) for f in SEED_FILES):
        return cache, {"source": cache, "reused": True}
    name = "seed-" + "-".join(tasks)
    r = run_host(a, work, name, tasks, "adamw", {"weight_decay": WEIGHT_DECAY}, 1, None)
    os.makedirs(cache, exist_ok=True)
    keep_seed(os.path.join(work, name), cache)
    return cache, {"source": f"host train, {'+'.join(tasks)}, 1 step, BM25 (index built in the run)", "wall_s": r["wall_s"]}


def keep_seed(run, cache):
    """Copy a run's negatives and run.json into the seed folder, each atomically."""
    for f in SEED_FILES:
        shutil.copyfile(os.path.join(run, f), os.path.join(cache, f + ".tmp"))
        os.replace(os.path.join(cache, f + ".tmp"), os.path.join(cache, f))


def negatives_file(seed):
    return os.path.join(seed, SEED_FILES[0])


def write_seed(seed, out):
    """Seed a run's output folder with `seed`'s negatives and run.json (see seed_dir)."""
    for f in SEED_FILES:
        shutil.copyfile(os.path.join(seed, f), os.path.join(out, f))


def vm_hwm_kb(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def log_lines(path):
    try:
        with open(path) as f:
            return [json.loads(l) for l in f if l.strip()]
    except (OSError, json.JSONDecodeError):
        return []


def run_host(a, work, name, tasks, optim, optim_settings, max_steps, seed, extra_env=None):
    """One `host train` run (its folder seeded from seed_dir's `seed`, if given, the
    environment given `extra_env`); returns its per-step seconds, optimizer statistics and peak
    RSS."""
    out = os.path.join(work, name)
    os.makedirs(out)
    recipe = os.path.join(work, f"{name}.toml")
    write_recipe(recipe, a, tasks, optim, optim_settings, max_steps)
    if seed:
        write_seed(seed, out)
    cmd = [a.host, "train", "--config", recipe, "--output-dir", out, "--device", a.device] + (["--bf16"] if a.bf16 else [])
    rss_file = os.path.join(work, f"{name}.time")
    timed = os.path.exists("/usr/bin/time")
    full = (["/usr/bin/time", "-v", "-o", rss_file] if timed else []) + cmd
    env = dict(os.environ, **thread_env(a.threads), **(extra_env or {}))
    log_path = os.path.join(out, "trainer_log.jsonl")
    stderr_path = os.path.join(work, f"{name}.stderr")
    load = os.getloadavg()
    t0 = time.perf_counter()
    with open(stderr_path, "w") as err:
        p = subprocess.Popen(full, env=env, stdout=subprocess.DEVNULL, stderr=err)
    # Watch the host process: its high-water mark when the last step is logged (before the final
    # checkpoint and model are written), and the peak overall when /usr/bin/time is missing.
    watch = {"loop_hwm_kb": None, "hwm_kb": None}

    def poll():
        import psutil

        child = None
        while p.poll() is None:
            if child is None:
                try:
                    kids = psutil.Process(p.pid).children() if timed else [psutil.Process(p.pid)]
                    child = kids[0].pid if kids else None
                except psutil.Error:
                    pass
            if child is not None:
                hwm = vm_hwm_kb(child)
                if hwm is not None:
                    watch["hwm_kb"] = hwm
                    if watch["loop_hwm_kb"] is None:
                        lines = log_lines(log_path)
                        if lines and lines[-1].get("step") == max_steps:
                            watch["loop_hwm_kb"] = hwm
            time.sleep(0.05)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    rc = p.wait()
    poller.join()
    wall = time.perf_counter() - t0
    if rc != 0:
        with open(stderr_path, errors="replace") as f:
            tail = f.read()[-3000:]
        sys.exit(f"{' '.join(full)} failed ({rc}):\n{tail}")
    peak_kb = watch["hwm_kb"]
    if timed:
        with open(rss_file) as f:
            for line in f:
                if "Maximum resident set size" in line:
                    peak_kb = int(line.rsplit(":", 1)[1])
    problems = []
    with open(stderr_path, errors="replace") as f:
        stderr_text = f.read()
    # A warning changes what is timed (keyed dropout's CUDA kernel falling back to tensor
    # operations, say): it goes in the row.
    problems += sorted({line.strip() for line in stderr_text.splitlines() if line.lstrip().startswith("warning:")})
    if seed and "BM25 negatives from" not in stderr_text:
        problems.append("host train mined its own BM25 negatives (the seeded ones were not reused)")
        # The seed no longer matches (another corpus, examples or host version): this run's
        # negatives and run.json seed the next runs instead.
        keep_seed(out, seed)
    lines = [l for l in log_lines(log_path) if "seconds_per_step" in l]
    cumulative = {l["step"]: l["step"] * l["seconds_per_step"] for l in lines}
    step_s = [cumulative[s] - cumulative.get(s - 1, 0.0) for s in range(SKIP + 1, max_steps + 1) if s in cumulative and s - 1 in cumulative]
    grad_norms = [(l.get("optimizer") or {}).get("grad_norm") for l in lines]
    measured = [l["phases_seconds_per_step"] for l in lines if l["step"] > SKIP and "phases_seconds_per_step" in l]
    phases = {k: round(statistics.mean(m.get(k, 0.0) for m in measured), 5) for k in sorted({k for m in measured for k in m})} if measured else None
    return {
        "phases": phases,
        "problems": problems + run_problems(lines, max_steps),
        "name": name,
        "cmd": " ".join(cmd),
        "tasks": tasks,
        "optim": optim,
        "optim_settings": optim_settings,
        **summary(step_s),
        "peak_rss_mib": round(peak_kb / 1024, 1) if peak_kb else None,
        "loop_peak_rss_mib": round(watch["loop_hwm_kb"] / 1024, 1) if watch["loop_hwm_kb"] else None,
        "grad_norms": grad_norms,
        "losses": [l.get("loss") for l in lines],
        "wall_s": round(wall, 1),
        "load_average_before": load,
        "rss_source": "/usr/bin/time -v" if timed else "VmHWM polling",
    }


def run_problems(lines, max_steps):
    """What makes a run's step times not those of full training steps."""
    problems = []
    if len(lines) < max_steps:
        problems.append(f"{len(lines)} of {max_steps} steps logged")
    skipped = lines[-1].get("skipped_steps", 0) if lines else 0
    if skipped:
        problems.append(f"{skipped} of {max_steps} steps skipped for a non-finite loss (a skipped step stops early, after its backward passes)")
    norms = [(l.get("optimizer") or {}).get("grad_norm", 0.0) for l in lines]
    # serde_json writes a NaN as null; a skipped step repeats the last step's statistics.
    nan = sum(1 for g in norms if g is None)
    if nan:
        problems.append(f"grad_norm NaN in {nan} of {len(norms)} logged steps")
    zero = sum(1 for g in norms if g == 0.0)
    if zero:
        problems.append(f"grad_norm 0 in {zero} of {len(norms)} logged steps: the update saw no gradient")
    return problems


# --- the Python implementations' data --------------------------------------------------------------

def load_triples(a, negatives, task, count):
    """(query, (title, text) gold, (title, text) top BM25 negative) for `count` queries of `task`,
    in a seeded order; the gold passage is the query's first in qrels order."""
    with open(negatives) as f:
        negs = json.load(f)["negatives"][task]
    tdir = os.path.join(a.task_dir, task)
    queries = {}
    with open(os.path.join(tdir, "queries.train.jsonl")) as f:
        for line in f:
            q = json.loads(line)
            queries[q["_id"]] = q["text"]
    gold = {}
    with open(os.path.join(tdir, "qrels.train.tsv")) as f:
        next(f)
        for line in f:
            qid, pid, grade = line.rstrip("\n").split("\t")
            if int(grade) >= 1:
                gold.setdefault(qid, []).append(pid)
    ids = [q for q in queries if q in negs and negs[q] and q in gold]
    random.Random(SEED).shuffle(ids)
    ids = ids[:count]
    if len(ids) < count:
        sys.exit(f"{task}: {len(ids)} usable queries, {count} needed")
    wanted = {p for q in ids for p in (gold[q][0], negs[q][0])}
    texts = {}
    with open(a.corpus) as f:
        for line in f:
            r = json.loads(line)
            if r["_id"] in wanted:
                texts[r["_id"]] = (r.get("title") or "", r["text"])
    ids = [q for q in ids if gold[q][0] in texts]
    return [(queries[q], texts[gold[q][0]], texts[negs[q][0]]) for q in ids]


def tokenize_passages(tok, passages):
    """As our encoder: titled passages as (title, text) pairs, untitled ones as their text."""
    if all(t for t, _ in passages):
        return tok([t for t, _ in passages], [x for _, x in passages], truncation=True, max_length=MAX_LENGTH, padding="longest", return_tensors="pt")
    items = [tok(t, x, truncation=True, max_length=MAX_LENGTH) if t else tok(x, truncation=True, max_length=MAX_LENGTH) for t, x in passages]
    return tok.pad(items, padding="longest", return_tensors="pt")


def decay_groups(model):
    """Hugging Face's convention (and ours): no weight decay on biases and LayerNorm weights."""
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if n.endswith("bias") or "LayerNorm" in n or "layer_norm" in n else decay).append(p)
    return [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}]


# --- torch: a plain PyTorch loop --------------------------------------------------------------------

def torch_loop(a, triples, max_steps):
    import torch
    import torch.nn.functional as F
    from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

    load = os.getloadavg()
    torch.manual_seed(SEED)
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModel.from_pretrained(a.model, dtype=torch.float32).to(a.device)
    model.train()
    cuda = a.device != "cpu"
    opt = torch.optim.AdamW(decay_groups(model), lr=LR)
    sched = get_linear_schedule_with_warmup(opt, 0, max_steps)

    def embed(batch):
        out = model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(out.dtype)
        return F.normalize((out * mask).sum(1) / mask.sum(1).clamp(min=1e-9), dim=-1)

    step_s = []
    profiler = None
    for s in range(max_steps):
        if s == SKIP and getattr(a, "profile", None):
            from torch.profiler import ProfilerActivity, profile
            profiler = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
            profiler.__enter__()
        # Under the profiler, the scopes host train's trace has (bench/trace_table.py).
        scope = torch.profiler.record_function if profiler is not None else (lambda name: contextlib.nullcontext())
        rows = triples[s * BATCH : (s + 1) * BATCH]
        t0 = time.perf_counter()
        with scope("rak::step"):
            with scope("rak::forward"):
                q = tok([r[0] for r in rows], truncation=True, max_length=MAX_LENGTH, padding="longest", return_tensors="pt")
                # Query i's group at rows 2i (gold) and 2i+1 (negative), as ours.
                p = tokenize_passages(tok, [x for r in rows for x in (r[1], r[2])])
                q, p = q.to(a.device), p.to(a.device)
                with torch.autocast(a.device.split(":")[0], dtype=torch.bfloat16, enabled=a.bf16):
                    q, p = embed(q), embed(p)
            with scope("rak::loss"):
                with torch.autocast(a.device.split(":")[0], dtype=torch.bfloat16, enabled=a.bf16):
                    scores = q @ p.T
                loss = F.cross_entropy(scores.float(), torch.arange(len(rows), device=a.device) * 2)
            with scope("rak::backward"):
                loss.backward()
            with scope("rak::optimizer"):
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
        step_s.append(time.perf_counter() - t0)
    if profiler is not None:
        profiler.__exit__(None, None, None)
        os.makedirs(a.profile, exist_ok=True)
        averages = profiler.key_averages()
        with open(os.path.join(a.profile, "torch-profile.txt"), "w") as f:
            if cuda:
                f.write(f"The PyTorch loop's {max_steps - SKIP} measured steps, by device time\n")
                f.write(averages.table(sort_by="self_cuda_time_total", row_limit=40) + "\n")
            f.write("By CPU time\n" + averages.table(sort_by="self_cpu_time_total", row_limit=40) + "\n")
        profiler.export_chrome_trace(os.path.join(a.profile, "torch-trace.json"))
    return {
        **summary(step_s[SKIP:]),
        "optimizer": f"torch.optim.AdamW(foreach={opt.defaults.get('foreach')}, fused={opt.defaults.get('fused')})",
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "torch_threads": torch.get_num_threads(),
        "load_average_before": load,
    }


# --- st: sentence-transformers' trainer ------------------------------------------------------------

def st_trainer(a, triples, max_steps, work):
    import torch
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer, SentenceTransformerTrainingArguments
    from sentence_transformers.base.sampler import DefaultBatchSampler
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
    from torch.utils.data import SequentialSampler
    from transformers import TrainerCallback

    load = os.getloadavg()
    torch.manual_seed(SEED)
    model = SentenceTransformer(a.model, device=a.device)
    model.max_seq_length = MAX_LENGTH
    sep = model.tokenizer.sep_token
    data = Dataset.from_dict({
        "anchor": [r[0] for r in triples],
        "positive": [f"{r[1][0]} {sep} {r[1][1]}" if r[1][0] else r[1][1] for r in triples],
        "negative": [f"{r[2][0]} {sep} {r[2][1]}" if r[2][0] else r[2][1] for r in triples],
    })

    def in_order(dataset, batch_size, drop_last, **_):
        # The same batches as the torch loop, in the same order.
        return DefaultBatchSampler(SequentialSampler(dataset), batch_size=batch_size, drop_last=drop_last)

    class Clock(TrainerCallback):
        def __init__(self):
            self.start = None
            self.begins, self.ends = [], []
            self.threads = None

        def on_train_begin(self, args, state, control, **kw):
            torch.set_num_threads(a.threads)
            self.start = time.perf_counter()

        def on_step_begin(self, args, state, control, **kw):
            self.begins.append(time.perf_counter())
            self.threads = torch.get_num_threads()

        def on_step_end(self, args, state, control, **kw):
            self.ends.append(time.perf_counter())

    args = SentenceTransformerTrainingArguments(
        output_dir=os.path.join(work, "st"),
        max_steps=max_steps,
        per_device_train_batch_size=BATCH,
        learning_rate=LR,
        weight_decay=WEIGHT_DECAY,
        warmup_steps=0,
        lr_scheduler_type="linear",
        max_grad_norm=MAX_GRAD_NORM,
        batch_sampler=in_order,
        save_strategy="no",
        logging_strategy="no",
        eval_strategy="no",
        report_to="none",
        use_cpu=a.device == "cpu",
        bf16=a.bf16,
        dataloader_num_workers=0,
        dataloader_drop_last=True,
        disable_tqdm=True,
        seed=SEED,
    )
    clock = Clock()
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=data, loss=MultipleNegativesRankingLoss(model), callbacks=[clock])
    trainer.train()
    ends = [clock.start] + clock.ends
    step_s = [ends[i + 1] - ends[i] for i in range(len(clock.ends))]
    inner_s = [e - b for b, e in zip(clock.begins, clock.ends)]
    opt = trainer.optimizer
    opt = getattr(opt, "optimizer", opt)
    return {
        **summary(step_s[SKIP:]),
        "begin_to_end_median_s": round(median(inner_s[SKIP:]), 4),
        "optimizer": f"{type(opt).__module__}.{type(opt).__name__}(foreach={opt.defaults.get('foreach')}, fused={opt.defaults.get('fused')}); args.optim={args.optim}",
        "torch_threads": clock.threads,
        "load_average_before": load,
    }


# --- the parts -----------------------------------------------------------------------------------

def part_dpr(a, work):
    max_steps = a.steps + SKIP
    seed, seed_info = seed_dir(a, work, DPR_TASKS)
    adamw = {"weight_decay": WEIGHT_DECAY}
    profile = getattr(a, "profile", None)
    traces = [os.path.join(profile, f) for f in ("host-trace.json", "torch-trace.json", "trace-table.md")] if profile else []
    for f in traces:
        # A folder profiled before must not lend this run an old trace.
        if os.path.exists(f):
            os.remove(f)
    ours = run_host(a, work, "dpr-ours", DPR_TASKS, "adamw", adamw, max_steps, seed, {"RAK_STEP_PHASES": "1"} if profile else None)
    print(json.dumps({"dpr": "ours", **ours}), flush=True)
    if profile:
        # The phases' waits for the device would show in the trace: a run of its own.
        traced = run_host(a, work, "dpr-ours-traced", DPR_TASKS, "adamw", adamw, max_steps, seed, {"RAK_TORCH_PROFILE": profile})
        print(json.dumps({"dpr": "ours-traced", **traced}), flush=True)
    triples = load_triples(a, negatives_file(seed), DPR_TASKS[0], max_steps * BATCH)
    torch_r = torch_loop(a, triples, max_steps)
    print(json.dumps({"dpr": "torch", **torch_r}), flush=True)
    r = {"negatives": seed_info, "ours": ours, "torch": torch_r, "ours_over_torch": round(ours["median_s"] / torch_r["median_s"], 3)}
    if profile:
        r["ours_traced"] = traced
        host_trace, torch_trace, table_file = traces
        if not os.path.exists(host_trace):
            r["trace_table"] = "host train wrote no trace (RAK_TORCH_PROFILE): see " + os.path.join(work, "dpr-ours-traced.stderr")
        else:
            script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trace_table.py")
            table = subprocess.run([sys.executable, script, host_trace, torch_trace, "--out", table_file], capture_output=True, text=True)
            r["trace_table"] = table.stdout if table.returncode == 0 else f"trace_table.py failed: {table.stderr[-2000:]}"
    if not a.no_st:
        st_r = st_trainer(a, triples, max_steps, work)
        print(json.dumps({"dpr": "st", **st_r}), flush=True)
        r.update(st=st_r, ours_over_st=round(ours["median_s"] / st_r["median_s"], 3))
    return r


def part_tsage(a, work, params):
    max_steps = a.steps + SKIP
    seed, seed_info = seed_dir(a, work, TSAGE_TASKS)
    runs = {}
    for name, optim, settings in [
        ("adamw", "adamw", {"weight_decay": WEIGHT_DECAY}),
        ("tsage-exact", "tsage", {"weight_decay": WEIGHT_DECAY, "beta": 0.999, "tau": 2.0, "form": "exact"}),
        ("tsage-lean", "tsage", {"weight_decay": WEIGHT_DECAY, "beta": 0.999, "tau": 2.0, "form": "lean"}),
    ]:
        r = run_host(a, work, f"tsage-{name}" if optim == "adamw" else name, TSAGE_TASKS, optim, settings, max_steps, seed)
        print(json.dumps({"tsage": name, **r}), flush=True)
        runs[name] = r
    tp_mib = len(TSAGE_TASKS) * params * 4 / 2**20
    base = runs["adamw"]
    for name in ("tsage-exact", "tsage-lean"):
        r = runs[name]
        r["time_over_adamw"] = round(r["median_s"] / base["median_s"], 3)
        for key in ("peak_rss_mib", "loop_peak_rss_mib"):
            if r[key] is not None and base[key] is not None:
                extra = r[key] - base[key]
                r[f"extra_{key}"] = round(extra, 1)
                r[f"extra_{key.replace('_mib', '')}_tp"] = round(extra / tp_mib, 3)
    return {"negatives": seed_info, "tasks": TSAGE_TASKS, "params": params, "tp_float32_mib": round(tp_mib, 1), "goal_extra_tp": 1.25, **runs}


def table(result):
    out = []
    if "dpr" in result:
        d = result["dpr"]
        out += [
            f"\nDPR step (batch {BATCH} + {BATCH} hard negatives, max length {MAX_LENGTH}, {result['threads']} threads, {result['device']}"
            f"{', bf16 autocast' if result['bf16'] else ', float32'}, median of {result['steps']} steps)\n",
            "| implementation | s/step | ours / this |",
            "|---|---:|---:|",
            f"| ours (host train) | {d['ours']['median_s']:.3f} | 1.000 |",
            f"| PyTorch loop | {d['torch']['median_s']:.3f} | {d['ours_over_torch']:.3f} |",
        ]
        if "st" in d:
            out.append(f"| sentence-transformers trainer | {d['st']['median_s']:.3f} | {d['ours_over_st']:.3f} |")
        if d["ours"].get("phases"):
            out.append("\nours by phase (s/step, the device synchronised at each phase's end): "
                       + ", ".join(f"{k} {v:.4f}" for k, v in d["ours"]["phases"].items()))
        if d.get("trace_table"):
            out.append("\nboth sides under libtorch's profiler (bench/trace_table.py):\n\n" + d["trace_table"])
    if "tsage" in result:
        t = result["tsage"]
        fmt = lambda v, f: "" if v is None else format(v, f)
        out += [
            f"\nT-SAGE vs AdamW (ours, {len(t['tasks'])} tasks per step, P = {t['params']:,}, T·P float32 = {t['tp_float32_mib']} MiB; goal: extra <= {t['goal_extra_tp']} T·P)\n",
            "| optimizer | s/step | / adamw | peak RSS MiB | extra MiB | extra / T·P | loop peak MiB | loop extra / T·P |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name in ("adamw", "tsage-exact", "tsage-lean"):
            r = t[name]
            out.append(
                f"| {name} | {r['median_s']:.3f} | {fmt(r.get('time_over_adamw', 1.0), '.3f')} | {fmt(r['peak_rss_mib'], '.0f')} | "
                f"{fmt(r.get('extra_peak_rss_mib'), '.0f')} | {fmt(r.get('extra_peak_rss_tp'), '.2f')} | {fmt(r['loop_peak_rss_mib'], '.0f')} | "
                f"{fmt(r.get('extra_loop_peak_rss_tp'), '.2f')} |"
            )
    warnings = [f"{part} {name}: {p}" for part in ("dpr", "tsage") if part in result for name, r in result[part].items() if isinstance(r, dict) for p in r.get("problems", [])]
    if warnings:
        out.append("\nWARNING, these runs did not take full training steps, or warned of what they timed:")
        out += [f"- {w}" for w in warnings]
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="measured steps (each run takes 2 more)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", choices=["dpr", "tsage"])
    ap.add_argument("--out", default=os.path.join(ROOT, "bench/results", f"train-step-{time.strftime('%Y-%m-%d')}.json"))
    ap.add_argument("--host", default=os.path.join(ROOT, "target/release/host"))
    ap.add_argument("--model", default=os.path.join(ROOT, ".cache/models/all-MiniLM-L6-v2"))
    ap.add_argument("--corpus", default=os.path.join(ROOT, "data/minikilt/corpus.jsonl"))
    ap.add_argument("--task-dir", default=os.path.join(ROOT, "data/minikilt/tasks"))
    ap.add_argument("--device", default="cpu", help="cpu or cuda (all implementations)")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast, float32 weights (all implementations)")
    ap.add_argument("--no-st", action="store_true", help="leave sentence-transformers' trainer out")
    ap.add_argument("--profile", help="a folder: profile both sides (see above)")
    a = ap.parse_args()
    for k in ("host", "model", "corpus", "task_dir"):
        setattr(a, k, os.path.abspath(getattr(a, k)))
    if a.profile:
        a.profile = os.path.abspath(a.profile)
    # Before torch is imported: the Python implementations run under the same caps as the host.
    os.environ.update(thread_env(a.threads))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

    import torch

    torch.set_num_threads(a.threads)
    work = tempfile.mkdtemp(prefix="bench-train-step-")
    try:
        result = {"steps": a.steps, "skipped_steps": SKIP, "threads": a.threads, "device": a.device, "bf16": a.bf16, "batch_size": BATCH, "max_length": MAX_LENGTH}
        if a.only in (None, "dpr"):
            result["dpr"] = part_dpr(a, work)
        if a.only in (None, "tsage"):
            result["tsage"] = part_tsage(a, work, param_count(a.model))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    import transformers

    try:
        import sentence_transformers
        st_version = sentence_transformers.__version__
    except ImportError:
        st_version = None
    result.update({
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "sentence_transformers": st_version,
        "host": a.host,
        "machine": describe(),
        "load_average_end": os.getloadavg(),
        "note": "per-step times exclude model loading and process start; ours includes a log line per step (logging_steps 1)",
    })
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(table(result))
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    sys.exit(main())
