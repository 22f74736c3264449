"""Column-separable programs (device/emulator/columns.py): which programs the emulator evaluates
column by column, and proof that the columns a caller reads come out as a full evaluation's.

Three checks per kernel kind:
- narrowed (read 1 or 3 columns) against the emulator's own full evaluation: bit-identical;
- against the plan run over all 16 columns at once: BLAS sums 1 and 16 columns in different
  orders, so a float32 sum may round to the neighbouring fp16 value; the test reports the
  fraction of values that moved and bounds the difference by 2e-3 of max|ref| (a few fp16 ulps);
- the whole-width plan's column 0 does not change when the padding columns do (bit for bit):
  the program really does not mix columns, measured on the program itself.
Programs that mix columns (attention over the spatial axis, a reduction, softmax or transpose
along it, a matmul that contracts it) are evaluated in full.
"""

import numpy as np
import pytest

from anelm.chip.profile import STRICT
from anelm.compiler.pipeline import compile_graph
from anelm.device.emulator import Emulator
from anelm.device.emulator.columns import COLUMN_BLOCK, column_axes, column_plan
from anelm.ir.builder import GraphBuilder
from anelm.kernels.decode import decode_layer
from anelm.kernels.families import family_for
from anelm.kernels.qlinear import qlinear
from anelm.kernels.layers import layer_params, layer_shape
from anelm.kernels.prefill import prefill_layer
from anelm.kernels.training import WEIGHTED, Dims, build_graph, layer_mats
from anelm.models.config import GPT2Config, LlamaConfig, Qwen3Config
from anelm.models.names import random_layer
from anelm.models.formats.quantized import InputQuant
from anelm.runtime.kernel import Kernel
from helpers import rms_norm_graph

PROFILE = STRICT.replace(compile_budget=10**9)
W = 16
CONFIGS = {
    "gpt2": GPT2Config(n_embd=64, n_layer=1, n_head=4, n_positions=64, vocab_size=96),
    "llama-gqa": LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=8,
                             num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=500.0),
    "qwen3": Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=1e6),
}


def _compiled(graph):
    emu = Emulator(PROFILE)
    art = compile_graph(graph, PROFILE)
    return emu, art, emu.compile(art.mil_text, art.weights)


def _decode(kind: str, int8: bool = False):
    cfg = CONFIGS[kind]
    s = layer_shape(cfg, 0)
    p = layer_params(s, random_layer(cfg, seed=7))
    if int8:  # the int8 linears of a quantized folder (W8), biases kept in fp16
        p = {n: (qlinear(w, InputQuant()), b) if w.ndim == 2 else (w, b) for n, (w, b) in p.items()}
    return decode_layer(s, p, 64, rope=s.family.rotary, name=f"decode_{kind}", columns=W)


def _static_training(kind: str):
    cfg = CONFIGS["llama-gqa"]
    m = Dims.from_config(cfg, W)
    weights = {f"model.layers.0.{k}": v for k, v in random_layer(cfg, seed=3).items()}
    mats = layer_mats(kind, weights, 0, family_for(cfg.model_type)) if kind in WEIGHTED else None
    return build_graph(kind, m, mats)


def _inputs(model, rng, scale=1.0):
    out = {}
    for name, t in model.inputs:
        a = rng.standard_normal(t.shape).astype(np.float32) * scale
        if name == "mask" and t.shape[2] > 1:  # decode's [1, 1, T, W]: positions down, columns across
            a = np.broadcast_to(np.where(np.arange(t.shape[2]) < 40, 0.0, -1e4)[:, None], t.shape).astype(np.float32)
        elif name == "mask":
            a = np.where(np.arange(t.shape[-1]) < 40, 0.0, -1e4).astype(np.float32).reshape(t.shape)
        out[name] = a.astype(np.float16).astype(np.float32)
    return out


SEPARABLE = {f"decode-{k}": (lambda k=k: _decode(k)) for k in CONFIGS}
SEPARABLE["decode-llama-int8"] = lambda: _decode("llama-gqa", int8=True)
# activation blocks side by side in one input ([dh1 | dh3], [dk | dv]) put other columns in a
# column's place: those kernels run in full
PACKED = ("ffn_up_dx", "qkv_dx")
SEPARABLE.update({f"train-static-{k}": (lambda k=k: _static_training(k)) for k in WEIGHTED if k not in PACKED})


@pytest.mark.parametrize("name", sorted(SEPARABLE))
def test_read_columns_match_a_full_evaluation(name):
    _, _, model = _compiled(SEPARABLE[name]())
    cols = model.columns
    assert cols is not None and cols.width == W, f"{name} should be column-separable"
    rng = np.random.default_rng(0)
    x = _inputs(model, rng)
    full = cols.run(x, set(), None, model.plan)
    for read in (1, 3):
        narrow = cols.run(x, set(), read, model.plan)
        for out in cols.carried_outputs:
            assert np.array_equal(narrow[out][..., :read], full[out][..., :read]), (name, out, read)
            assert not narrow[out][..., read:].any()  # unread columns are left as zeros
    wide = model.plan.run(x)  # every column in one pass
    moved = total = 0
    for out in model.plan.outputs:
        ref = wide[out]
        err = np.abs(full[out] - ref).max() / np.abs(ref).max()
        assert err <= 2e-3, (name, out, err)
        moved, total = moved + int((full[out] != ref).sum()), total + ref.size
    print(f"{name}: {moved / total:.2%} of values one summation order apart")
    # the padding cannot reach column 0: new padding values, the same column 0, bit for bit
    other = {n: (a if n not in cols.carried_inputs else np.concatenate(
        [a[..., :1], _inputs(model, rng, 50.0)[n][..., 1:]], axis=-1)) for n, a in x.items()}
    again = model.plan.run(other)
    for out in cols.carried_outputs:
        assert np.array_equal(again[out][..., 0], wide[out][..., 0]), (name, out)


def _mixing_programs():
    cfg = CONFIGS["llama-gqa"]
    s = layer_shape(cfg, 0)
    p = layer_params(s, random_layer(cfg, seed=1))
    progs = {"prefill": prefill_layer(s, p, W),
             "train-dynamic-qkv": build_graph("qkv", Dims.from_config(cfg, W)),
             "train-sdpa_fwd": _static_training("sdpa_fwd"), "train-sdpa_bwd": _static_training("sdpa_bwd")}
    progs.update({f"train-static-{k}": _static_training(k) for k in PACKED})

    def one(name, build):
        b = GraphBuilder(name)
        x = b.input("x", [1, 8, 1, W])
        b.output("y", build(b, x))
        return b.build()
    progs["softmax-spatial"] = one("sm", lambda b, x: b.softmax(x, axis=3))
    progs["reduce-spatial"] = one("rs", lambda b, x: x * b.reduce_sum(x, axes=[3]))
    progs["matmul-contracts"] = one("mm", lambda b, x: b.reshape(
        b.matmul(b.reshape(x, [1, 1, 8, W]), b.const(np.ones((1, 1, W, W), np.float32), name="w", dtype="fp16"),
                 name="m"), [1, 8, 1, W]))
    progs["transpose-reduce"] = one("tr", lambda b, x: b.transpose(
        b.reduce_max(b.transpose(x, [0, 3, 2, 1]), axes=[1]) + b.transpose(x, [0, 3, 2, 1]), [0, 3, 2, 1]))
    return progs


MIXING = _mixing_programs()


@pytest.mark.parametrize("name", sorted(MIXING))
def test_programs_that_mix_columns_run_in_full(name):
    _, _, model = _compiled(MIXING[name])
    assert model.columns is None


def test_separable_hand_written_program_and_the_width_limit():
    def prog(width):
        b = GraphBuilder("sep")
        x = b.input("x", [1, 8, 1, width])
        h = b.linear(rms_norm_graph(b, x, np.ones(8)), np.eye(8) * 0.5, name="p")
        b.output("y", b.sigmoid(h) * x)
        return b.build()
    assert _compiled(prog(W))[2].columns is not None
    # wider programs (prefill, training) are read whole: one product over all their columns
    plan = _compiled(prog(2 * COLUMN_BLOCK))[2].plan
    assert column_plan(plan, column_axes(plan)) is None


def test_kernel_read_columns_through_the_device():
    emu, art, _ = _compiled(_decode("qwen3"))
    x = _inputs(emu.compile(art.mil_text, art.weights), np.random.default_rng(5))
    full = Kernel(art, emu, float32_outputs=True).run(x)
    narrow = Kernel(art, emu, float32_outputs=True, read_columns=1).run(x)
    for out in ("k_new", "v_new", "y"):
        assert np.array_equal(narrow[out][..., 0], full[out][..., 0])



@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_an_evaluation_of_some_outputs_runs_only_their_steps(kind):
    """`only` (Device.evaluate): a decode chunk's first pass reads k_new and v_new alone, which
    come before the attention and the MLP; the cut plan gives them bit for bit, in fewer steps."""
    _, _, model = _compiled(_decode(kind))
    x = _inputs(model, np.random.default_rng(2))
    full = model.plan.run(x)
    cut = model.pruned(("k_new", "v_new"))
    got = cut.run(x)
    assert set(got) == {"k_new", "v_new"} and len(cut.steps) < len(model.plan.steps) // 2
    assert all(np.array_equal(got[n], full[n]) for n in got)
    assert model.pruned(("k_new", "v_new")) is cut  # cut once per plan
