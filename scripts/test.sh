#!/usr/bin/env bash
# The project's test command: install what is missing, make the reference values that come
# from real models (not committed), build, and run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
# Free disk, before and after: a run needs about 14 GB (the venv's torch 5 GB, target/ 3 GB,
# the tests' training runs up to 5 GB at a time); a full disk fails tests far from the cause.
disk_free() { echo "test: $(df -h --output=avail . | tail -n1 | tr -d ' ') free on this disk ($1)"; }
disk_free "before"
scripts/install.sh
. scripts/env.sh
# A reference made by an older version of its script is made again.
stale() { [[ ! -f $1 || $2 -nt $1 ]]; }
if stale .cache/fixtures/minilm/expected.safetensors scripts/fixtures/minilm_reference.py; then
    python scripts/fixtures/minilm_reference.py --model .cache/models/all-MiniLM-L6-v2 --out .cache/fixtures/minilm
fi
if stale .cache/fixtures/st62/expected.safetensors scripts/fixtures/st62_reference.py; then
    python scripts/fixtures/st62_reference.py --model .cache/models/all-MiniLM-L6-v2 --out .cache/fixtures/st62
fi
if stale .cache/fixtures/train_step/taco-v1_1/reference.safetensors scripts/fixtures/train_step_reference.py; then
    python scripts/fixtures/train_step_reference.py --model .cache/models/all-MiniLM-L6-v2 --t5 tests/fixtures/t5 --out .cache/fixtures/train_step
fi
if stale .cache/fixtures/bm25/reference.json scripts/fixtures/bm25_reference.py; then
    python scripts/fixtures/bm25_reference.py --data data/minikilt --out .cache/fixtures/bm25
fi
# The real black-box LM the augment tests talk to (built once per machine, cached outside
# the checkout: about 10 minutes on 2 cores the first time), built beside the Rust build,
# whose serial stretches (torch-sys's C++, the links) leave a core idle; at a lower priority,
# so that it takes what the Rust build leaves. In a process group of its own: if this script
# stops early, the whole build (cmake, make, the compilers) is stopped with it.
log=$(mktemp)
llama_log=$(mktemp)
setsid nice -n 10 scripts/llama-server.sh build >/dev/null 2>"$llama_log" &
llama_build=$!
stop_llama_build() {
    if [[ -n ${llama_build:-} ]]; then
        kill -TERM -- "-$llama_build" 2>/dev/null || true
        wait "$llama_build" 2>/dev/null || true
    fi
    rm -f "$log" "$llama_log"
}
trap stop_llama_build EXIT
# The experiment scripts' own tests (standard library only; seconds).
python scripts/experiments/test_carve_validation.py
python scripts/experiments/test_ranking_record.py
python scripts/experiments/test_select_table.py
python bench/test_trace_table.py
cargo build --release --workspace
built=0
wait "$llama_build" || built=$?
llama_build=
cat "$llama_log" >&2
if [[ $built != 0 ]]; then
    echo "test: building llama-server failed ($built)" >&2
    exit 1
fi
scripts/llama-server.sh model >/dev/null
set +e
# --no-fail-fast: one run reports every failing test binary, not only the first.
# cargo runs as many tests at once as there are cores; each libtorch (in a test process or in
# a host a test starts) takes one core, so that two never share one: OpenMP threads spinning
# against each other made train_cli's tests take 331 s instead of 209 s on 2 cores. What a
# user runs keeps libtorch's default, every core.
OMP_NUM_THREADS=1 cargo test --release --workspace --no-fail-fast 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
set -e
disk_free "after"
# One closing line for the whole run (cargo's own last line is often a crate with no doc tests).
awk '/^test result:/ { p += $4; f += $6 } END { printf "tests: %d passed, %d failed\n", p, f }' "$log"
exit "$status"
