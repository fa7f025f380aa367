#!/usr/bin/env python3
"""Two Chrome traces of training steps side by side: `host train` under RAK_TORCH_PROFILE
(host-trace.json) and the PyTorch loop of bench/train_step.py under torch.profiler
(torch-trace.json). Both mark each measured step as a `rak::step` scope and its phases as
`rak::forward`, `rak::loss`, `rak::backward`, `rak::optimizer`; both traces come from the same
profiler (libtorch's Kineto), so the counts read alike.

  python3 bench/trace_table.py OURS.json THEIRS.json [--top 25] [--out FILE]

Per step, for each side: the steps' wall time inside the profiler; the host time in each phase
scope; operators (every `cpu_op` event, and the leaves, those calling no other operator: on a
GPU about one kernel each); on CUDA, kernels and their device time, how much of the step the
device was busy, runtime calls that wait for the device (synchronisations), launches and copies;
then the operators (or, on CUDA, kernels) that differ most in count or time between the sides.
Profiling inflates host time; compare the counts freely and the times with each other only.
"""
import argparse
import collections
import json
import os
import statistics
import sys

PHASES = ("rak::forward", "rak::loss", "rak::backward", "rak::optimizer")
# Runtime and driver calls that block the host until the device (or a stream, or an event) is
# done. (A blocking `.item()` is a `cudaMemcpyAsync` then a `cudaStreamSynchronize`: counted once,
# by the latter; `cudaStreamWaitEvent` orders streams on the device and blocks no host.)
SYNCS = {
    "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaMemcpy2D",
    "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize", "cuMemcpy", "cuMemcpyDtoH", "cuMemcpyDtoH_v2",
}
# Where kernels are launched from: libtorch's through the runtime API, ours (the keyed dropout
# kernel) and recent cuBLAS's through the driver API.
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
# What keeps the device busy.
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def load(path):
    with open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def nesting(ops):
    """(leaf flags, top-level flags) of `cpu_op` events, nested by time on each thread."""
    by_thread = collections.defaultdict(list)
    for i, e in enumerate(ops):
        by_thread[(e.get("pid"), e.get("tid"))].append(i)
    leaf = [True] * len(ops)
    top = [False] * len(ops)
    for idx in by_thread.values():
        # Parents first: by start, longer first on a tie.
        idx.sort(key=lambda i: (ops[i]["ts"], -ops[i]["dur"]))
        stack = []
        for i in idx:
            start = ops[i]["ts"]
            while stack and ops[stack[-1]]["ts"] + ops[stack[-1]]["dur"] <= start:
                stack.pop()
            if stack:
                leaf[stack[-1]] = False
            else:
                top[i] = True
            stack.append(i)
    return leaf, top


def busy_us(intervals):
    """Length of the union of (start, end) intervals."""
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def summarise(path):
    events = load(path)
    steps = sorted((e for e in events if e.get("name") == "rak::step" and e.get("cat") == "user_annotation"), key=lambda e: e["ts"])
    if not steps:
        sys.exit(f"{path}: no rak::step scope (not a trace of bench/train_step.py's steps)")
    n = len(steps)
    windows = [(s["ts"], s["ts"] + s["dur"]) for s in steps]

    def in_steps(e):
        return any(a <= e["ts"] < b for a, b in windows)

    ops = [e for e in events if e.get("cat") == "cpu_op" and in_steps(e)]
    leaf, top = nesting(ops)
    runtime = [e for e in events if e.get("cat") in LAUNCH_CATEGORIES and in_steps(e)]
    # Kernels run after their launch: a kernel belongs to the step that launched it when Kineto
    # links the two (`correlation`), else to the step it started in.
    launched = {e["args"]["correlation"] for e in runtime if "correlation" in e.get("args", {})}
    device = [e for e in events if e.get("cat") in DEVICE_CATEGORIES]
    device = [k for k in device if k.get("args", {}).get("correlation") in launched] if launched else [k for k in device if in_steps(k)]
    kernels = [k for k in device if k.get("cat") == "kernel"]
    # How long the device worked inside each step's window, mean over the steps (work launched
    # in a step that runs on after its window, as ours can, since our steps end without a wait,
    # counts outside it).
    busy = statistics.mean(
        busy_us([(max(k["ts"], a), min(k["ts"] + k["dur"], b)) for k in device if k["ts"] < b and k["ts"] + k["dur"] > a]) for a, b in windows
    )
    phase_us = collections.Counter()
    for e in events:
        if e.get("cat") == "user_annotation" and e.get("name") in PHASES and in_steps(e):
            phase_us[e["name"]] += e["dur"]
    s = {
        "path": path,
        "steps": n,
        "step_ms": statistics.mean(s["dur"] for s in steps) / 1e3,
        "phase_ms": {p: phase_us[p] / n / 1e3 for p in PHASES},
        "ops": len(ops) / n,
        "leaf_ops": sum(leaf) / n,
        "top_ops": sum(top) / n,
        "op_count": collections.Counter(e["name"] for e, l in zip(ops, leaf) if l),
        "op_us": collections.Counter(),
        "kernels": len(kernels) / n,
        "kernel_ms": sum(k["dur"] for k in kernels) / n / 1e3,
        "busy_ms": busy / 1e3,
        "kernel_count": collections.Counter(k["name"] for k in kernels),
        "kernel_us": collections.Counter(),
        "syncs": sum(1 for e in runtime if e["name"] in SYNCS) / n,
        "launches": sum(1 for e in runtime if "LaunchKernel" in e["name"] or "LaunchCooperative" in e["name"]) / n,
        "copies": sum(1 for e in runtime if "Memcpy" in e["name"]) / n,
    }
    for e, l in zip(ops, leaf):
        if l:
            s["op_us"][e["name"]] += e["dur"]
    for k in kernels:
        s["kernel_us"][k["name"]] += k["dur"]
    return s


def table(ours, theirs, top):
    n_o, n_t = ours["steps"], theirs["steps"]
    cuda = ours["kernels"] > 0 or theirs["kernels"] > 0
    rows = [
        ("steps profiled", n_o, n_t, "d"),
        ("step, ms (mean, profiled)", ours["step_ms"], theirs["step_ms"], ".1f"),
        *[(f"host in {p}, ms", ours["phase_ms"][p], theirs["phase_ms"][p], ".1f") for p in PHASES],
        ("operators", ours["ops"], theirs["ops"], ".0f"),
        ("leaf operators", ours["leaf_ops"], theirs["leaf_ops"], ".0f"),
        ("top-level operators", ours["top_ops"], theirs["top_ops"], ".0f"),
    ]
    if cuda:
        rows += [
            ("kernels", ours["kernels"], theirs["kernels"], ".0f"),
            ("kernel time, ms", ours["kernel_ms"], theirs["kernel_ms"], ".2f"),
            ("device busy in the step (kernels, copies, fills), ms", ours["busy_ms"], theirs["busy_ms"], ".2f"),
            ("device idle in the step, ms", ours["step_ms"] - ours["busy_ms"], theirs["step_ms"] - theirs["busy_ms"], ".2f"),
            ("kernel launches", ours["launches"], theirs["launches"], ".0f"),
            ("memory copies", ours["copies"], theirs["copies"], ".0f"),
            ("waits for the device", ours["syncs"], theirs["syncs"], ".1f"),
        ]
    out = ["Per step (ours: host train; theirs: the PyTorch loop)", "", "| | ours | theirs |", "|---|---:|---:|"]
    out += [f"| {name} | {format(a, f)} | {format(b, f)} |" for name, a, b, f in rows]
    count, us = ("kernel_count", "kernel_us") if cuda else ("op_count", "op_us")
    what = "kernels" if cuda else "leaf operators"
    names = set(ours[count]) | set(theirs[count])

    def per_step(side, key, name):
        return side[key][name] / side["steps"]

    by_count = sorted(names, key=lambda k: -abs(per_step(ours, count, k) - per_step(theirs, count, k)))[:top]
    out += ["", f"The {what} whose count a step differs most", "", "| name | ours | theirs | ours ms | theirs ms |", "|---|---:|---:|---:|---:|"]
    for k in by_count:
        out.append(f"| `{k[:90]}` | {per_step(ours, count, k):.1f} | {per_step(theirs, count, k):.1f} | {per_step(ours, us, k) / 1e3:.2f} | {per_step(theirs, us, k) / 1e3:.2f} |")
    by_time = sorted(names, key=lambda k: -abs(per_step(ours, us, k) - per_step(theirs, us, k)))[:top]
    out += ["", f"The {what} whose time a step differs most", "", "| name | ours ms | theirs ms | ours | theirs |", "|---|---:|---:|---:|---:|"]
    for k in by_time:
        out.append(f"| `{k[:90]}` | {per_step(ours, us, k) / 1e3:.2f} | {per_step(theirs, us, k) / 1e3:.2f} | {per_step(ours, count, k):.1f} | {per_step(theirs, count, k):.1f} |")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("ours")
    ap.add_argument("theirs")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out")
    a = ap.parse_args()
    text = table(summarise(a.ours), summarise(a.theirs), a.top)
    if a.out:
        with open(a.out + ".tmp", "w") as f:
            f.write(text + "\n")
        os.replace(a.out + ".tmp", a.out)
    print(text)


if __name__ == "__main__":
    main()
