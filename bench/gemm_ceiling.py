"""The arithmetic ceiling of this CPU for the work `host train` and `host encode` do: GFLOP/s of
libtorch's matrix products at MiniLM-L6's shapes, float32 and bf16, on --threads threads.

A DPR training step and an encoding batch are almost all matrix products of about 8,192 token
rows with MiniLM's weights (384 wide, 1,536 in the feed-forward block): forward `x @ Wᵀ`, and in
backward the input gradient `g @ W` and the weight gradient `gᵀ @ x`. Timing those products alone
says how fast any implementation built on the same libraries could go, and so whether a speed
goal is a matter of our code or of the cores (docs/BENCHMARKS.md, "How far the float32 goals
are from these cores' arithmetic").

    .venv/bin/python bench/gemm_ceiling.py [--threads 2] [--rows 8192] [--seconds 2]
        [--out bench/results/gemm-ceiling-DATE.json]

Each product runs for about --seconds after two warm-up calls; the rate is the best of three
such windows (a ceiling, not a typical figure). `linear` is `torch.nn.functional.linear` (what
`host train` runs: MKL's sgemm on the CPU, oneDNN for bf16); `mm` is the same product without
the bias. The step estimate weighs each shape by how often a MiniLM-L6 step runs it.
"""
import argparse
import json
import os
import time


def rate(fn, flop, seconds):
    fn(), fn()
    best = 0.0
    for _ in range(3):
        n, start = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            took = time.perf_counter() - start
            if took >= seconds:
                break
        best = max(best, flop * n / took / 1e9)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=8192, help="token rows (64 passages of 128 tokens)")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--out")
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))
    import torch

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    hidden, ffn, layers = 384, 1536, 6
    # (name, in, out, uses a layer): the QKV products (3 of 384 -> 384, run as one of 1,152 by
    # ours and as three by transformers), attention's output, the feed-forward block's two.
    shapes = [("qkv", hidden, 3 * hidden), ("attn_out", hidden, hidden), ("ffn_in", hidden, ffn), ("ffn_out", ffn, hidden)]
    rows = a.rows
    result = {"threads": a.threads, "rows": rows, "torch": torch.__version__, "shapes": {}}
    for kind in (torch.float32, torch.bfloat16):
        kname = str(kind).removeprefix("torch.")
        step_flop, step_seconds = 0.0, 0.0
        for name, i, o in shapes:
            x = torch.randn(rows, i, dtype=kind)
            w = torch.randn(o, i, dtype=kind)
            b = torch.randn(o, dtype=kind)
            g = torch.randn(rows, o, dtype=kind)
            flop = 2.0 * rows * i * o
            rates = {
                "forward_linear": rate(lambda: torch.nn.functional.linear(x, w, b), flop, a.seconds),
                "forward_mm": rate(lambda: x @ w.t(), flop, a.seconds),
                "input_grad": rate(lambda: g @ w, flop, a.seconds),
                "weight_grad": rate(lambda: g.t() @ x, flop, a.seconds),
            }
            result["shapes"][f"{name}.{kname}"] = {k: round(v, 1) for k, v in rates.items()}
            # One step: forward (linear) and the two backward products, per layer.
            for k in ("forward_linear", "input_grad", "weight_grad"):
                step_flop += flop * layers
                step_seconds += flop * layers / (rates[k] * 1e9)
            print(f"{kname:9} {name:9} " + "  ".join(f"{k} {v:6.1f}" for k, v in rates.items()) + "  GFLOP/s", flush=True)
        result[f"linear_layers_{kname}"] = {"gflop": round(step_flop / 1e9, 1), "seconds": round(step_seconds, 3), "gflop_per_s": round(step_flop / step_seconds / 1e9, 1)}
        print(f"{kname}: the linear layers of one step ({step_flop / 1e9:.0f} GFLOP) at these rates take {step_seconds:.2f} s, {step_flop / step_seconds / 1e9:.0f} GFLOP/s", flush=True)
    if a.out:
        tmp = a.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, a.out)


if __name__ == "__main__":
    main()
