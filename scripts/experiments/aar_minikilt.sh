#!/usr/bin/env bash
# AAR on mini-KILT (issue 22; docs/RESULTS.md): retrievers adapted to a small black-box source
# LM, judged by target LMs that never saw them.
#
#   scripts/experiments/aar_minikilt.sh                     # train the three retrievers, then judge every row
#   STAGE=train scripts/experiments/aar_minikilt.sh         # only train (STAGE=judge: only judge)
#   QUERIES=400 TARGETS="qwen2.5-coder-1.5b" EVERY=8 ...    # sizes (defaults below)
#
# Training (the same squad training queries, negatives, seed and steps for each; the recipe is
# configs/aar/minikilt-smollm2.toml, the source SmolLM2-135M-Instruct behind llama-server):
#   aar     AAR: positives = gold + the source's top 2 of MiniLM's top 10 (REFERENCE §6)
#   human   the same recipe with [aar] k = 0: gold positives only (the source is not asked)
#   replug  REPLUG's LM-supervised retrieval from the same scores (minikilt-smollm2-replug.toml)
# and the starting retriever, zero-shot all-MiniLM-L6-v2, plus BM25 and closed book.
# Judging: scripts/experiments/augment_minikilt.sh on each of TARGETS (smollm2 is the source,
# so its row is not a transfer to an unseen LM), every EVERY-th dev question of mc and shortqa, 3 passages, recipes as
# docs/TARGETS.md says (chat.toml for the instruction-tuned Qwen models, openai.toml for
# gemma-3-270m, a base model). TRAINED=DIR adds a `host train` model to the comparison.
#
# Everything resumes: aar-train's stages, the source's cached replies, the indexes and the
# results files. Outputs: runs/aar/{aar,human,replug}/ (models, analysis.json, summary.json)
# and runs/augment/TARGET/ (tables; the same files augment_minikilt.sh writes).
set -euo pipefail
cd "$(dirname "$0")/../.."
H=${HOST:-target/release/host}
M=.cache/models/all-MiniLM-L6-v2
QUERIES=${QUERIES:-200}
RUNS=${RUNS:-runs/aar}
TARGETS=${TARGETS:-qwen2.5-coder-0.5b gemma3-270m smollm2 qwen2.5-coder-1.5b}
EVERY=${EVERY:-8}
STAGE=${STAGE:-all}
mkdir -p "$RUNS"

if [[ $STAGE == all || $STAGE == train ]]; then
    # The human-label baseline: the AAR recipe with K = 0.
    sed 's/^k = 2$/k = 0/' configs/aar/minikilt-smollm2.toml > "$RUNS/minikilt-human.toml"
    grep -q '^k = 0$' "$RUNS/minikilt-human.toml" || { echo "could not set k = 0" >&2; exit 2; }
    URL=$(scripts/llama-server.sh start --model smollm2)
    trap 'scripts/llama-server.sh stop --model smollm2' EXIT
    echo "== human (gold positives only) $(date -u +%H:%M:%S)"
    $H aar-train --source openai --encoder dpr --model $M --config "$RUNS/minikilt-human.toml" \
        --max-queries "$QUERIES" --base-url "$URL" --output-dir "$RUNS/human" > "$RUNS/human.summary.json"
    echo "== aar $(date -u +%H:%M:%S)"
    $H aar-train --source openai --encoder dpr --model $M --config configs/aar/minikilt-smollm2.toml \
        --max-queries "$QUERIES" --base-url "$URL" --output-dir "$RUNS/aar" > "$RUNS/aar.summary.json"
    echo "== replug $(date -u +%H:%M:%S)"
    $H aar-train --source openai --encoder dpr --model $M --config configs/aar/minikilt-smollm2-replug.toml \
        --max-queries "$QUERIES" --base-url "$URL" --output-dir "$RUNS/replug" > "$RUNS/replug.summary.json"
    scripts/llama-server.sh stop --model smollm2
    trap - EXIT
fi

if [[ $STAGE == all || $STAGE == judge ]]; then
    models="aar=$RUNS/aar human=$RUNS/human replug=$RUNS/replug"
    for target in $TARGETS; do
        case $target in
            gemma3-270m) config=configs/augment/openai.toml ;;
            *) config=configs/augment/chat.toml ;;
        esac
        echo "== judge: $target $(date -u +%H:%M:%S)"
        TARGET=$target CONFIG=$config EVERY=$EVERY MODELS="$models" \
            scripts/experiments/augment_minikilt.sh
    done
fi
