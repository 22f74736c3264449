"""fp16/bits.py: the fast fp16 casts give numpy's casts bit for bit (numpy is the reference:
round to nearest even, overflow to inf, subnormals, NaN payloads)."""

import numba
import numpy as np
import pytest

from anelm.fp16 import bits as half
from anelm.fp16.bits import from_half, to_half


def every_half() -> np.ndarray:
    return np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)


def test_from_half_matches_numpy_on_every_fp16_pattern():
    h = np.tile(every_half(), 2)  # large enough for the compiled path
    assert from_half(h).view(np.uint32).tobytes() == h.astype(np.float32).view(np.uint32).tobytes()


def probe_floats() -> np.ndarray:
    """float32 values where a cast to fp16 goes wrong first: ties, their neighbours, the edges
    of the ranges, and a sweep of every 997th bit pattern (NaNs with all kinds of payloads)."""
    finite = every_half().astype(np.float32)
    finite = np.sort(finite[np.isfinite(finite)])
    below, above = finite[:-1], finite[1:]
    ties = ((below.astype(np.float64) + above) / 2).astype(np.float32)  # exact midpoints: ties to even
    near = np.concatenate([np.nextafter(ties, np.float32(np.inf)), np.nextafter(ties, np.float32(-np.inf))])
    edges = np.array([65504, 65519.996, 65520, 65535.99, 65536, 1e30, 2.0 ** -14, 2.0 ** -24, 2.0 ** -25,
                      2.0 ** -25 * 1.0000001, 2.0 ** -26, 0.0, -0.0, np.inf, -np.inf], np.float32)
    sweep = np.arange(0, 1 << 32, 997, dtype=np.uint64).astype(np.uint32).view(np.float32)  # NaNs included
    return np.concatenate([finite, ties, near, edges, -edges, sweep])


def test_to_half_matches_numpy_on_ties_boundaries_and_a_sweep_of_float32():
    x = probe_floats()
    with np.errstate(all="ignore"):
        want = x.astype(np.float16)
    assert to_half(x).view(np.uint16).tobytes() == want.view(np.uint16).tobytes()


def _each(one, src: np.ndarray, dtype) -> np.ndarray:
    """Compiled scalar conversion `one` applied to every element of src."""
    @numba.njit
    def convert(src, dst):
        for i in range(src.size):
            dst[i] = one(src[i])

    out = np.empty(src.size, dtype)
    convert(src, out)
    return out


@pytest.mark.parametrize("kind", ["soft", "hard"])
def test_both_float32_to_fp16_kernels_match_numpy(kind):
    """The bit-pattern kernel (any CPU) and the CPU's own conversion (F16C, arm64), whichever
    `to_half` does not use here is checked too."""
    if kind == "hard" and not half._cpu_converts_half():
        pytest.skip("this CPU has no float32 -> fp16 instruction (F16C)")
    one = half._soft_half_bits if kind == "soft" else half._hard_half_bits
    x = probe_floats()
    got = _each(one, x.view(np.uint32), np.uint16)
    with np.errstate(all="ignore"):
        assert got.tobytes() == x.astype(np.float16).view(np.uint16).tobytes()


@pytest.mark.parametrize("kind", ["soft", "hard"])
def test_both_fp16_to_float32_kernels_match_numpy_on_every_pattern(kind):
    if kind == "hard" and not half._cpu_converts_half():
        pytest.skip("this CPU has no fp16 -> float32 instruction (F16C)")
    one = half._soft_float_bits if kind == "soft" else half._hard_float_bits
    h = every_half()
    got = _each(one, h.view(np.uint16), np.uint32)
    assert got.tobytes() == h.astype(np.float32).view(np.uint32).tobytes()


def test_to_half_of_fp16_values_is_a_new_contiguous_copy():
    h = np.tile(every_half(), 2)[::2]  # a strided view, large enough for the compiled path
    got = to_half(h)
    assert got.dtype == np.float16 and got.flags.c_contiguous and not np.shares_memory(got, h)
    assert got.view(np.uint16).tobytes() == np.ascontiguousarray(h).view(np.uint16).tobytes()


def test_fold_to_half_is_the_float32_fold_then_the_cast_bit_for_bit():
    # W·diag(g)·diag(r) -> fp16 in one pass: the float32 products in that order, then numpy's cast
    from anelm.fp16.bits import fold_to_half

    rng = np.random.default_rng(0)
    w = rng.standard_normal((320, 256)).astype(np.float32)  # 81,920 elements: the compiled path
    g = (rng.standard_normal(256) * 3).astype(np.float32)
    w[0, :8] = [np.inf, -np.inf, np.nan, 0.0, -0.0, 1e-30, 7e4, -6.1e-5]
    g[:3] *= np.float32(1e4)  # products past fp16's range: inf
    g[5] = np.float32(1e-6)  # products in fp16's subnormals
    rows = np.ones(320, np.float32)
    rows[:100] = np.float32(0.125)
    with np.errstate(all="ignore"):
        want = (w * g[None, :]).astype(np.float32) * rows[:, None]
        want = want.astype(np.float16)
        plain = (w * g[None, :]).astype(np.float16)
    out = np.zeros((400, 256), np.float16)
    fold_to_half(w, g, rows, out=out[40:360])  # rows of a larger array, as the fused qkv takes them
    assert out[40:360].view(np.uint16).tobytes() == want.view(np.uint16).tobytes()
    assert not out[:40].any() and not out[360:].any()
    assert fold_to_half(w, g).view(np.uint16).tobytes() == plain.view(np.uint16).tobytes()
    small = fold_to_half(w[:4], g, rows[:4])  # numpy's path below the compiled size
    assert small.view(np.uint16).tobytes() == want[:4].view(np.uint16).tobytes()
