#!/usr/bin/env bash
# Set up a fresh checkout and run the main job: installs libtorch (PyPI torch==2.11.0) and the
# models into the checkout, builds `host` and the plugins in release mode, then runs them.
set -euo pipefail
cd "$(dirname "$0")"
scripts/install.sh
. scripts/env.sh
echo "setup: building host and plugins (release; the first build takes several minutes)"
cargo build --release --workspace
target/release/host doctor
target/release/host plugins list
