#!/usr/bin/env bash
# The quick start: BM25, zero-shot all-MiniLM-L6-v2, and MiniLM after a short multitask
# training run (configs/minikilt/quickstart.toml, the recipe chosen on a validation split:
# 212 steps of 32 queries over the four tasks, AdamW, one BM25 negative each and the step's
# passages as in-batch negatives, about 10 minutes on 2 CPU cores) on every mini-KILT task's
# dev split, ending in a metrics table per system. Resumable: finished steps are skipped on a
# rerun (training resumes from its last checkpoint).
# Outputs (indexes, embeddings, runs, metrics JSON) go to $OUT (default .cache/quickstart).
set -euo pipefail
cd "$(dirname "$0")/.."
H=target/release/host
D=data/minikilt
M=.cache/models/all-MiniLM-L6-v2
OUT=${OUT:-.cache/quickstart}
TASKS=(fever squad vitaminc wikidata)
mkdir -p "$OUT/runs"

# An index (and its runs) from before BM25 took Pyserini's constants is rebuilt.
if [[ -f $OUT/bm25/index.json ]] && ! grep -q '"scorer"' "$OUT/bm25/index.json"; then
    rm -rf "$OUT/bm25" "$OUT"/runs/bm25.*
fi
[[ -f $OUT/bm25/index.json ]] || $H index build --kind bm25 --corpus $D/corpus.jsonl --output "$OUT/bm25" >/dev/null
$H encode --encoder dpr --model $M --input $D/corpus.jsonl --output "$OUT/minilm"
[[ -f $OUT/minilm-flat/index.json ]] || $H index build --kind flat --embeddings "$OUT/minilm" --output "$OUT/minilm-flat" >/dev/null

# Multitask training from MiniLM; the trained model is a folder `host` encodes with directly.
# $OUT/multitask.recipe.toml records the recipe the model was trained from: when the recipe's
# settings change (whole-line comments do not count), the model and what was made from it are
# made again. Outputs of that name with no record (quick starts before 2026-11-29 trained
# naive.toml, or someone else's files) are refused, never removed.
T=$OUT/multitask
RECIPE=configs/minikilt/quickstart.toml
STAMP=$OUT/multitask.recipe.toml
MADE_FROM_MODEL=("$T" "$OUT/multitask-emb" "$OUT/multitask-flat" "$OUT"/runs/multitask.* "$OUT/multitask.dev.metrics.json")
settings() { grep -v -e '^[[:space:]]*#' -e '^[[:space:]]*$' "$1" 2>/dev/null || true; }
if [[ "$(settings "$RECIPE")" != "$(settings "$STAMP")" ]]; then
    if [[ -f $STAMP ]]; then
        echo "quickstart: $T was trained from another recipe; training again from $RECIPE" >&2
        rm -rf "${MADE_FROM_MODEL[@]}"
    else
        found=()
        for f in "${MADE_FROM_MODEL[@]}"; do [[ -e $f ]] && found+=("$f"); done
        if (( ${#found[@]} )); then
            echo "quickstart: $OUT holds outputs of a multitask model with no record of its recipe ($STAMP): ${found[*]}" >&2
            echo "quickstart: quick starts before 2026-11-29 trained naive.toml; remove them to train $RECIPE, or set OUT to another folder" >&2
            exit 1
        fi
    fi
    cp "$RECIPE" "$STAMP.tmp" && mv "$STAMP.tmp" "$STAMP"
fi
if [[ ! -f $T/model.safetensors ]]; then
    resume=()
    compgen -G "$T/checkpoint-*" >/dev/null && resume=(--resume-from-checkpoint latest)
    $H train --encoder dpr --model $M --config "$RECIPE" \
        --output-dir "$T" "${resume[@]}" >/dev/null
fi
$H encode --encoder dpr --model "$T" --input $D/corpus.jsonl --output "$OUT/multitask-emb"
[[ -f $OUT/multitask-flat/index.json ]] || $H index build --kind flat --embeddings "$OUT/multitask-emb" --output "$OUT/multitask-flat" >/dev/null

for system in bm25 minilm multitask; do
    args=()
    for task in "${TASKS[@]}"; do
        run=$OUT/runs/$system.$task.dev.trec
        q=$D/tasks/$task/queries.dev.jsonl
        if [[ ! -f $run ]]; then
            if [[ $system == bm25 ]]; then
                $H search --index "$OUT/bm25" --bm25 --queries "$q" --k 100 --output "$run"
            elif [[ $system == minilm ]]; then
                $H search --index "$OUT/minilm-flat" --encoder dpr --model $M --queries "$q" --task "$task" --k 100 --output "$run"
            else
                $H search --index "$OUT/multitask-flat" --encoder dpr --model "$T" --queries "$q" --task "$task" --k 100 --output "$run"
            fi
        fi
        args+=(--run "$run" --qrels "$D/tasks/$task/qrels.dev.tsv" --queries "$q" --task "$task")
    done
    echo
    echo "== $system, mini-KILT dev =="
    $H eval --corpus $D/corpus.jsonl "${args[@]}" --output "$OUT/$system.dev.metrics.json" >/dev/null
done
echo
echo "metrics JSON: $OUT/bm25.dev.metrics.json $OUT/minilm.dev.metrics.json $OUT/multitask.dev.metrics.json"
