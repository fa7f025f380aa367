#!/usr/bin/env bash
# bench/milvus_vs_pymilvus.py against a Milvus standalone server, which (unlike milvus-lite)
# builds and searches HNSW at the parameters asked:
#
#   . scripts/env.sh && cargo build --release -p rak-retrieval --example bench_milvus --example bench_index
#   bench/milvus_standalone.sh --ann hnsw [--m 32 --ef-construction 200 --ef-search 32 ...]
#
# The server is PyPI's `milvus` 2.3.5 (Milvus standalone with an embedded etcd and local
# storage, 58 MB; its SHA-256 pinned here), installed into .cache/bench/milvus-standalone/. It listens on every
# interface and cannot be told otherwise, so it runs in a network namespace of its own whose
# only interface is loopback: nothing outside this machine's namespace can reach it, and the
# benchmark runs in the same namespace. Needs root (ip netns). Arguments go to the benchmark;
# its JSON goes to stdout.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
STATE=.cache/bench/milvus-standalone
NS=rak-milvus-bench
WHEEL=milvus-2.3.5-py3-none-manylinux2014_x86_64.whl
SHA256=69515a0630ce29fd10e101fa442afea8ca1387b93a456cd9bd41fdf3deb93d04
mkdir -p "$STATE"
if [[ ! -x $STATE/venv/bin/milvus-server ]]; then
    rm -rf "$STATE/wheel" && mkdir -p "$STATE/wheel"
    .venv/bin/pip download --quiet --no-deps --dest "$STATE/wheel" milvus==2.3.5 >&2
    got=$(sha256sum "$STATE/wheel/$WHEEL" | cut -d' ' -f1)
    [[ $got == "$SHA256" ]] || { echo "milvus_standalone: $WHEEL has SHA-256 $got, expected $SHA256" >&2; exit 1; }
    python3 -m venv "$STATE/venv"
    "$STATE/venv/bin/pip" install --quiet --no-deps "$STATE/wheel/$WHEEL" >&2
fi
stop_namespace() {
    # milvus-server's child, the milvus binary, outlives a killed parent: end every process in
    # the namespace, then the namespace.
    ip netns pids $NS 2>/dev/null | xargs -r kill 2>/dev/null || true
    for _ in $(seq 20); do [[ -z $(ip netns pids $NS 2>/dev/null) ]] && break; sleep 0.5; done
    ip netns pids $NS 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns delete $NS 2>/dev/null || true
}
# A namespace left by a killed run may still hold its server: start from nothing.
stop_namespace
trap stop_namespace EXIT
ip netns add $NS
ip netns exec $NS ip link set lo up
rm -rf "$STATE/data"
ip netns exec $NS "$STATE/venv/bin/milvus-server" --data "$ROOT/$STATE/data" >"$STATE/server.log" 2>&1 &
server=$!
ready=0
for _ in $(seq 120); do
    if ip netns exec $NS bash -c 'exec 3<>/dev/tcp/127.0.0.1/19530' 2>/dev/null; then ready=1; break; fi
    kill -0 $server 2>/dev/null || break
    sleep 1
done
if [[ $ready == 0 ]]; then
    tail -n 20 "$STATE/server.log" >&2
    echo "milvus_standalone: the server did not answer on 127.0.0.1:19530 within 120 s" >&2
    exit 1
fi
ip netns exec $NS .venv/bin/python bench/milvus_vs_pymilvus.py --uri http://127.0.0.1:19530 \
    --server "milvus 2.3.5 standalone (PyPI), in a loopback-only network namespace" "$@"
