"""Gemma 3 op by op against llama.cpp: each of flashllm's kernels fed llama.cpp's own input.

Run:  python -m scripts.studies.gemma_ops FOLDER GGUF [--text-chars 400] [--layers 0,1,5]
FOLDER: a flashllm conversion of GGUF (the native one `flashllm convert GGUF -o FOLDER` makes).
llama.cpp evaluates a prose prefix in one batch (scripts/studies/llamacpp_trace.py captures its
named tensors); for every op of the chosen layers flashllm's kernel gets llama.cpp's input of
that op and its output is compared with llama.cpp's: max |diff| / max |llama.cpp| and the RMS
of the difference over the RMS of llama.cpp's values. An op computed the same way differs by
f32 rounding (~1e-7); one that rounds elsewhere (f16, 8 bits) shows it here.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from flashllm.ffi import kernel
from flashllm.format.reader import open_flash
from flashllm.runtime.model import Model
from flashllm.sparsity.corpus import builtin_text
from scripts.studies.llamacpp_trace import capture, tokenize


def report(name: str, ours: np.ndarray, ref: np.ndarray) -> None:
    d = ours.reshape(ref.shape).astype(np.float64) - ref                      # ref's shape
    rms = float(np.sqrt((ref.astype(np.float64) ** 2).mean())) or 1.0
    print(f"  {name:16s} max|d|/max|ref| {np.abs(d).max() / max(np.abs(ref).max(), 1e-30):.2e}"
          f"   rms(d)/rms(ref) {np.sqrt((d ** 2).mean()) / rms:.2e}")


def layer_ops(net: Model, i: int, t: dict, T: int) -> None:
    """Layer i's ops, each on llama.cpp's input t[...] (names as llama.cpp's graph has them)."""
    cfg, L = net.config, net.w.layer(i)
    x = (t["inp_scaled"] if i == 0 else t[f"l_out-{i - 1}"]).reshape(T, -1)   # (T, d_model)
    report("attn_norm", kernel.rmsnorm(x, L.attn_norm, cfg.norm_eps), t[f"attn_norm-{i}"])
    q, k, v = net._qkv(L, t[f"attn_norm-{i}"].reshape(T, -1))               # (T, nq), (T, nkv) x2
    report("q", q, t[f"Qcur-{i}"])
    report("k", k, t[f"Kcur-{i}"])
    report("v", v, t[f"Vcur-{i}"])
    hd = cfg.head_dim
    qn = net._head_norm(t[f"Qcur-{i}"].reshape(T, -1, hd), L.q_norm)        # (T, n_heads, hd)
    report("q_norm", qn, t[f"Qcur_normed-{i}"])
    kn = net._head_norm(t[f"Kcur-{i}"].reshape(T, -1, hd), L.k_norm)        # (T, n_kv, hd)
    report("k_norm", kn, t[f"Kcur_normed-{i}"])
    pos = np.arange(T, dtype=np.int32)                                       # (T,)
    qr = np.ascontiguousarray(t[f"Qcur_normed-{i}"].reshape(T, -1, hd))
    kernel.rope(qr, pos, net.rope_inv[i])
    report("q_rope", qr, t[f"last:Qcur-{i}"])
    kr = np.ascontiguousarray(t[f"Kcur_normed-{i}"].reshape(T, -1, hd))
    kernel.rope(kr, pos, net.rope_inv[i])
    report("k_rope", kr, t[f"last:Kcur-{i}"])
    kc = np.zeros((T, cfg.n_kv_heads, hd), np.float16)                       # (T, n_kv, hd)
    vc = np.zeros_like(kc)
    kc[:] = t[f"last:Kcur-{i}"].reshape(T, -1, hd)
    vc[:] = t[f"Vcur-{i}"].reshape(T, -1, hd)
    qs = np.ascontiguousarray(t[f"last:Qcur-{i}"].reshape(T, -1, hd))
    o = kernel.attention(qs, kc, vc, 0, net.attn_scale, window=net.windows[i])  # (T, nq)
    report("attention", o, t[f"kqv_out-{i}"])
    a = kernel.matmul(L.wo, t[f"kqv_out-{i}"].reshape(T, -1), L.bo, net.n_threads)  # (T, d)
    report("wo", a, t[f"after:kqv_out-{i}"])
    an = kernel.rmsnorm(t[f"after:kqv_out-{i}"].reshape(T, -1), L.post_attn_norm, cfg.norm_eps)
    report("post_attn_norm", an, t[f"attn_post_norm-{i}"])
    h = kernel.rmsnorm(t[f"sa_out-{i}"].reshape(T, -1), L.ffn_norm, cfg.norm_eps)   # (T, d)
    report("ffn_norm", h, t[f"ffn_norm-{i}"])
    f = net.ffn
    gu = kernel.matmul(f.gate_up[i], t[f"ffn_norm-{i}"].reshape(T, -1), None, net.n_threads)
    report("gate", gu[:, :f.n_ff], t[f"ffn_gate-{i}"])
    report("up", gu[:, f.n_ff:], t[f"ffn_up-{i}"])
    g = kernel.act_mul(f.act, t[f"ffn_gate-{i}"].reshape(T, -1), t[f"ffn_up-{i}"].reshape(T, -1))
    report("geglu", g, t[f"ffn_geglu-{i}"])
    y = kernel.matmul(f.down[i], t[f"ffn_geglu-{i}"].reshape(T, -1), None, net.n_threads)
    report("down", y, t[f"ffn_out-{i}"])
    yn = kernel.rmsnorm(t[f"ffn_out-{i}"].reshape(T, -1), L.post_ffn_norm, cfg.norm_eps)
    report("post_ffn_norm", yn, t[f"ffn_post_norm-{i}"])


def drift(net: Model, t: dict, ids: list) -> None:
    """flashllm's own forward pass (f16 KV, as `run`) layer by layer against llama.cpp's l_out:
    how far the residual stream has moved apart after each layer, and the logits."""
    T = len(ids)
    pos = np.arange(T, dtype=np.int32)                                       # (T,)
    net.reset()
    x = net._embed(np.asarray(ids, np.int32), pos)                           # (T, d_model)
    print("drift: flashllm's pass against llama.cpp's, after each layer")
    for i in range(net.config.n_layers):
        L = net.w.layer(i)
        net._attention_block(i, L, x, pos, T)
        net._ffn_block(i, L, x)
        report(f"l_out-{i}", x, t[f"l_out-{i}"])
    report("logits", net.output_rows(x, pos, np.asarray(ids, np.int32)), t["logits"])


def named(seq: list) -> dict:
    """{name: array} of (name, array) in compute order: a repeated name gets #2, #3 ..., its
    last 'last:NAME' (llama.cpp names q and k again after a reshape and after RoPE), and
    'after:NAME' is the tensor computed right after NAME."""
    out, seen = {}, {}
    for j, (name, a) in enumerate(seq):
        seen[name] = seen.get(name, 0) + 1
        out[name if seen[name] == 1 else f"{name}#{seen[name]}"] = a
        out[f"last:{name}"] = a
        if j and f"after:{seq[j - 1][0]}" not in out:
            out[f"after:{seq[j - 1][0]}"] = a
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--text-chars", type=int, default=400)
    ap.add_argument("--layers", default="0,1,5,17")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    text = builtin_text("evaluation", "prose", max_chars=args.text_chars).text
    ids = tokenize(args.gguf, text)
    seq = []
    got = capture(args.gguf, ids, lambda n: "(" not in n, n_threads=args.threads, into=seq)
    t = named(seq)
    T = len(ids)
    net = Model(open_flash(args.folder), n_threads=args.threads, n_ctx=max(T, 64), kv_dtype="f16")
    for i in map(int, args.layers.split(",")):
        print(f"layer {i} ({T} tokens)")
        layer_ops(net, i, t, T)
    last = t[f"l_out-{net.config.n_layers - 1}"].reshape(T, -1)           # (T, d_model)
    out = net.output_rows(last, np.arange(T, dtype=np.int32), np.asarray(ids, np.int32))
    report("output", out, got["logits"])
    t["logits"] = got["logits"]
    drift(net, t, ids)


if __name__ == "__main__":
    main()
