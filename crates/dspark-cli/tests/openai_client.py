"""Drives a running dspark server with the official `openai` client (argv: base_url model)."""
import json
import sys

import openai

base, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base, api_key="unused")

assert model in [m.id for m in client.models.list().data]

msgs = [{"role": "user", "content": "Name three primary colors."}]
chat = client.chat.completions.create(model=model, messages=msgs, max_tokens=24, temperature=0)
text = chat.choices[0].message.content
assert text, chat
assert chat.choices[0].finish_reason in ("stop", "length")
assert chat.usage.prompt_tokens > 0 and chat.usage.completion_tokens > 0
assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
spec = (chat.usage.model_extra or {}).get("speculative")
assert spec is not None and spec["rounds"] >= 1, chat.usage
print("CHAT=" + json.dumps(text, ensure_ascii=False))

parts, usage, finish = [], None, None
for chunk in client.chat.completions.create(
    model=model, messages=msgs, max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True}
):
    if chunk.usage is not None:
        usage = chunk.usage
    for c in chunk.choices:
        parts.append(c.delta.content or "")
        finish = c.finish_reason or finish
assert "".join(parts) == text, ("".join(parts), text)
assert usage is not None and usage.completion_tokens == chat.usage.completion_tokens, usage
assert finish == chat.choices[0].finish_reason

comp = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
assert comp.choices[0].text and comp.usage.completion_tokens > 0, comp
streamed = "".join(
    c.choices[0].text
    for c in client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True)
    if c.choices
)
assert streamed == comp.choices[0].text, (streamed, comp.choices[0].text)

sampled = client.chat.completions.create(model=model, messages=msgs, max_tokens=16, temperature=0.8, seed=3,
                                         extra_body={"metadata": {"tag": "chat"}})
assert sampled.usage.completion_tokens > 0

# Log-probabilities parse into the client's types; greedy tokens are their position's argmax.
lp = client.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0, logprobs=True,
                                    top_logprobs=3)
content = lp.choices[0].logprobs.content
assert len(content) == lp.usage.completion_tokens, lp
assert "".join(c.token for c in content) == lp.choices[0].message.content, lp
for c in content:
    assert c.logprob <= 0 and len(c.top_logprobs) == 3, c
    assert abs(c.top_logprobs[0].logprob - c.logprob) < 1e-6 and c.top_logprobs[0].token == c.token, c
    assert bytes(c.bytes).decode() == c.token, c
lc = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0, logprobs=2)
l = lc.choices[0].logprobs
assert len(l.tokens) == len(l.token_logprobs) == len(l.top_logprobs) == len(l.text_offset) > 0, l
assert "".join(l.tokens) == lc.choices[0].text and l.text_offset[0] == 0, l
try:
    client.chat.completions.create(model=model, messages=msgs, logprobs=True, top_logprobs=21)
    raise AssertionError("top_logprobs 21 accepted")
except openai.BadRequestError as e:
    assert "top_logprobs" in str(e)

try:
    client.chat.completions.create(model="no-such-model", messages=msgs)
    raise AssertionError("unknown model accepted")
except openai.NotFoundError as e:
    assert "does not exist" in str(e)
try:
    client.chat.completions.create(model=model, messages=msgs, temperature=9)
    raise AssertionError("bad temperature accepted")
except openai.BadRequestError as e:
    assert "temperature" in str(e)

print("all openai client checks passed")
