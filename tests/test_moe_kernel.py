"""A mixture of experts' layer in C (native/moe.c, ffi/moe.py): the routing against numpy's softmax
and top-k in f64, and a pass's experts with their weighted sum against gguf-py's dequantization of
the same random expert rows (q4_0; Q4_K_M's Q4_K gate / up with Q6_K down; q8_0), packed on int8
activations and unpacked in f32 (exact); each token's result the bits of its one-token pass."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from flashllm.errors import KernelError
from flashllm.ffi import kernel
from flashllm.ffi.moe import ExpertSet, route
from flashllm.model.tensor import QTensor
from test_down_rows import int8
from test_pack import reference, rows_of

D = 256
KINDS = {"q4_0": ("q4_0", "q4_0", 64), "q4_k_m": ("q4_k", "q6_k", 256), "q8_0": ("q8_0", "q8_0", 32)}
TYPES = {"q4_0": Q.Q4_0, "q4_k": Q.Q4_K, "q6_k": Q.Q6_K, "q8_0": Q.Q8_0}
N_EXPERTS, K = 6, 2


def test_route_against_numpy():
    """Softmax, the k largest in falling order, renormalised or not: numpy in f64."""
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((7, 64)).astype(np.float32) * 3         # (T, E)
    p = np.exp(logits - logits.max(1, keepdims=True).astype(np.float64))
    p /= p.sum(1, keepdims=True)                                          # (T, E) f64
    want = np.argsort(-p, axis=1, kind="stable")[:, :8]                   # (T, 8)
    for norm in (False, True):
        ids, w = route(logits, 8, norm)
        np.testing.assert_array_equal(ids, want)
        ref = np.take_along_axis(p, want, 1)                              # (T, 8)
        ref = ref / ref.sum(1, keepdims=True) if norm else ref
        np.testing.assert_allclose(w, ref, rtol=2e-6)


def test_route_ties_and_bad_logits():
    ids, w = route(np.zeros((1, 5), np.float32), 3, True)
    assert ids.tolist() == [[0, 1, 2]] and np.allclose(w, 1 / 3)
    with pytest.raises(KernelError):
        route(np.array([[0.0, np.nan, 1.0]], np.float32), 2, False)
    with pytest.raises(KernelError):
        route(np.zeros((1, 4), np.float32), 5, False)


def make_experts(kind: str, n: int, seed: int = 0):
    """n experts of `kind`, each ((gate_up QTensor, down QTensor), (gate_up, down) f64 values);
    the last one's n_ff twice the others' (a shared expert's)."""
    gt, dt, n_ff = KINDS[kind]
    rng, out = np.random.default_rng(seed), []
    for e in range(n):
        f = n_ff * (2 if e == n - 1 else 1)
        gu = rows_of(rng, TYPES[gt], 2 * f, D)                            # (2 f, row bytes)
        dn = rows_of(rng, TYPES[dt], D, f)                                # (D, row bytes)
        out.append(((QTensor(gu, gt, 2 * f, D), QTensor(dn, dt, D, f)),
                    (reference(gu, TYPES[gt], 2 * f, D), reference(dn, TYPES[dt], D, f))))
    return out


def routing(rng, T: int, n: int):
    """ids (T, K + 1): K distinct of the first n - 1 experts, then the last; weights (T, K + 1)."""
    ids = np.stack([np.append(rng.permutation(n - 1)[:K], n - 1) for _ in range(T)]).astype(np.int32)
    return ids, rng.uniform(0.1, 1.0, ids.shape).astype(np.float32)


def reference_moe(values, ids, w, h, x, q, block: tuple) -> np.ndarray:
    """x + Σ w · down @ q(silu(g) · u) of [g; u] = gate_up @ q(h), in f64 (q: int8 rounding)."""
    out = x.astype(np.float64)                                            # (T, D)
    for t in range(len(h)):
        for e, wt in zip(ids[t], w[t]):
            gu, dn = values[e]
            f = dn.shape[1]
            g = gu @ q(h[t:t + 1], block[0])[0]                           # (2 f,)
            a = g[:f] / (1 + np.exp(-g[:f])) * g[f:]                      # (f,)
            out[t] += wt * (dn @ q(a[None], block[1])[0])
    return out


def _blocks(kind: str) -> tuple:
    gt, dt, _ = KINDS[kind]
    return tuple(256 if t.endswith("_k") else 32 for t in (gt, dt))


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("T,threads", [(1, 1), (5, 2), (23, 2)])
def test_moe_ffn_against_gguf_py(kind, T, threads):
    """Packed (where this build packs) on int8 activations: the f64 pass on the same rounded
    activations up to f32 sums; exact (unpacked, f32): the f64 pass itself."""
    experts = make_experts(kind, N_EXPERTS + 1)
    mats, values = [m for m, _ in experts], [v for _, v in experts]
    rng = np.random.default_rng(T)
    h = rng.standard_normal((T, D)).astype(np.float32)                    # (T, D)
    x = np.zeros((T, D), np.float32)      # (T, D) the sums alone (test below: the residual's)
    ids, w = routing(rng, T, N_EXPERTS + 1)
    packed = [tuple(kernel.pack(m) or m for m in pair) for pair in mats]
    got = x.copy()
    ExpertSet(packed, "silu")(ids, w, h, got, n_threads=threads)
    want = reference_moe(values, ids, w, h, x, int8, _blocks(kind))
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 1e-4 * scale, np.abs(got - want).max() / scale
    exact = x.copy()
    ExpertSet(mats, "silu")(ids, w, h, exact, exact=True, n_threads=threads)
    want = reference_moe(values, ids, w, h, x, lambda v, b: v, _blocks(kind))
    assert np.abs(exact - want).max() <= 1e-5 * scale


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_token_gets_its_one_token_bits(kind):
    """A pass of 13 tokens (experts meeting 1..13 of them) gives each token the bits of a pass of
    that token alone, on 1 or 2 threads; and the per-expert sequence runtime/moe.py ran before
    (kernel.matmul, act_mul, x += w · y in ascending expert order) to the bit."""
    mats = [tuple(kernel.pack(m) or m for m in pair)
            for pair, _ in make_experts(kind, N_EXPERTS + 1, seed=2)]
    if any(isinstance(m, QTensor) for pair in mats for m in pair):
        pytest.skip("this build has no packed layout for these experts")
    experts = ExpertSet(mats, "silu")
    rng = np.random.default_rng(4)
    h = rng.standard_normal((13, D)).astype(np.float32)                   # (13, D)
    x = rng.standard_normal((13, D)).astype(np.float32)                   # (13, D)
    ids, w = routing(rng, 13, N_EXPERTS + 1)
    ids[:, 0] = 0                                                         # expert 0 meets all 13
    ids[:, 1] = np.where(ids[:, 1] == 0, 1, ids[:, 1])
    whole = x.copy()
    experts(ids, w, h, whole, n_threads=2)
    for t in range(13):
        one = x[t:t + 1].copy()
        experts(ids[t:t + 1], w[t:t + 1], h[t:t + 1], one, n_threads=1)
        np.testing.assert_array_equal(one[0], whole[t])
    seq = x.copy()
    for e in np.unique(ids):
        t, j = np.nonzero(ids == e)
        gu, dn = mats[e]
        g = kernel.matmul(gu, h[t], None, 2)                              # (n, 2 f)
        f = dn.cols
        ys = np.zeros((len(t), D), np.float32)
        ys += kernel.matmul(dn, kernel.act_mul("silu", g[:, :f], g[:, f:]), None, 2)
        seq[t] += w[t, j, None] * ys
    np.testing.assert_array_equal(seq, whole)


def test_bad_input_is_refused():
    mats = [pair for pair, _ in make_experts("q4_0", 3)]
    experts = ExpertSet(mats, "silu")
    h = np.zeros((2, D), np.float32)
    ids = np.array([[0, 1], [1, 3]], np.int32)
    with pytest.raises(KernelError, match="expert ids"):
        experts(ids, np.ones((2, 2), np.float32), h, h.copy())
    with pytest.raises(KernelError, match="x must be"):
        experts(ids[:, :1] * 0, np.ones((2, 1), np.float32), h, np.zeros((2, D + 1), np.float32))
    with pytest.raises(KernelError, match="activation"):
        ExpertSet(mats, "swish")
    packed = [tuple(kernel.pack(m) or m for m in pair) for pair in mats]
    if isinstance(packed[0][0], QTensor):
        pytest.skip("this build has no packed layout")
    with pytest.raises(KernelError, match="moe_ffn failed"):     # a packed matrix has no f32 path
        ExpertSet(packed, "silu")(ids[:, :1] * 0, np.ones((2, 1), np.float32), h, h.copy(),
                                  exact=True)
