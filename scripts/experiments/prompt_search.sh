#!/usr/bin/env bash
# The prompt search of issue 21, item 3 (docs/RESULTS.md): short answers on every EVERY-th
# mini-KILT dev question (default 8: 110 of 875), closed book and with BM25's top 3, for
# each recipe variant, against one target.
#
#   scripts/experiments/prompt_search.sh                      # qwen2.5-coder-1.5b, every variant
#   TARGET=qwen2.5-coder-0.5b scripts/experiments/prompt_search.sh configs/augment/search/v1-header.toml
#
# Variants: the recipes named on the command line (default: configs/augment/search/*.toml;
# configs/augment/chat.toml is v1-header, the variant the search chose). Each runs scripts/experiments/augment_minikilt.sh into
# runs/prompt-search/TARGET/NAME (resumable) on one server, with a connector cache shared by
# the variants, so a prompt two variants share (a closed-book prompt the header leaves alone)
# is asked once. Then scripts/experiments/augment_stats.py on each: accuracy with passages
# against closed book, split by whether the shown passages hold a gold alias.
set -euo pipefail
cd "$(dirname "$0")/../.."
TARGET=${TARGET:-qwen2.5-coder-1.5b}
ROOT=${OUT_ROOT:-runs/prompt-search}/$TARGET
mkdir -p "$ROOT/recipes"
if (($#)); then VARIANTS=("$@"); else VARIANTS=(configs/augment/search/*.toml); fi
if [[ -n ${BASE_URL:-} ]]; then
    URL=$BASE_URL
else
    URL=$(scripts/llama-server.sh start --model "$TARGET")
    trap 'scripts/llama-server.sh stop --model "$TARGET"' EXIT
fi
for v in "${VARIANTS[@]}"; do
    name=$(basename "$v" .toml)
    recipe=$ROOT/recipes/$name.toml
    # The same recipe with the shared cache (keyed on the whole request, so only identical
    # prompts share a reply).
    sed "0,/^settings = { /s||settings = { cache_dir = \"$ROOT/cache\", |" "$v" > "$recipe"
    grep -q "cache_dir = \"$ROOT/cache\"" "$recipe" || { echo "$v: no [target] settings line to add the cache to" >&2; exit 2; }
    echo "== variant $name ($(date -u +%H:%M:%S))"
    BASE_URL=$URL EVERY=${EVERY:-8} TASKS=shortqa RETRIEVERS="none bm25" TARGET=$TARGET CONFIG=$recipe \
        OUT=$ROOT/$name scripts/experiments/augment_minikilt.sh > "$ROOT/$name.log" 2>&1 || { tail -5 "$ROOT/$name.log"; exit 1; }
    sed -n '/split by whether/,$p' "$ROOT/$name/stats.md"
done
