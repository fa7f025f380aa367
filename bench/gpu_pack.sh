#!/usr/bin/env bash
# Packs what bench/gpu_check.sh needs on a lent GPU machine into .gpu/ (gitignored), small
# enough to travel with the working tree (the device tool carries at most 64 MiB in all):
# the release `host`, the plugins it uses, the parity-test binary of the T5 models and
# rak-core's unit tests,
# stripped and xz-compressed, and MiniLM's tokenizer and sentence-transformers files (not
# its weights: the check makes a MiniLM-shaped model with random weights there).
# Run here after `cargo build --release --workspace` and `cargo test --release --no-run`;
# then the device command is the one at the top of bench/gpu_check.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .gpu && mkdir -p .gpu/bin .gpu/minilm
for f in host librak_encoder_dpr.so librak_encoder_taco.so librak_reader_fid.so librak_optim_adamw.so librak_optim_tsage.so librak_command_aar.so; do
    cp target/release/$f .gpu/bin/
done
# The T5 parity tests (FiD cross-attention scores, bf16) run on CUDA when there is one.
t5=$(ls -t target/release/deps/t5_parity-* | grep -v '\.d$' | head -1)
cp "$t5" .gpu/bin/t5_parity
# rak-core's unit tests: those named on_cuda hold the CUDA kernels and the multi-tensor
# optimizer step to the CPU's (they skip without a GPU).
core=$(find target/release/deps -maxdepth 1 -name 'rak_core-*' -type f -executable -printf '%T@ %p\n' | sort -rn | head -1 | cut -d' ' -f2)
[[ -n $core ]] || { echo "gpu_pack: no rak-core test binary (run cargo test --release --no-run first)" >&2; exit 1; }
cp "$core" .gpu/bin/rak_core_tests
strip --strip-unneeded .gpu/bin/*
tar -C .gpu/bin -cJf .gpu/bin.tar.xz . && rm -rf .gpu/bin
M=.cache/models/all-MiniLM-L6-v2
cp -r $M/1_Pooling $M/config.json $M/config_sentence_transformers.json $M/modules.json \
    $M/sentence_bert_config.json $M/special_tokens_map.json $M/tokenizer.json $M/tokenizer_config.json $M/vocab.txt .gpu/minilm/
du -sh .gpu
