"""fp16-resident conv weights on the decode path (device/emulator_matvec).

The oracle is independent of the code under test: numpy's float16 casts for the bit patterns,
and for the products the exact sum (float64 over fp16 operands, whose products are exact) and
the BLAS path the emulator took before (float32 matmul, then fp16 rounding). The fp32
accumulator (docs/chip-profiles.md) leaves the summation order open, so a one-column result may sit one
fp16 ulp from the BLAS one where the float32 sum lies near a rounding boundary; never further,
and rarely (measured fraction printed and bounded).

strict's programs are 16 columns wide (the 16-column spatial multiple): a decode program carries its token in
column 0, and the emulator evaluates a column-separable program one column at a time
(emulator.columns), so that narrowed evaluation is where the one-column path must be taken.
Wider evaluations (prefill, training) multiply row blocks of the widened patterns with BLAS:
against one whole-matrix product the float32 sums of some rows differ (OpenBLAS's kernels
depend on the row count), so the same one-ulp measure applies there.
"""

import numpy as np
import pytest

from anelm.device import base
from anelm.device.emulator import matvec as emulator_matvec
from anelm.chip.profile import STRICT
from anelm.compiler.pipeline import compile_graph
from anelm.device.emulator import Emulator
from anelm.device.emulator.matvec import HalfMatrix, ResidentConv, half_bits, half_matvec, half_times, widen
from anelm.fp16.grid import round_fp16
from anelm.ir.builder import GraphBuilder
from anelm.runtime.cache import ProgramCache
from anelm.runtime.kernel import Kernel

PROFILE = STRICT.replace(compile_budget=10**9)
rng = np.random.default_rng(18)


def ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Distance in fp16 steps between fp16 values (held in any float dtype), per element."""
    def ordered(x):
        bits = np.asarray(x, np.float16).view(np.int16).astype(np.int32)
        return np.where(bits < 0, -(bits & 0x7FFF), bits)
    return np.abs(ordered(a) - ordered(b))


def test_bit_patterns_round_trip_every_fp16_value():
    bits = np.arange(1 << 16, dtype=np.uint16)
    values = bits.view(np.float16).astype(np.float32)
    got = widen(bits)
    finite = np.isfinite(values)
    assert np.array_equal(got[finite].view(np.uint32), values[finite].view(np.uint32))  # -0 and subnormals too
    assert np.array_equal(np.isnan(got), np.isnan(values)) and np.array_equal(got[np.isinf(values)], values[np.isinf(values)])
    assert np.array_equal(half_bits(values[finite]), bits[finite])
    blocked = np.empty(bits.size, np.float32)
    emulator_matvec.widen_into(bits, blocked)  # the row blocks' F16C widening: the same values
    assert np.array_equal(blocked[~np.isnan(values)].view(np.uint32), values[~np.isnan(values)].view(np.uint32))
    assert np.array_equal(np.isnan(blocked), np.isnan(values))


def test_matvec_is_within_one_ulp_of_the_exact_sum():
    w = (rng.standard_normal((700, 300)) * 0.05).astype(np.float16)
    x = rng.standard_normal(300).astype(np.float16)
    exact = w.astype(np.float64) @ x.astype(np.float64)  # fp16 products are exact in float64
    got = half_matvec(w.view(np.uint16), x.astype(np.float32))
    assert ulps(round_fp16(got), exact.astype(np.float16)).max() <= 1


WIDTH = STRICT.spatial_multiple_of  # strict's narrowest I/O width: a decode program's


def projection(oc: int, c: int, w: np.ndarray, width: int = WIDTH, profile=PROFILE):
    b = GraphBuilder("proj")
    b.output("y", b.linear(b.input("x", [1, c, 1, width]), w))
    return compile_graph(b.build(), profile)


def in_column_0(x: np.ndarray) -> np.ndarray:
    """x `[C]` as a decode input `[1, C, 1, 16]`: the token in column 0, zeros after."""
    padded = np.zeros((1, x.size, 1, WIDTH), np.float32)
    padded[0, :, 0, 0] = x
    return padded


@pytest.fixture
def matvec_calls(monkeypatch):
    """How many times the fp16 matrix-vector product ran (a list, one entry per call)."""
    calls, real = [], emulator_matvec.half_matvec
    monkeypatch.setattr(emulator_matvec, "half_matvec", lambda bits, x: calls.append(bits.shape) or real(bits, x))
    return calls


def resident(kernel: Kernel):
    """The plan's one ResidentConv step, or None."""
    (held,) = [st.fn for st in kernel.model.plan.steps if isinstance(st.fn, ResidentConv)] or [None]
    return held


@pytest.mark.parametrize("oc, c", [(2304, 768), (576, 1536)])
def test_one_column_conv_matches_the_blas_path_but_for_rare_one_ulp_moves(oc, c, capsys, matvec_calls):
    w = round_fp16(rng.standard_normal((oc, c)) * 0.03)
    xs = round_fp16(rng.standard_normal((32, c)))
    dev = Emulator(PROFILE)
    # a decode-shaped program: 16 columns, column 0 read, evaluated in that column alone
    with Kernel(projection(oc, c, w), dev, cache=ProgramCache(), float32_outputs=True, read_columns=1) as k:
        assert k.model.columns is not None  # column-separable
        got = np.stack([k.run({"x": in_column_0(x)})["y"][0, :, 0, 0] for x in xs])
        assert resident(k) is not None and resident(k).weight.f32 is None  # fp16 only, no float32 copy
        assert resident(k).weight.nbytes == oc * c * 2
    assert matvec_calls == [(oc, c)] * len(xs)  # every evaluation took the fp16 path
    before = round_fp16(xs @ w.T)  # the BLAS path: float32 sums, rounded once
    assert_reordered(got, before, 2 * c * 2.0 ** -24 * (np.abs(xs) @ np.abs(w).T), f"[{oc}x{c}] one-column", capsys)


def assert_reordered(got: np.ndarray, before: np.ndarray, spread: np.ndarray, label: str, capsys) -> None:
    """got and before: fp16 results of the same float32 sums of c products formed in two orders.
    Two such sums differ by at most spread = 2·c·2^-24·Σ|products| (each within c·2^-24·Σ|products|
    of the exact sum). Only where the sum cancels (a result far smaller than its terms) is that
    more than one fp16 ulp of the result; elsewhere a result moves by one ulp at most, rarely."""
    moved = ulps(got, before)
    one_ulp = np.abs(before) * 2.0 ** -10 + 2.0 ** -24
    cancelling = spread > one_ulp
    with capsys.disabled():
        print(f"\n{label} results one fp16 ulp from the whole-matrix BLAS product: {np.mean(moved == 1):.4%}; "
              f"further, all where the sum cancels: {np.mean(moved > 1):.4%}")
    assert float(np.mean(moved > 0)) < 0.01 and float(np.mean(moved > 1)) < 0.001
    assert moved[~cancelling].max(initial=0) <= 1
    assert np.all(np.abs(got - before)[moved > 1] <= spread[moved > 1] + one_ulp[moved > 1])


def test_every_column_of_a_separable_program_goes_through_the_fp16_path(matvec_calls):
    oc, c = 96, 64
    w = round_fp16(rng.standard_normal((oc, c)) * 0.1)
    x = round_fp16(rng.standard_normal((1, c, 1, WIDTH)))
    with Kernel(projection(oc, c, w), Emulator(PROFILE), cache=ProgramCache(), float32_outputs=True) as k:
        got = k.run({"x": x})["y"][0, :, 0]  # all 16 columns read: one one-column evaluation each
        assert resident(k).weight.f32 is None
    assert matvec_calls == [(oc, c)] * WIDTH
    assert ulps(got, round_fp16(w @ x[0, :, 0])).max() <= 1


def test_a_plan_from_the_kernel_cache_takes_the_same_fp16_path(tmp_path, monkeypatch, matvec_calls):
    monkeypatch.setenv("ANELM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("ANELM_KERNEL_CACHE_MB", raising=False)
    oc, c = 128, 96
    w = round_fp16(rng.standard_normal((oc, c)) * 0.1)
    x = in_column_0(round_fp16(rng.standard_normal(c)))
    art = projection(oc, c, w, profile=STRICT)

    def column_0():
        with Kernel(art, Emulator(STRICT), cache=ProgramCache(), float32_outputs=True, read_columns=1) as k:
            y = k.run({"x": x})["y"][0, :, 0, 0].copy()
            return y, k.model.func is None, resident(k)
    before = base.compile_count()
    fresh, fresh_replayed, fresh_step = column_0()  # a cold compile, which fills the cache
    cached, cached_replayed, cached_step = column_0()  # a hit: the plan replayed from its record
    assert (fresh_replayed, cached_replayed) == (False, True) and base.compile_count() - before == 1
    assert cached_step is not None and cached_step.weight.f32 is None
    assert len(matvec_calls) == 2 and np.array_equal(fresh, cached)


@pytest.mark.parametrize("oc, c, t, n, scratch, tiled", [
    (40, 24, 5, 2, 200, False),  # 5 columns: BLAS over row blocks of the fewest rows, 16 (40 = 16 + 16 + 8)
    (1536, 576, 16, 1, None, True),  # prefill widths: the 4x16 register tiles
    (962, 576, 32, 2, None, True),  # 962 = 4·240 + 2: a last partial block of rows, two batch items
    (576, 1536, 64, 2, None, False),  # wider than NARROW: BLAS over 1 MB row blocks
])
def test_the_wide_products_are_the_whole_matrix_product_but_for_rare_one_ulp_moves(oc, c, t, n, scratch, tiled, capsys,
                                                                                   monkeypatch):
    if scratch:
        monkeypatch.setattr(emulator_matvec, "SCRATCH", scratch)
    tiles, real = [], emulator_matvec.narrow_times
    monkeypatch.setattr(emulator_matvec, "narrow_times", lambda b, v, *a: tiles.append(v.shape) or real(b, v, *a))
    w = round_fp16(rng.standard_normal((oc, c)) * 0.03)
    x = round_fp16(rng.standard_normal((n, c, t)))
    got = half_times(half_bits(w), x)
    assert tiles == ([(c, t)] * n if tiled else [])
    whole = np.matmul(w, x)  # the op table's conv before: one float32 GEMM with the whole weight
    with capsys.disabled():
        print(f"\n[{oc}x{c}]x[{c}x{t}] float32 sums identical to the whole-matrix product's: {np.mean(got == whole):.2%}")
    if scratch:
        assert np.array_equal(got, whole)  # 5 columns: OpenBLAS forms every sum in one order here
    exact = np.einsum("oc,nct->not", w.astype(np.float64), x.astype(np.float64))
    # a float32 sum of c products in any order: within c·2^-24·Σ|products| of the exact sum
    assert np.all(np.abs(got - exact) <= c * 2.0 ** -24 * np.einsum("oc,nct->not", np.abs(w), np.abs(x)))
    spread = 2 * c * 2.0 ** -24 * np.einsum("oc,nct->not", np.abs(w), np.abs(x))
    label = "register-tiled" if tiled else "row-blocked"
    assert_reordered(round_fp16(got), round_fp16(whole), spread, f"[{oc}x{c}]x[{c}x{t}] {label}", capsys)


def test_the_tiles_pass_inf_and_nan_through_as_the_sum_does():
    """Non-finite sums: the tiles multiply and add in float32 as BLAS does, so an overflowing
    row gives inf, inf·0 and inf-inf give NaN, in the same places as the float32 product."""
    oc, c, t = 8, 32, 16
    w = round_fp16(rng.standard_normal((oc, c)))
    w[0, :] = 60000.0  # with x >= 0.5 its sums pass 65504: finite float32, fp16 inf once rounded
    w[1, 3], w[2, 5] = np.inf, np.nan  # inf·x > 0 is inf; NaN spreads
    w[3, 7], w[3, 8] = np.inf, -np.inf  # inf - inf: NaN
    x = round_fp16(np.abs(rng.standard_normal((1, c, t))) + 0.5)
    got = half_times(half_bits(w), x)[0]
    with np.errstate(invalid="ignore"):
        whole = w @ x[0]
    assert np.isinf(got[1]).all() and np.isnan(got[2:4]).all() and np.isfinite(got[0]).all()
    assert np.array_equal(np.isnan(got), np.isnan(whole)) and np.array_equal(np.isinf(got), np.isinf(whole))
    assert np.array_equal(np.sign(got[np.isinf(got)]), np.sign(whole[np.isinf(whole)]))
    assert np.array_equal(round_fp16(got)[0], round_fp16(whole)[0])  # past fp16's range: all inf


@pytest.mark.parametrize("t", [32, 48])  # the tiles' fused pass; BLAS and then numpy
def test_the_bias_and_the_limit_are_the_separate_passes_bit_for_bit(t):
    from anelm.device.emulator.accum import saturate
    oc, c, limit = 66, 48, 4.0
    w = round_fp16(rng.standard_normal((oc, c)))
    w[1, 2], w[2, :] = np.nan, 0.0  # a NaN sum stays NaN; a row of exact zeros
    x = round_fp16(rng.standard_normal((2, c, t)))
    bias = round_fp16(rng.standard_normal(oc))
    product = half_times(half_bits(w), x)
    for b in (None, bias):
        got = half_times(half_bits(w), x, b, limit)
        want = saturate(product if b is None else product + b.reshape(1, -1, 1), limit)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
        assert np.isinf(got).any() and np.isnan(got[:, 1]).all() and np.isfinite(got[:, 2]).all()


def test_a_wide_program_multiplies_the_fp16_patterns_and_keeps_no_float32_copy(monkeypatch, capsys):
    """A 64-column program (a prefill's width: evaluated whole, not column by column) on a blob
    weight: every evaluation goes through the blocked product, and the weight stays fp16."""
    oc, c, width = 576, 1536, 64
    w = round_fp16(rng.standard_normal((oc, c)) * 0.03)
    x = round_fp16(rng.standard_normal((1, c, 1, width)))
    calls, real = [], emulator_matvec.half_times
    monkeypatch.setattr(emulator_matvec, "half_times", lambda bits, v, *a: calls.append(bits.shape) or real(bits, v, *a))
    with Kernel(projection(oc, c, w, width), Emulator(PROFILE), cache=ProgramCache(), float32_outputs=True) as k:
        assert k.model.columns is None  # wider than a column block: one evaluation of all columns
        got = [k.run({"x": x})["y"][0, :, 0] for _ in range(3)]  # wide over and over: no switch to float32
        held = resident(k).weight
        assert held.f32 is None and held.f16.dtype == np.uint16 and held.nbytes == oc * c * 2
    assert calls == [(oc, c)] * 3 and all(np.array_equal(g, got[0]) for g in got)
    before = round_fp16(w @ x[0, :, 0])  # [OC, 64], the op table's float32 product
    assert_reordered(got[0], before, 2 * c * 2.0 ** -24 * (np.abs(w) @ np.abs(x[0, :, 0])), "[576x1536] 64-column program",
                     capsys)


def test_the_q15_16_accumulator_keeps_its_own_path():
    prof = PROFILE.replace(accumulator="q15.16")
    w = round_fp16(rng.standard_normal((8, 16)))
    with Kernel(projection(8, 16, w, profile=prof), Emulator(prof), cache=ProgramCache()) as k:
        assert resident(k) is None


@pytest.mark.parametrize("rows", [1, 7])
def test_half_matrix_rows_and_products_are_those_of_its_fp16_values(rows):
    w = rng.standard_normal((6000, 48)).astype(np.float32)  # past SCRATCH // 48 rows: two blocks
    x = rng.standard_normal((rows, 48)).astype(np.float32)
    m = HalfMatrix(w)
    w16 = w.astype(np.float16).astype(np.float64)
    assert m.bits.nbytes == w.size * 2
    assert np.array_equal(m[[3, 5999, 3]], w16[[3, 5999, 3]].astype(np.float32))
    exact = x.astype(np.float64) @ w16.T
    assert np.abs(m.times(x) - exact).max() <= 1e-5 * np.abs(x).sum(axis=1).max() * np.abs(w16).max()
