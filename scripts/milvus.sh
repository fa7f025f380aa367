#!/usr/bin/env bash
# A real Milvus server on this machine, for `host index build --kind milvus` and its tests:
# the server binary that PyPI's `milvus-lite` 2.5.1 wheel carries (Milvus's C++ engine,
# knowhere, behind Milvus's gRPC API), listening on 127.0.0.1 only.
#
#   scripts/milvus.sh start    start (once), wait until it answers, print its URI
#   scripts/milvus.sh uri      print the URI of the running server
#   scripts/milvus.sh stop     stop it
#
# milvus-lite accepts FLAT and IVF_FLAT (and AUTOINDEX) indexes and refuses HNSW by name; it
# searches small collections exactly whatever their index, and did not seem to use nprobe at
# 100,000 vectors (docs/BENCHMARKS.md, with pymilvus too): approximate search at chosen
# parameters needs a Milvus standalone or cluster server (`--ann hnsw` there).
# PyPI's `milvus` package (2.3.5) bundles a standalone server, but it binds every interface, so
# only bench/milvus_standalone.sh starts it, inside a loopback-only network namespace (root).
# The wheel is fetched with `pip download --no-deps`, checked against the SHA-256 pinned here,
# and unpacked once per machine under $RAK_CACHE (default ~/.cache/rak). The server's pid, URI,
# log and data (one database file: collections survive a restart, and the server takes its
# port again when it is free, so index directories that point at it stay valid) live in $MILVUS_STATE_DIR (default .cache/milvus in the checkout);
# tests use their own. MILVUS_START_TIMEOUT: seconds to wait for it to answer (60).
# MILVUS_PARENT_PID: stop the server (within about a second) once that process has exited, as
# `stop` would; tests give their own, so a test that is killed leaves no server behind. Unset,
# the server runs until `stop` (`--uri $(scripts/milvus.sh start)` starts it from a subshell
# that exits at once).
set -euo pipefail
shopt -s inherit_errexit
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VERSION=2.5.1
WHEEL=milvus_lite-$VERSION-py3-none-manylinux2014_x86_64.whl
SHA256=25ce13f4b8d46876dd2b7ac8563d7d8306da7ff3999bb0d14b116b30f71d706c
CACHE=${RAK_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rak}
HOME_DIR=$CACHE/milvus-lite-$VERSION
BIN=$HOME_DIR/milvus_lite/lib/milvus
STATE=${MILVUS_STATE_DIR:-$ROOT/.cache/milvus}
PY=python3
[[ -x $ROOT/.venv/bin/python ]] && PY=$ROOT/.venv/bin/python
export PIP_DISABLE_PIP_VERSION_CHECK=1

say() { echo "milvus.sh: $*" >&2; }

# The server binary, fetched and checked once per machine (under a lock of the cache's own:
# tests start several servers, each with its own state folder, at once).
fetch() {
    if [[ -x $BIN ]]; then return; fi
    mkdir -p "$CACHE"
    exec 8>"$CACHE/.milvus-lite.lock"
    flock -w 600 8 || { say "another fetch held $CACHE/.milvus-lite.lock for 10 minutes"; exit 1; }
    if [[ -x $BIN ]]; then exec 8>&-; return; fi
    local tmp got status=0
    tmp=$(mktemp -d "$CACHE/.milvus-lite.XXXXXX")
    say "fetching milvus-lite $VERSION from PyPI"
    {
        "$PY" -m pip download --quiet --no-deps --only-binary=:all: --platform manylinux2014_x86_64 \
            "milvus-lite==$VERSION" -d "$tmp" >&2 &&
            got=$(sha256sum "$tmp/$WHEEL" | cut -d' ' -f1) &&
            { [[ $got == "$SHA256" ]] || { say "$WHEEL: SHA-256 $got, expected $SHA256"; false; }; } &&
            "$PY" -m zipfile -e "$tmp/$WHEEL" "$tmp/unpacked" &&
            chmod +x "$tmp/unpacked/milvus_lite/lib/milvus" &&
            rm -rf "$HOME_DIR" && mv "$tmp/unpacked" "$HOME_DIR"
    } || status=$?
    rm -rf "$tmp"
    exec 8>&-
    [[ $status == 0 ]] || { say "could not fetch milvus-lite $VERSION"; exit 1; }
}

proc_start() { # PID: its start time, so that a reused pid is not taken for ours; fails for a
    # zombie too (dead, only not yet reaped: whoever inherits an orphan may never reap it)
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    stat=${stat##*) }
    # shellcheck disable=SC2086
    set -- $stat
    [[ $1 != Z ]] || return 1
    echo "${20}"
}

running() { # true when STATE/pid names the live server this script started
    local pid start
    [[ -f $STATE/pid ]] || return 1
    read -r pid start <"$STATE/pid" || true
    [[ ${pid:-} =~ ^[0-9]+$ && -n ${start:-} && $(proc_start "$pid" || true) == "$start" ]]
}

# The port this state folder's server had before, when it is free (index folders name the
# server's URI, so a restart keeps them valid), else any free one.
free_port() {
    "$PY" - "$STATE/port" <<'EOF'
import socket, sys
try:
    wanted = int(open(sys.argv[1]).read())
except (OSError, ValueError):
    wanted = 0
for port in ([wanted] if wanted else []) + [0]:
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
        print(s.getsockname()[1])
        break
    except OSError:
        continue
    finally:
        s.close()
EOF
}

# Wait until PORT accepts connections while PID lives; false if it died or TIMEOUT passed.
wait_ready() { # PID PORT TIMEOUT
    "$PY" - "$@" <<'EOF'
import os, socket, sys, time
pid, port, timeout = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
deadline = time.monotonic() + timeout
while time.monotonic() < deadline:
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                sys.exit(1)
    except FileNotFoundError:
        sys.exit(1)
    # Ready when the server itself listens on the port (not another process that took it):
    # a socket of its own in LISTEN state (0A) on the port in /proc/net/tcp or tcp6.
    ours = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                ours.add(link[8:-1])
    except OSError:
        pass
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port and f[9] in ours:
                sys.exit(0)
    time.sleep(0.2)
sys.exit(2)
EOF
}

# Stop the server PID (started at START) once the process PARENT (started at PSTART) has
# exited, or return when the server has. Start times, not bare pids: either pid may be reused.
watch_parent() { # PARENT PSTART PID START
    local _
    while [[ $(proc_start "$1" || true) == "$2" && $(proc_start "$3" || true) == "$4" ]]; do sleep 1; done
    [[ $(proc_start "$3" || true) == "$4" ]] || return 0
    kill "$3" 2>/dev/null || true
    for _ in $(seq 1 50); do
        [[ $(proc_start "$3" || true) == "$4" ]] || return 0
        sleep 0.1
    done
    if [[ $(proc_start "$3" || true) == "$4" ]]; then kill -9 "$3" 2>/dev/null || true; fi
}

stop() {
    if running; then
        local pid start _
        read -r pid start <"$STATE/pid"
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 1 50); do
            [[ $(proc_start "$pid" || true) == "$start" ]] || break
            sleep 0.1
        done
        # Only if it is still ours: the pid may name another process once ours is gone.
        if [[ $(proc_start "$pid" || true) == "$start" ]]; then kill -9 "$pid" 2>/dev/null || true; fi
    fi
    rm -f "$STATE/pid" "$STATE/uri"
}

start() {
    if running && [[ -f $STATE/uri ]]; then cat "$STATE/uri"; return; fi
    local parent_start=
    if [[ -n ${MILVUS_PARENT_PID:-} ]]; then
        [[ $MILVUS_PARENT_PID =~ ^[0-9]+$ ]] && parent_start=$(proc_start "$MILVUS_PARENT_PID") ||
            { say "MILVUS_PARENT_PID=$MILVUS_PARENT_PID: no such process"; exit 1; }
    fi
    stop
    fetch
    mkdir -p "$STATE/data"
    local try port pid status
    # The port is picked, then bound by the server: another process may take it in between,
    # so a server that dies at once is tried again on another port.
    for try in 1 2 3 4 5; do
        port=$(free_port)
        : >"$STATE/log"
        (cd "$STATE/data" && LD_LIBRARY_PATH="$HOME_DIR/milvus_lite/lib" exec setsid "$BIN" \
            "$STATE/data/milvus.db" "127.0.0.1:$port" "${MILVUS_LOG_LEVEL:-ERROR}" \
            </dev/null >>"$STATE/log" 2>&1 9>&-) &
        pid=$!
        echo "$pid $(proc_start "$pid" || true)" >"$STATE/pid"
        status=0
        wait_ready "$pid" "$port" "${MILVUS_START_TIMEOUT:-60}" || status=$?
        if [[ $status == 0 ]]; then
            if [[ -n $parent_start ]]; then
                # In the background, holding none of the caller's descriptors (whoever reads
                # this script's output would otherwise wait for the watcher too) nor the lock.
                (watch_parent "$MILVUS_PARENT_PID" "$parent_start" "$pid" "$(proc_start "$pid" || true)" </dev/null >/dev/null 2>&1 9>&- &)
            fi
            echo "$port" >"$STATE/port"
            echo "http://127.0.0.1:$port" | tee "$STATE/uri"
            return
        fi
        stop
        if [[ $status == 2 ]]; then break; fi
        say "the server exited at once (try $try; port $port taken?)"
    done
    tail -20 "$STATE/log" >&2
    say "Milvus did not start (log above, full log $STATE/log)"
    exit 1
}

mkdir -p "$STATE"
exec 9>"$STATE/lock"
flock -w 300 9 || { say "another start or stop held $STATE/lock for 5 minutes"; exit 1; }
case ${1:-} in
    start) start ;;
    uri) if running && [[ -f $STATE/uri ]]; then cat "$STATE/uri"; else say "not running"; exit 1; fi ;;
    stop) stop ;;
    *) awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0" >&2; exit 2 ;;
esac
