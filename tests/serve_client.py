"""The real OpenAI Python client against `host serve` (tests/serve.rs): embeddings, chat
with and without streaming, retrieval turned off for one request. Prints one JSON line."""
import json
import sys

from openai import OpenAI

url = sys.argv[1]
client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)

# The client's default encoding is base64 (float32), decoded by the client itself.
emb = client.embeddings.create(model="all-MiniLM-L6-v2-query", input=["Who wrote Hamlet?"])
question = [{"role": "user", "content": "Who founded the Roman Empire? Answer in a few words."}]
chat = client.chat.completions.create(model="any", messages=question, max_tokens=12, temperature=0)
closed = client.chat.completions.create(model="any", messages=question, max_tokens=4, temperature=0, extra_body={"retrieval": {"k": 0}})
pieces = []
chunks = 0
stream = client.chat.completions.create(model="any", messages=question, max_tokens=12, temperature=0, stream=True)
for chunk in stream:
    chunks += 1
    if chunk.choices and chunk.choices[0].delta.content:
        pieces.append(chunk.choices[0].delta.content)

print(json.dumps({
    "query_embedding": emb.data[0].embedding,
    "chat": chat.choices[0].message.content,
    "chat_passages": (chat.model_extra or {}).get("retrieval", {}).get("passages"),
    "closed_book_passages": (closed.model_extra or {}).get("retrieval", {}).get("passages"),
    "streamed": "".join(pieces),
    "streamed_chunks": chunks,
}))
