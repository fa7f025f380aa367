#!/usr/bin/env bash
# mini-KILT training experiments (docs/RESULTS.md): train a recipe of configs/minikilt/ with
# a seed, then encode the corpus with the trained model, build an exact index, search every
# task's dev queries and evaluate. Resumable: each finished step is skipped on a rerun, and an
# interrupted training run continues from its latest checkpoint.
#
#   scripts/experiments/minikilt.sh METHOD[:SEED] ...     e.g. naive:42 prefix:42 taco:43
#
# METHOD single-TASK (e.g. single-fever) trains naive.toml on that one task alone and is
# evaluated on it alone: the "one model per task" row (table.py merges the four).
#
# METHOD peer-st is the sentence-transformers peer (scripts/experiments/peer_st.py): the same
# train splits, with taco-sSEED's BM25 negatives, trained by sentence-transformers' own trainer
# for as long as `host train` took for taco-sSEED (whole command: negative mining included;
# only its last session if it was interrupted and resumed: set PEER_SECONDS then), then
# evaluated like the others. Run taco:SEED first (PEER_OF=METHOD: that method's run instead).
#
# STEPS=N trains every recipe for N steps (a copy of it in $OUT with max_steps = N and a
# checkpoint every N/4 steps): the longer ablation of docs/RESULTS.md, under its own $OUT.
#
# Outputs under $OUT (default runs/minikilt): METHOD-sSEED/ (the run; nothing else is written
# inside it, so its checkpoint digest stays the same), METHOD-sSEED.eval/ (corpus embeddings,
# index, TREC runs) and METHOD-sSEED.metrics.json. $HOST picks the binary (default
# target/release/host), so a copy can run while the checkout is being rebuilt.
# Then: .venv/bin/python scripts/experiments/table.py $OUT/*.metrics.json
set -euo pipefail
cd "$(dirname "$0")/../.."
H=${HOST:-target/release/host}
D=data/minikilt
M=.cache/models/all-MiniLM-L6-v2
OUT=${OUT:-runs/minikilt}
TASKS=(fever squad vitaminc wikidata)
mkdir -p "$OUT"

# The recipe file of a method; single-TASK gets naive.toml with its task list cut to TASK.
recipe_of() {
    if [[ $1 == peer-st ]]; then
        echo configs/minikilt/naive.toml  # only for its encoder, dpr
    elif [[ $1 == single-* ]]; then
        local f=$OUT/$1.toml
        sed "s/^tasks = .*/tasks = [\"${1#single-}\"]/" configs/minikilt/naive.toml > "$f"
        echo "$f"
    elif [[ -n ${STEPS:-} ]]; then
        local f=$OUT/$1.toml
        sed -e "s/^max_steps = .*/max_steps = $STEPS/" -e "s/^save_steps = .*/save_steps = $(( (STEPS + 3) / 4 ))/" \
            "configs/minikilt/$1.toml" > "$f"
        echo "$f"
    else
        echo "configs/minikilt/$1.toml"
    fi
}
encoder_of() { sed -n 's/^encoder = "\(.*\)"/\1/p' "$1" | head -1; }

for spec in "$@"; do
    method=${spec%%:*}
    seed=42
    [[ $spec == *:* ]] && seed=${spec##*:}
    name=$method-s$seed
    run=$OUT/$name
    recipe=$(recipe_of "$method")
    enc=$(encoder_of "$recipe")
    tasks=("${TASKS[@]}")
    [[ $method == single-* ]] && tasks=("${method#single-}")
    echo "== $name ($enc) $(date -u +%H:%M:%S)"
    if [[ $method == peer-st && ! -f $run/done ]]; then
        taco=$OUT/${PEER_OF:-taco}-s$seed
        [[ -f $taco/done ]] || { echo "peer-st:$seed needs ${PEER_OF:-taco}:$seed first" >&2; exit 2; }
        # A retrain starts clean: no earlier model, evaluation, or killed run's temporary.
        rm -rf "$run" "$OUT/$name.eval" "$OUT/$name.metrics.json" "$OUT/.$name.tmp-"*
        start=$(date +%s)
        .venv/bin/python scripts/experiments/peer_st.py --seconds "${PEER_SECONDS:-$(cat "$taco/done")}" --seed "$seed" \
            --negatives "$taco/negatives-episode-0.json" --model $M --data $D --out "$run"
        echo "$(( $(date +%s) - start ))" > "$run/done"
    fi
    if [[ ! -f $run/done ]]; then
        resume=()
        compgen -G "$run/checkpoint-*" >/dev/null && resume=(--resume-from-checkpoint latest)
        start=$(date +%s)
        $H train --encoder "$enc" --model $M --config "$recipe" --seed "$seed" \
            --output-dir "$run" "${resume[@]}"
        echo "$(( $(date +%s) - start ))" > "$run/done"
    fi
    # TRAIN_ONLY=1: train now, evaluate on a later run of the same command (timed runs back to
    # back on a quiet machine, their evaluations after).
    [[ -n ${TRAIN_ONLY:-} ]] && continue
    ev=$OUT/$name.eval
    [[ -f $OUT/$name.metrics.json ]] && continue
    mkdir -p "$ev/runs"
    $H encode --encoder "$enc" --model "$run" --input $D/corpus.jsonl --output "$ev/corpus"
    [[ -f $ev/flat/index.json ]] || $H index build --kind flat --embeddings "$ev/corpus" --output "$ev/flat" >/dev/null
    args=()
    for task in "${tasks[@]}"; do
        q=$D/tasks/$task/queries.dev.jsonl
        trec=$ev/runs/$task.dev.trec
        [[ -f $trec ]] || $H search --index "$ev/flat" --encoder "$enc" --model "$run" --queries "$q" --task "$task" --k 100 --output "$trec"
        args+=(--run "$trec" --qrels "$D/tasks/$task/qrels.dev.tsv" --queries "$q" --task "$task")
    done
    $H eval --corpus $D/corpus.jsonl "${args[@]}" --output "$OUT/$name.metrics.json" >/dev/null
done
