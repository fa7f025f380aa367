#!/usr/bin/env bash
# A profile of one configuration of bench/gpu_check.sh's speed step (issue 33, item 2), written
# to the folder given: the DPR step of `host train` with RAK_STEP_PHASES=1 (seconds a step by
# phase: sample, forward, loss, backward, optimizer, the device synchronised at each phase's
# end), then again under libtorch's profiler (RAK_TORCH_PROFILE: host-trace.json), beside the
# PyTorch loop under torch.profiler (torch-profile.txt: operators by device and by CPU time;
# torch-trace.json: a Chrome trace); trace-table.md, both traces side by side
# (bench/trace_table.py: kernels, device idle time, waits for the device, a step); and
# train-step.json with both sides' times (and gpu_check.log, what it printed).
# `PROFILE_WORST=1 SPEED_ONLY=1 bash bench/gpu_check.sh` profiles the speed table's worst row in
# the same run instead (into $OUT/profile).
#
#   bash bench/gpu_profile.sh DIR [minilm|base] [0|0.1] [bf16]     # default: base 0.1 (float32)
#
# Packed and carried as gpu_check.sh is (bench/gpu_pack.sh, carry .gpu); on the device machine
# DIR under $OUT comes back: run(command="bash bench/gpu_profile.sh $OUT/profile", carry=[".gpu"]).
# DEVICE=cpu tries it here.
set -euo pipefail
cd "$(dirname "$0")/.."
[[ $# -ge 1 ]] || { echo "usage: bench/gpu_profile.sh DIR [minilm|base] [0|0.1] [bf16]" >&2; exit 2; }
case ${2:-base} in minilm|base) ;; *) echo "shape: minilm or base, not ${2}" >&2; exit 2 ;; esac
case ${3:-0.1} in 0|0.1) ;; *) echo "dropout: 0 or 0.1, not ${3}" >&2; exit 2 ;; esac
case ${4:-} in ""|bf16) ;; *) echo "dtype: bf16 or nothing (float32), not ${4}" >&2; exit 2 ;; esac
dir=$(mkdir -p "$1" && cd "$1" && pwd)
PROFILE_DIR=$dir PROFILE_SHAPE=${2:-base} PROFILE_DROPOUT=${3:-0.1} PROFILE_BF16=${4:+1} OUT=${OUT:-$dir} exec bash bench/gpu_check.sh
