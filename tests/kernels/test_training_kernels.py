"""Each training kernel alone, compiled and run on the emulator, against float64 numpy written here.

Weighted kernels run in both forms: dynamic (the test packs activations and weight blocks into
the spatial axis itself, forward blocks as Wᵀ, dx blocks as W) and static (weights baked).
Tolerance (docs/testing.md, max|got − ref| / max|ref|): 1e-2, the matmul/softmax figure, for
every kernel. The attention backward (five matmuls, a softmax and a row reduction, each result
rounded to fp16) measures 1.4e-3, the projections 4e-4 to 7e-4.
"""

import math

import numpy as np
import pytest

from helpers import rel_err

from anelm.compiler.pipeline import compile_graph
from anelm.device import base
from anelm.device.emulator import Emulator
from anelm.chip.profile import STRICT
from anelm.runtime.kernel import Kernel
from anelm.compiler.passes.cost import graph_flops
from anelm.kernels.training import FORWARD, WEIGHTED, Dims, build_graph, layouts

PROFILE = STRICT.replace(compile_budget=10**9)


@pytest.fixture(autouse=True, scope="module")
def _compile_count_as_found():
    """These tests compile many programs (uncapped profile), but the count is process-wide:
    later tests that use the strict budget start from zero, as a fresh process would."""
    yield
    base.reset_compile_count()


M = Dims(d=32, f=48, hq=4, hkv=2, hd=12, s=16)  # GQA, head_dim ≠ d / hq
# HF orientation [out, in] of every weight role
SHAPES = {"wq": (M.q, M.d), "wk": (M.kv, M.d), "wv": (M.kv, M.d), "wo": (M.d, M.q),
          "w1": (M.f, M.d), "w3": (M.f, M.d), "w2": (M.d, M.f)}


def sig(x):
    return 1.0 / (1.0 + np.exp(-x))


# y = W·x forward, dx = Wᵀ·dy backward; activations [C, S] float64
REF = {
    "qkv": lambda w, a: {"q": w["wq"] @ a["xn"], "k": w["wk"] @ a["xn"], "v": w["wv"] @ a["xn"]},
    "wo": lambda w, a: {"o": w["wo"] @ a["attn"]},
    "ffn_up": lambda w, a: {"h1": w["w1"] @ a["x2n"], "h3": w["w3"] @ a["x2n"],
                            "gate": (w["w1"] @ a["x2n"]) * sig(w["w1"] @ a["x2n"]) * (w["w3"] @ a["x2n"])},
    "ffn_down": lambda w, a: {"f": w["w2"] @ a["gate"]},
    "ffn_down_dx": lambda w, a: {"dgate": w["w2"].T @ a["dy"]},
    "ffn_up_dx": lambda w, a: {"dx": w["w1"].T @ a["dh1"] + w["w3"].T @ a["dh3"]},
    "wo_dx": lambda w, a: {"dattn": w["wo"].T @ a["dx2"]},
    "qkv_dx": lambda w, a: {"dx": w["wq"].T @ a["dq"] + w["wk"].T @ a["dk"] + w["wv"].T @ a["dv"]},
}



def random_case(kind, seed):
    rng = np.random.default_rng(seed)
    w = {r: rng.standard_normal(s) / math.sqrt(s[1]) for r, s in SHAPES.items()}
    acts = {a: rng.standard_normal((pk.channels, M.s)) for pk in layouts(M)[kind].values() for a in pk.acts}
    return w, acts


def pack(kind, w, acts, dynamic, m=M):
    """Kernel inputs `[1, C, 1, W]`: activations, then (dynamic) M = Wᵀ forward or W for dx."""
    inputs = {}
    for name, pk in layouts(m)[kind].items():
        blocks = [acts[a] for a in pk.acts]
        if dynamic:
            blocks += [w[r].T if kind in FORWARD else w[r] for r, _ in pk.weights]
        inputs[name] = np.concatenate(blocks, axis=1)[None, :, None, :]  # [1, C, 1, W]
    return inputs


def run(graph, inputs):
    with Kernel(compile_graph(graph, PROFILE), Emulator(PROFILE)) as k:
        return {n: v.astype(np.float64)[0, :, 0, :] for n, v in k.run(inputs).items()}


@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "static"])
@pytest.mark.parametrize("kind", WEIGHTED)
def test_weighted_kernel_matches_numpy(kind, dynamic):
    w, acts = random_case(kind, seed=WEIGHTED.index(kind))
    ref = REF[kind](w, acts)
    mats = None
    if not dynamic:  # the static form takes the staged matrices M and bakes Mᵀ
        mats = {r: (w[r].T if kind in FORWARD else w[r]) for pk in layouts(M)[kind].values()
                for r, _ in pk.weights}
    got = run(build_graph(kind, M, mats), pack(kind, w, acts, dynamic))
    assert set(got) == set(ref)
    for name in ref:
        assert got[name].shape == ref[name].shape, name
        assert rel_err(got[name], ref[name]) <= 1e-2, (name, rel_err(got[name], ref[name]))


def heads(x, hd):
    return x.reshape(-1, hd, x.shape[1])  # [H, hd, S]


def attention_ref(q, k, v):
    """Causal GQA attention and what the backward needs; query head h uses KV head h // G."""
    qh, kh, vh = heads(q, M.hd), heads(k, M.hd), heads(v, M.hd)
    g = M.hq // M.hkv
    future = np.triu(np.ones((M.s, M.s), bool), 1)
    probs, out = [], np.zeros_like(qh)
    for h in range(M.hq):
        s = qh[h].T @ kh[h // g] / math.sqrt(M.hd)  # [S_q, S_k]
        s[future] = -np.inf
        p = np.exp(s - s.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        probs.append(p)
        out[h] = vh[h // g] @ p.T
    return out.reshape(q.shape), probs


def attention_bwd_ref(q, k, v, da):
    qh, kh, vh, dah = heads(q, M.hd), heads(k, M.hd), heads(v, M.hd), heads(da, M.hd)
    g = M.hq // M.hkv
    _, probs = attention_ref(q, k, v)
    dq, dk, dv = np.zeros_like(qh), np.zeros_like(kh), np.zeros_like(vh)
    for h in range(M.hq):
        p = probs[h]
        dp = dah[h].T @ vh[h // g]                                  # [S_q, S_k]
        ds = p * (dp - (p * dp).sum(axis=1, keepdims=True)) / math.sqrt(M.hd)
        dq[h] = kh[h // g] @ ds.T
        dk[h // g] += qh[h] @ ds
        dv[h // g] += dah[h] @ p
    return {"dq": dq.reshape(q.shape), "dk": dk.reshape(k.shape), "dv": dv.reshape(v.shape)}


def qkv_inputs(seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((M.q, M.s)), rng.standard_normal((M.kv, M.s)),
            rng.standard_normal((M.kv, M.s)), rng.standard_normal((M.q, M.s)))


def test_sdpa_fwd_matches_numpy():
    q, k, v, _ = qkv_inputs(7)
    got = run(build_graph("sdpa_fwd", M), {"q": q[None, :, None], "k": k[None, :, None],
                                           "v": v[None, :, None]})
    assert rel_err(got["attn"], attention_ref(q, k, v)[0]) <= 1e-2


def test_sdpa_bwd_matches_numpy():
    q, k, v, da = qkv_inputs(8)
    got = run(build_graph("sdpa_bwd", M), {"q": q[None, :, None], "k": k[None, :, None],
                                           "v": v[None, :, None], "da": da[None, :, None]})
    ref = attention_bwd_ref(q, k, v, da)
    for name in ("dq", "dk", "dv"):
        assert rel_err(got[name], ref[name]) <= 1e-2, (name, rel_err(got[name], ref[name]))


def test_sdpa_carrying_the_probabilities_gives_the_recomputed_gradients_bit_for_bit():
    """`Dims.carry_probs`: sdpa_fwd returns P `[Hq·S_q, S_k]` (numpy's softmax within 1e-2), and
    sdpa_bwd given it returns exactly what it returns recomputing P from q and k: the forward's
    P is the fp16 tensor the backward would compute."""
    m = Dims(**{**M.__dict__, "carry_probs": True})
    q, k, v, da = qkv_inputs(10)
    ins = {"q": q[None, :, None], "k": k[None, :, None], "v": v[None, :, None]}
    fwd = run(build_graph("sdpa_fwd", m), ins)
    assert rel_err(fwd["attn"], run(build_graph("sdpa_fwd", M), ins)["attn"]) == 0
    assert rel_err(fwd["probs"], np.concatenate(attention_ref(q, k, v)[1])) <= 1e-2
    carried = run(build_graph("sdpa_bwd", m), {**ins, "da": da[None, :, None], "probs": fwd["probs"][None, :, None]})
    recomputed = run(build_graph("sdpa_bwd", M), {**ins, "da": da[None, :, None]})
    for name in ("dq", "dk", "dv"):
        assert np.array_equal(carried[name], recomputed[name]), name


@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "static"])
def test_the_fused_mlp_backward_is_its_two_kernels_bit_for_bit(dynamic):
    """`Dims.ffn_dx`: ffn_dx (dy, h1, h3 -> dh1, dh3, dx) returns exactly what ffn_down_dx with the
    SwiGLU backward inside and then ffn_up_dx on its dh1, dh3 return (the same fp16 dh1, dh3
    meet the same matmuls), and dx within 1e-2 of numpy's."""
    two = Dims(**{**M.__dict__, "swiglu_dx": True})
    one = Dims(**{**two.__dict__, "ffn_dx": True})
    w, acts = random_case("ffn_down_dx", seed=11)
    acts.update({n: 3 * np.random.default_rng(12).standard_normal((M.f, M.s)) for n in ("h1", "h3")})

    def mats(kind, m):
        return None if dynamic else {r: w[r] for pk in layouts(m)[kind].values() for r, _ in pk.weights}

    got = run(build_graph("ffn_dx", one, mats("ffn_dx", one)), pack("ffn_dx", w, acts, dynamic, one))
    down = run(build_graph("ffn_down_dx", two, mats("ffn_down_dx", two)), pack("ffn_down_dx", w, acts, dynamic, two))
    up = run(build_graph("ffn_up_dx", two, mats("ffn_up_dx", two)), pack("ffn_up_dx", w, down, dynamic, two))
    assert sorted(got) == ["dh1", "dh3", "dx"]
    for name, want in (("dh1", down["dh1"]), ("dh3", down["dh3"]), ("dx", up["dx"])):
        assert np.array_equal(got[name], want), name
    s1 = sig(acts["h1"])
    dgate = w["w2"].T @ acts["dy"]
    dh1 = dgate * acts["h3"] * s1 * (1 + acts["h1"] * (1 - s1))
    dh3 = dgate * acts["h1"] * s1
    assert rel_err(got["dx"], w["w1"].T @ dh1 + w["w3"].T @ dh3) <= 1e-2


def test_flops_count_the_matmuls():
    # qkv is three projections and nothing else: 2·S·D·(Q + 2·KV)
    assert graph_flops(build_graph("qkv", M)) == 2 * M.s * M.d * (M.q + 2 * M.kv)
    static = {r: np.zeros((pk.channels, c), np.float32) for pk in layouts(M)["qkv"].values()
              for r, c in pk.weights}
    assert graph_flops(build_graph("qkv", M, static)) == 2 * M.s * M.d * (M.q + 2 * M.kv)


def test_kernels_take_the_strict_profile():
    # no concat, named transposes, alphabetical names (no io_naming prefixes) for every kernel
    for kind in list(WEIGHTED) + ["sdpa_fwd", "sdpa_bwd"]:
        art = compile_graph(build_graph(kind, M), STRICT)
        assert "concat(" not in art.mil_text
        names = [s.name for s in art.signature.inputs] + [s.name for s in art.signature.outputs]
        assert not any(n[:1] in "io" and n[1:2].isdigit() for n in names), (kind, names)


def rope_case(seed):
    """q, k, v, dattn and the RoPE tables `[hd, S]` of a packed sequence (two examples), the
    positions as the trainer's tables get them (`models.layers`, HF's full width)."""
    from anelm.models.layers import rope_full_width, rope_tables

    pos = np.concatenate([np.arange(10), np.arange(M.s - 10)])
    inv = 1.0 / 10000.0 ** (np.arange(0, M.hd, 2) / M.hd)
    cos, sin = (rope_full_width(t).astype(np.float64) for t in rope_tables(pos, inv))
    return (*qkv_inputs(seed), cos, sin)


def test_sdpa_with_rope_inside_matches_numpy_rotating_before_and_after():
    """`Dims.rope`: q and k enter unrotated beside cos and sin; the forward equals attention on
    the rotated q, k (RoPE by cpu_ops.rope_fwd, itself checked against HF's), and the backward's
    dq, dk are the gradients before the rotation (cpu_ops.rope_bwd of the rotated ones)."""
    from anelm.train.steps.cpu_ops import rope_bwd, rope_fwd

    m = Dims(**{**M.__dict__, "rope": True})
    q, k, v, da, cos, sin = rope_case(9)
    qr, kr = rope_fwd(q, cos, sin), rope_fwd(k, cos, sin)
    tables = np.concatenate([cos, sin], axis=1)[None, :, None]  # [1, hd, 1, 2S]: cos, then sin
    ins = {"q": q[None, :, None], "k": k[None, :, None], "v": v[None, :, None], "rope": tables}
    got = run(build_graph("sdpa_fwd", m), ins)
    assert rel_err(got["attn"], attention_ref(qr, kr, v)[0]) <= 1e-2
    got = run(build_graph("sdpa_bwd", m), {**ins, "da": da[None, :, None]})
    ref = attention_bwd_ref(qr, kr, v, da)
    ref["dq"], ref["dk"] = rope_bwd(ref["dq"], cos, sin), rope_bwd(ref["dk"], cos, sin)
    for name in ("dq", "dk", "dv"):
        assert rel_err(got[name], ref[name]) <= 1e-2, (name, rel_err(got[name], ref[name]))
    # the rotation matters: the same inputs without it are far off
    assert rel_err(run(build_graph("sdpa_fwd", M), {n: a for n, a in ins.items() if n != "rope"})["attn"],
                   attention_ref(qr, kr, v)[0]) > 5e-2
