"""The first op whose fp16 result overflowed is named once per kernel on stderr (docs/chip-profiles.md)."""

from __future__ import annotations

import numpy as np
import pytest

from anelm.compiler.pipeline import compile_graph
from anelm.device.emulator import Emulator
from anelm.device.overflow import Overflow, output_overflow, reset_overflow_warnings
from anelm.chip.profile import STRICT
from anelm.device.base import Surface
from anelm.ir.builder import GraphBuilder
from anelm.runtime.cache import ProgramCache
from anelm.runtime.kernel import Kernel

PROFILE = STRICT.replace(compile_budget=10**9)
X = [1, 64, 1, 16]


@pytest.fixture(autouse=True)
def fresh_warnings():
    reset_overflow_warnings()  # as in a fresh process
    yield
    reset_overflow_warnings()


def norm_kernel(name="layer12_prefill", warn=True) -> Kernel:
    """RMSNorm's first steps: x·x overflows for |x| > 256, and pow(inf, -0.5) = 0 hides it from
    the output, which comes out finite (and wrong)."""
    b = GraphBuilder(name)
    x = b.input("x", X)
    ss = b.reduce_sum(b.mul(x, x, name="attn_norm_sq"), axes=[1], name="attn_norm_ss")
    r = b.pow(b.add(ss, 1e-5, name="attn_norm_eps"), -0.5, name="attn_norm_r")
    b.output("y", b.mul(x, r, name="attn_norm"))
    return Kernel(compile_graph(b.build(), PROFILE), Emulator(PROFILE), cache=ProgramCache(), warn_overflow=warn)


def lines(capsys) -> list[str]:
    return [ln for ln in capsys.readouterr().err.splitlines() if "overflow" in ln]


def test_overflow_in_a_named_mul_is_reported_once(capsys):
    k = norm_kernel()
    big = np.full(X, 300.0, np.float32)
    out = k.run({"x": big})["y"]
    assert np.isfinite(out).all() and (out == 0).all()  # the overflow is invisible in the output
    k.run({"x": big})
    assert lines(capsys) == ["anelm: warning: fp16 overflow in kernel layer12_prefill, mul 'attn_norm_sq'"]
    norm_kernel().run({"x": big})  # another Kernel of the same name: still once
    assert lines(capsys) == []
    norm_kernel("layer13_prefill").run({"x": big})
    assert lines(capsys) == ["anelm: warning: fp16 overflow in kernel layer13_prefill, mul 'attn_norm_sq'"]


def test_no_warning_within_range(capsys):
    norm_kernel().run({"x": np.full(X, 20.0, np.float32)})  # 64 · 20² = 25600: finite
    assert lines(capsys) == []


def test_an_op_fed_an_inf_input_is_not_the_first_overflow(capsys):
    b = GraphBuilder("two_paths")
    x, z = b.input("x", X), b.input("z", X)
    b.output("p", b.mul(b.add(x, 1.0, name="from_inf"), 2.0, name="still_inf"))  # runs first
    b.output("q", b.mul(b.mul(z, z, name="squares"), 0.5, name="halved"))  # an output node takes its name
    k = Kernel(compile_graph(b.build(), PROFILE), Emulator(PROFILE), cache=ProgramCache())
    x = np.zeros(X, np.float32)
    x[0, 3, 0, 5] = np.inf
    k.run({"x": x, "z": np.ones(X, np.float32)})
    assert lines(capsys) == []  # inf in, inf out: nothing overflowed here
    k.run({"x": x, "z": np.full(X, 300.0, np.float32)})
    assert lines(capsys) == ["anelm: warning: fp16 overflow in kernel two_paths, mul 'squares'"]


def test_accumulator_limit_is_an_overflow(capsys):
    b = GraphBuilder("proj")
    x = b.input("x", X)
    b.output("y", b.linear(x, np.full((64, 64), 4.0, np.float32), name="wq"))  # 64 · 4 · 128 = 32768
    k = Kernel(compile_graph(b.build(), PROFILE), Emulator(PROFILE), cache=ProgramCache())
    assert np.isinf(k.run({"x": np.full(X, 128.0, np.float32)})["y"]).all()
    (line,) = lines(capsys)
    assert line.startswith("anelm: warning: fp16 overflow in kernel proj, conv '")


def test_a_kernel_with_warnings_off_is_silent(capsys):
    norm_kernel(warn=False).run({"x": np.full(X, 300.0, np.float32)})
    assert lines(capsys) == []


def test_training_dx_kernels_do_not_warn_and_forward_kernels_do(capsys):
    from anelm.kernels.families import LLAMA
    from anelm.kernels.training import BACKWARD, FORWARD, Dims
    from anelm.train.steps.kernels_bank import DynamicBank

    dims = Dims(d=32, f=48, hq=4, hkv=2, hd=8, s=16)
    rng = np.random.default_rng(0)
    shapes = {"self_attn.q_proj.weight": (32, 32), "self_attn.k_proj.weight": (16, 32),
              "self_attn.v_proj.weight": (16, 32), "self_attn.o_proj.weight": (32, 32),
              "mlp.gate_proj.weight": (48, 32), "mlp.up_proj.weight": (48, 32), "mlp.down_proj.weight": (32, 48)}
    weights = {f"model.layers.0.{k}": rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    bank = DynamicBank(dims, Emulator(PROFILE), weights, n_layers=1, family=LLAMA)
    try:
        # kernels are compiled under their kind's name
        assert {k.name for k in bank._kernels if not k.warn_overflow} == {*BACKWARD, "sdpa_bwd"}
        assert {k.name for k in bank._kernels if k.warn_overflow} == {*FORWARD, "sdpa_fwd"}
        huge = np.full((32, 16), 60000.0, np.float32)  # dx = Wᵀ·dy and o = Woᵀ·attn pass 32768
        assert not np.isfinite(bank.run("wo_dx", 0, {"dx2": huge})["dattn"]).all()
        assert lines(capsys) == []
        assert not np.isfinite(bank.run("wo", 0, {"attn": huge})["o"]).all()
        (line,) = lines(capsys)
        assert line.startswith("anelm: warning: fp16 overflow in kernel wo, matmul '")
    finally:
        bank.close()


def test_ane_output_check_names_the_output():
    class Model:
        mil_text = ("program(1.3)\n{\n    func main<ios18>(tensor<fp16, [1, 4, 1, 16]> x) {\n"
                    '        tensor<fp16, [1, 4, 1, 16]> y = mul(x = x, y = x)[name = string("y")];\n'
                    "    } -> (y);\n}\n")

    def surface(values):
        s = Surface(49152)
        s.write(np.asarray(values, np.float16))
        return s

    m = Model()
    fine, inf = np.ones(64), np.full(64, np.inf)
    assert output_overflow(m, PROFILE, [surface(fine)], [surface(fine)]) is None
    assert output_overflow(m, PROFILE, [surface(fine)], [surface(inf)]) == Overflow("output", "y")
    assert output_overflow(m, PROFILE, [surface(inf)], [surface(inf)]) is None  # the input was inf already
