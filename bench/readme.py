#!/usr/bin/env python3
"""Writes README.md's benchmark tables from bench/results/*.json.

The text between `<!-- bench:begin -->` and `<!-- bench:end -->` in README.md is generated: for
each benchmark (a result's "name") the newest result that may be quoted, its machine, ISA and
date above the table, one row per case (sluice, llama.cpp at its best setting, named, and the
median of the per-round ratios), and the footnotes the JSON implies (llama.cpp's default
OOM-killed, a synthetic model's routing note).

A result may be quoted when it measured a clean tree ("clean": true) and is not a dry run.
Results written before the clean flag existed are accepted when their sluice.version carries no
`-dirty` suffix, and the script says so.

    python3 bench/readme.py           # rewrite README.md
    python3 bench/readme.py --check   # exit 1 and print a diff if README.md differs
"""

import argparse
import difflib
import glob
import json
import math
import os
import re
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN = "<!-- bench:begin -->"
END = "<!-- bench:end -->"
ISA_NAMES = {"avx512": "AVX-512", "avx2": "AVX2", "scalar": "scalar", "below-avx2": "below AVX2"}


def note(msg):
    print("readme.py: " + msg, file=sys.stderr)


# ---------------------------------------------------------------- which results


def verdict(r):
    """(usable, why) for one result."""
    if r.get("dry_run"):
        return False, "is a dry run"
    version = (r.get("sluice") or {}).get("version", "unknown")
    if "clean" in r:
        if r["clean"] is True:
            return True, "clean"
        return False, 'measured a tree with uncommitted changes ("clean": false, sluice %s)' % version
    if version == "unknown" or version.endswith("-dirty"):
        return False, "has no clean flag, and its sluice version, %s, does not say the tree was clean" % version
    return True, "legacy"


def selection_key(r, fallback_name):
    """Results compete only with results of the same benchmark on the same kind of machine
    with the same SIMD level on both sides: an AVX2 run on an AMD EPYC and an AVX-512 run on
    a Xeon are both quoted, each the newest of its kind. A result that does not name a side's
    level ran at the machine's best."""
    m = r.get("machine", {})
    best = "avx512" if "avx512f" in m.get("isa", []) else "avx2"
    side = lambda k: ((r.get(k) or {}).get("isa") or best)
    return (r.get("name", fallback_name), m.get("cpu"), m.get("l3_mib"), side("sluice"), side("peer"))


def select(results_dir):
    """The newest quotable result of each benchmark, and a list of benchmarks with none."""
    by_name = {}
    for path in sorted(glob.glob(os.path.join(results_dir, "*.json"))):
        with open(path) as f:
            try:
                r = json.load(f)
            except ValueError as e:
                raise SystemExit(f"{path}: not JSON ({e})")
        r["_path"] = os.path.relpath(path, ROOT) if os.path.abspath(path).startswith(ROOT + os.sep) else path
        # The section tabulates the resident and streaming benchmarks; the server and
        # speculative-decoding results are kept beside them in their own JSON.
        if not str(r.get("name", "")).startswith(("resident-", "streaming-")):
            continue
        by_name.setdefault(selection_key(r, os.path.basename(path)), []).append(r)
    chosen, missing = [], []
    for (name, *_), rs in sorted(by_name.items(), key=lambda kv: tuple(str(x) for x in kv[0])):
        rs.sort(key=lambda r: r.get("date", ""), reverse=True)
        pick = None
        for r in rs:
            ok, why = verdict(r)
            if ok:
                pick = r
                if why == "legacy":
                    r["_legacy"] = True
                    note(f"{r['_path']}: no clean flag; used because its sluice.version {r['sluice']['version']} has no -dirty suffix")
                break
            note(f"{r['_path']}: not used: it {why}")
        if pick:
            chosen.append(pick)
        else:
            newest = rs[0]
            missing.append((name, newest, verdict(newest)[1]))
    return chosen, missing


# ---------------------------------------------------------------- formatting


def sig3(x):
    """Three significant digits, never in exponent form."""
    if x is None:
        return "—"
    if x == 0:
        return "0"
    d = 2 - int(math.floor(math.log10(abs(x))))
    return f"{x:.{max(d, 0)}f}"


def ratio(x):
    return "—" if x is None else (f"{x:.2f}×" if x < 10 else sig3(x) + "×")


def gib(x):
    return f"{x / 2**30:.3g} GiB"


def nbytes(x):
    if x is None:
        return "—"
    for unit, m in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if x >= m:
            return f"{sig3(x / m)} {unit}"
    return f"{x:.0f} B"


def pct(x):
    return "—" if x is None else f"{x * 100:.1f}%"


def med(x):
    """A metric as results carry it: a number, or a summary with a median."""
    if isinstance(x, dict):
        return x.get("median")
    return x


def pretty_model(r):
    base = os.path.splitext(os.path.basename(r["model"]["path"]))[0]
    m = re.search(r"-((?:i?q\d\w*)|mxfp4|f16|bf16|f32)$", base)
    quant = ""
    if m:
        quant = " " + m.group(1).upper()
        base = base[: m.start()]
    known = {"olmoe": "OLMoE", "smollm2": "SmolLM2", "gemma3": "Gemma3", "gpt": "gpt", "oss": "oss"}
    words = []
    for w in base.split("-"):
        if w in known:
            words.append(known[w])
        elif re.fullmatch(r"[a-z]?\d+(\.\d+)?[bm]", w):
            words.append(w.upper())
        else:
            words.append(w[:1].upper() + w[1:])
    synthetic = r["model"].get("synthetic") or (r["model"].get("synthetic") is None and "/synth/" in r["model"]["path"])
    return ("synthetic " if synthetic else "") + "-".join(words) + quant


def isa_of(side):
    isa = side.get("isa")
    return ISA_NAMES.get(isa, isa) if isa else None


def machine_isa(m):
    flags = m.get("isa", [])
    level = "AVX-512" if "avx512f" in flags else ("AVX2" if "avx2" in flags else "no AVX2")
    return f"{level} ({' '.join(flags)})" if flags else level


def machine_cache(m):
    """' with a 260 MiB L3' where the result recorded it (results from before it did, nothing)."""
    return f" with a {m['l3_mib']} MiB L3" if m.get("l3_mib") else ""


def threads_of(r):
    return r.get("protocol", {}).get("threads")


def group_key(r):
    m = r["machine"]
    return (m.get("cpu"), m.get("l3_mib"), m.get("cores"), m.get("mem_gib"), tuple(m.get("isa", [])), threads_of(r), isa_of(r["sluice"]), isa_of(r["peer"]))


# ---------------------------------------------------------------- rows


def resident_rows(r):
    label = pretty_model(r)
    p = r["protocol"]
    rows = []
    for k, test in (("decode", f"decode (tg{p['gen_tokens']})"), ("prefill", f"prefill (pp{p['prompt_tokens']})")):
        metric = k + "_tok_s"
        setting = r["peer"]["best_setting"][metric]
        key = "repack0" if setting == "--repack 0" else "repack1"
        rows.append(
            [
                f"{label}, {test}",
                f"{sig3(r['sluice']['metrics'][metric])} tok/s",
                f"{sig3(r['peer']['metrics'][key][metric])} (`{setting}`{failed_settings(r)})",
                ratio(med(r["ratios"][k])),
            ]
        )
    return rows


def failed_settings(r):
    """'; `--repack 1` dies: signal 4 (SIGILL)' for each llama.cpp setting that did not run."""
    out = ""
    for key, fs in sorted((r["peer"].get("failures") or {}).items()):
        if fs and "failed" in (r["peer"]["metrics"].get(key) or {}):
            out += f"; `--repack {key[-1]}` dies: {fs[0]['why']}"
    return out


def peer_default_note(r):
    pd = r.get("peer_default")
    if not pd:
        return None
    if pd.get("oom_killed") or pd.get("outcome") == "OOM-killed":
        return "the default is OOM-killed"
    if pd.get("outcome") == "ran" and pd.get("decode_tok_s"):
        return f"the default, measured once, ran at {sig3(pd['decode_tok_s'])} tok/s"
    return f"the default: {pd.get('outcome')}"


def stream_test(r):
    p = r["protocol"]
    if "gen_tokens" in p:
        return f"decode (tg{p['gen_tokens']})"
    return f"decode (sluice tg{p.get('sluice_gen_tokens')}, llama.cpp tg{p.get('peer_gen_tokens')})"


def stream_case(r):
    left = r["protocol"].get("memory_left_bytes")
    where = f" in {gib(left)}" if left else ""
    return f"{pretty_model(r)} ({gib(r['model']['bytes'])}){where}"


def streaming_rows(r):
    setting = r["peer"].get("best_setting", "--repack 0").split(" (")[0]
    peer = f"{sig3(med(r['peer']['metrics']['decode_tok_s']))} (`{setting}`"
    d = peer_default_note(r)
    peer += f"; {d})" if d else ")"
    return [[f"{stream_case(r)}, {stream_test(r)}", f"{sig3(med(r['sluice']['metrics']['decode_tok_s']))} tok/s", peer, ratio(med(r["ratios"]["decode"]))]]


def table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return out


def streaming_detail(r, mark):
    """The streaming result's side-by-side table: rate, disk bytes both ways, cache statistics."""
    if "disk_bytes_per_token" not in r:
        return []
    arms = [k for k in ("sluice", "sluice_no_prefetch", "sluice_pack") if k in r]
    names = {"sluice": "sluice", "sluice_no_prefetch": "sluice `--no-prefetch`", "sluice_pack": "sluice (pack)"}
    peer = "llama.cpp --repack 0"
    m = {k: r[k]["metrics"] for k in arms}
    pm = r["peer"]["metrics"]
    whole = r["disk_bytes_per_token"]["whole_run"]
    steady = r["disk_bytes_per_token"]["steady_state"]
    bounds = {"sluice": r.get("bound"), "sluice_no_prefetch": r.get("bound_no_prefetch"), "sluice_pack": r.get("bound_pack")}

    def bound_cell(k):
        b = bounds.get(k)
        if not b or not med(b.get("decode_tok_s")):
            return "—"
        return f"{sig3(med(b['decode_tok_s']))} tok/s ({pct(med(b.get('sluice_fraction')))} reached)"

    p = r["protocol"]
    n_tok = p.get("tokens_per_run")
    rows = [
        ["decode, steady state (tok/s)"] + [sig3(med(m[k]["decode_tok_s"])) for k in arms] + [sig3(med(pm["decode_tok_s"]))],
        ["decode, first repetition from an empty cache (tok/s)"] + [sig3(med(m[k]["decode_tok_s_first_run"])) for k in arms] + [sig3(med(pm["decode_tok_s_first_run"]))],
        [f"disk bytes per token, whole run: block device counters, same for both ({n_tok} tokens, loading included)"]
        + [nbytes(med(whole.get(k))) for k in arms]
        + [nbytes(med(whole.get(peer)))],
        ["disk bytes per token, steady state: sluice's own counters (second repetition)"] + [nbytes(med(steady.get(k))) for k in arms] + ["not measurable"],
        [f"demand hit rate{mark}"] + [pct(med(m[k]["hit_rate"])) for k in arms] + ["—"],
        [f"prefetch hit rate{mark}"] + [pct(med(m[k]["prefetch_hit_rate"])) for k in arms] + ["—"],
        [f"miss rate{mark}"] + [pct(med(m[k]["miss_rate"])) for k in arms] + ["—"],
        [f"prefetch precision{mark}"] + [pct(med(m[k]["prefetch_precision"])) for k in arms] + ["—"],
        ["IO bound: disk rate / steady bytes per token"] + [bound_cell(k) for k in arms] + ["—"],
        ["peak RSS"] + [nbytes(med(m[k]["peak_rss"])) for k in arms] + [nbytes(med(pm.get("peak_rss")))],
    ]
    quota = None
    for rd in r.get("rounds", []):
        quota = rd.get("sluice", {}).get("quota_bytes") or quota
    case = stream_case(r)
    cache = "from a dropped page cache" if str(p.get("page_cache", "")).startswith("dropped") else "without dropping the page cache"
    out = [
        "",
        f"{case[:1].upper() + case[1:]}: medians of {p['rounds']} rounds, each run `-p 0 -n {p.get('gen_tokens')} -r {p.get('repetitions')}` {cache},"
        + f" the order alternating (llama.cpp first in odd rounds, sluice first in even ones)"
        + (f"; sluice's expert cache {gib(quota)}" if quota else "")
        + ". Hit rates count demand accesses only: a hit found the expert resident from earlier demand, a prefetch hit was served by a prefetch, the rest missed.",
        "",
    ]
    out += table(["", *[names[k] for k in arms], f"llama.cpp `--repack 0`"], rows)
    fits = r.get("fits_case")
    if fits:
        out += ["", f"With every expert of {pretty_model({'model': fits['model']})} fitting in the cache, streaming decodes at {ratio(med(fits['ratios']['decode_stream_over_resident']))} resident mode ({fits['protocol'].split(',')[0]})."]
    return out


# ---------------------------------------------------------------- the section


def section(results_dir):
    chosen, missing = select(results_dir)
    lines = [BEGIN, "<!-- generated by bench/readme.py from bench/results/*.json; edit those, not this -->", ""]
    groups = {}
    for r in chosen:
        groups.setdefault(group_key(r), []).append(r)
    footnotes = {}

    def mark_for(text):
        if text not in footnotes:
            footnotes[text] = "¹²³⁴⁵⁶⁷⁸⁹"[len(footnotes)]
        return footnotes[text]

    for key, rs in groups.items():
        resident = sorted((r for r in rs if r["name"].startswith("resident-")), key=lambda r: r["model"]["bytes"])
        streaming = sorted((r for r in rs if r["name"].startswith("streaming-")), key=lambda r: r["model"]["bytes"])
        first = rs[0]
        m = first["machine"]
        dates = sorted({r["date"][:10] for r in rs})
        versions = sorted({r["sluice"]["version"] for r in rs})
        peers = sorted({r["peer"].get("version", "?") for r in rs})
        s_isa = isa_of(first["sluice"])
        p_isa = isa_of(first["peer"])
        lines.append(
            f"Measured on {m['cpu']}{machine_cache(m)}, {m['cores']} cores, {m['mem_gib']} GiB, {machine_isa(m)}, {threads_of(first)} threads, on {', '.join(dates)}: "
            + f"sluice {', '.join(versions)}"
            + (f" running its {s_isa} kernels" if s_isa else ", whose kernels' ISA (AVX2 or AVX-512) was not recorded,")
            + f" against {first['peer']['name']} {', '.join(peers)}"
            + (f" built for {p_isa}" if p_isa else ", whose build's ISA was not recorded")
            + ":"
        )
        lines.append("")
        rows = []
        for r in resident:
            rows += resident_rows(r)
        for r in streaming:
            rows += streaming_rows(r)
        lines += table(["case", "sluice", f"{first['peer']['name']} (best setting)", "ratio"], rows)
        legacy = [r for r in rs if r.get("_legacy")]
        if legacy:
            lines += [
                "",
                "These results predate the record of a clean tree; they are used because their sluice version ("
                + ", ".join(sorted({r["sluice"]["version"] for r in legacy}))
                + ") carries no `-dirty` suffix.",
            ]
        for r in streaming:
            rnote = r.get("routing_note") or r["sluice"].get("routing_note")
            lines += streaming_detail(r, mark_for(rnote) if rnote else "")
        lines.append("")
    if footnotes:
        for text, mk in footnotes.items():
            lines.append(f"{mk} {text[:1].upper() + text[1:]}.")
        lines.append("")
    for name, newest, why in missing:
        script = "bench/" + name.split("-")[0] + ".py"
        lines.append(f"No result of `{name}` may be quoted: the newest, `{newest['_path']}`, {why}; `{script}` must run again from a clean commit.")
        lines.append("")
    if not chosen and not missing:
        lines += ["No results in bench/results yet.", ""]
    lines.append(END)
    return "\n".join(wrap(line) for line in lines)


def wrap(line, width=95):
    """Prose wrapped as the rest of the README is; tables, comments and markers left alone."""
    if line.startswith(("|", "<!--")) or len(line) <= width:
        return line
    return textwrap.fill(line, width=width, break_long_words=False, break_on_hyphens=False)


def render(readme_text, results_dir):
    if readme_text.count(BEGIN) != 1 or readme_text.count(END) != 1:
        raise SystemExit(f"README.md must hold exactly one {BEGIN} and one {END}")
    head, rest = readme_text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return head + section(results_dir) + tail


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="do not write; exit 1 and print a diff when README.md differs from what the results imply")
    ap.add_argument("--results", default=os.path.join(ROOT, "bench", "results"), help="directory of result JSON files")
    ap.add_argument("--readme", default=os.path.join(ROOT, "README.md"))
    a = ap.parse_args()
    with open(a.readme) as f:
        old = f.read()
    new = render(old, a.results)
    if a.check:
        if new != old:
            sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), new.splitlines(True), "README.md", "README.md (from bench/results)"))
            print(
                f"\n{os.path.relpath(a.readme, ROOT)}: the benchmark section differs from what bench/results implies; run python3 bench/readme.py",
                file=sys.stderr,
            )
            return 1
        note("README.md's benchmark section matches bench/results")
        return 0
    if new != old:
        with open(a.readme, "w") as f:
            f.write(new)
        note(f"rewrote the benchmark section of {os.path.relpath(a.readme, ROOT)}")
    else:
        note("README.md already matches bench/results")
    return 0


if __name__ == "__main__":
    sys.exit(main())
