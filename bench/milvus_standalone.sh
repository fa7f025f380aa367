#!/usr/bin/env bash
# bench/milvus_vs_pymilvus.py against a Milvus standalone server, which (unlike milvus-lite)
# builds and searches HNSW at the parameters asked:
#
#   . scripts/env.sh && cargo build --release -p rak-retrieval --example bench_milvus --example bench_index
#   sudo bench/milvus_standalone.sh --ann hnsw [--m 32 --ef-construction 200 --ef-search 32 ...]
#
# The server is PyPI's `milvus` 2.3.5 (Milvus standalone with an embedded etcd and local
# storage, 58 MB), installed into .cache/bench/milvus-standalone/. It listens on every
# interface and cannot be told otherwise, so it runs in a network namespace of its own whose
# only interface is loopback: nothing outside this machine's namespace can reach it, and the
# benchmark runs in the same namespace. Needs root (ip netns). Arguments go to the benchmark;
# its JSON goes to stdout.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
STATE=.cache/bench/milvus-standalone
NS=rak-milvus-bench
mkdir -p "$STATE"
if [[ ! -x $STATE/venv/bin/milvus-server ]]; then
    python3 -m venv "$STATE/venv"
    "$STATE/venv/bin/pip" install --quiet --no-deps milvus==2.3.5 >&2
fi
ip netns add $NS 2>/dev/null || true
ip netns exec $NS ip link set lo up
rm -rf "$STATE/data"
ip netns exec $NS "$STATE/venv/bin/milvus-server" --data "$ROOT/$STATE/data" >"$STATE/server.log" 2>&1 &
server=$!
cleanup() {
    kill $server 2>/dev/null || true
    # milvus-server's child, the milvus binary, outlives a killed parent.
    ip netns pids $NS 2>/dev/null | xargs -r kill 2>/dev/null || true
    sleep 2
    ip netns pids $NS 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns delete $NS 2>/dev/null || true
}
trap cleanup EXIT
for _ in $(seq 120); do
    ip netns exec $NS bash -c 'exec 3<>/dev/tcp/127.0.0.1/19530' 2>/dev/null && break
    kill -0 $server 2>/dev/null || { cat "$STATE/server.log" >&2; echo "milvus_standalone: the server exited" >&2; exit 1; }
    sleep 1
done
ip netns exec $NS .venv/bin/python bench/milvus_vs_pymilvus.py --uri http://127.0.0.1:19530 \
    --server "milvus 2.3.5 standalone (PyPI), in a loopback-only network namespace" "$@"
