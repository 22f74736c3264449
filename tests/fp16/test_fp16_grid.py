"""round_fp16 against numpy's IEEE float16 cast, bit for bit (signed zeros, subnormals, inf, NaN)."""

import functools

import numpy as np
import pytest

from anelm.fp16 import FP16_MAX
from anelm.fp16.bits import to_half
from anelm.fp16.grid import round_fp16, round_fp16_owned, round_fp16_owned_counted, write_fp16_columns


def ieee(x: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        return x.astype(np.float16).astype(np.float32)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    nan = np.isnan(a)
    return bool(np.array_equal(nan, np.isnan(b)) and np.array_equal(a[~nan].view(np.uint32), b[~nan].view(np.uint32)))


# float32 binades (exponent field): deep fp16 subnormals, the subnormal/normal boundary, 1.0,
# the top fp16 binade (65504 and the overflow to inf), far past it, and zero/NaN/inf patterns
@pytest.mark.parametrize("exponent", [100, 112, 113, 127, 142, 143, 0, 255])
def test_every_float32_of_a_binade(exponent):
    bits = (np.uint32(exponent) << 23) | np.arange(1 << 23, dtype=np.uint32)
    for sign in (0, 1):
        x = (bits | np.uint32(sign << 31)).view(np.float32)
        assert same_bits(round_fp16(x), ieee(x))


# float32 mantissa fields: 0 and 1, the largest, fp16's ulp (1 << 13) and the exact halves of
# it with even and odd fp16 results (ties go to even), one either side of a half, and the
# halves of coarser grids met in the fp16 subnormal binades
MANTISSAS = [0, 1, 0x7FFFFF, 1 << 13, 1 << 12, 3 << 12, (1 << 12) - 1, (1 << 12) + 1,
             1 << 22, 3 << 21, (1 << 22) - 1, 1 << 20, 3 << 19]


def every_binade() -> np.ndarray:
    """Each of the 256 float32 exponents with each of MANTISSAS, both signs."""
    exp = np.arange(256, dtype=np.uint32)[:, None, None] << 23
    sign = np.array([0, 1 << 31], np.uint32)[None, None, :]
    mant = np.array(MANTISSAS, np.uint32)[None, :, None]
    return (exp | mant | sign).reshape(-1).view(np.float32)


def test_every_binade_small_arrays():
    # arrays shorter than a vector register run the loops' scalar tail only
    x = every_binade()
    for part in np.array_split(x, len(x) // 3):
        assert same_bits(round_fp16(part), ieee(part)), part
    assert same_bits(np.array([round_fp16(v) for v in x]), ieee(x))  # 0-d scalars


def test_every_binade_large_arrays():
    # thousands of values at once run the vectorised loops, out of place and in place
    x = every_binade()
    want = ieee(x)
    assert same_bits(round_fp16(x), want)
    assert same_bits(round_fp16_owned(x.copy()), want)
    dst = np.zeros((len(x), 3), np.float32)
    write_fp16_columns(x[:, None], dst, 1)
    assert same_bits(dst[:, 1], want)


def test_the_top_binades_overflow_to_infinity():
    # [2**115, 2**116) once came out NaN: its rounding constant was a NaN bit pattern
    x = np.array([2.0**115, 1.5 * 2.0**115, 2.0**116, 2.0**127, 3e38], np.float32)
    for v in (x, -x, np.resize(x, 5000)):
        assert same_bits(round_fp16(v), np.copysign(np.float32(np.inf), v))


def test_edges_and_shapes():
    x = np.array([65504, 65519.99, 65520, -70000, 2.0**-24, 2.0**-25, 3 * 2.0**-25,
                  2.0**-14 - 2.0**-30, 0.0, -0.0, -1e-9], np.float32)
    assert same_bits(round_fp16(x), ieee(x))
    assert round_fp16(x[-1]).view(np.uint32) == np.uint32(0x80000000)  # -1e-9 rounds to -0.0
    assert round_fp16(np.float32(3.3)).shape == ()
    m = (np.arange(12, dtype=np.float32).reshape(3, 4).T - 5) * 1e-6  # non-contiguous, fp16 subnormals
    assert same_bits(round_fp16(m), ieee(m)) and round_fp16(m).shape == (4, 3)
    big = np.linspace(-1e-5, 1e-5, 3 * 5000, dtype=np.float32).reshape(3, 5000)[:, ::2]  # strided
    assert same_bits(round_fp16(big), ieee(big))
    h = np.array([1.5, -2.0], np.float16)
    assert round_fp16(h).dtype == np.float32 and list(round_fp16(h)) == [1.5, -2.0]


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("rows,cols", [(70, 45), (530, 270)])
def test_write_fp16_columns_matches_numpy_assignment(transposed, exact, rows, cols):
    # sizes that are not multiples of the 8x8 blocks; 530 rows cross two 256-wide tiles;
    # values span fp16 subnormals to overflow
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((cols, rows)) * 10.0 ** rng.integers(-9, 6, (cols, rows))).astype(np.float32)
    src = w.T if transposed else w.T.copy()                    # [rows, cols] either way
    src = round_fp16(src) if exact else src
    dst = rng.standard_normal((rows, cols + 55)).astype(np.float32)
    want = dst.copy()
    want[:, 30:30 + cols] = ieee(src)
    write_fp16_columns(src, dst, 30, exact=exact)
    assert same_bits(dst, want)  # columns outside the block untouched, the block rounded


def test_write_fp16_columns_rejects_what_does_not_fit():
    dst = np.zeros((4, 10), np.float32)
    with pytest.raises(ValueError, match="column 8"):
        write_fp16_columns(np.ones((4, 3), np.float32), dst, 8)
    with pytest.raises(ValueError, match="float16"):  # the destination must hold float32 values
        write_fp16_columns(np.ones((4, 3), np.float32), np.zeros((4, 10), np.float16), 0)


def test_round_fp16_in_place_and_into_out():
    x = np.linspace(-70000, 70000, 9001, dtype=np.float32)
    want = ieee(x)
    out = np.empty_like(x)
    assert round_fp16(x, out=out) is out and same_bits(out, want)
    assert round_fp16_owned(x) is x and same_bits(x, want)       # a fresh result: rounded in place
    ro = want.copy()
    ro.flags.writeable = False
    assert round_fp16_owned(ro) is not ro                        # not ours to write: a new array


@pytest.mark.parametrize("n", [100, 4095, 4096, 50000])  # both sides of SMALL: one loop, two loops in one call
def test_round_fp16_owned_counted_rounds_and_counts_the_non_finite_results(n):
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * 30000).astype(np.float32)  # some past 65504: inf once rounded
    x[rng.integers(0, n, 5)] = np.nan
    x[rng.integers(0, n, 5)] = -np.inf
    want = ieee(x)
    got, bad = round_fp16_owned_counted(x)
    assert got is x and same_bits(got, want) and bad == np.count_nonzero(~np.isfinite(want)) > 10
    clean, bad = round_fp16_owned_counted(np.linspace(-65504, 65504, n, dtype=np.float32)[::-1])  # a view: a new array
    assert bad == 0 and clean.flags.c_contiguous


def saturating_cases():
    """Values on both sides of fp16's range: its largest, the last that rounds down to it, the
    first that rounds up past it, inf and NaN, and a sweep through every binade."""
    rng = np.random.default_rng(11)
    edge = np.array([65504.0, 65519.99, 65520.0, 1e6, np.inf, np.nan, 0.0, -0.0, 6e-8, 3.0], np.float32)
    sweep = (rng.standard_normal(5000) * 2.0 ** rng.integers(-30, 30, 5000)).astype(np.float32)
    return np.concatenate([edge, -edge, sweep]).reshape(2, -1)


def test_saturating_conversions_are_a_clamp_then_numpys_cast():
    """`saturate`: what the trainer's old two passes gave (np.clip to ±65504, then the fp16
    cast), bit for bit, in each of the conversions activations enter the device through."""
    x = saturating_cases()
    want = np.clip(x, -FP16_MAX, FP16_MAX).astype(np.float16)
    assert FP16_MAX == float(np.finfo(np.float16).max)
    same = functools.partial(np.testing.assert_array_equal, strict=True)
    same(round_fp16(x, saturate=True), want.astype(np.float32))
    with np.errstate(over="ignore"):  # an inf already fp16
        same(round_fp16(x.astype(np.float16), saturate=True), want.astype(np.float32))
    same(to_half(x, saturate=True).view(np.uint16), want.view(np.uint16))
    for src in (x, np.asfortranarray(x)):  # by rows, and the transposed-view path
        dst = np.zeros((2, x.shape[1] + 8), np.float32)
        write_fp16_columns(src, dst, 3, saturate=True)
        same(dst[:, 3:-5], want.astype(np.float32))
    past = np.abs(np.nan_to_num(x)) >= 65520  # without it, what rounds past the range is inf
    assert past.sum() > 6 and np.array_equal(np.isinf(round_fp16(x)), past | np.isinf(x))
