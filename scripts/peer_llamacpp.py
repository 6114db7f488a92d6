#!/usr/bin/env python3
"""llama.cpp peer for `dspark` benchmarks, through PyPI's prebuilt `xllamacpp`.

Runs the same GGUF with the same thread count and prompts as the dspark bench, greedy, and
prints decode tokens/s (llama.cpp's own `timings.predicted_per_second`), plain or with
draft-model speculation.

    python3 -m venv /tmp/xl && /tmp/xl/bin/pip install xllamacpp
    /tmp/xl/bin/python scripts/peer_llamacpp.py --model PATH.gguf --threads 2 --max-tokens 128 \
        [--draft PATH.gguf --draft-max 8] [--prompts FILE.jsonl --n 4]

With `--forward-k 1,2,4,8,16,32,64` it times instead, like `dspark bench forward`, the
evaluation of k new tokens after a cached context of `--context` tokens (llama.cpp's own
`timings.prompt_ms` for a prompt whose first `--context` tokens are in its cache), and the
prefill of a `--prefill`-token prompt into an empty cache.
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
    ap.add_argument("--forward-k", help="comma-separated k: time k new tokens after a cached context")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()

    p = xl.CommonParams()
    p.model.path = a.model
    p.n_ctx = max(4096, a.context + 128, a.prefill + 16) if a.forward_k else 4096
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
    if a.forward_k:
        return forward_table(server, a)
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


def completion(server, tokens):
    r = server.handle_completions(
        {"prompt": tokens, "n_predict": 1, "temperature": 0.0, "cache_prompt": True, "stream": False}
    )
    if isinstance(r, str):
        r = json.loads(r)
    return r["timings"]


def forward_table(server, a):
    # Fixed token ids, as in `dspark bench forward`: cost does not depend on them.
    context = [100 + i % 1000 for i in range(a.context)]
    rows = []
    for k in [int(v) for v in a.forward_k.split(",")]:
        block = [200 + i for i in range(k)]
        times = []
        for rep in range(a.reps + 1):
            completion(server, context)  # the context is cached (and the block is not)
            t = completion(server, context + block)
            if t["prompt_n"] != k:
                raise SystemExit(f"llama.cpp evaluated {t['prompt_n']} tokens, expected {k}")
            if rep > 0:
                times.append(t["prompt_ms"])
        rows.append({"k": k, "ms": statistics.median(times)})
    prefill = None
    if a.prefill > 0:
        times = []
        for rep in range(min(a.reps, 3) + 1):
            # A different first token each time: nothing of the prompt is in the cache.
            prompt = [300 + rep] + [300 + i % 5000 for i in range(1, a.prefill)]
            t = completion(server, prompt)
            if rep > 0:
                times.append(t["prompt_ms"] / 1e3)
        s = statistics.median(times)
        prefill = {"tokens": a.prefill, "s": s, "tok_s": a.prefill / s}
    print(json.dumps({
        "engine": "llama.cpp (xllamacpp)",
        "model": a.model,
        "threads": a.threads,
        "context": a.context,
        "forward": rows,
        "prefill": prefill,
    }))


if __name__ == "__main__":
    main()
