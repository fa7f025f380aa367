#!/usr/bin/env bash
# Recipes chosen on a validation split (issue 32, item 5; docs/RESULTS.md, "Recipes chosen on a
# validation split"): every recipe of configs/minikilt/select/ trained on the carved train split
# (scripts/experiments/carve_validation.py, run here if $VAL has no carving yet) for the same
# wall-clock budget as the sentence-transformers peer, then evaluated on the validation split,
# the unseen-page probe and dev. Choices are made on val and unseen; dev is the report.
#
#   scripts/experiments/recipe_select.sh                  # the whole plan below
#   scripts/experiments/recipe_select.sh taco:42 peer-st:42 zeroshot ...
#   .venv/bin/python scripts/experiments/select_table.py runs/select
#
# The whole plan: zeroshot (MiniLM at 128 tokens, untrained), then for seeds 42 43 44 each
# variant of $VARIANTS and peer-st. METHOD is a recipe of configs/minikilt/select/ (naive-peerlike,
# taco, taco-noprefix, taco-notsage, taco-stepneg, taco-t4, naive), peer-st
# (scripts/experiments/peer_st.py on the carved train split, with $PEER_OF-sSEED's BM25
# negatives: run that first), or zeroshot.
#
# Equal wall clock. The peer lays its learning-rate schedule over a time budget and stops when
# it is spent (peer_st.py), so its first run gets --seconds $BUDGET; the steps that run took
# are kept ($OUT/calib/peer-st.json) and every later seed trains that many steps (its schedule
# over those steps), so a faster or slower machine on another day changes no system's steps.
# `host train` runs a step count, so each recipe's steps are fitted to the budget once, before
# its first seed: a calibration run of $CAL_STEPS steps ($OUT/calib/METHOD.json) gives its seconds a step (the last logging
# window, after warm-up and T-SAGE's 30-step burn-in) and its fixed cost (loading, BM25
# mining, saving: the whole command's time less its steps), and max_steps = (BUDGET - fixed) /
# (seconds a step). The whole `host train` command then takes about $BUDGET, as minikilt.sh
# measured the peer's budget (the command's time, negative mining included). Each run's
# actual seconds are kept in METHOD-sSEED/done and shown by select_table.py, which flags runs
# more than 10% off the budget: time on a shared machine is not a constant, so calibrate and
# train on a quiet one (TRAIN_ONLY=1 trains back to back; a later run without it evaluates).
#
# Settings (environment):
#   OUT=runs/select           outputs: METHOD-sSEED/ (the run), .eval/ (corpus embeddings,
#                             index, TREC runs), METHOD-sSEED.SPLIT.metrics.json.gz (per
#                             query). What the tables need is small and can be committed:
#                             OUT=results/recipe-select keeps it across machines (its README)
#   VAL=runs/minikilt-val     the carved data (carve_validation.py's --out)
#   BUDGET=600                seconds of training for every system (taco.toml's 10 minutes)
#   VARIANTS="naive-peerlike taco taco-noprefix taco-notsage taco-stepneg taco-t4"
#   SEEDS="42 43 44"
#   CAL_STEPS=40              steps of a calibration run (a multiple of 10)
#   STEPS=N                   no calibration: every recipe trains N steps (a quick check of
#                             the pipeline; the peer still gets PEER_SECONDS)
#   PEER_SECONDS=$BUDGET      the peer's budget (given: every seed trains for it, no steps kept)
#   PEER_OF=naive-peerlike    the run whose negatives-episode-0.json the peer trains with (any
#                             recipe with hard_negatives = 1 and negative_depth = 1 mines the
#                             same top BM25 negative)
#   SPLITS="val unseen dev"   the splits evaluated
#   HOST=target/release/host  the binary (a copy can run while the checkout is rebuilt)
# Resumable: finished steps are skipped on a rerun, an interrupted training run continues from
# its checkpoint. A calibration is redone only when its file is removed.
set -euo pipefail
cd "$(dirname "$0")/../.."
H=${HOST:-target/release/host}
M=.cache/models/all-MiniLM-L6-v2
D=data/minikilt
OUT=${OUT:-runs/select}
VAL=${VAL:-runs/minikilt-val}
BUDGET=${BUDGET:-600}
CAL_STEPS=${CAL_STEPS:-40}
VARIANTS=(${VARIANTS:-naive-peerlike taco taco-noprefix taco-notsage taco-stepneg taco-t4})
SEEDS=(${SEEDS:-42 43 44})
SPLITS=(${SPLITS:-val unseen dev})
PEER_OF=${PEER_OF:-naive-peerlike}
TASKS=(fever squad vitaminc wikidata)
PY=.venv/bin/python
[[ -x $PY ]] || PY=python3

die() { echo "recipe_select.sh: $*" >&2; exit 2; }
[[ -x $H ]] || die "$H: no such binary (cargo build --release --workspace, or set HOST)"
[[ -d $M ]] || die "$M: the model is missing (setup.sh fetches it)"
[[ $BUDGET =~ ^[0-9]+$ ]] || die "BUDGET=$BUDGET: give whole seconds"
(( CAL_STEPS >= 20 && CAL_STEPS % 10 == 0 )) || die "CAL_STEPS=$CAL_STEPS: give a multiple of 10, at least 20"
mkdir -p "$OUT/recipes" "$OUT/calib"
[[ -f $VAL/STATS.json ]] || python3 scripts/experiments/carve_validation.py --data $D --out "$VAL"

# record_time RUN START BUDGET [resumed]: the training command's seconds into RUN/done, and a
# warning when they are more than 10% off BUDGET: the machine's speed changed since the
# calibration, or other work shared the cores. select_table.py marks such a run with †; its
# model is still the one its steps give, but the budgets are no longer equal: calibrate again on
# a quiet machine (remove $OUT/calib/METHOD.json, and each METHOD-sSEED/ with its
# METHOD-sSEED.eval/ and METHOD-sSEED.*.metrics.json.gz). A resumed run's seconds are only the
# resumed part's, so they say nothing of the machine.
record_time() {
    local secs=$(( $(date +%s) - $2 ))
    echo "$secs" > "$1/done"
    if [[ -n ${4:-} ]]; then
        echo "recipe_select.sh: $(basename "$1") was resumed: its done ($secs s) holds the resumed part only" >&2
    elif [[ -z ${STEPS:-} ]] && (( secs * 10 < $3 * 9 || secs * 10 > $3 * 11 )); then
        echo "recipe_select.sh: warning: $(basename "$1") trained in $secs s, more than 10% off the budget of $3 s" >&2
    fi
}

# drop_evaluation NAME: a run trained from the start loses any evaluation of an earlier model
# and any killed run's temporary.
drop_evaluation() { rm -rf "$OUT/$1.eval" "$OUT/$1".*.metrics.json* "$OUT/.$1.tmp-"*; }

# set_key FILE KEY VALUE: replace the line `KEY = ...` of a recipe (it must have one).
set_key() {
    grep -q "^$2 = " "$1" || die "$1: no '$2 = ' line to replace"
    sed -i "s#^$2 = .*#$2 = $3#" "$1"
}

# A copy of configs/minikilt/select/METHOD.toml reading $VAL and training STEPS steps.
recipe_copy() {  # METHOD STEPS FILE
    local src=configs/minikilt/select/$1.toml
    [[ -f $src ]] || die "$1: no recipe $src (methods: $(ls configs/minikilt/select | sed 's/\.toml$//' | tr '\n' ' ')peer-st zeroshot)"
    cp "$src" "$3"
    set_key "$3" task_dir "\"$VAL/tasks\""
    set_key "$3" max_steps "$2"
    set_key "$3" save_steps "$(( ($2 + 2) / 3 ))"
    # One checkpoint kept (the last, for a resume): the runs' folders stay at ~260 MB each.
    grep -q '^save_total_limit = ' "$3" || sed -i 's/^\[train\]$/[train]\nsave_total_limit = 1/' "$3"
}
encoder_of() { sed -n 's/^encoder = "\(.*\)"/\1/p' "$1" | head -1; }

# The steps that fill $BUDGET for METHOD (calibrated once, kept in $OUT/calib/METHOD.json).
steps_for() {
    local method=$1
    if [[ -n ${STEPS:-} ]]; then echo "$STEPS"; return; fi
    local cal=$OUT/calib/$method.json
    if [[ ! -f $cal ]]; then
        local run=$OUT/calib/$method.run recipe=$OUT/calib/$method.toml
        recipe_copy "$method" "$CAL_STEPS" "$recipe"
        set_key "$recipe" logging_steps 10
        rm -rf "$run"  # a calibration interrupted before its .json: its time would be wrong
        echo "== calibrating $method: $CAL_STEPS steps $(date -u +%H:%M:%S)" >&2
        local start end
        start=$(date +%s.%N)
        $H train --encoder "$(encoder_of "$recipe")" --model $M --config "$recipe" --seed 42 --output-dir "$run" >&2
        end=$(date +%s.%N)
        python3 - "$run/trainer_log.jsonl" "$start" "$end" "$BUDGET" "$CAL_STEPS" "$cal" <<'EOF' >&2
import json, math, os, sys
log, start, end, budget, cal_steps, out = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
lines = [json.loads(l) for l in open(log) if l.strip()]
by_step = {l["step"]: l["seconds_per_step"] for l in lines}
a, b = cal_steps - 10, cal_steps
if a not in by_step or b not in by_step:
    sys.exit(f"{log}: no log lines at steps {a} and {b}")
# seconds_per_step is the mean since the loop started: the last window's own mean from two.
late = (b * by_step[b] - a * by_step[a]) / (b - a)
total = end - start
fixed = total - b * by_step[b]
steps = max(1, math.floor((budget - fixed) / late))
rec = {"calibration_steps": b, "command_seconds": round(total, 2), "seconds_per_step_last_window": round(late, 4),
       "seconds_per_step_mean": round(by_step[b], 4), "fixed_seconds": round(fixed, 2), "budget": budget, "steps": steps}
tmp = out + ".tmp"
open(tmp, "w").write(json.dumps(rec, indent=2) + "\n")
os.replace(tmp, out)
print(f"calibration: {rec}")
EOF
        rm -rf "$run"  # written by this script just above; only the timing is kept
    fi
    python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["steps"])' "$cal"
}

# The plan when no METHOD is given.
specs=("$@")
if (( ${#specs[@]} == 0 )); then
    specs=(zeroshot)
    for seed in "${SEEDS[@]}"; do
        for v in "${VARIANTS[@]}"; do specs+=("$v:$seed"); done
        specs+=("peer-st:$seed")
    done
fi

for spec in "${specs[@]}"; do
    method=${spec%%:*}
    seed=42
    [[ $spec == *:* ]] && seed=${spec##*:}
    if [[ $method == zeroshot ]]; then
        name=zeroshot model=$M enc=dpr len=(--max-length 128)
    else
        name=$method-s$seed model=$OUT/$name enc=dpr len=()
    fi
    run=$OUT/$name
    echo "== $name $(date -u +%H:%M:%S)"
    if [[ $method == peer-st && ! -f $run/done ]]; then
        negs=$OUT/$PEER_OF-s$seed/negatives-episode-0.json
        [[ -f $negs ]] || die "peer-st:$seed needs $PEER_OF:$seed first (its $negs)"
        # A retrain starts clean: no earlier model, evaluation, or killed run's temporary.
        rm -rf "$run"
        drop_evaluation "$name"
        start=$(date +%s)
        peer_cal=$OUT/calib/peer-st.json
        budget=(--seconds "${PEER_SECONDS:-$BUDGET}")
        if [[ -z ${PEER_SECONDS:-} && -z ${STEPS:-} && -f $peer_cal ]]; then
            # The steps of the peer's first run; the time limit only guards against a hang.
            budget=(--seconds $(( 4 * BUDGET )) --max-steps "$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["steps"])' "$peer_cal")")
        fi
        $PY scripts/experiments/peer_st.py "${budget[@]}" --seed "$seed" \
            --negatives "$negs" --model $M --data "$VAL" --out "$run"
        record_time "$run" "$start" "${PEER_SECONDS:-$BUDGET}"
        if [[ -z ${PEER_SECONDS:-} && -z ${STEPS:-} && ! -f $peer_cal ]]; then
            python3 - "$run/peer_run.json" "$name" "$BUDGET" "$peer_cal" <<'EOF'
import json, os, sys
run, name, budget, out = json.load(open(sys.argv[1])), sys.argv[2], float(sys.argv[3]), sys.argv[4]
rec = {"steps": run["steps"], "from": f"{name}'s run of {budget:.0f} s (stopped by {run['stopped_by']})", "budget": budget}
open(out + ".tmp", "w").write(json.dumps(rec, indent=2) + "\n")
os.replace(out + ".tmp", out)
EOF
        fi
    elif [[ $method != zeroshot && ! -f $run/done ]]; then
        recipe=$OUT/recipes/$method.toml
        steps=$(steps_for "$method")
        recipe_copy "$method" "$steps" "$recipe.new"
        # A resumed run must keep its recipe: refuse a step count that changed under it.
        if [[ -f $recipe ]] && ! cmp -s "$recipe" "$recipe.new" && compgen -G "$run/checkpoint-*" >/dev/null; then
            rm -f "$recipe.new"
            die "$recipe changed since $run began; remove $run to retrain"
        fi
        mv "$recipe.new" "$recipe"
        enc=$(encoder_of "$recipe")
        resume=()
        if compgen -G "$run/checkpoint-*" >/dev/null; then
            resume=(--resume-from-checkpoint latest)
        else
            drop_evaluation "$name"
        fi
        start=$(date +%s)
        $H train --encoder "$enc" --model $M --config "$recipe" --seed "$seed" --output-dir "$run" "${resume[@]}"
        record_time "$run" "$start" "$BUDGET" "${resume[*]}"
    fi
    # The encoder the recipe trained (a run finished earlier, evaluated now, as well).
    [[ $method != zeroshot && $method != peer-st && -f $OUT/recipes/$method.toml ]] && enc=$(encoder_of "$OUT/recipes/$method.toml")
    [[ -n ${TRAIN_ONLY:-} ]] && continue
    ev=$OUT/$name.eval
    mkdir -p "$ev/runs"
    need=()
    for split in "${SPLITS[@]}"; do
        [[ -f $OUT/$name.$split.metrics.json.gz ]] || need+=("$split")
    done
    (( ${#need[@]} )) || continue
    # A finished run kept without its model (results committed from another machine).
    compgen -G "$model/*.safetensors" >/dev/null || compgen -G "$model/model.safetensors*" >/dev/null ||
        die "$name: trained ($run/done) but its model is not here and ${need[*]} not evaluated: remove $run to retrain it"
    $H encode --encoder "$enc" --model "$model" "${len[@]}" --input $D/corpus.jsonl --output "$ev/corpus"
    [[ -f $ev/flat/index.json ]] || $H index build --kind flat --embeddings "$ev/corpus" --output "$ev/flat" >/dev/null
    for split in "${need[@]}"; do
        args=()
        for task in "${TASKS[@]}"; do
            q=$VAL/tasks/$task/queries.$split.jsonl
            [[ -f $q ]] || die "$q: missing (carve_validation.py writes val and unseen; dev is copied)"
            trec=$ev/runs/$task.$split.trec
            [[ -f $trec ]] || $H search --index "$ev/flat" --encoder "$enc" --model "$model" "${len[@]}" \
                --queries "$q" --task "$task" --k 100 --output "$trec"
            args+=(--run "$trec" --qrels "$VAL/tasks/$task/qrels.$split.tsv" --queries "$q" --task "$task")
        done
        $H eval --corpus $D/corpus.jsonl "${args[@]}" --per-query --output "$OUT/$name.$split.metrics.json" >/dev/null
        # Gzipped (1 MB of per-query JSON becomes about 25 KB): small enough to commit. Through a
        # temporary name: a .gz that exists is a whole one (it marks the split as evaluated).
        gzip -nc "$OUT/$name.$split.metrics.json" > "$OUT/.$name.$split.metrics.json.gz.tmp-$$"
        mv "$OUT/.$name.$split.metrics.json.gz.tmp-$$" "$OUT/$name.$split.metrics.json.gz"
        rm "$OUT/$name.$split.metrics.json"
    done
done
