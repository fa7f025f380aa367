# Shell functions the experiment scripts share (sourced; they read $H, the host binary, and
# $INDEXES, where indexes go).

# dense_index NAME DIR [CORPUS]: a dense index of CORPUS (default data/minikilt/corpus.jsonl)
# for model DIR under $INDEXES/NAME-flat. `host encode` runs every time: it does nothing when
# the embeddings are complete and made by the same checkpoint, and refuses a checkpoint that
# changed (a model retrained in place); the index is rebuilt when the embeddings are newer.
dense_index() {
    local corpus=${3:-data/minikilt/corpus.jsonl}
    $H encode --encoder dpr --model "$2" --input "$corpus" --output "$INDEXES/$1-corpus"
    if [[ ! -f $INDEXES/$1-flat/index.json || $INDEXES/$1-corpus/encode.json -nt $INDEXES/$1-flat/index.json ]]; then
        $H index build --kind flat --embeddings "$INDEXES/$1-corpus" --output "$INDEXES/$1-flat" >/dev/null
    fi
}
