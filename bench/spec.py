#!/usr/bin/env python3
"""Speculative decoding, sluice against llama.cpp on the same GGUF file and prompt.

The prompt is a code edit whose answer repeats most of its input (rename a variable in a
60-line function and write the whole function out again), rendered as a ChatML user turn and
given to every tool as the same text. Greedy decoding everywhere (the output is the plain
decode's, so the rates compare like for like). Per round, in this order:

  sluice run                       plain decode
  sluice run --spec ngram          prompt lookup
  sluice run --spec draft          draft model: a smaller requantization of the same model
  llama-completion --temp 0        plain decode
  llama-lookup --temp 0            prompt lookup
  llama-speculative --temp 0       the same draft model

Each tool's speedup is its speculative decode rate over its own plain decode rate in the same
round; the result quotes medians over rounds, sluice's acceptance (kept / drafted) and
llama.cpp's (n_accept / n_drafted), and the ratio of the speedups. The draft model is made
once with llama-quantize (--allow-requantize, default Q2_K) from the target into a temporary
directory and removed at the end; it is the same model at lower precision, so this is
same-model drafting.

    python3 bench/spec.py --model ~/.cache/sluice/models/qwen2.5-coder-0.5b-q4_k_m.gguf
        [--threads 2] [--rounds 3] [-n 512] [--draft-type Q2_K] [--peer-bin DIR]
"""

import argparse
import os
import re
import shutil
import tempfile

import lib

FUNCTION = '''def summarize_orders(orders, tax_rate, discounts):
    x = {}
    for order in orders:
        customer = order["customer"]
        if customer not in x:
            x[customer] = {"count": 0, "subtotal": 0.0, "items": []}
        entry = x[customer]
        entry["count"] += 1
        for item in order["items"]:
            price = item["price"] * item["quantity"]
            code = item.get("discount")
            if code and code in discounts:
                price = price * (1.0 - discounts[code])
            entry["subtotal"] += price
            entry["items"].append(item["name"])
    report = []
    for customer, entry in x.items():
        subtotal = round(entry["subtotal"], 2)
        tax = round(subtotal * tax_rate, 2)
        total = round(subtotal + tax, 2)
        unique = sorted(set(entry["items"]))
        report.append(
            {
                "customer": customer,
                "orders": entry["count"],
                "subtotal": subtotal,
                "tax": tax,
                "total": total,
                "items": unique,
            }
        )
    report.sort(key=lambda r: r["total"], reverse=True)
    best = None
    for row in report:
        if best is None or row["total"] > best["total"]:
            best = row
    totals = [row["total"] for row in report]
    if totals:
        average = round(sum(totals) / len(totals), 2)
    else:
        average = 0.0
    summary = {
        "customers": len(x),
        "orders": sum(e["count"] for e in x.values()),
        "best": best["customer"] if best else None,
        "average_total": average,
        "report": report,
    }
    for customer, entry in x.items():
        if entry["count"] > 3:
            summary.setdefault("frequent", []).append(customer)
    if "frequent" in summary:
        summary["frequent"].sort()
    large = [row for row in report if row["total"] > 1000]
    summary["large_orders"] = len(large)
    for row in large:
        row["flag"] = "review"
    summary["tax_rate"] = tax_rate
    summary["discount_codes"] = sorted(discounts)
    return summary
'''

PROMPT = (
    "<|im_start|>system\nYou are a careful coding assistant.<|im_end|>\n"
    "<|im_start|>user\nRename the variable `x` to `by_customer` in this function. "
    "Output the whole function, changed, in one Python code block, and nothing else.\n\n"
    "```python\n" + FUNCTION + "```<|im_end|>\n<|im_start|>assistant\n"
)


def sluice_run(exe, model, a, extra):
    cmd = [exe, "run", "-m", model, "-t", str(a.threads), "-n", str(a.gen), "-p", PROMPT, "--json", "--stats"] + extra
    r = lib.last_json(lib.run(cmd, env=lib.sluice_env(a.sluice_isa))["out"])
    m = {"decode_tok_s": r["timings"]["decode_tok_s"], "tokens": len(r["token_ids"]), "prompt_tokens": r["prompt_tokens"]}
    if "spec" in r:
        s = r["spec"]
        m.update({"drafted": s["drafted"], "accepted": s["accepted"], "rounds": s["rounds"], "mean_k": s["mean_k"], "acceptance": s["accepted"] / max(1, s["drafted"])})
        m["detail"] = {k: s.get(k) for k in ("chosen_k", "k_reasons", "draft_stops", "draft_s", "verify_s", "reruns", "estimates")}
    return cmd, m, r["token_ids"]


def parse_peer(text, spec):
    m = {}
    for line in text.splitlines():
        if spec:
            g = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s", line)
            if g:
                m["tokens"], m["decode_tok_s"] = int(g.group(1)), float(g.group(3))
            g = re.search(r"encoded\s+(\d+) tokens", line)
            if g:
                m["prompt_tokens"] = int(g.group(1))
            for k in ("n_drafted", "n_accept"):
                g = re.match(r"\s*%s\s*=\s*(\d+)" % k, line)
                if g:
                    m[k] = int(g.group(1))
        else:
            g = re.search(r"prompt eval time =.*/\s*(\d+) tokens", line)
            if g:
                m["prompt_tokens"] = int(g.group(1))
            g = re.search(r"\s+eval time =\s*[\d.]+ ms /\s*(\d+) runs.*,\s*([\d.]+) tokens per second", line)
            if g and "prompt" not in line:
                m["tokens"], m["decode_tok_s"] = int(g.group(1)), float(g.group(2))
    if "n_drafted" in m:
        m["acceptance"] = m.get("n_accept", 0) / max(1, m["n_drafted"])
    if "decode_tok_s" not in m:
        raise SystemExit("could not read a decode rate from llama.cpp's output:\n" + text[-3000:])
    return m


def peer_run(d, tool, args, a, spec):
    cmd = [os.path.join(d, tool), "-m", a.model, "-t", str(a.threads), "-n", str(a.gen), "--temp", "0", "-p", PROMPT, "-c", "4096"] + args
    r = lib.run(cmd, env=lib.peer_env(d))
    return cmd, parse_peer(r["out"] + "\n" + r["err"], spec)


def speedups(rounds, plain, spec):
    return lib.ratio_summary([r[spec]["decode_tok_s"] / r[plain]["decode_tok_s"] for r in rounds])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.expanduser("~/.cache/sluice/models/qwen2.5-coder-0.5b-q4_k_m.gguf"))
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-n", "--gen", type=int, default=512, help="most tokens to generate (all tools stop at end of turn)")
    ap.add_argument("--draft-type", default="Q2_K", help="llama-quantize type of the draft model made from the target")
    ap.add_argument("--draft-max", type=int, default=16, help="sluice's --draft-max (its default) and llama.cpp's --spec-draft-n-max")
    ap.add_argument("--only", help="comma-separated subset of the runs (sluice_plain, sluice_ngram, sluice_draft, llama_plain, llama_lookup, llama_speculative), to check the script")
    lib.add_common_args(ap)
    a = ap.parse_args()
    state = lib.check_tree(a.allow_dirty)
    build = not a.dry_run
    exe = lib.sluice_bin(build)
    peer = lib.peer_dir(a.peer_bin)
    isas = {"sluice": lib.sluice_isa(a.sluice_isa, build), "peer": lib.peer_isa(peer, a.model)}
    tmp = tempfile.mkdtemp(prefix="sluice-spec-bench-")
    try:
        draft = os.path.join(tmp, "draft-%s.gguf" % a.draft_type.lower())
        lib.run([os.path.join(peer, "llama-quantize"), "--allow-requantize", a.model, draft, a.draft_type, str(a.threads)], env=lib.peer_env(peer))
        dm = str(a.draft_max)
        tools = {
            "sluice_plain": lambda: sluice_run(exe, a.model, a, []),
            "sluice_ngram": lambda: sluice_run(exe, a.model, a, ["--spec", "ngram", "--draft-max", dm]),
            "sluice_draft": lambda: sluice_run(exe, a.model, a, ["--spec", "draft", "--draft-model", draft, "--draft-max", dm]),
            "llama_plain": lambda: peer_run(peer, "llama-completion", ["-no-cnv"], a, False),
            "llama_lookup": lambda: peer_run(peer, "llama-lookup", ["--spec-draft-n-max", dm], a, True),
            "llama_speculative": lambda: peer_run(peer, "llama-speculative", ["-md", draft, "--spec-draft-n-max", dm, "-td", str(a.threads)], a, True),
        }
        if a.only:
            tools = {k: v for k, v in tools.items() if k in a.only.split(",")}
        rounds, cmds = [], {}
        same_tokens = True
        for i in range(a.rounds):
            lib.log(f"round {i + 1}/{a.rounds}")
            r, outs = {}, {}
            for name, f in tools.items():
                res = f()
                cmds[name] = res[0]
                r[name] = res[1]
                if len(res) > 2:
                    outs[name] = res[2]
                lib.log(f"  {name}: {r[name]['decode_tok_s']:.2f} tok/s" + (f", acceptance {100 * r[name]['acceptance']:.1f}%" if "acceptance" in r[name] else ""))
            if len(outs) > 1:
                same_tokens &= all(o == list(outs.values())[0] for o in outs.values())
            rounds.append(r)
        med = lambda k, m: lib.summary([r[k][m] for r in rounds])["median"]
        pairs = {
            "sluice_ngram": "sluice_plain",
            "sluice_draft": "sluice_plain",
            "llama_lookup": "llama_plain",
            "llama_speculative": "llama_plain",
        }
        sp = {k: speedups(rounds, base, k) for k, base in pairs.items() if k in tools and base in tools}
        ratios = {}
        for name, (x, y) in {"ngram_vs_lookup": ("sluice_ngram", "llama_lookup"), "draft_vs_speculative": ("sluice_draft", "llama_speculative")}.items():
            if x in sp and y in sp:
                ratios[name] = sp[x]["median"] / sp[y]["median"]
        result = lib.header("spec-" + os.path.splitext(os.path.basename(a.model))[0], state, a.dry_run)
        result.update(
            {
                "model": lib.model_info(a.model),
                "draft_model": {"made_with": f"llama-quantize --allow-requantize {os.path.basename(a.model)} {a.draft_type}", "bytes": os.path.getsize(draft), "note": "a requantization of the target: same-model drafting"},
                "protocol": {
                    "prompt": "rename a variable in a 60-line Python function, output the whole function (ChatML user turn, the same text for every tool)",
                    "gen_tokens_max": a.gen,
                    "threads": a.threads,
                    "rounds": a.rounds,
                    "greedy": True,
                    "draft_max": a.draft_max,
                    "order": ", ".join(tools),
                },
                "sluice": {"version": lib.version(state), "isa": isas["sluice"]["isa"], "commands": {k: " ".join(v) for k, v in cmds.items() if k.startswith("sluice")}},
                "peer": {"name": "llama.cpp", "version": lib.PEER_VERSION, "bin": peer, "isa": isas["peer"]["isa"], "commands": {k: " ".join(v) for k, v in cmds.items() if k.startswith("llama")}},
                "speculative_output_equals_plain": same_tokens,
                "decode_tok_s": {k: med(k, "decode_tok_s") for k in tools},
                "acceptance": {k: med(k, "acceptance") for k in tools if "acceptance" in rounds[0][k]},
                "speedups": sp,
                "speedup_ratios": ratios,
                "rounds": rounds,
            }
        )
        # Commands carry the whole prompt; keep the result readable.
        for side in ("sluice", "peer"):
            result[side]["commands"] = {k: v.replace(PROMPT, "$PROMPT") for k, v in result[side]["commands"].items()}
        lib.write_result(result["name"], result, lib.out_dir(a))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
