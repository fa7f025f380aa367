"""The serving stack a user would otherwise write (bench/serve.py's anchor): FastAPI on
uvicorn, sentence-transformers for the queries, faiss-cpu's exact inner-product index over
the same passage embeddings `host serve` searches. Plain `def` endpoints, so FastAPI runs
them on its thread pool, as its documentation advises for blocking work.

Configured by environment variables (uvicorn imports this module): ANCHOR_MODEL,
ANCHOR_EMBEDDINGS (a `host encode` output folder), ANCHOR_CORPUS, ANCHOR_THREADS."""
import json
import os

import faiss
import numpy as np
import torch
from fastapi import FastAPI
from pydantic import BaseModel
from sentence_transformers import SentenceTransformer

threads = int(os.environ.get("ANCHOR_THREADS", "2"))
torch.set_num_threads(threads)
faiss.omp_set_num_threads(threads)
model = SentenceTransformer(os.environ["ANCHOR_MODEL"], device="cpu")
emb_dir = os.environ["ANCHOR_EMBEDDINGS"]
vectors = np.load(os.path.join(emb_dir, "embeddings.npy")).astype(np.float32)
ids = open(os.path.join(emb_dir, "ids.txt")).read().split("\n")[: len(vectors)]
index = faiss.IndexFlatIP(vectors.shape[1])
index.add(vectors)
corpus = {}
with open(os.environ["ANCHOR_CORPUS"]) as f:
    for line in f:
        r = json.loads(line)
        corpus[r["_id"]] = (r.get("title", ""), r["text"])

app = FastAPI()


class SearchRequest(BaseModel):
    query: str
    k: int = 10


class EmbeddingsRequest(BaseModel):
    input: str | list[str]
    model: str = ""


@app.post("/search")
def search(req: SearchRequest):
    q = model.encode([req.query], convert_to_numpy=True)
    scores, rows = index.search(q.astype(np.float32), req.k)
    hits = []
    for s, r in zip(scores[0], rows[0]):
        title, text = corpus.get(ids[r], ("", ""))
        hits.append({"id": ids[r], "title": title, "text": text, "score": float(s)})
    return {"query": req.query, "passages": hits, "k": req.k}


@app.post("/v1/embeddings")
def embeddings(req: EmbeddingsRequest):
    texts = [req.input] if isinstance(req.input, str) else req.input
    vecs = model.encode(texts, convert_to_numpy=True)
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": v.tolist()} for i, v in enumerate(vecs)],
        "model": req.model,
    }


@app.get("/health")
def health():
    return {"status": "ok"}
