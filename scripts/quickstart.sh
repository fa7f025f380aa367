#!/usr/bin/env bash
# The quick start: BM25 and zero-shot all-MiniLM-L6-v2 on every mini-KILT task's dev split,
# ending in a metrics table per system. Resumable: finished steps are skipped on a rerun.
# Outputs (indexes, embeddings, runs, metrics JSON) go to $OUT (default .cache/quickstart).
set -euo pipefail
cd "$(dirname "$0")/.."
H=target/release/host
D=data/minikilt
M=.cache/models/all-MiniLM-L6-v2
OUT=${OUT:-.cache/quickstart}
TASKS=(fever squad vitaminc wikidata)
mkdir -p "$OUT/runs"

[[ -f $OUT/bm25/index.json ]] || $H index build --kind bm25 --corpus $D/corpus.jsonl --output "$OUT/bm25" >/dev/null
$H encode --encoder dpr --model $M --input $D/corpus.jsonl --output "$OUT/minilm"
[[ -f $OUT/minilm-flat/index.json ]] || $H index build --kind flat --embeddings "$OUT/minilm" --output "$OUT/minilm-flat" >/dev/null

for system in bm25 minilm; do
    args=()
    for task in "${TASKS[@]}"; do
        run=$OUT/runs/$system.$task.dev.trec
        q=$D/tasks/$task/queries.dev.jsonl
        if [[ ! -f $run ]]; then
            if [[ $system == bm25 ]]; then
                $H search --index "$OUT/bm25" --bm25 --queries "$q" --k 100 --output "$run"
            else
                $H search --index "$OUT/minilm-flat" --encoder dpr --model $M --queries "$q" --task "$task" --k 100 --output "$run"
            fi
        fi
        args+=(--run "$run" --qrels "$D/tasks/$task/qrels.dev.tsv" --queries "$q" --task "$task")
    done
    echo
    echo "== $system, mini-KILT dev =="
    $H eval --corpus $D/corpus.jsonl "${args[@]}" --output "$OUT/$system.dev.metrics.json" >/dev/null
done
echo
echo "metrics JSON: $OUT/bm25.dev.metrics.json $OUT/minilm.dev.metrics.json"
