#!/usr/bin/env bash
# The project's test command: install what is missing, make the reference values that come
# from real models (not committed), build, and run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
. scripts/env.sh
if [[ ! -f .cache/fixtures/minilm/expected.safetensors ]]; then
    python scripts/fixtures/minilm_reference.py --model .cache/models/all-MiniLM-L6-v2 --out .cache/fixtures/minilm
fi
cargo build --release --workspace
cargo test --release --workspace
