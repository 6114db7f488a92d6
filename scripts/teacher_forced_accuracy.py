#!/usr/bin/env python3
"""A drafter's teacher-forced greedy accuracy along plain greedy decoding, every position an anchor.

`dspark bench decode` measures acceptance where decoding rounds start: after a rejection, mostly,
which are harder positions than average. This script removes that selection: `dspark
draft-trace --accept 0` walks the target's own greedy path one token a round and drafts a whole
block at every position, so draft k of round r is compared with the greedy token r + k + 1. It
prints the unconditional accuracy per position, the first position's accuracy after a hit and
after a miss of the round before (the selection effect itself), and the τ a fixed block of γ
would reach if every position opened a round.

Usage: scripts/teacher_forced_accuracy.py DRAFTER [--prompts data/bench/mbpp-test.jsonl]
           [--skip 0] [--n 8] [--tokens 96] [--target qwen2.5-coder-1.5b] [--dspark target/release/dspark]
"""
import argparse
import json
import re
import subprocess

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("drafter")
ap.add_argument("--prompts", default="data/bench/mbpp-test.jsonl")
ap.add_argument("--skip", type=int, default=0)
ap.add_argument("--n", type=int, default=8)
ap.add_argument("--tokens", type=int, default=96)
ap.add_argument("--target", default="qwen2.5-coder-1.5b")
ap.add_argument("--dspark", default="target/release/dspark")
a = ap.parse_args()

texts = []
for i, line in enumerate(open(a.prompts)):
    if i >= a.skip + a.n:
        break
    if i >= a.skip:
        row = json.loads(line)
        texts.append(next(row[k] for k in ("prompt", "text", "question", "problem") if k in row))

traces = []
for t in texts:
    out = subprocess.run([a.dspark, "tokenize", "-m", a.target, "--json", t], check=True, capture_output=True, text=True)
    tokens = ",".join(map(str, json.loads(out.stdout)["tokens"]))
    out = subprocess.run([a.dspark, "draft-trace", "--target", a.target, "--drafter", a.drafter,
                          "--prompt-tokens", tokens, "--accept", "0", "--rounds", str(a.tokens + 1)],
                         check=True, capture_output=True, text=True)
    rounds = [(int(m.group(1)), [int(x) for x in m.group(2).split(",")])
              for m in re.finditer(r"round \d+: anchor (\d+), drafts \[(.*)\]", out.stdout)]
    traces.append(rounds)

gamma = len(traces[0][0][1])
hit, tot = [0] * gamma, [0] * gamma
after = {True: [0, 0], False: [0, 0]}
runs = [0] * (gamma + 1)
for rounds in traces:
    anchors = [r[0] for r in rounds]
    for r, (_, drafts) in enumerate(rounds):
        for k in range(gamma):
            if r + k + 1 < len(rounds):
                tot[k] += 1
                hit[k] += drafts[k] == anchors[r + k + 1]
        if 1 <= r < len(rounds) - 1:
            prev = rounds[r - 1][1][0] == anchors[r]
            after[prev][0] += drafts[0] == anchors[r + 1]
            after[prev][1] += 1
        if r + gamma < len(rounds):
            n = 0
            while n < gamma and drafts[n] == anchors[r + n + 1]:
                n += 1
            runs[n] += 1

print(f"{len(traces)} prompts, {tot[0]} positions")
print("teacher-forced greedy accuracy per position:", " ".join(f"{h / t:.3f}" for h, t in zip(hit, tot)))
for prev, name in ((True, "hit"), (False, "miss")):
    h, t = after[prev]
    print(f"position 1 after a {name} at the previous position: {h / t:.3f} ({t})")
print(f"τ at γ {gamma} if every position opened a round: {sum((n + 1) * c for n, c in enumerate(runs)) / sum(runs):.2f}")
