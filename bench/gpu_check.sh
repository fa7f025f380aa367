#!/usr/bin/env bash
# The CUDA paths on a lent GPU machine, in one run of a few minutes (issue 20, item 6):
#   1. `host doctor` sees the GPU;
#   2. a CUDA training step against the CPU step: the same batch, float32, dropout off, two
#      AdamW steps, weights within 1e-4;
#   3. bf16 training on CUDA (float32 weights, autocast): three steps move the weights, which
#      stay finite and float32, close to the float32 run's;
#   4. the T5 parity tests on CUDA (ST5 embeddings, FiD generation and cross-attention
#      passage scores against transformers' values, bf16);
#   5. `host encode --device cuda` against sentence-transformers on the same GPU, the same
#      model and corpus: embeddings and passages per second.
# Here: bench/gpu_pack.sh (after a release build and `cargo test --release --no-run`). Then,
# with the device tool (carry .gpu; the machine has python3 with torch, transformers and
# sentence-transformers):
#   run(command="bash bench/gpu_check.sh", carry=[".gpu"], timeout_s=540)
# Everything it prints also lands in $OUT/gpu_check.log. DEVICE=cpu runs the same flow on
# the CPU (to try the script here; its timings mean nothing).
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE=${DEVICE:-cuda}
# The corpus step 5 encodes (a smaller one to try the script here).
CORPUS=${CORPUS:-data/minikilt/corpus.jsonl}
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check.log") 2>&1
PY=${PY:-python3}
W=$(mktemp -d)
mkdir -p "$W/bin" && tar -xJf .gpu/bin.tar.xz -C "$W/bin"
# The host and plugins were linked against PyPI's torch 2.11.0; use this machine's copy.
export LD_LIBRARY_PATH=$($PY -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export RAK_PLUGIN_PATH=$W/bin
H=$W/bin/host
step() { echo; echo "== $* ($(date -u +%H:%M:%S))"; }

step "1. doctor"
$H doctor

step "making a MiniLM-shaped model with random weights (dropout off) and a small training set"
$PY bench/gpu_data.py --tokenizer .gpu/minilm --out "$W" || exit 1
$H index build --kind bm25 --corpus data/minikilt/corpus.jsonl --output "$W/bm25" >/dev/null || exit 1

step "2. the training step on $DEVICE against the CPU's (float32, dropout off, 2 AdamW steps)"
for dev in cpu "$DEVICE"; do
    $H train --device "$dev" --model "$W/model" --config "$W/recipe.toml" --output-dir "$W/step-$dev" --max-steps 2 --overwrite-output-dir >/dev/null || exit 1
    cp -r "$W/step-$dev" "$W/done-$dev-$RANDOM"
done
$PY bench/gpu_data.py --compare $(ls -d "$W"/done-cpu-* | head -1) $(ls -d "$W"/done-"$DEVICE"-* | tail -1) --tolerance 1e-4

step "3. bf16 training on $DEVICE (float32 weights, autocast), 3 steps, against float32"
for p in f32 bf16; do
    flag=(); [[ $p == bf16 ]] && flag=(--bf16)
    start=$(date +%s.%N)
    $H train --device "$DEVICE" --model "$W/model" --config "$W/recipe.toml" --output-dir "$W/train-$p" --max-steps 3 "${flag[@]}" >/dev/null || exit 1
    echo "$p: $($PY -c "print(round($(date +%s.%N) - $start, 1))") s for 3 steps (the whole command)"
done
$PY bench/gpu_data.py --moved "$W/model" "$W/train-f32" "$W/train-bf16"

step "4. T5 parity tests on $DEVICE (FiD cross-attention scores, bf16)"
RAK_T5_FIXTURES=$PWD/tests/fixtures/t5 "$W/bin/t5_parity" --test-threads 1 --nocapture 2>&1 | grep -E "^test |bf16|fid|Cuda|result"

step "5. host encode on $DEVICE against sentence-transformers (same GPU, model, corpus)"
# A first run warms the page cache and the GPU; the second is timed.
$H encode --encoder dpr --model "$W/model" --device "$DEVICE" --batch-size 128 --input "$CORPUS" --output "$W/emb" >/dev/null 2>&1
$PY bench/gpu_data.py --st "$W/model" --device "$DEVICE" --corpus "$CORPUS" --host "$H"
echo; echo "gpu_check: done"
