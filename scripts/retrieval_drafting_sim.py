#!/usr/bin/env python3
"""Would a retrieval drafter (REST / SuffixDecoding style) help `--drafter auto`? A replay.

Walks the target's greedy path on each prompt (`dspark draft-trace --accept 0`, which also gives
the DSpark drafter's block and raw confidences at every position) and replays decoding with
drafts from: prompt lookup (3 tokens), the DSpark drafter (cut where the plan of Algorithm 1 on
the cost curve below stops paying), a datastore of the target's own committed training answers
(longest suffix of the context found in a suffix array, then the most frequent continuation,
its frequency as confidence), today's `auto` (lookup against the model by first confidence),
`auto` plus the datastore, and an oracle that picks the best of the three every round. Speeds
are estimates from the cost curve (forward of k tokens / forward of 1; a drafting round 0.09),
measured on the AVX2 Zen 2 (docs/TRAINING.md, nineteenth session).

Usage: scripts/retrieval_drafting_sim.py [--prompts data/bench/mbpp-test.jsonl] [--n 16]
           [--tokens 128] [--answers data/train/qwen2.5-coder-1.5b-answers.jsonl]
           [--drafter drafters/qwen2.5-coder-1.5b-dspark-markov] [--dspark target/release/dspark]
Needs numpy.
"""
import argparse
import bisect
import json
import math
import re
import subprocess
from collections import Counter

import numpy as np

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--prompts", default="data/bench/mbpp-test.jsonl")
ap.add_argument("--n", type=int, default=16)
ap.add_argument("--tokens", type=int, default=128)
ap.add_argument("--answers", default="data/train/qwen2.5-coder-1.5b-answers.jsonl")
ap.add_argument("--drafter", default="drafters/qwen2.5-coder-1.5b-dspark-markov")
ap.add_argument("--target", default="qwen2.5-coder-1.5b")
ap.add_argument("--dspark", default="target/release/dspark")
a = ap.parse_args()

F = [1.0, 1.0, 1.10, 1.21, 1.29, 1.58, 1.88, 1.97, 2.06]  # forward(k) / forward(1), Zen 2
DRAFT_COST = 0.09
SEP = 2**31 - 1


def paths():
    rows = []
    for i, line in enumerate(open(a.prompts)):
        if i >= a.n:
            break
        row = json.loads(line)
        text = next(row[k] for k in ("prompt", "text", "question", "problem") if k in row)
        out = subprocess.run([a.dspark, "tokenize", "-m", a.target, "--json", text], check=True,
                             capture_output=True, text=True)
        prompt = json.loads(out.stdout)["tokens"]
        out = subprocess.run([a.dspark, "draft-trace", "--target", a.target, "--drafter", a.drafter,
                              "--prompt-tokens", ",".join(map(str, prompt)), "--accept", "0",
                              "--rounds", str(a.tokens + 1)], check=True, capture_output=True, text=True).stdout
        rounds = [(int(m.group(1)), [int(x) for x in m.group(2).split(",")])
                  for m in re.finditer(r"round \d+: anchor (\d+), drafts \[(.*)\]", out)]
        conf = [float(x) for x in re.findall(r"confidence logit (\S+)", out)]
        g = len(rounds[0][1])
        rows.append({"prompt": prompt, "gen": [r[0] for r in rounds], "drafts": [r[1] for r in rounds],
                     "conf": [[1 / (1 + math.exp(-c)) for c in conf[i * g:(i + 1) * g]] for i in range(len(rounds))]})
    return rows


class Datastore:
    """A suffix array over the answers' tokens (prefix doubling, ranks over 128 tokens)."""

    def __init__(self, path):
        toks = []
        for line in open(path):
            r = json.loads(line)
            toks += r["tokens"][r["prompt_len"]:] + [SEP]
        rank, n, k = np.array(toks, dtype=np.int64), len(toks), 1
        while True:
            r2 = np.full(n, -1, dtype=np.int64)
            r2[:n - k] = rank[k:]
            sa = np.lexsort((r2, rank))
            k1, k2 = rank[sa], r2[sa]
            new = np.empty(n, dtype=bool)
            new[0] = True
            new[1:] = (k1[1:] != k1[:-1]) | (k2[1:] != k2[:-1])
            rank = np.empty(n, dtype=np.int64)
            rank[sa] = np.cumsum(new) - 1
            if new.all() or k > 64:
                break
            k *= 2
        self.t, self.sa = toks, sa.tolist()

    def range(self, pat, lo=0, hi=None):
        key = lambda i: self.t[i:i + len(pat)]
        hi = len(self.sa) if hi is None else hi
        lo = bisect.bisect_left(self.sa, pat, lo, hi, key=key)
        return lo, bisect.bisect_right(self.sa, pat, lo, hi, key=key)

    def draft(self, ctx, gamma=7, longest=32):
        for m in range(min(longest, len(ctx)), 0, -1):
            lo, hi = self.range(ctx[-m:])
            if hi > lo:
                break
        else:
            return [], []
        pat, out, conf = list(ctx[-m:]), [], []
        for _ in range(gamma):
            step = max(1, (hi - lo) // 4096)
            c = Counter(self.t[self.sa[j] + len(pat)] for j in range(lo, hi, step) if self.sa[j] + len(pat) < len(self.t))
            c.pop(SEP, None)
            if not c:
                break
            tok, cnt = c.most_common(1)[0]
            out.append(tok)
            conf.append(cnt / (sum(c.values()) + 1))
            pat.append(tok)
            lo, hi = self.range(pat, lo, hi)
        return out, conf


def lookup(ctx, max_len=3):
    for n in (4, 3, 2):
        suf = ctx[-n:]
        for s in range(len(ctx) - n - 1, -1, -1):
            if ctx[s:s + n] == suf:
                return ctx[s + n:s + n + max_len]
    return []


def plan(conf):
    """Algorithm 1's verify length on the cost curve: most expected tokens per unit of cost."""
    s, tokens, best = 1.0, 1.0, (1.0, 0)
    for k, c in enumerate(conf, 1):
        s *= c
        tokens += s
        best = max(best, (tokens / F[k + 1], k))
    return best[1]


def value(d, c):
    k = plan(c)
    s = tokens = 1.0
    for x in c[:k]:
        s *= x
        tokens += s
    return tokens / F[k + 1]


def accepted(d, truth):
    n = 0
    for x, y in zip(d, truth):
        if x != y:
            break
        n += 1
    return n


def replay(rows, choose):
    tokens = cost = rounds = 0
    for row in rows:
        P, G, r, n = row["prompt"], row["gen"], 0, len(row["gen"]) - 1
        while r < n:
            truth = G[r + 1:n + 1]
            d, dc = choose(P + G[:r + 1], row["drafts"][r], row["conf"][r], truth)
            d = d[:len(truth)]
            acc = accepted(d, truth)
            r, tokens, rounds, cost = r + acc + 1, tokens + acc + 1, rounds + 1, cost + F[len(d) + 1] + dc
    return tokens / rounds, tokens / cost


store = Datastore(a.answers)
rows = paths()


def model(ctx, md, mc, _):
    return md[:plan(mc)], DRAFT_COST


def auto(ctx, md, mc, _):
    found = lookup(ctx)
    return (found, DRAFT_COST) if found and 0.8 > mc[0] else model(ctx, md, mc, _)


def auto_store(ctx, md, mc, _):
    cands = [(md, mc), store.draft(ctx)]
    found = lookup(ctx)
    if found:
        cands.append((found, [0.8] * len(found)))
    d, c = max((x for x in cands if x[0]), key=lambda x: value(*x))
    return d[:plan(c)], DRAFT_COST


def oracle(ctx, md, mc, truth):
    sd, sc = store.draft(ctx)
    cands = [md[:plan(mc)], sd[:plan(sc)], lookup(ctx)]
    return max(cands, key=lambda d: (accepted(d[:len(truth)], truth) + 1) / (F[len(d[:len(truth)]) + 1] + DRAFT_COST)), DRAFT_COST


for name, f in [("prompt lookup", lambda c, md, mc, t: (lookup(c), 0.0)),
                ("DSpark, Algorithm 1", model),
                ("datastore", lambda c, md, mc, t: (lambda d, s: (d[:plan(s)], 0.0))(*store.draft(c))),
                ("auto (today)", auto), ("auto + datastore", auto_store), ("oracle of the three", oracle)]:
    tau, speed = replay(rows, f)
    print(f"{name:22s} τ {tau:.2f}   estimated speed {speed:.2f}× plain")
