#!/usr/bin/env python3
"""Checks bench/trace_table.py's accounting on a made-up CUDA trace (scripts/test.sh runs it):
kernels launched through the runtime and the driver API both count, a kernel belongs to the
step that launched it, device time is clipped to the step's window, and a blocking read counts
as one wait, not as its asynchronous copy too."""
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trace_table  # noqa: E402


def event(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "args": args}


def main():
    events = [
        # Two steps of 100 us, 200 us apart.
        event("user_annotation", "rak::step", 0, 100),
        event("user_annotation", "rak::step", 200, 100),
        event("user_annotation", "rak::forward", 0, 40),
        event("user_annotation", "rak::forward", 200, 40),
        # Step 1: an operator calling another (one leaf), a runtime launch and a driver launch.
        event("cpu_op", "aten::linear", 1, 20),
        event("cpu_op", "aten::addmm", 2, 10),
        event("cuda_runtime", "cudaLaunchKernel", 3, 2, correlation=1),
        event("cuda_driver", "cuLaunchKernel", 30, 2, correlation=2),
        # A blocking read: its copy, then the wait.
        event("cuda_runtime", "cudaMemcpyAsync", 50, 2, correlation=3),
        event("cuda_runtime", "cudaStreamSynchronize", 52, 20),
        # Step 2: one launch whose kernel runs past the step's end (250 us of its 300 outside).
        event("cpu_op", "aten::mul", 201, 5),
        event("cuda_runtime", "cudaLaunchKernel", 202, 2, correlation=4),
        # Device side (another pid/tid in real traces).
        event("kernel", "gemm", 10, 30, tid=7, correlation=1),
        event("kernel", "keyed_mask", 35, 10, tid=7, correlation=2),
        event("gpu_memcpy", "Memcpy DtoH", 55, 5, tid=7, correlation=3),
        event("kernel", "mul", 250, 300, tid=7, correlation=4),
        # A kernel nobody in the steps launched.
        event("kernel", "stray", 120, 10, tid=7, correlation=99),
    ]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "t.json")
        with open(path, "w") as f:
            json.dump({"traceEvents": events}, f)
        s = trace_table.summarise(path)
    checks = {
        "steps": (s["steps"], 2),
        "kernels a step (runtime and driver launches, not the stray one)": (s["kernels"], 1.5),
        "kernel ms a step": (round(s["kernel_ms"], 6), round((30 + 10 + 300) / 2 / 1e3, 6)),
        # Step 1: gemm 10-40 and keyed_mask 35-45 (35 us), the copy 55-60 (5); step 2: mul clipped to 250-300 (50).
        "device busy ms a step, clipped to the windows": (round(s["busy_ms"], 6), round((40 + 50) / 2 / 1e3, 6)),
        "waits a step (the synchronize, not the async copy)": (s["syncs"], 0.5),
        "launches a step": (s["launches"], 1.5),
        "leaf operators a step": (s["leaf_ops"], 1.0),
        "top-level operators a step": (s["top_ops"], 1.0),
        "forward ms a step": (s["phase_ms"]["rak::forward"], 0.04),
    }
    bad = [f"{k}: {got} != {want}" for k, (got, want) in checks.items() if got != want]
    if bad:
        sys.exit("trace_table accounting wrong:\n  " + "\n  ".join(bad))
    text = trace_table.table(s, s, 5)
    assert "device idle in the step" in text and "| `gemm` |" in text, text
    print("test_trace_table: ok")


if __name__ == "__main__":
    main()
