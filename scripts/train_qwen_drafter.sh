#!/usr/bin/env bash
# The Qwen2.5-Coder-1.5B drafter (docs/TRAINING.md), stage by stage and resumable: run it again
# after an interruption, or in the next session, and every stage continues where it stopped
# (answers and features already on disk are kept; training resumes from its last checkpoint).
# Usage: scripts/train_qwen_drafter.sh [SAMPLES] [STEPS] [METHOD]
#   METHOD: dspark-markov | dflash | dspark-markov-2l (two draft layers, started from the
#   one-layer run's last checkpoint deepened by `init-drafter --grow`) | continue (trains on
#   from the shipped drafter in drafters/: what a new machine, which keeps nothing but the
#   repository, starts from; LR defaults to 3e-4 for it; once a `continue` run has been shipped,
#   remove $W/qwen-run-continue so that the next one starts from the new shipped drafter) |
#   continue-3l (the shipped two-layer drafter deepened to three by `init-drafter --grow`, which
#   drafts exactly what it drafted at step 0, trained on; ships in 4 bits, `--format dspark-q4`)
# Environment: EXTRA, more prompt ranges to answer (below); LR, the peak learning rate of a new run (default 6e-4; a resumed run keeps its own).
# SAMPLES counts code prompts tried; prompts too long for the 512-token window are skipped.
# Work files and runs go to $DSPARK_HOME/train (default ~/.cache/dspark/train).
set -euo pipefail
cd "$(dirname "$0")/.."
SAMPLES=${1:-2000}
STEPS=${2:-20000}
METHOD=${3:-dspark-markov}
W=${DSPARK_HOME:-$HOME/.cache/dspark}/train
T=qwen2.5-coder-1.5b
mkdir -p "$W"
cargo build --release
D=target/release/dspark

# 1. Code prompts from ShareGPT (disjoint from every benchmark), answered by the target itself;
#    the target's features (five layers + final norm, f16: ~18 KB per token) are captured in the
#    same pass.
[ -f "$W/code-prompts.jsonl" ] || $D data prompts --topic code --out "$W/code-prompts.jsonl"
# 1b. More code prompts after ShareGPT's 2 064 (whose indices stay): functions and classes to write
#     from the docstrings of the running Python's standard library (≈ 3 500 with Python 3.11),
#     through the same benchmark filter. Answer them with an EXTRA range from 2064 on.
if [ ! -f "$W/stdlib-prompts.jsonl" ]; then
  python3 scripts/stdlib_code_prompts.py "$W/stdlib-prompts.jsonl.part"
  $D data prompts --from "$W/stdlib-prompts.jsonl.part" --append --out "$W/code-prompts.jsonl"
  mv "$W/stdlib-prompts.jsonl.part" "$W/stdlib-prompts.jsonl"
fi
# 1c. More after the standard library's (from index 5 571): functions and classes to write from
#     the docstrings of permissively licensed PyPI packages, pinned so that every machine makes
#     the same prompts at the same indices (licences in data/train/README.md), in two appends
#     (`data prompts --append` orders each batch its own way, so the split is part of the
#     indices): boltons, more-itertools and toolz are 5 571–6 162, pydash, funcy and networkx
#     6 163–7 773. Answer them with EXTRA="5571:2203".
if [ ! -f "$W/pkg-prompts.jsonl" ]; then
  P="$W/pkgs"
  mkdir -p "$P"
  python3 -m pip download -q --no-deps --no-binary :all: -d "$P" boltons==26.2.0 more-itertools==11.2.1 \
    toolz==1.2.0 pydash==8.1.0 funcy==2.1 networkx==3.6.1
  for batch in "boltons-26.2.0 more_itertools-11.2.1 toolz-1.2.0" "pydash-8.1.0 funcy-2.1 networkx-3.6.1"; do
    : > "$W/pkg-batch.jsonl"
    for pkg in $batch; do
      tar -xzf "$P/$pkg.tar.gz" -C "$P"
      python3 scripts/stdlib_code_prompts.py "$P/$pkg.jsonl" --root "$P/$pkg"
      cat "$P/$pkg.jsonl" >> "$W/pkg-batch.jsonl"
    done
    $D data prompts --from "$W/pkg-batch.jsonl" --append --out "$W/code-prompts.jsonl"
  done
  mv "$W/pkg-batch.jsonl" "$W/pkg-prompts.jsonl"
fi
# 1e. More after those (from index 7 774): the same from nine more pinned packages' own code
#     (vendored folders left out), one append: sympy, numpy, scipy, pandas, scikit-learn, click,
#     werkzeug, sortedcontainers, attrs (licences in data/train/README.md). Downloaded by hash
#     without building anything (scripts/fetch_sdists.py says why). Answer them with EXTRA="7774:N".
if [ ! -f "$W/pkg2-prompts.jsonl" ]; then
  P="$W/pkgs2"
  python3 scripts/fetch_sdists.py "$P" \
    sympy==1.14.0=d3d3fe8df1e5a0b42f0e7bdf50541697dbe7d23746e894990c030e2b05e72517 \
    numpy==2.4.6=f3a3570c4a2a16746ac2c31a7c7c7b0c186b95ce902e33db6f28094ed7387dda \
    scipy==1.17.1=95d8e012d8cb8816c226aef832200b1d45109ed4464303e997c5b13122b297c0 \
    pandas==3.1.1=05fed3e3b7c99b226f160e29d7d6cb7ef39638c758cbfe42b3f24ba34f04b859 \
    scikit-learn==1.9.1=629cada3e33e2b9bf376cdc7614a47a4140b8aedc1d836579e359736fbd82977 \
    click==8.5.1=9bbfada76703fd1d784b83eea012e3e8c6a001a876543ef104fa56aaaeb072b4 \
    werkzeug==3.1.9=55ca7c70a75689be937aa27f8ff4b018f06ff4838fc73045560bf0f5a1291060 \
    sortedcontainers==2.4.0=25caa5a06cc30b6b83d11423433f65d1f9d76c4c6a0c90e3379eaa43b9bfdb88 \
    attrs==26.1.0=d03ceb89cb322a8fd706d4fb91940737b6642aa36998fe130a9bc96c985eff32
  skip=(--skip-dir externals --skip-dir vendored --skip-dir array_api_extra --skip-dir array_api_compat
        --skip-dir cobyqa --skip-dir pyprima --skip-dir _uarray --skip-dir benchmarks)
  : > "$W/pkg2-batch.jsonl"
  for root in sympy-1.14.0/sympy numpy-2.4.6/numpy scipy-1.17.1/scipy pandas-3.1.1/pandas \
      scikit_learn-1.9.1/sklearn click-8.5.1/src werkzeug-3.1.9/src \
      sortedcontainers-2.4.0/sortedcontainers attrs-26.1.0/src; do
    pkg=${root%%/*}
    [ -d "$P/$pkg" ] || tar -xzf "$P/$pkg.tar.gz" -C "$P"
    python3 scripts/stdlib_code_prompts.py "$P/$pkg.jsonl" --root "$P/$root" "${skip[@]}"
    cat "$P/$pkg.jsonl" >> "$W/pkg2-batch.jsonl"
  done
  $D data prompts --from "$W/pkg2-batch.jsonl" --append --out "$W/code-prompts.jsonl"
  mv "$W/pkg2-batch.jsonl" "$W/pkg2-prompts.jsonl"
fi
# 1d. Answers earlier sessions regenerated, committed (data/train/README.md) because a new machine
#     keeps nothing but the repository: a fresh answers file starts from them, `regenerate` skips
#     their prompts, and step 2 recomputes their features.
A=data/train/$T-answers.jsonl
[ -f "$W/qwen-code-regen.jsonl" ] || { [ -f "$A" ] && cp "$A" "$W/qwen-code-regen.jsonl"; } || true
regen=(-m $T --prompts "$W/code-prompts.jsonl" --out "$W/qwen-code-regen.jsonl"
       --max-tokens 384 --batch 32 --features "$W/qwen-features" --max-len 512)
$D data regenerate "${regen[@]}" --n "$SAMPLES"
# More prompt ranges, as SKIP:N pairs (e.g. EXTRA="1224:840", the third shipped drafter's second
# range, or "2064:600", the first standard-library prompts; prompts 1 200–1 223 are held out for
# calibration): same answers file, same feature cache.
for r in ${EXTRA:-}; do
  $D data regenerate "${regen[@]}" --skip "${r%%:*}" --n "${r##*:}"
done
# 2. Features of answers regenerated without --features (earlier runs of this script).
$D data features -m $T --data "$W/qwen-code-regen.jsonl" --out "$W/qwen-features" --max-len 512

# 3. One draft layer with a 4 096-wide MLP (bf16 checkpoint < 80 MB), γ 7, 8 192-token draft
#    vocabulary, 64 anchored blocks per sequence.
case $METHOD in
  dspark-markov) args=(--method dspark --head markov) ;;
  dflash) args=(--method dflash) ;;
  dspark-markov-2l) args=(--method dspark --head markov) ;;
  continue|continue-3l) args=(--method dspark --head markov) ;;
  *) echo "METHOD must be dspark-markov, dflash, dspark-markov-2l, continue or continue-3l" >&2; exit 2 ;;
esac
LR=${LR:-$(case $METHOD in continue*) echo 3e-4 ;; *) echo 6e-4 ;; esac)}
out="$W/qwen-run-$METHOD"
if [ "$METHOD" = dspark-markov-2l ] && [ ! -d "$out/checkpoints" ]; then
  src=$(ls -d "$W"/qwen-run-dspark-markov/checkpoints/step-* | tail -1)
  [ -d "$out/init" ] || $D init-drafter --grow "$src" --layers 2 --out "$out/init"
  args+=(--init "$out/init")
fi
if [ "$METHOD" = continue ] && [ ! -d "$out/checkpoints" ]; then
  # The shipped drafter's layout (layers, widths, vocabulary) comes with it; its 8-bit weights
  # are dequantized, and the optimizer starts afresh.
  args+=(--init drafters/$T-dspark-markov)
fi
if [ "$METHOD" = continue-3l ] && [ ! -d "$out/checkpoints" ]; then
  [ -d "$out/init" ] || $D init-drafter --grow drafters/$T-dspark-markov --layers 3 --out "$out/init"
  args+=(--init "$out/init")
fi
# The layout options (layers, widths, vocabulary) shape a fresh drafter only: with --init or
# --resume the checkpoint's own layout is kept.
common=(--target $T --data "$W/qwen-code-regen.jsonl" --features "$W/qwen-features"
        --block 7 --layers 1 --intermediate 4096 --draft-vocab 8192 --vocab-from "$W/qwen-code-regen.jsonl"
        --markov-rank 32 --max-len 512 --batch 4 --anchors 64 --steps "$STEPS" --lr "$LR" --checkpoint-every 50)
if [ -d "$out/checkpoints" ]; then
  $D train "${args[@]}" "${common[@]}" --out "$out" --resume
else
  $D train "${args[@]}" "${common[@]}" --out "$out"
fi
