#!/usr/bin/env python3
"""The float truth of a quantized GGUF: each weight widened by gguf-py (llama.cpp's own Python
GGUF library, not sluice's code) and the model run in float64 with numpy, with
llama-perplexity's chunking. bench/fidelity.py holds sluice and llama.cpp against it.

Supported architectures: qwen2 (RMSNorm, q/k/v biases, GQA, NeoX rope, SwiGLU) and llama
(the same without biases; its GGUF stores q and k rows permuted for the interleaved rope).
Anything else in the file that would change the forward (rope scaling, sliding windows,
softcaps) is refused rather than ignored.

    PYTHONPATH=<gguf, numpy> python3 bench/fidelity_truth.py MODEL.gguf TOKENS.json CTX CHUNKS

TOKENS.json holds {"ids": [...]}, the text's tokens as the tools tokenize it (BOS first when the
model adds one). Prints one JSON object: {"ppl", "nll": [...], "chunks", "ctx", "types"}.
"""

import json
import sys
from collections import Counter

import numpy as np

import gguf

SUPPORTED = ("qwen2", "llama")


def field(reader, key, default=None):
    f = reader.get_field(key)
    return default if f is None else f.contents()


class Weights:
    def __init__(self, path):
        self.reader = gguf.GGUFReader(path)
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.arch = field(self.reader, "general.architecture")
        if self.arch not in SUPPORTED:
            raise SystemExit(f"fidelity_truth: architecture {self.arch!r} is not one of {SUPPORTED}")
        a = self.arch
        for key in (f"{a}.rope.scaling.type", f"{a}.attention.sliding_window", f"{a}.final_logit_softcapping"):
            if field(self.reader, key) not in (None, "none"):
                raise SystemExit(f"fidelity_truth: {key} is set; this forward does not model it")
        self.layers = field(self.reader, f"{a}.block_count")
        self.heads = field(self.reader, f"{a}.attention.head_count")
        self.kv_heads = field(self.reader, f"{a}.attention.head_count_kv", self.heads)
        self.dim = field(self.reader, f"{a}.embedding_length")
        self.head_dim = field(self.reader, f"{a}.attention.key_length", self.dim // self.heads)
        self.rope_dim = field(self.reader, f"{a}.rope.dimension_count", self.head_dim)
        self.base = float(field(self.reader, f"{a}.rope.freq_base", 10000.0))
        self.eps = float(field(self.reader, f"{a}.attention.layer_norm_rms_epsilon"))

    def get(self, name):
        """The tensor as float64, rows × columns as ggml lays them out (a matrix's rows are its
        outputs), or None when the file has no such tensor."""
        t = self.tensors.get(name)
        if t is None:
            return None
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        shape = [int(x) for x in reversed(t.shape)]
        return np.asarray(w, dtype=np.float64).reshape(shape)

    def types(self):
        """How many tensors of each block type the file holds."""
        return dict(sorted(Counter(t.tensor_type.name for t in self.reader.tensors).items()))


def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def unpermute(w, heads):
    """llama's converter reorders each head's q/k rows from the NeoX halves (0..d/2, d/2..d) to
    interleaved pairs (0,1), (2,3), ... for ggml's normal rope: undo it, so one NeoX rope serves
    both architectures."""
    rows, cols = w.shape
    d = rows // heads
    return w.reshape(heads, d // 2, 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


def rope_neox(x, positions, base, rot):
    """x: tokens × heads × head_dim; rotates dimension i with i + rot/2 for i < rot/2."""
    half = rot // 2
    inv = base ** (-np.arange(half, dtype=np.float64) * 2.0 / rot)
    ang = positions[:, None].astype(np.float64) * inv[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., :half], x[..., half:rot]
    out = x.copy()
    out[..., :half] = a * c - b * s
    out[..., half:rot] = a * s + b * c
    return out


def forward_chunk(W, layers, emb, out_norm, out_w, tokens, first):
    """Negative log-likelihoods of tokens[j + 1] given tokens[..= j], j in first..n-1."""
    n = len(tokens)
    x = emb[tokens]
    pos = np.arange(n)
    hd, nh, nkv = W.head_dim, W.heads, W.kv_heads
    mask = np.triu(np.full((n, n), -np.inf), 1)
    for L in layers:
        h = rms_norm(x, L["attn_norm"], W.eps)
        q = h @ L["q"].T + L["bq"]
        k = h @ L["k"].T + L["bk"]
        v = h @ L["v"].T + L["bv"]
        q = rope_neox(q.reshape(n, nh, hd), pos, W.base, W.rope_dim)
        k = rope_neox(k.reshape(n, nkv, hd), pos, W.base, W.rope_dim)
        v = v.reshape(n, nkv, hd)
        o = np.empty((n, nh, hd))
        group = nh // nkv
        for i in range(nh):
            g = i // group
            s = q[:, i, :] @ k[:, g, :].T / np.sqrt(hd) + mask
            s = np.exp(s - s.max(axis=1, keepdims=True))
            s /= s.sum(axis=1, keepdims=True)
            o[:, i, :] = s @ v[:, g, :]
        x = x + o.reshape(n, nh * hd) @ L["o"].T
        h = rms_norm(x, L["ffn_norm"], W.eps)
        g = h @ L["gate"].T
        x = x + ((g / (1.0 + np.exp(-g))) * (h @ L["up"].T)) @ L["down"].T
    x = rms_norm(x[first : n - 1], out_norm, W.eps)
    logits = x @ out_w.T
    m = logits.max(axis=1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(axis=1, keepdims=True)))[:, 0]
    target = logits[np.arange(len(x)), np.asarray(tokens[first + 1 :])]
    return lse - target


def main():
    path, tokens_path, ctx, chunks = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    ids = json.load(open(tokens_path))["ids"]
    W = Weights(path)
    bos = field(W.reader, "tokenizer.ggml.bos_token_id")
    add_bos = bool(field(W.reader, "tokenizer.ggml.add_bos_token", False))
    def bias(name, rows):
        # A llama file has no q/k/v biases.
        b = W.get(name)
        return np.zeros(rows) if b is None else b

    layers = []
    for i in range(W.layers):
        p = f"blk.{i}."
        q, k = W.get(p + "attn_q.weight"), W.get(p + "attn_k.weight")
        if W.arch == "llama":
            q, k = unpermute(q, W.heads), unpermute(k, W.kv_heads)
        layers.append(
            {
                "attn_norm": W.get(p + "attn_norm.weight"),
                "q": q,
                "k": k,
                "v": W.get(p + "attn_v.weight"),
                "bq": bias(p + "attn_q.bias", q.shape[0]),
                "bk": bias(p + "attn_k.bias", k.shape[0]),
                "bv": bias(p + "attn_v.bias", k.shape[0]),
                "o": W.get(p + "attn_output.weight"),
                "ffn_norm": W.get(p + "ffn_norm.weight"),
                "gate": W.get(p + "ffn_gate.weight"),
                "up": W.get(p + "ffn_up.weight"),
                "down": W.get(p + "ffn_down.weight"),
            }
        )
    emb = W.get("token_embd.weight")
    out_w = W.get("output.weight")
    out_w = emb if out_w is None else out_w
    out_norm = W.get("output_norm.weight")
    # llama-perplexity: chunks of ctx tokens, the first replaced by BOS when the model adds
    # one, the second half of each chunk scored.
    n_chunks = len(ids) // ctx if chunks == 0 else min(chunks, len(ids) // ctx)
    first = ctx // 2
    nll = []
    for c in range(n_chunks):
        t = list(ids[c * ctx : (c + 1) * ctx])
        if add_bos:
            t[0] = bos
        nll.extend(float(v) for v in forward_chunk(W, layers, emb, out_norm, out_w, t, first))
    print(json.dumps({"ppl": float(np.exp(np.mean(nll))), "nll": nll, "chunks": n_chunks, "ctx": ctx, "types": W.types()}))


if __name__ == "__main__":
    main()
