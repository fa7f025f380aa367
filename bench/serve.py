"""Serving speed: `host serve` against the stack a user would otherwise write (FastAPI +
uvicorn + sentence-transformers + faiss-cpu, bench/serve_anchor.py), side by side on one
machine: the same model (all-MiniLM-L6-v2), the same passage embeddings and exact
inner-product search over the whole mini-KILT corpus, the same threads. For `/search` and
`/v1/embeddings` (one query text a request), requests per second and p50/p99 latency at 1, 8
and 32 concurrent keep-alive clients, DURATION seconds each. Then a soak of `host serve`:
SOAK requests at 32 clients, errors counted, resident memory sampled (after warm-up and at the
end).

  .venv/bin/pip install -r bench/requirements.txt
  .venv/bin/python bench/serve.py [--duration 30] [--soak 20000] [--threads 2]

The load generator is asyncio over raw sockets in this process (cheap next to either server);
it shares the machine's cores with the server under test, equally for both.
"""
import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

from machine import describe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))


def wait_listening(url, proc, timeout=300):
    import urllib.request

    t = time.time()
    while time.time() - t < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise SystemExit(f"{url} did not come up")


async def one_client(host, port, make_body, path, stop_at, latencies, errors, limit=None):
    reader, writer = await asyncio.open_connection(host, port)
    i = 0
    try:
        while time.perf_counter() < stop_at and (limit is None or limit[0] > 0):
            if limit is not None:
                limit[0] -= 1
            body = make_body(i).encode()
            i += 1
            head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            t0 = time.perf_counter()
            writer.write(head + body)
            await writer.drain()
            status_line = await reader.readline()
            length = None
            while True:
                line = await reader.readline()
                if line in (b"\r\n", b""):
                    break
                name, _, value = line.decode().partition(":")
                if name.lower() == "content-length":
                    length = int(value)
            if length is None:
                raise RuntimeError(f"no content-length in the reply to {path}")
            await reader.readexactly(length)
            latencies.append(time.perf_counter() - t0)
            if b" 200 " not in status_line:
                errors.append(status_line.decode().strip())
    finally:
        writer.close()


def load(url, path, make_body, clients, duration=None, total=None):
    host, port = url.removeprefix("http://").split(":")
    latencies, errors = [], []
    limit = [total] if total is not None else None
    stop_at = time.perf_counter() + (duration if duration else 1e9)

    async def run():
        await asyncio.gather(*[one_client(host, int(port), make_body, path, stop_at, latencies, errors, limit) for _ in range(clients)])

    t = time.perf_counter()
    asyncio.run(run())
    wall = time.perf_counter() - t
    latencies.sort()
    pct = lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else float("nan")
    return {"requests": len(latencies), "errors": len(errors), "first_errors": errors[:3], "rps": len(latencies) / wall, "p50_ms": pct(0.50) * 1e3, "p99_ms": pct(0.99) * 1e3}


def rss_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", default=os.path.join(ROOT, "data/minikilt/corpus.jsonl"))
    ap.add_argument("--queries", default=os.path.join(ROOT, "data/minikilt/tasks/squad/queries.dev.jsonl"))
    ap.add_argument("--model", default=os.path.join(ROOT, ".cache/models/all-MiniLM-L6-v2"))
    ap.add_argument("--host", default=os.path.join(ROOT, "target/release/host"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--duration", type=float, default=30)
    ap.add_argument("--clients", default="1,8,32")
    ap.add_argument("--soak", type=int, default=20000)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--work", default=None, help="keep the embeddings here (default: a temporary folder)")
    ap.add_argument("--out", default=None, help="write the results JSON here")
    args = ap.parse_args()

    queries = [json.loads(l)["text"] for l in open(args.queries)]
    work = args.work or tempfile.mkdtemp(prefix="bench-serve-")
    os.makedirs(work, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    emb, idx = os.path.join(work, "emb"), os.path.join(work, "flat")
    subprocess.run([args.host, "encode", "--encoder", "dpr", "--model", args.model, "--input", args.corpus, "--output", emb], check=True, env=env, stdout=subprocess.DEVNULL)
    if not os.path.exists(os.path.join(idx, "index.json")):
        subprocess.run([args.host, "index", "build", "--kind", "flat", "--embeddings", emb, "--output", idx], check=True, stdout=subprocess.DEVNULL)

    bodies = {
        "/search": lambda i: json.dumps({"query": queries[i % len(queries)], "k": args.k}),
        "/v1/embeddings": lambda i: json.dumps({"input": queries[i % len(queries)], "model": "all-MiniLM-L6-v2"}),
    }
    clients = [int(c) for c in args.clients.split(",")]
    port = {"ours": 18931, "anchor": 18932}
    systems = {
        "ours": [args.host, "serve", "--index", idx, "--encoder", "dpr", "--model", args.model, "--corpus", args.corpus, "--port", str(port["ours"])],
        "anchor": [sys.executable, "-m", "uvicorn", "serve_anchor:app", "--port", str(port["anchor"]), "--workers", "1", "--log-level", "warning"],
    }
    anchor_env = dict(env, ANCHOR_MODEL=args.model, ANCHOR_EMBEDDINGS=emb, ANCHOR_CORPUS=args.corpus, ANCHOR_THREADS=str(args.threads), PYTHONPATH=HERE)
    results = {"machine": describe(), "threads": args.threads, "duration_s": args.duration, "k": args.k, "passages": sum(1 for _ in open(args.corpus)), "runs": []}
    for name, cmd in systems.items():
        url = f"http://127.0.0.1:{port[name]}"
        log = open(os.path.join(work, f"{name}.log"), "w")
        proc = subprocess.Popen(cmd, env=anchor_env if name == "anchor" else env, stdout=log, stderr=log, cwd=HERE)
        try:
            wait_listening(url, proc)
            for path, body in bodies.items():
                load(url, path, body, 4, total=200)  # warm-up
                for c in clients:
                    r = load(url, path, body, c, duration=args.duration)
                    r.update(system=name, route=path, clients=c)
                    print(json.dumps(r), flush=True)
                    results["runs"].append(r)
            if name == "ours" and args.soak:
                samples = []
                stop = threading.Event()

                def sample():
                    while not stop.is_set():
                        samples.append((time.time(), rss_mb(proc.pid)))
                        time.sleep(0.5)

                th = threading.Thread(target=sample)
                th.start()
                t = time.time()
                r = load(url, "/search", bodies["/search"], 32, total=args.soak)
                stop.set()
                th.join()
                warm = [m for (ts, m) in samples if ts - t > 0.1 * (samples[-1][0] - t)]
                r.update(system=name, route="/search", clients=32, soak=True, rss_mb_after_warmup=warm[0] if warm else None, rss_mb_end=samples[-1][1], rss_mb_max=max(m for _, m in samples))
                print(json.dumps(r), flush=True)
                results["soak"] = r
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()
        if name == "ours":
            results["ours_exit_code_after_sigterm"] = proc.returncode

    print("\n| route | clients | ours req/s | anchor req/s | ours / anchor | ours p50 / p99 ms | anchor p50 / p99 ms |")
    print("|---|---:|---:|---:|---:|---|---|")
    for path in bodies:
        for c in clients:
            o = next(r for r in results["runs"] if r["system"] == "ours" and r["route"] == path and r["clients"] == c)
            a = next(r for r in results["runs"] if r["system"] == "anchor" and r["route"] == path and r["clients"] == c)
            print(f"| {path} | {c} | {o['rps']:.0f} | {a['rps']:.0f} | {o['rps'] / a['rps']:.2f} | {o['p50_ms']:.1f} / {o['p99_ms']:.1f} | {a['p50_ms']:.1f} / {a['p99_ms']:.1f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
