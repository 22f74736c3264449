"""Bound plans (device/emulator/steps.py) against the plan they bind: the same values, bit for bit.

`BoundPlan.run` replaces `Plan.run` for the emulator's one-column decode evaluation, so every
check here is exact (the fp16 values' bit patterns, NaN and signed zeros included) and covers
what the emulator models besides plain values: results that overflow fp16 to inf, inf and NaN
inputs, the fp32 accumulator's limit on matmul (strict's 32768), and the first-overflow
diagnostic (the same op named). Plans: the decode kernels of three families (and an int8 one,
whose rewritten steps keep their own compute), whole and narrowed to one column, and a
hand-written program with the ops decode does not use (transpose, slice_by_index with a
squeeze, reduce_mean, scalars), under strict and under profiles whose rounders differ
(saturating activations, fp32 compute).
"""

import numpy as np
import pytest

from anelm.chip.profile import STRICT
from anelm.device.emulator import Emulator
from anelm.device.emulator.steps import BoundPlan, _bound_compute
from test_emulator_columns import _compiled, _decode, _inputs

PROFILE = STRICT.replace(compile_budget=10**9)
HEAD = 'program(1.3)\n[buildInfo = dict<string, string>({{"coremlc-version", "3505.4.1"}})]\n{\n'
X, Y = "tensor<fp16, [1, 8, 1, 4]>", "tensor<fp16, [4, 8]>"
MIXED = HEAD + f"""    func main<ios18>({X} x, {Y} w) {{
        tensor<int32, [4]> perm = const()[name = string("perm"), val = tensor<int32, [4]>([0, 3, 2, 1])];
        tensor<fp16, [1, 4, 1, 8]> xt = transpose(x = x, perm = perm)[name = string("xt")];
        tensor<int32, [4]> b0 = const()[name = string("b0"), val = tensor<int32, [4]>([0, 1, 0, 0])];
        tensor<int32, [4]> e0 = const()[name = string("e0"), val = tensor<int32, [4]>([1, 2, 1, 8])];
        tensor<bool, [4]> sq = const()[name = string("sq"), val = tensor<bool, [4]>([true, true, true, false])];
        tensor<fp16, [8]> row = slice_by_index(x = xt, begin = b0, end = e0, squeeze_mask = sq)[name = string("row")];
        tensor<int32, [1]> ax = const()[name = string("ax"), val = tensor<int32, [1]>([1])];
        tensor<fp16, [1, 1, 1, 4]> mean = reduce_mean(x = x, axes = ax, keep_dims = bool(true))[name = string("mean")];
        tensor<fp16, [1, 8, 1, 4]> d = sub(x = x, y = mean)[name = string("d")];
        tensor<fp16, [1, 8, 1, 4]> sq2 = mul(x = d, y = d)[name = string("sq2")];
        tensor<fp16, [1, 1, 4, 8]> dt = reshape(x = sq2, shape = tensor<int32, [4]>([1, 1, 4, 8]))[name = string("dt")];
        tensor<fp16, [1, 1, 4, 4]> g = matmul(x = dt, y = w, transpose_x = tx, transpose_y = ty)[name = string("g")];
        tensor<fp16, [1, 1, 4, 4]> e = exp(x = g)[name = string("e")];
        fp16 s = reduce_max(x = row, keep_dims = bool(false))[name = string("s")];
        fp16 s2 = mul(x = s, y = s)[name = string("s2")];
        tensor<fp16, [8]> r2 = real_div(x = row, y = s2)[name = string("r2")];
    }} -> (e, r2, s2);
}}
"""
MIXED = MIXED.replace("transpose_x = tx, transpose_y = ty", "transpose_x = fx, transpose_y = ty").replace(
    "        tensor<fp16, [1, 1, 4, 4]> g", '        bool fx = const()[name = string("fx"), val = bool(false)];\n'
    '        bool ty = const()[name = string("ty"), val = bool(true)];\n        tensor<fp16, [1, 1, 4, 4]> g')


def _same(a, b) -> bool:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def _check(plan, inputs, exact=frozenset()):
    """Both runs on the same inputs, with and without the overflow watch: identical results and
    the same first overflow. Returns that overflow (None when every result stayed finite)."""
    bound = BoundPlan(plan)
    for watch in (False, True):
        found_ref, found = ([], []) if watch else (None, None)
        ref = plan.run(inputs, exact, overflow=found_ref)
        got = bound.run(inputs, exact, overflow=found)
        assert sorted(got) == sorted(ref)
        for name in ref:
            assert _same(got[name], ref[name]), name
        assert found == found_ref
    return found[0] if found else None


def _decode_cases():
    return [("gpt2", False), ("llama-gqa", False), ("qwen3", False), ("llama-gqa", True)]


def _column(model, inputs: dict) -> dict:
    """The inputs of the width-1 plan: column 0 of the column-carrying ones."""
    return {n: np.ascontiguousarray(a[..., :1]) if n in model.columns.carried_inputs else a for n, a in inputs.items()}


@pytest.mark.parametrize("kind,int8", _decode_cases())
def test_decode_plans_bound_equal_their_plans(kind, int8):
    _, _, model = _compiled(_decode(kind, int8))
    one, rng = model.columns.one, np.random.default_rng(11)
    bound_steps = sum(_bound_compute(st, one) is not None for st in one.steps)
    assert bound_steps >= len(one.steps) // 2, "most decode steps run bound: the fast path is what is tested"
    plain = _inputs(model, rng)
    for plan, inputs in ((one, _column(model, plain)), (model.plan, plain)):
        assert _check(plan, inputs, exact=set(inputs)) is None
    # the stream near fp16's limit and values past what the attention's sums hold: inf (then NaN)
    big = _inputs(model, rng)
    big["x"] = np.sign(big["x"]) * np.float32(60000)
    big["v_cache"] = np.clip(big["v_cache"] * 20000, -60000, 60000)
    for plan, inputs in ((one, _column(model, big)), (model.plan, big)):
        assert _check(plan, inputs) is not None
    # an inf and a NaN in the input itself: they spread, and no op is to blame
    bad = _inputs(model, rng)
    bad["x"][0, 0, 0, :] = np.inf
    bad["x"][0, 1, 0, :] = np.nan
    for plan, inputs in ((one, _column(model, bad)), (model.plan, bad)):
        assert _check(plan, inputs) is None


ANY_WIDTH = PROFILE.replace(spatial_multiple_of=1)  # a hand-written program of small, unpadded tensors


@pytest.mark.parametrize("profile", [ANY_WIDTH, ANY_WIDTH.replace(saturate_above=300.0),
                                     ANY_WIDTH.replace(compute_dtype="fp32")], ids=["strict", "saturating", "fp32"])
def test_hand_written_program_bound_equals_its_plan(profile):
    emu = Emulator(profile)
    model = emu.compile(MIXED, {})
    plan, rng = model.plan, np.random.default_rng(5)
    assert sum(_bound_compute(st, plan) is not None for st in plan.steps) == len(plan.steps)
    x = rng.standard_normal((1, 8, 1, 4)).astype(np.float32)
    w = rng.standard_normal((4, 8)).astype(np.float32)
    _check(plan, {"x": x, "w": w})
    # the matmul's sums reach strict's accumulator limit: inf there, and in exp after it (the
    # overflow diagnostic watches fp16 compute only, docs/chip-profiles.md)
    found = _check(plan, {"x": x * 60, "w": w * 60})
    assert (found is not None) == (profile.compute_dtype == "fp16")
    x[0, 2, 0, 1] = -np.inf
    _check(plan, {"x": x, "w": w})


def test_kernels_run_the_bound_plan():
    """The emulator's column evaluation is the bound plan's (what the decode path runs)."""
    _, _, model = _compiled(_decode("qwen3"))
    assert isinstance(model.columns.bound, BoundPlan) and model.columns.bound.plan is model.columns.one
