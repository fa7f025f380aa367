"""The `openai` connector against the Python `openai` client (AsyncOpenAI), side by side.

Same machine, same run, same server, same requests: the closed-book multiple-choice prompts of
mini-KILT `mc/dev.jsonl` (AAR's API prompt), each a POST /v1/completions with max_tokens 1,
temperature 0 and logprobs 20, which is what `host augment --task mc` sends.

  - ours: `host augment --target openai --task mc` (cache off, --workers = concurrency =
    the connector's `concurrency`); the time is the summary's `timing.seconds`, from the first
    question asked to the last record written, so it also covers prompt building, reading the
    letters' log-probabilities, and appending each record to results.jsonl;
  - python: AsyncOpenAI (max_retries 0) with an asyncio semaphore of the same concurrency,
    the same prompts and body;
  - raw: a bare keep-alive http.client loop (concurrency 1 only), the floor a client can reach
    against this server; a client's own overhead per request is its latency minus this.

Servers: `canned` (default), a small asyncio server in its own process that answers every
POST at once with a fixed llama.cpp-shaped reply, so client costs dominate; `llama`, a real
llama-server (scripts/llama-server.sh), where the model dominates (use fewer --requests).
Against llama-server both clients send the same questions, and the server runs with its
prompt cache off (LLAMA_CACHE_RAM=0), so that the second client does not find the first one's
prompts cached (a slot keeps only its last prompt, long gone by then; the template's opening is
reused by both alike). It stops the smollm2 server `scripts/llama-server.sh` runs, if any, and
starts its own (so nothing else should be using that one meanwhile).

    .venv/bin/python bench/connector.py [--server canned|llama] [--requests 600] [--out FILE]

Needs `openai` in the venv (bench/requirements.txt).
"""
import argparse
import asyncio
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from machine import describe  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MC = ROOT / "data/minikilt/mc/dev.jsonl"
TEMPLATE = ("Here's a problem to solve: {question}\n\nAmong the {n} following options, which is the "
            "correct answer?\n{choices}\n\nAnswer:")

CANNED_SERVER = r'''
import asyncio, json, sys
REPLY = json.dumps({"id": "c", "object": "text_completion", "model": "m", "choices": [{"index": 0, "text": " A",
    "finish_reason": "length", "logprobs": {"content": [{"id": 330, "token": " A", "logprob": -0.4,
    "top_logprobs": [{"id": 330, "token": " A", "logprob": -0.4}, {"id": 331, "token": " B", "logprob": -1.3}]}]}}],
    "usage": {"prompt_tokens": 80, "completion_tokens": 1, "total_tokens": 81}}).encode()
HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(REPLY)

async def handle(reader, writer):
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            n = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    n = int(line.split(b":")[1])
            await reader.readexactly(n)
            writer.write(HEAD + REPLY)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()

async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", int(sys.argv[1]), backlog=256)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()

asyncio.run(main())
'''


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def prompt(item):
    choices = "\n".join(f"- {chr(65 + i)}: {c}" for i, c in enumerate(item["choices"]))
    return TEMPLATE.format(question=item["question"], n=len(item["choices"]), choices=choices)


def questions(n):
    """`n` mc questions: mc/dev.jsonl, repeated when `n` is larger."""
    items = [json.loads(l) for l in open(MC)]
    return (items * (n // len(items) + 1))[:n]


def ours(host, url, items, conc, tmp):
    cfg = Path(tmp) / "bench.toml"
    cfg.write_text(
        '[target]\nname = "openai"\n'
        f'settings = {{ base_url = "{url}", model = "m", endpoint = "completions", concurrency = {conc}, cache = false, timeout_s = 600 }}\n'
    )
    # The questions with fresh ids (the canned server's list repeats them).
    n = len(items)
    inp = Path(tmp) / "mc.jsonl"
    with open(inp, "w") as f:
        for i, item in enumerate(items):
            it = dict(item)
            it["_id"] = f"q{i}"
            f.write(json.dumps(it) + "\n")
    out = Path(tmp) / f"ours-{conc}.jsonl"
    res = subprocess.run([host, "augment", "--config", str(cfg), "--task", "mc", "--input", str(inp), "--output", str(out),
                          "--workers", str(conc), "--overwrite"], capture_output=True, text=True, check=True,
                         env={**os.environ, "OPENAI_API_KEY": ""})
    s = json.loads(res.stdout)
    assert s["answered"] == n and s["target_stats"]["requests"] == n, s
    return s["timing"]["seconds"]


async def python_client(url, ps, conc):
    from openai import AsyncOpenAI
    # Its own connection pool (openai 3.x ships its own HTTP stack); the semaphore bounds
    # requests in flight to `conc`, as the connector's gate does.
    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    sem = asyncio.Semaphore(conc)

    async def one(p):
        async with sem:
            r = await client.completions.create(model="m", prompt=p, max_tokens=1, temperature=0.0, logprobs=20)
            return r.choices[0].text

    t = time.perf_counter()
    await asyncio.gather(*(one(p) for p in ps))
    dt = time.perf_counter() - t
    await client.close()
    return dt


def raw_client(url, ps):
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port))
    t = time.perf_counter()
    for p in ps:
        body = json.dumps({"model": "m", "prompt": p, "max_tokens": 1, "temperature": 0.0, "logprobs": 20})
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        json.loads(conn.getresponse().read())
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", choices=["canned", "llama"], default="canned")
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--host", default=str(ROOT / "target/release/host"))
    ap.add_argument("--out")
    a = ap.parse_args()
    proc = None
    if a.server == "canned":
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-c", CANNED_SERVER, str(port)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        url = f"http://127.0.0.1:{port}"
    else:
        subprocess.run([str(ROOT / "scripts/llama-server.sh"), "stop"], check=False)  # a fresh one, cache off
        url = subprocess.run([str(ROOT / "scripts/llama-server.sh"), "start"], capture_output=True, text=True, check=True,
                             env={**os.environ, "LLAMA_CACHE_RAM": "0"}).stdout.strip()
    concs = [int(c) for c in a.concurrency.split(",")]
    items = questions(a.requests)
    ps = [prompt(i) for i in items]
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            # Warm both up (connections, page cache of the binary and plugins).
            ours(a.host, url, items[:20], 1, tmp)
            asyncio.run(python_client(url, ps[:20], 1))
            raw = raw_client(url, ps)
            for conc in concs:
                t_ours = ours(a.host, url, items, conc, tmp)
                t_py = asyncio.run(python_client(url, ps, conc))
                row = {"concurrency": conc, "requests": a.requests,
                       "ours_req_per_s": a.requests / t_ours, "python_req_per_s": a.requests / t_py,
                       "ours_ms_per_req": 1000 * t_ours / a.requests, "python_ms_per_req": 1000 * t_py / a.requests}
                if conc == 1:
                    row["raw_ms_per_req"] = 1000 * raw / a.requests
                    row["ours_overhead_ms"] = row["ours_ms_per_req"] - row["raw_ms_per_req"]
                    row["python_overhead_ms"] = row["python_ms_per_req"] - row["raw_ms_per_req"]
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        if proc:
            proc.kill()
        else:
            subprocess.run([str(ROOT / "scripts/llama-server.sh"), "stop"], check=False)
    result = {"bench": "connector", "server": a.server, "machine": describe(), "rows": rows}
    print("\n| concurrency | ours req/s | AsyncOpenAI req/s | ratio | ours ms/req | AsyncOpenAI ms/req |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['concurrency']} | {r['ours_req_per_s']:.0f} | {r['python_req_per_s']:.0f} | "
              f"{r['ours_req_per_s'] / r['python_req_per_s']:.2f}x | {r['ours_ms_per_req']:.3f} | {r['python_ms_per_req']:.3f} |")
    if rows and "raw_ms_per_req" in rows[0]:
        r = rows[0]
        print(f"\nconcurrency 1: bare http.client {r['raw_ms_per_req']:.3f} ms/req; own overhead: ours "
              f"{r['ours_overhead_ms']:.3f} ms, AsyncOpenAI {r['python_overhead_ms']:.3f} ms")
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
