"""AAR's passage scoring: white-box FiD cross-attention preferences against the same computation
in `transformers`, and black-box scoring through llama-server with and without the cache.

Part `fid` (default). A T5 of Flan-T5-base's shape (12 + 12 layers, d_model 768, 12 heads,
gated-GELU d_ff 2048, vocabulary 32128) with random weights (no Flan-T5 weights are reachable
here; the cost does not depend on the values), saved once under --work, with the committed test
tokenizer (tests/fixtures/t5, 2,000 pieces: token counts differ from Flan-T5's, the same on both
sides). Q squad training queries of mini-KILT, a small corpus (their gold passages and 40 times
as many others), MiniLM's top N = 10 for each.
  - ours: `host aar-train --source T5_DIR` (the `fid` reader's `passage_preferences` through the
    plugin ABI, batch_size queries per call, as the recipe says); the time is the score stage's
    own (`summary.scoring`: from the first call to the last record written, the model loaded
    before), so it covers tokenising, the batched encoder and one decoder step, the scores'
    reduction and one JSON record per query.
  - transformers: T5ForConditionalGeneration on the same checkpoint, the same texts
    (passage[:500] + " " + question, as AAR's code builds them), the same batches (batch_size
    queries x N passages, padded to the batch's longest), tokenised by the same tokenizer.json;
    the pre-softmax cross-attention logits come from forward hooks on every decoder layer's
    EncDecAttention `q` and `k` projections (what the module computes anyway), reduced as
    REFERENCE §6 says (padding zeroed, summed over layers, heads and tokens, divided by real
    tokens x layers x heads). Its scores are checked against ours.
  Both on the same threads (--threads: torch.set_num_threads here, OMP/MKL for ours), float32;
  with --device cuda both on the GPU (bench/gpu_check.sh, with --retriever: a MiniLM-shaped
  retriever, since MiniLM's weights do not travel to the GPU machine).

Part `blackbox`: `host aar-train --source openai` against SmolLM2-135M behind llama-server
(scripts/llama-server.sh), Q queries x N passages, each scored by the log-likelihood of the
gold answer (tokens forced one by one: llama.cpp has no echo); then a second run over the same
connector cache (a new output folder): what a rerun costs when every reply is cached.

    .venv/bin/python bench/aar_scoring.py [--part fid|blackbox] [--queries 16] [--threads 2] [--device cpu|cuda]
        [--retriever DIR] [--out FILE]

Needs torch and transformers in the venv (bench/requirements.txt).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from machine import describe  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "data/minikilt"
MINILM = ROOT / ".cache/models/all-MiniLM-L6-v2"
TOKENIZER_DIR = ROOT / "tests/fixtures/t5/t5-v1_1"
N = 10
PASSAGE_CHARS = 500


def small_data(work, queries, others_per_query=40):
    """Q squad training queries spread over the file, their gold passages and others."""
    out = work / f"data-{queries}"
    if (out / "done").exists():
        return out
    (out / "tasks/squad").mkdir(parents=True, exist_ok=True)
    lines = open(DATA / "tasks/squad/queries.train.jsonl").read().splitlines()
    qrels = [l.split("\t") for l in open(DATA / "tasks/squad/qrels.train.tsv").read().splitlines()[1:]]
    gold = {}
    for q, p, _ in qrels:
        gold.setdefault(q, []).append(p)
    picked = [json.loads(lines[i * len(lines) // queries]) for i in range(queries)]
    wanted = {p for q in picked for p in gold.get(q["_id"], [])}
    corpus = open(DATA / "corpus.jsonl").read().splitlines()
    step = max(1, len(corpus) // (others_per_query * queries))
    keep = [l for i, l in enumerate(corpus) if i % step == 0 or json.loads(l)["_id"] in wanted]
    (out / "corpus.jsonl").write_text("\n".join(keep) + "\n")
    (out / "tasks/squad/queries.train.jsonl").write_text("".join(json.dumps(q) + "\n" for q in picked))
    rows = [f"{q['_id']}\t{p}\t1" for q in picked for p in gold.get(q["_id"], [])]
    (out / "tasks/squad/qrels.train.tsv").write_text("query-id\tcorpus-id\tscore\n" + "\n".join(rows) + "\n")
    (out / "done").write_text("")
    return out


def recipe(work, data, source, batch_size, extra_settings=""):
    path = work / f"aar-{source}.toml"
    src = {
        "fid": f'kind = "white-box"\nbatch_size = {batch_size}\n',
        "blackbox": f'kind = "black-box"\nconnector = "openai"\nworkers = 2\n'
                    f'settings = {{ base_url = "http://127.0.0.1:9", model = "", endpoint = "completions", concurrency = 2, timeout_s = 300{extra_settings} }}\n',
    }[source]
    path.write_text(
        f"[source]\n{src}\n[data]\ncorpus = \"{data / 'corpus.jsonl'}\"\ntask_dir = \"{data / 'tasks'}\"\ntask = \"squad\"\n\n"
        f"[aar]\nn = {N}\nk = 2\nnegatives_depth = 30\nnegatives_sampled = 7\nnegatives_per_query = 1\npassage_chars = {PASSAGE_CHARS}\n\n"
        "[train]\nper_device_train_batch_size = 4\nmax_steps = 1\nscore_scale = 20.0\nsave_steps = 1\n\n"
        "[model]\nencoder = \"dpr\"\nsettings = { max_length = 128 }\n")
    return path


def aar_train(host, rec, out, source, env, extra=(), retriever=MINILM):
    shutil.rmtree(out, ignore_errors=True)
    res = subprocess.run([host, "aar-train", "--source", source, "--encoder", "dpr", "--model", str(retriever),
                          "--config", str(rec), "--output-dir", str(out), *extra],
                         capture_output=True, text=True, env=env)
    if res.returncode != 0:
        sys.exit(f"aar-train failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout)


def flan_t5_base_shape(work):
    """A random T5 with Flan-T5-base's shape, saved once."""
    d = work / "t5-base-shape"
    if (d / "model.safetensors").exists():
        return d
    import torch
    from transformers import T5Config, T5ForConditionalGeneration
    torch.manual_seed(0)
    cfg = T5Config(vocab_size=32128, d_model=768, d_kv=64, d_ff=2048, num_layers=12, num_decoder_layers=12,
                   num_heads=12, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    T5ForConditionalGeneration(cfg).save_pretrained(d, safe_serialization=True)
    for f in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(TOKENIZER_DIR / f, d / f)
    return d


def transformers_scores(model_dir, items, batch_size, threads, device="cpu"):
    """The same preferences in transformers: the seconds and the scores per query."""
    import torch
    from transformers import PreTrainedTokenizerFast, T5ForConditionalGeneration
    torch.set_num_threads(threads)
    # The checkpoint's tokenizer.json itself, as ours reads it (AutoTokenizer would rebuild a
    # T5Tokenizer from tokenizer_config.json, which maps a few characters differently).
    tok = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"), pad_token="<pad>", eos_token="</s>")
    model = T5ForConditionalGeneration.from_pretrained(model_dir, attn_implementation="eager").eval().to(device)
    captured = {}

    def keep(name):
        def hook(_module, _args, output):
            captured.setdefault(name, []).append(output)
        return hook

    for blk in model.decoder.block:
        att = blk.layer[1].EncDecAttention
        att.q.register_forward_hook(keep("q"))
        att.k.register_forward_hook(keep("k"))
    layers, heads, dkv = len(model.decoder.block), model.config.num_heads, model.config.d_kv
    scores, magnitude = [], []
    t = time.perf_counter()
    with torch.no_grad():
        for start in range(0, len(items), batch_size):
            batch = items[start:start + batch_size]
            texts = [p[:PASSAGE_CHARS] + prompt for prompt, ps in batch for p in ps]
            enc = tok(texts, padding=True, truncation=True, max_length=512, return_tensors="pt")
            b, n = len(batch), len(batch[0][1])
            ids, mask = enc["input_ids"].to(device), enc["attention_mask"].to(device)
            length = ids.shape[1]
            hidden = model.encoder(input_ids=ids, attention_mask=mask).last_hidden_state.reshape(b, n * length, -1)
            cat_mask = mask.reshape(b, n * length)
            captured.clear()
            model.decoder(input_ids=torch.zeros(b, 1, dtype=torch.long, device=device), encoder_hidden_states=hidden,
                          encoder_attention_mask=cat_mask, use_cache=False)
            total = torch.zeros(b, n * length, device=device)
            for q, k in zip(captured["q"], captured["k"]):
                q = q.view(b, 1, heads, dkv).transpose(1, 2)            # [b, h, 1, dkv]
                k = k.view(b, n * length, heads, dkv).transpose(1, 2)   # [b, h, nL, dkv]
                logits = torch.matmul(q, k.transpose(2, 3))[:, :, 0, :]
                total += logits.sum(1)
                # The size of one logit (random weights make them large), for the float32 noise.
                magnitude.append(float((logits.abs() * cat_mask[:, None, :]).sum() / (cat_mask.sum() * heads)))
            total = (total * cat_mask).view(b, n, length).sum(2)
            real = mask.view(b, n, length).sum(2)
            scores.extend((total / (real * layers * heads)).tolist())
    if device != "cpu":
        torch.cuda.synchronize()
    return time.perf_counter() - t, scores, sum(magnitude) / len(magnitude)


def part_fid(a, env):
    work = Path(a.work)
    model = flan_t5_base_shape(work)
    data = small_data(work, a.queries)
    out = work / "ours-fid"
    s = aar_train(a.host, recipe(work, data, "fid", a.batch_size), out, str(model), env, ["--device", a.device], a.retriever)
    ours = s["scoring"]
    retrieved = {json.loads(l)["query_id"]: json.loads(l) for l in open(out / "stages/retrieve/retrieved.jsonl")}
    corpus = {}
    for line in open(data / "corpus.jsonl"):
        d = json.loads(line)
        corpus[d["_id"]] = d["text"]
    records = [json.loads(l) for l in open(out / "stages/score/scores.jsonl")]
    # In the order ours asked (the retrieve stage's order), the same batches.
    order = [json.loads(l)["query_id"] for l in open(out / "stages/retrieve/retrieved.jsonl")]
    items = [(" " + retrieved[q]["query"], [corpus[p] for p in retrieved[q]["hits"][:N]]) for q in order]
    secs, theirs, logit_size = transformers_scores(model, items, a.batch_size, a.threads, a.device)
    mine = {r["query_id"]: r["scores"] for r in records}
    diffs = sorted(abs(x - y) for q, row in zip(order, theirs) for x, y in zip(mine[q], row))
    diff = diffs[-1]
    top = lambda row: set(sorted(range(len(row)), key=lambda i: -row[i])[:2])  # noqa: E731
    same_top2 = sum(top(mine[q]) == top(row) for q, row in zip(order, theirs)) / len(order)
    passages = sum(len(ps) for _, ps in items)
    row = {"part": "fid", "device": a.device, "queries": len(items), "passages": passages, "batch_size": a.batch_size, "threads": a.threads,
           "ours_passages_per_s": ours["scored_per_second"], "ours_seconds": ours["seconds"],
           "transformers_passages_per_s": passages / secs, "transformers_seconds": secs,
           "ratio": ours["scored_per_second"] / (passages / secs), "max_abs_score_diff": diff,
           "median_abs_score_diff": diffs[len(diffs) // 2], "mean_abs_logit": logit_size, "same_top2_share": same_top2}
    print(json.dumps(row), flush=True)
    return [row]


def part_blackbox(a, env):
    work = Path(a.work)
    data = small_data(work, a.queries)
    cache = work / "blackbox-cache"
    shutil.rmtree(cache, ignore_errors=True)
    url = subprocess.run([str(ROOT / "scripts/llama-server.sh"), "start"], capture_output=True, text=True, check=True).stdout.strip()
    rows = []
    try:
        rec = recipe(work, data, "blackbox", a.batch_size, f', cache_dir = "{cache}"')
        for run in ["asked", "cached"]:
            s = aar_train(a.host, rec, work / f"ours-blackbox-{run}", "openai", env, ["--base-url", url])
            sc = s["scoring"]
            row = {"part": "blackbox", "run": run, "queries": s["queries"], "passages": sc["passages"], "scored": s["scored"],
                   "failed": s["failed"], "seconds": sc["seconds"], "passages_per_s": sc["scored_per_second"]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        subprocess.run([str(ROOT / "scripts/llama-server.sh"), "stop"], check=False)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=["fid", "blackbox"], default="fid")
    ap.add_argument("--queries", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--host", default=str(ROOT / "target/release/host"))
    ap.add_argument("--work", default="/tmp/rak-bench-aar")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--retriever", default=str(MINILM), help="the starting retriever (a sentence-transformers folder)")
    ap.add_argument("--out")
    a = ap.parse_args()
    Path(a.work).mkdir(parents=True, exist_ok=True)
    threads = str(a.threads)
    # This process's own pools too (transformers' tokenizer is Rust's rayon).
    for var in ["OMP_NUM_THREADS", "MKL_NUM_THREADS", "RAYON_NUM_THREADS"]:
        os.environ[var] = threads
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "RAYON_NUM_THREADS": threads}
    rows = part_fid(a, env) if a.part == "fid" else part_blackbox(a, env)
    result = {"bench": "aar_scoring", "machine": describe(), "rows": rows}
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
