"""Data-parallel training step (issue 23): `host train --nproc 2` against PyTorch
DistributedDataParallel with Gloo, on the same loopback, threads, model and batch.

Both: all-MiniLM-L6-v2, mini-KILT squad training queries with their gold passage and top BM25
negative (bench/train_step.py's data), 2 processes x 16 queries (a global batch of 32 queries
and 64 passages), max length 128, each process's query and passage embeddings gathered from
both processes (detached; its own rows keep their graph) so that every query meets all 64
passages, NCE over the whole batch, AdamW (lr 2e-5, weight decay 0.01 off biases and
LayerNorms), clipping at 1.0, float32, `--threads` threads per process (default 1: two
processes on two cores).
  - ours: `host train --nproc 2 --per-device-train-batch-size 16`; per-step seconds from rank
    0's trainer_log.jsonl (logging_steps 1), communication from its
    `communication_seconds_per_step` (the gathers and the gradient sums, which run after the
    backward pass);
  - torch: torch.multiprocessing, `init_process_group("gloo")`, DDP around a module that
    encodes queries and passages in one forward (DDP takes one forward per backward), loss x
    world size (DDP averages gradients; the loss of the whole batch wants their sum);
    communication: the all-gathers plus each gradient bucket's all-reduce from launch to
    completion (a comm hook; DDP overlaps these with the backward pass, so their sum can
    exceed the time they add).
Also ours in one process with the whole batch of 32, for scale.

    .venv/bin/python bench/ddp_step.py [--steps 20] [--threads 1] [--out FILE]
"""
import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import train_step as ts  # noqa: E402
from machine import describe  # noqa: E402

WORLD = 2
PER_PROCESS = 16
SCALE = 20.0


def host_run(a, work, name, seed, nproc, batch):
    """`host train` (nproc processes, `batch` queries each): per-step and communication seconds."""
    out = os.path.join(work, name)
    os.makedirs(out)
    recipe = os.path.join(work, f"{name}.toml")
    ts.BATCH = batch
    ts.write_recipe(recipe, a, ["squad"], "adamw", {"weight_decay": ts.WEIGHT_DECAY}, a.steps + ts.SKIP)
    ts.write_seed(seed, out)
    cmd = [a.host, "train", "--config", recipe, "--output-dir", out, "--nproc", str(nproc)]
    env = dict(os.environ, **ts.thread_env(a.threads))
    res = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if res.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
    lines = [l for l in ts.log_lines(os.path.join(out, "trainer_log.jsonl")) if "seconds_per_step" in l]
    total = {l["step"]: l["step"] * l["seconds_per_step"] for l in lines}
    steps = range(ts.SKIP + 1, a.steps + ts.SKIP + 1)
    step_s = [total[s] - total[s - 1] for s in steps]
    comm = [l["communication_seconds_per_step"] for l in lines if l["step"] in steps and "communication_seconds_per_step" in l]
    problems = [] if "BM25 negatives from" in res.stderr else ["host train mined its own BM25 negatives (the seeded ones were not reused)"]
    return {**ts.summary(step_s), "problems": problems, "communication_median_s": round(ts.median(comm), 4) if comm else None, "losses": [l["loss"] for l in lines]}


def ddp_worker(rank, a, port, triples, result):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.manual_seed(ts.SEED)
    tok = AutoTokenizer.from_pretrained(a.model)
    # No pooler: mean pooling leaves it unused, and DDP wants every parameter in the loss.
    bert = AutoModel.from_pretrained(a.model, dtype=torch.float32, add_pooling_layer=False)
    bert.train()

    def embed(batch):
        out = bert(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(out.dtype)
        return F.normalize((out * mask).sum(1) / mask.sum(1).clamp(min=1e-9), dim=-1)

    class Both(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = bert

        def forward(self, q, p):
            return embed(q), embed(p)

    model = DDP(Both())
    comm = []

    def timed_allreduce(_state, bucket):
        t0 = time.perf_counter()
        fut = dist.all_reduce(bucket.buffer().div_(WORLD), async_op=True).get_future()

        def done(f):
            comm.append(time.perf_counter() - t0)
            return f.value()[0]
        return fut.then(done)

    model.register_comm_hook(None, timed_allreduce)
    opt = torch.optim.AdamW(ts.decay_groups(bert), lr=ts.LR)
    steps = a.steps + ts.SKIP
    sched = get_linear_schedule_with_warmup(opt, 0, steps)

    def gather(x):
        parts = [torch.empty_like(x) for _ in range(WORLD)]
        dist.all_gather(parts, x.detach().contiguous())
        parts[rank] = x
        return torch.cat(parts)

    step_s, comm_s, losses = [], [], []
    for s in range(steps):
        rows = triples[s * WORLD * PER_PROCESS:(s + 1) * WORLD * PER_PROCESS][rank * PER_PROCESS:(rank + 1) * PER_PROCESS]
        comm.clear()
        t0 = time.perf_counter()
        q = tok([r[0] for r in rows], truncation=True, max_length=ts.MAX_LENGTH, padding="longest", return_tensors="pt")
        p = ts.tokenize_passages(tok, [x for r in rows for x in (r[1], r[2])])
        qe, pe = model(q, p)
        g0 = time.perf_counter()
        qa, pa = gather(qe), gather(pe)
        gathered = time.perf_counter() - g0
        loss = F.cross_entropy(SCALE * qa @ pa.T, torch.arange(qa.shape[0]) * 2)
        (loss * WORLD).backward()
        torch.nn.utils.clip_grad_norm_(bert.parameters(), ts.MAX_GRAD_NORM)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        step_s.append(time.perf_counter() - t0)
        comm_s.append(gathered + sum(comm))
        losses.append(loss.item())
    if rank == 0:
        result.update({**ts.summary(step_s[ts.SKIP:]), "communication_median_s": round(ts.median(comm_s[ts.SKIP:]), 4),
                       "losses": losses, "torch_threads": torch.get_num_threads()})
    dist.destroy_process_group()


def ddp_run(a, triples):
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    manager = mp.Manager()
    result = manager.dict()
    mp.spawn(ddp_worker, args=(a, port, triples, result), nprocs=WORLD, join=True)
    return dict(result)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="measured steps (each run takes 2 more)")
    ap.add_argument("--threads", type=int, default=1, help="threads per process")
    ap.add_argument("--out", default=os.path.join(ts.ROOT, "bench/results", f"ddp-step-{time.strftime('%Y-%m-%d')}.json"))
    ap.add_argument("--host", default=os.path.join(ts.ROOT, "target/release/host"))
    ap.add_argument("--model", default=os.path.join(ts.ROOT, ".cache/models/all-MiniLM-L6-v2"))
    ap.add_argument("--corpus", default=os.path.join(ts.ROOT, "data/minikilt/corpus.jsonl"))
    ap.add_argument("--task-dir", default=os.path.join(ts.ROOT, "data/minikilt/tasks"))
    a = ap.parse_args()
    a.device, a.bf16, a.no_st = "cpu", False, True
    for k in ("host", "model", "corpus", "task_dir"):
        setattr(a, k, os.path.abspath(getattr(a, k)))
    os.environ.update(ts.thread_env(a.threads))
    work = tempfile.mkdtemp(prefix="bench-ddp-step-")
    try:
        ts.BATCH = 32
        seed, neg_info = ts.seed_dir(a, work, ["squad"])
        ours = host_run(a, work, "ours-2", seed, WORLD, PER_PROCESS)
        print(json.dumps({"ours": ours}), flush=True)
        one = host_run(a, work, "ours-1", seed, 1, WORLD * PER_PROCESS)
        print(json.dumps({"ours_one_process": one}), flush=True)
        triples = ts.load_triples(a, ts.negatives_file(seed), "squad", (a.steps + ts.SKIP) * WORLD * PER_PROCESS)
        torch_r = ddp_run(a, triples)
        print(json.dumps({"torch_ddp": torch_r}), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    import torch
    result = {"steps": a.steps, "skipped_steps": ts.SKIP, "threads_per_process": a.threads, "processes": WORLD,
              "per_process_batch": PER_PROCESS, "max_length": ts.MAX_LENGTH, "negatives": neg_info,
              "ours": ours, "ours_one_process": one, "torch_ddp": torch_r,
              "ours_over_torch": round(ours["median_s"] / torch_r["median_s"], 3),
              "torch": torch.__version__, "machine": describe(), "host": a.host}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\n2 processes x {PER_PROCESS} queries (+ gold + BM25 negative each), {a.threads} thread(s) each, median of {a.steps} steps\n")
    print("| implementation | s/step | communication s/step | ours / this |")
    print("|---|---:|---:|---:|")
    print(f"| ours (`host train --nproc 2`) | {ours['median_s']:.3f} | {ours['communication_median_s']:.3f} | 1.000 |")
    print(f"| PyTorch DDP (Gloo) | {torch_r['median_s']:.3f} | {torch_r['communication_median_s']:.3f} | {result['ours_over_torch']:.3f} |")
    print(f"| ours, 1 process x {WORLD * PER_PROCESS} | {one['median_s']:.3f} | | |")
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
