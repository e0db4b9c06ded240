"""The official `openai` Python client against a running `sluice serve` (started by
crates/server/tests/openai_client.rs): chat completion, streaming, logprobs, completions.
Usage: openai_client.py BASE_URL. Exits non-zero on the first failed check."""
import concurrent.futures
import json
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

# Tools: Qwen2.5-Coder-0.5B answers a weather question with the bare call object; it comes
# back as a tool call, streamed or not, and the tool's result goes into the next turn.
tools = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ask = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]
r = client.chat.completions.create(model="qwen", messages=ask, tools=tools, max_tokens=64, temperature=0)
c = r.choices[0]
assert c.finish_reason == "tool_calls", (c.finish_reason, c.message)
assert c.message.content is None, c.message.content
call = c.message.tool_calls[0]
assert call.type == "function" and call.function.name == "get_weather", call
assert json.loads(call.function.arguments) == {"city": "Paris"}, call.function.arguments
names, args, finish = [], "", None
for chunk in client.chat.completions.create(model="qwen", messages=ask, tools=tools, max_tokens=64,
                                            temperature=0, stream=True):
    for ch in chunk.choices:
        assert not ch.delta.content, ("content beside a call", ch.delta.content)
        for tc in ch.delta.tool_calls or []:
            if tc.function.name:
                names.append(tc.function.name)
            args += tc.function.arguments or ""
        finish = ch.finish_reason or finish
assert names == ["get_weather"] and json.loads(args) == {"city": "Paris"} and finish == "tool_calls", (names, args)
turn2 = ask + [c.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 17, "sky": "clear"}'}]
r2 = client.chat.completions.create(model="qwen", messages=turn2, tools=tools, max_tokens=32, temperature=0)
# (What this small model does with the result varies; the result and the call are in its prompt.)
assert r2.usage.prompt_tokens > r.usage.prompt_tokens + r.usage.completion_tokens, (r.usage, r2.usage)

# Six different requests at once get the text and log-probabilities they get alone.
def ask_one(k):
    m = [{"role": "user", "content": f"Write a haiku about the number {k}."}]
    r = client.chat.completions.create(model="qwen", messages=m, max_tokens=12 + 5 * k, temperature=0.7,
                                       seed=k, logprobs=True, top_logprobs=2)
    ch = r.choices[0]
    return ch.message.content, [(t.token, t.logprob, [(x.token, x.logprob) for x in t.top_logprobs])
                                for t in ch.logprobs.content]
alone = [ask_one(k) for k in range(6)]
with concurrent.futures.ThreadPoolExecutor(6) as ex:
    together = list(ex.map(ask_one, range(6)))
for k in range(6):
    assert together[k] == alone[k], (k, together[k][0], alone[k][0])

# Errors come back as the client's exception types.
try:
    client.chat.completions.create(model="qwen", messages=[{"role": "user", "content": "x" * 200_000}],
                                   max_tokens=4)
    raise SystemExit("an oversize body was accepted")
except openai.APIStatusError as e:
    assert e.status_code == 413, e.status_code
    assert "body" in e.message.lower(), e.message
try:
    client.chat.completions.create(model="qwen", messages=msgs, max_tokens="many")
    raise SystemExit("a max_tokens that is not a number was accepted")
except openai.BadRequestError as e:
    assert e.status_code == 400 and "max_tokens" in e.message, e.message
bad = openai.OpenAI(base_url=base + "/v1", api_key="wrong")
try:
    bad.models.list()
    raise SystemExit("a wrong key was accepted")
except openai.AuthenticationError:
    pass
print("openai client: all checks passed")
