#!/usr/bin/env bash
# The speculative-decoding figures of docs/BENCHMARKS.md, in one run (≈ 6 minutes on 2 cores).
# Needs the llama.cpp peer: python3 -m venv /tmp/xl && /tmp/xl/bin/pip install xllamacpp
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PEER_PYTHON:-/tmp/xl/bin/python}
M=${DSPARK_HOME:-$HOME/.cache/dspark}/models
CODE=data/bench/mbpp-test.jsonl
D=./target/release/dspark
cargo build --release -q
$D bench decode -m smollm2-135m --drafter ngram --draft-len 3 --prompts $CODE --n 8 --max-tokens 128
$PY scripts/peer_llamacpp.py --model $M/SmolLM2-135M-Instruct.Q4_1.gguf --prompts $CODE --n 8 --max-tokens 128 2>/dev/null | tail -1
$D bench decode -m qwen2.5-coder-1.5b --drafter draft:qwen2.5-coder-0.5b --draft-len 3 --prompts $CODE --n 4 --max-tokens 96
$D bench decode -m qwen2.5-coder-1.5b --drafter ngram --draft-len 3 --prompts $CODE --n 4 --max-tokens 96
$PY scripts/peer_llamacpp.py --model $M/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --prompts $CODE --n 4 --max-tokens 96 2>/dev/null | tail -1
$PY scripts/peer_llamacpp.py --model $M/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --draft $M/qwen2.5-coder-0.5b-instruct.gguf --draft-max 4 --prompts $CODE --n 4 --max-tokens 96 2>/dev/null | tail -1
