"""The official `openai` Python client against a running `sluice serve` (started by
crates/server/tests/openai_client.rs): chat completion, streaming, logprobs, completions.
Usage: openai_client.py BASE_URL. Exits non-zero on the first failed check."""
import sys

import openai

base = sys.argv[1]
client = openai.OpenAI(base_url=base + "/v1", api_key="test-key")

models = client.models.list()
assert [m.id for m in models.data] == ["qwen"], models

msgs = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
r = client.chat.completions.create(model="qwen", messages=msgs, max_tokens=16, temperature=0,
                                   logprobs=True, top_logprobs=3)
c = r.choices[0]
assert c.message.role == "assistant"
assert "Paris" in c.message.content, c.message.content
assert c.finish_reason in ("stop", "length"), c.finish_reason
assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0, r.usage
lp = c.logprobs.content
assert len(lp) >= 1 and all(len(t.top_logprobs) == 3 for t in lp), lp
assert all(t.logprob <= 0 for t in lp)
assert lp[0].top_logprobs[0].logprob >= lp[0].top_logprobs[1].logprob

# Streaming gives the same text, and usage in a last chunk.
stream = client.chat.completions.create(model="qwen", messages=msgs, max_tokens=16, temperature=0,
                                        stream=True, stream_options={"include_usage": True})
text, usage, finish = "", None, None
for chunk in stream:
    if chunk.usage is not None:
        usage = chunk.usage
    for ch in chunk.choices:
        if ch.delta.content:
            text += ch.delta.content
        if ch.finish_reason:
            finish = ch.finish_reason
assert text == c.message.content, (text, c.message.content)
assert finish == c.finish_reason
assert usage is not None and usage.completion_tokens == r.usage.completion_tokens, usage

# Completions with logprobs; a stop string is not included.
cr = client.completions.create(model="qwen", prompt="def add(a, b):\n    return", max_tokens=12,
                               temperature=0, logprobs=2, stop=["\n"])
t = cr.choices[0].text
assert "\n" not in t and len(t) > 0, repr(t)
assert len(cr.choices[0].logprobs.tokens) == len(cr.choices[0].logprobs.token_logprobs)

# Errors come back as the client's exception types.
try:
    client.chat.completions.create(model="qwen", messages=msgs, max_tokens=-1)
    raise SystemExit("a negative max_tokens was accepted")
except openai.BadRequestError as e:
    assert e.status_code == 400
bad = openai.OpenAI(base_url=base + "/v1", api_key="wrong")
try:
    bad.models.list()
    raise SystemExit("a wrong key was accepted")
except openai.AuthenticationError:
    pass
print("openai client: all checks passed")
