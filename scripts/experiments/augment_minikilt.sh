#!/usr/bin/env bash
# Retrieval-augmented answering on mini-KILT dev with a real black-box LM (docs/RESULTS.md):
# llama.cpp's llama-server serving a target from PyPI (scripts/llama-server.sh --model
# TARGET; default SmolLM2-135M-Instruct), asked through the `openai` connector with the
# prompts of a recipe (default configs/augment/openai.toml: AAR's and PopQA's), for `mc`
# (multiple choice) and `shortqa` (short answers), each closed book, with 3 BM25 passages,
# with 3 passages from zero-shot all-MiniLM-L6-v2 (exact inner product) and, given TRAINED,
# with 3 passages from a model `host train` made.
#
#   scripts/experiments/augment_minikilt.sh            # every question (about 1.5 h on 2 cores)
#   EVERY=4 scripts/experiments/augment_minikilt.sh    # every 4th question of each file
#   TASKS=shortqa scripts/experiments/augment_minikilt.sh   # one task (default: mc shortqa)
#   TARGET=qwen2.5-coder-1.5b CONFIG=configs/augment/chat.toml scripts/experiments/augment_minikilt.sh
#   TRAINED=runs/taco3/taco-s42 TRAINED_TASK=wikidata ...   # + that model's passages (its
#       queries encoded as TRAINED_TASK's, when it was trained with task names)
#   MODELS="aar=runs/aar-smollm2 human=runs/aar-human@squad" ...   # + several models' passages,
#       each NAME=DIR[@TASK]; TRAINED is MODELS="trained=$TRAINED@$TRAINED_TASK"
#   RANKED="aar=results/aar/rankings/shortqa-aar.trec" ...   # + passages from fixed rankings
#       (TREC runs of the questions' ids, `host augment --retriever run:FILE`), NAME=FILE each:
#       judging needs neither the model nor an index, so a judgement can go on in a later session;
#       a built-in name (RANKED="minilm=FILE") replaces that retriever's search
#
# Resumable: indexes are built once, `host augment` resumes its results files, and replies
# are cached; the indexes are shared by every target, under $INDEXES (default
# runs/augment/indexes). Outputs under $OUT (default runs/augment/TARGET): TASK-RETRIEVER.jsonl (one
# record per question), TASK-RETRIEVER.summary.json, table.md and stats.md (95% intervals,
# paired comparisons against closed book: scripts/experiments/augment_stats.py). BASE_URL
# uses a server of your own instead of starting one (any OpenAI-compatible server; set MODEL
# for its model name).
set -euo pipefail
cd "$(dirname "$0")/../.."
H=${HOST:-target/release/host}
D=data/minikilt
M=.cache/models/all-MiniLM-L6-v2
TARGET=${TARGET:-smollm2}
CONFIG=${CONFIG:-configs/augment/openai.toml}
OUT=${OUT:-runs/augment/$TARGET}
mkdir -p "$OUT"
if [[ -n ${BASE_URL:-} ]]; then
    URL=$BASE_URL
else
    URL=$(scripts/llama-server.sh start --model "$TARGET")
    trap 'scripts/llama-server.sh stop --model "$TARGET"' EXIT
fi
# EVERY=k asks every k-th question (the mc file is ordered by subject, so a prefix would
# not do); a later full run into the same files asks only the rest.
input_of() {
    if [[ -z ${EVERY:-} ]]; then echo "$D/$1/dev.jsonl"; return; fi
    mkdir -p "$OUT/inputs"
    awk -v k="$EVERY" 'NR % k == 1' "$D/$1/dev.jsonl" > "$OUT/inputs/$1-every$EVERY.jsonl"
    echo "$OUT/inputs/$1-every$EVERY.jsonl"
}

# RETRIEVERS="none bm25" leaves some out (default: none bm25 minilm, + each of MODELS).
read -r -a RETRIEVERS <<< "${RETRIEVERS:-none bm25 minilm}"
wants() { [[ " ${RETRIEVERS[*]} " == *" $1 "* ]]; }
INDEXES=${INDEXES:-runs/augment/indexes}
mkdir -p "$INDEXES"
if wants bm25 && [[ ! -f $INDEXES/bm25/index.json ]]; then
    $H index build --kind bm25 --corpus $D/corpus.jsonl --output "$INDEXES/bm25" >/dev/null
fi
. scripts/experiments/lib.sh  # dense_index NAME DIR

# RANKED: NAME=FILE each, a fixed ranking per retriever (see the header).
declare -A RANKED_FILE
read -r -a RANKED_SPECS <<< "${RANKED:-}"
for spec in "${RANKED_SPECS[@]}"; do
    name=${spec%%=*} file=${spec#*=}
    [[ $name != "$spec" && -n $name && -f $file ]] || { echo "RANKED: $spec is not NAME=FILE of an existing file" >&2; exit 2; }
    # NAME becomes TASK-NAME.jsonl, and `none` is closed book, the baseline of every comparison.
    [[ $name =~ ^[A-Za-z0-9_-]+$ ]] || { echo "RANKED: $name: a name is letters, digits, _ and - only" >&2; exit 2; }
    [[ $name != none ]] || { echo "RANKED: none is closed book, not a ranking's name" >&2; exit 2; }
    RANKED_FILE[$name]=$file
    # A built-in name (minilm) is that retriever's passages from a fixed ranking instead.
    wants "$name" || RETRIEVERS+=("$name")
done

if wants minilm && [[ -z ${RANKED_FILE[minilm]:-} ]]; then dense_index minilm $M; fi
# MODELS: NAME=DIR[@TASK] each; TASK is the task name its queries are encoded with, for a
# model trained with task names.
read -r -a MODEL_SPECS <<< "${MODELS:-}"
if [[ -n ${TRAINED:-} ]]; then MODEL_SPECS+=("trained=$TRAINED${TRAINED_TASK:+@$TRAINED_TASK}"); fi
declare -A MODEL_DIR MODEL_TASK
for spec in "${MODEL_SPECS[@]}"; do
    name=${spec%%=*} rest=${spec#*=}
    [[ $name != "$spec" && -n $name ]] || { echo "MODELS: $spec is not NAME=DIR[@TASK]" >&2; exit 2; }
    [[ $name =~ ^[A-Za-z0-9_-]+$ ]] || { echo "MODELS: $name: a name is letters, digits, _ and - only" >&2; exit 2; }
    case $name in none|bm25|minilm) echo "MODELS: $name is a built-in retriever's name" >&2; exit 2 ;; esac
    [[ -z ${RANKED_FILE[$name]:-} ]] || { echo "MODELS: $name is also in RANKED" >&2; exit 2; }
    MODEL_DIR[$name]=${rest%%@*}
    [[ $rest == *@* ]] && MODEL_TASK[$name]=${rest#*@}
    RETRIEVERS+=("$name")
    dense_index "$name" "${MODEL_DIR[$name]}"
done

for task in ${TASKS:-mc shortqa}; do
    for r in "${RETRIEVERS[@]}"; do
        model=$M config=$CONFIG
        if [[ -n ${RANKED_FILE[$r]:-} ]]; then
            spec=run:${RANKED_FILE[$r]}
        else
            case $r in
                none) spec=none ;;
                bm25) spec=bm25:$INDEXES/bm25 ;;
                minilm) spec=dense:$INDEXES/minilm-flat ;;
                *) spec=dense:$INDEXES/$r-flat model=${MODEL_DIR[$r]}
                    # The recipe's [retrieval] task: the task name the queries are encoded with.
                    if [[ -n ${MODEL_TASK[$r]:-} ]]; then
                        config=$OUT/recipe-$r.toml
                        sed "s/^\[retrieval\]$/[retrieval]\ntask = \"${MODEL_TASK[$r]}\"/" "$CONFIG" > "$config"
                        grep -q "^task = \"${MODEL_TASK[$r]}\"$" "$config" || { echo "$CONFIG: no [retrieval] line to put the task after" >&2; exit 2; }
                    fi ;;
            esac
        fi
        echo "== $task, passages: $r $(date -u +%H:%M:%S)"
        status=0
        $H augment --target openai --config "$config" --task $task \
            --input "$(input_of $task)" --output "$OUT/$task-$r.jsonl" --base-url "$URL" \
            ${MODEL:+--model "$MODEL"} --retriever "$spec" --k 3 --encoder dpr --encoder-model "$model" \
            > "$OUT/$task-$r.summary.json" || status=$?
        # Exit 3: some questions failed (their records say why); a rerun asks them again.
        [[ $status == 0 || $status == 3 ]] || exit $status
    done
done

scripts/experiments/augment_table.py "$OUT" "$D" | tee "$OUT/table.md"
scripts/experiments/augment_stats.py "$OUT" "$D" | tee "$OUT/stats.md"
