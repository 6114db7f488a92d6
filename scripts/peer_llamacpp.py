#!/usr/bin/env python3
"""llama.cpp peer for `dspark` benchmarks, through PyPI's prebuilt `xllamacpp`.

Runs the same GGUF with the same thread count and prompts as the dspark bench, greedy, and
prints decode tokens/s (llama.cpp's own `timings.predicted_per_second`), plain or with
draft-model speculation.

    python3 -m venv /tmp/xl && /tmp/xl/bin/pip install xllamacpp
    /tmp/xl/bin/python scripts/peer_llamacpp.py --model PATH.gguf --threads 2 --max-tokens 128 \
        [--draft PATH.gguf --draft-max 8] [--prompts FILE.jsonl --n 4]
"""
import argparse
import json
import statistics

import xllamacpp as xl

DEFAULT_PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain in three sentences why the sky is blue.",
    "List five prime numbers and explain what makes them prime.",
    "Write a haiku about the sea.",
    "Describe how a hash map works, with a short example in Rust.",
]


def prompts_from(path, n):
    out = []
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            out.append(r.get("prompt") or r.get("question") or r.get("problem") or r.get("text"))
            if len(out) == n:
                break
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompts")
    ap.add_argument("--n", type=int, default=4, help="measured prompts (one more runs as warm-up)")
    ap.add_argument("--draft")
    ap.add_argument("--draft-max", type=int, default=8)
    a = ap.parse_args()

    p = xl.CommonParams()
    p.model.path = a.model
    p.n_ctx = 4096
    p.n_parallel = 1
    p.cpuparams.n_threads = a.threads
    p.cpuparams_batch.n_threads = a.threads
    p.sampling.temp = 0.0
    p.sampling.top_k = 1
    if a.draft:
        p.speculative.types = [xl.common_speculative_type.COMMON_SPECULATIVE_TYPE_DRAFT_SIMPLE]
        p.speculative.draft.mparams.path = a.draft
        p.speculative.draft.n_max = a.draft_max
        p.speculative.draft.n_min = 0
        p.speculative.draft.cpuparams.n_threads = a.threads
        p.speculative.draft.cpuparams_batch.n_threads = a.threads
    server = xl.Server(p)
    prompts = prompts_from(a.prompts, a.n + 1) if a.prompts else DEFAULT_PROMPTS[: a.n + 1]
    speeds, tokens = [], 0
    for i, text in enumerate(prompts):
        req = {
            "messages": [{"role": "user", "content": text}],
            "max_tokens": a.max_tokens,
            "temperature": 0.0,
            "stream": False,
        }
        r = server.handle_chat_completions(req)
        if isinstance(r, str):
            r = json.loads(r)
        t = r["timings"]
        if i == 0:
            continue  # warm-up
        speeds.append(t["predicted_per_second"])
        tokens += t["predicted_n"]
    print(json.dumps({
        "engine": "llama.cpp (xllamacpp)",
        "model": a.model,
        "draft": a.draft,
        "threads": a.threads,
        "prompts": len(speeds),
        "generated_tokens": tokens,
        "decode_tok_s": statistics.mean(speeds),
    }))


if __name__ == "__main__":
    main()
