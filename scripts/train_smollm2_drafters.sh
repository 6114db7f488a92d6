#!/usr/bin/env bash
# The shipped SmolLM2-135M drafters, end to end, under one budget: the same regenerated data, γ = 7,
# one draft layer, an 8 192-token draft vocabulary, the same wall time per method.
# Usage: scripts/train_smollm2_drafters.sh [SAMPLES] [MINUTES_PER_METHOD]
# Work files go to $DSPARK_HOME/train (default ~/.cache/dspark/train); checkpoints to $DEST
# (default drafters/). METHODS (default "dspark-markov dspark-rnn dflash eagle3") picks a subset,
# e.g. for a data-scaling run: METHODS="dspark-markov dflash" DEST=/tmp/scaling scripts/... 2400 15
set -euo pipefail
cd "$(dirname "$0")/.."
SAMPLES=${1:-1000}
MINUTES=${2:-18}
W=${DSPARK_HOME:-$HOME/.cache/dspark}/train
DEST=${DEST:-drafters}
METHODS=${METHODS:-dspark-markov dspark-rnn dflash eagle3}
mkdir -p "$W"
cargo build --release
D=target/release/dspark

# 1. Prompts (ShareGPT first turns, disjoint from every benchmark) and target-regenerated answers.
[ -f "$W/prompts.jsonl" ] || $D data prompts --out "$W/prompts.jsonl"
$D data regenerate --prompts "$W/prompts.jsonl" --out "$W/smollm2-regen.jsonl" --n "$SAMPLES" --max-tokens 384 --batch 16
# 2. Target features of the five DFlash layers + final norm, once for all methods.
$D data features --data "$W/smollm2-regen.jsonl" --out "$W/smollm2-features" --max-len 512 --n "$SAMPLES"

# 3. Steps per method: measured step time × budget.
common=(--data "$W/smollm2-regen.jsonl" --features "$W/smollm2-features" --n "$SAMPLES" --block 7 --layers 1
        --draft-vocab 8192 --vocab-from "$W/smollm2-regen.jsonl" --markov-rank 32 --max-len 512 --batch 4 --anchors 16)
for m in $METHODS; do
  case $m in
    dspark-markov) args=(--method dspark --head markov) ;;
    dspark-rnn) args=(--method dspark --head rnn) ;;
    dflash) args=(--method dflash) ;;
    eagle3) args=(--method eagle3) ;;
  esac
  probe="$W/probe-$m"; rm -rf "$probe"
  # 12 probe steps, median of the last 10: the first steps fault the feature cache in and ran
  # 40 % slow, which once cost DSpark a quarter of its steps.
  $D train "${args[@]}" "${common[@]}" --out "$probe" --steps 12 --checkpoint-every 100 2>/dev/null
  step_s=$(python3 -c "import json,statistics;L=[json.loads(l) for l in open('$probe/train_log.jsonl')][2:];print(statistics.median(r['step_s'] for r in L))")
  steps=$(python3 -c "print(max(20, int($MINUTES*60/$step_s)))")
  echo "$m: $step_s s/step → $steps steps"
  out="$W/run-$m"; rm -rf "$out"
  $D train "${args[@]}" "${common[@]}" --out "$out" --steps "$steps" --checkpoint-every 50
  mkdir -p "$DEST/smollm2-135m-$m"
  cp "$out/config.json" "$out/model.safetensors" "$out/train_log.jsonl" "$DEST/smollm2-135m-$m/"
done

# 4. Calibrate the DSpark drafters on held-out prompts (never regenerated: index ≥ 12000).
for m in $METHODS; do
  [[ $m == dspark-* ]] || continue
  $D calibrate --drafter "$DEST/smollm2-135m-$m" --prompts "$W/prompts.jsonl" --skip 12000 --n 40 --max-tokens 128 \
    | tee "$DEST/smollm2-135m-$m/calibration.txt"
done
