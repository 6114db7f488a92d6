#!/usr/bin/env bash
# Held-out acceptance and speed of the shipped SmolLM2 drafters: prompts never used in training
# (index ≥ 12000 of the prompts file), γ = 7, temperature 1 (the paper's τ protocol) and greedy.
# Usage: scripts/eval_smollm2_drafters.sh [N_PROMPTS] [MAX_TOKENS]   → JSON lines on stdout
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-20}
T=${2:-128}
W=${DSPARK_HOME:-$HOME/.cache/dspark}/train
D=target/release/dspark
for temp in 1.0 0.0; do
  for m in dspark-markov dspark-rnn dflash eagle3; do
    kind=${m%%-*}
    $D bench decode --prompts "$W/prompts.jsonl" --skip 12000 --n "$N" --max-tokens "$T" --temperature "$temp" \
      --drafter "$kind:drafters/smollm2-135m-$m" --draft-len 7 \
      | python3 -c "import json,sys; r=json.load(sys.stdin); r['temperature']=$temp; r['method']='$m'; print(json.dumps(r))"
  done
done
