#!/usr/bin/env bash
# Set up a fresh checkout and run the main job: installs libtorch (PyPI torch==2.11.0) and the
# models into the checkout, builds `host` and the plugins in release mode, then runs the quick
# start: BM25, zero-shot all-MiniLM-L6-v2 and MiniLM after a 10-minute multitask training run
# (configs/minikilt/quickstart.toml) on every mini-KILT task's dev split, ending in metrics tables.
set -euo pipefail
cd "$(dirname "$0")"
scripts/install.sh
. scripts/env.sh
echo "setup: building host and plugins (release; the first build takes several minutes)"
cargo build --release --workspace
target/release/host doctor
target/release/host plugins list
scripts/quickstart.sh
