#!/usr/bin/env bash
# AAR on mini-KILT (issue 22; docs/RESULTS.md): retrievers adapted to a small black-box source
# LM, judged by target LMs that never saw them.
#
#   scripts/experiments/aar_minikilt.sh                     # train the three retrievers, evaluate their retrieval, judge every row
#   STAGE=train scripts/experiments/aar_minikilt.sh         # only train (STAGE=eval: only retrieval; STAGE=judge: only judge)
#   QUERIES=400 TARGETS="qwen2.5-coder-1.5b" EVERY=8 ...    # sizes (defaults below); EVERY= (empty) judges every question
#   RUNS=runs/aar-authors AUGMENT_OUT=runs/augment-authors TASKS=shortqa RETRIEVERS=minilm EVERY= ...
#   RANKINGS=results/aar-authors/rankings STAGE=rank ...   # the judged retrievers' top 3 for every
#       short-answer dev question as TREC runs; STAGE=judge with RANKINGS set then judges those
#       passages (no models needed: results/aar-authors/README.md, judged across sessions)
#       # a second set of retrievers beside the first (their indexes and judgements apart), judged
#       # on every short-answer question, against zero-shot MiniLM only (JUDGED="aar human":
#       # which trained retrievers are judged)
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
# Retrieval (STAGE=eval): each retriever (and zero-shot MiniLM, and TRAINED) encodes the corpus,
# searches squad and wikidata dev (exact inner product, top 100) and is evaluated per query;
# scripts/experiments/aar_retrieval_table.py prints the table with 95% intervals and paired
# differences (RUNS/eval/table.md).
#
# Everything resumes: aar-train's stages, the source's cached replies, the indexes and the
# results files. Outputs: RUNS/{aar,human,replug}/ (models, analysis.json, summary.json),
# RUNS/eval/ (runs, metrics, table.md) and AUGMENT_OUT/TARGET/ (tables; the same files
# augment_minikilt.sh writes; the indexes in AUGMENT_OUT/indexes, shared with RUNS/eval).
set -euo pipefail
cd "$(dirname "$0")/../.."
H=${HOST:-target/release/host}
M=.cache/models/all-MiniLM-L6-v2
QUERIES=${QUERIES:-200}
RUNS=${RUNS:-runs/aar}
TARGETS=${TARGETS:-qwen2.5-coder-0.5b gemma3-270m smollm2 qwen2.5-coder-1.5b}
EVERY=${EVERY-8}
STAGE=${STAGE:-all}
AUGMENT_OUT=${AUGMENT_OUT:-runs/augment}
INDEXES=$AUGMENT_OUT/indexes
D=data/minikilt
. scripts/experiments/lib.sh  # dense_index NAME DIR
mkdir -p "$RUNS"
# Judging rankings: they hold the short-answer questions only (refused now, not after training).
if [[ -n ${RANKINGS:-} && ( $STAGE == all || $STAGE == judge ) && ${TASKS:-} != shortqa ]]; then
    echo "judging with RANKINGS needs TASKS=shortqa (the rankings hold the short-answer questions)" >&2; exit 2
fi

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

if [[ $STAGE == all || $STAGE == eval ]]; then
    ev=$RUNS/eval
    mkdir -p "$ev" "$INDEXES"
    systems="minilm=$M aar=$RUNS/aar human=$RUNS/human replug=$RUNS/replug${TRAINED:+ trained=$TRAINED}"
    for spec in $systems; do
        name=${spec%%=*} dir=${spec#*=}
        echo "== retrieval: $name $(date -u +%H:%M:%S)"
        # The same corpus embeddings and index the judging uses (host encode refuses a model
        # changed in place, so a retrained model needs a new AUGMENT_OUT).
        dense_index "$name" "$dir"
        args=()
        for task in squad wikidata; do
            q=$D/tasks/$task/queries.dev.jsonl
            trec=$ev/$name.$task.dev.trec
            # A model trained on task names (TRAINED) encodes each task's queries as that task's.
            [[ -f $trec && $trec -nt $INDEXES/$name-flat/index.json ]] || \
                $H search --index "$INDEXES/$name-flat" --encoder dpr --model "$dir" --queries "$q" --task "$task" --k 100 --output "$trec"
            args+=(--run "$trec" --qrels "$D/tasks/$task/qrels.dev.tsv" --queries "$q" --task "$task")
        done
        $H eval --corpus $D/corpus.jsonl "${args[@]}" --per-query --output "$ev/$name.metrics.json" >/dev/null
    done
    .venv/bin/python scripts/experiments/aar_retrieval_table.py "$ev" | tee "$ev/table.md"
fi

if [[ $STAGE == rank || ( $STAGE == all && -n ${RANKINGS:-} ) ]]; then
    # The 3 passages each judged retriever (and zero-shot MiniLM) gives every short-answer dev
    # question, as TREC runs under $RANKINGS: committed, they let the judge stage go on in a
    # later session, or on another machine, without the models or their indexes. Beside each,
    # shortqa-NAME.json records what made it (the encoder's checkpoint digest and the corpus's,
    # from encode.json, and the questions' SHA-256): a ranking is kept only while the model
    # that is here (when one is) is the one that made it.
    [[ -n ${RANKINGS:-} ]] || { echo "STAGE=rank needs RANKINGS=DIR (where the rankings go)" >&2; exit 2; }
    mkdir -p "$RANKINGS"
    q=$(mktemp --suffix=.jsonl)
    trap 'rm -f "$q"' EXIT
    python3 -c 'import json,sys
for l in open(sys.argv[1]):
    r = json.loads(l); print(json.dumps({"_id": r["_id"], "text": r["question"]}))' data/minikilt/shortqa/dev.jsonl > "$q"
    for spec in minilm=$M $(for n in ${JUDGED-aar human replug}; do echo "$n=$RUNS/$n"; done); do
        name=${spec%%=*} dir=${spec#*=}
        trec=$RANKINGS/shortqa-$name.trec rec=$RANKINGS/shortqa-$name.json
        if [[ -f $trec ]]; then
            [[ -f $rec ]] || { echo "$trec: no $rec says which model made it; remove the ranking to rank again" >&2; exit 2; }
            # No model here (another machine, or a training not finished): nothing to compare.
            [[ -f $dir/model.safetensors ]] || continue
        fi
        echo "== ranking: $name $(date -u +%H:%M:%S)"
        dense_index "$name" "$dir"
        if [[ -f $trec ]]; then
            python3 scripts/experiments/ranking_record.py --check "$rec" "$INDEXES/$name-corpus/encode.json" data/minikilt/shortqa/dev.jsonl || exit 2
            continue
        fi
        $H search --index "$INDEXES/$name-flat" --encoder dpr --model "$dir" --queries "$q" --k 3 --output "$trec"
        python3 scripts/experiments/ranking_record.py --write "$rec" "$INDEXES/$name-corpus/encode.json" data/minikilt/shortqa/dev.jsonl
    done
    rm -f "$q"
    trap - EXIT
fi

if [[ $STAGE == all || $STAGE == judge ]]; then
    # JUDGED: which of the trained retrievers are judged (RETRIEVERS: which built-in ones).
    # With RANKINGS (STAGE=rank's output), the passages come from those rankings.
    models="" ranked=""
    for name in ${JUDGED-aar human replug}; do
        if [[ -n ${RANKINGS:-} ]]; then
            ranked+=" $name=$RANKINGS/shortqa-$name.trec"
        else
            models+=" $name=$RUNS/$name"
        fi
    done
    if [[ -n ${RANKINGS:-} ]]; then ranked+=" minilm=$RANKINGS/shortqa-minilm.trec"; fi
    for target in $TARGETS; do
        case $target in
            gemma3-270m) config=configs/augment/openai.toml ;;
            *) config=configs/augment/chat.toml ;;
        esac
        echo "== judge: $target $(date -u +%H:%M:%S)"
        TARGET=$target CONFIG=$config EVERY=$EVERY MODELS="$models" RANKED="$ranked" \
            OUT=$AUGMENT_OUT/$target INDEXES=$INDEXES scripts/experiments/augment_minikilt.sh
    done
fi
