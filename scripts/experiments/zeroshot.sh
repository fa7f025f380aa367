#!/usr/bin/env bash
# Zero-shot all-MiniLM-L6-v2 on every mini-KILT dev task with passages (and queries) cut at
# LENGTH tokens: MiniLM's own 256, or 128 as the recipes train and evaluate (docs/RESULTS.md,
# the squad investigation: how much of a trained model's squad score the cut alone costs).
#
#   scripts/experiments/zeroshot.sh 128 256        # outputs under $OUT (default runs/minikilt)
#   -> $OUT/zeroshot-len128.metrics.json, ... ; then scripts/experiments/table.py
set -euo pipefail
cd "$(dirname "$0")/../.."
H=${HOST:-target/release/host}
D=data/minikilt
M=.cache/models/all-MiniLM-L6-v2
OUT=${OUT:-runs/minikilt}
for len in "$@"; do
    name=zeroshot-len$len
    ev=$OUT/$name.eval
    [[ -f $OUT/$name.metrics.json ]] && continue
    mkdir -p "$ev/runs"
    $H encode --encoder dpr --model $M --max-length "$len" --input $D/corpus.jsonl --output "$ev/corpus"
    [[ -f $ev/flat/index.json ]] || $H index build --kind flat --embeddings "$ev/corpus" --output "$ev/flat" >/dev/null
    args=()
    for task in fever squad vitaminc wikidata; do
        q=$D/tasks/$task/queries.dev.jsonl
        trec=$ev/runs/$task.dev.trec
        [[ -f $trec ]] || $H search --index "$ev/flat" --encoder dpr --model $M --max-length "$len" --queries "$q" --task "$task" --k 100 --output "$trec"
        args+=(--run "$trec" --qrels "$D/tasks/$task/qrels.dev.tsv" --queries "$q" --task "$task")
    done
    $H eval --corpus $D/corpus.jsonl "${args[@]}" --output "$OUT/$name.metrics.json" >/dev/null
done
