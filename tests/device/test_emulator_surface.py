"""ShadowedSurface: its bytes are always what a hardware surface would hold, whichever form was written."""

import numpy as np
import pytest

from anelm.device.emulator.surface import ShadowedSurface

rng = np.random.default_rng(5)


def test_value_writes_read_back_as_fp16_bytes():
    s = ShadowedSurface(64)
    v = rng.standard_normal(10).astype(np.float32) * 100
    s.write_half(v)  # rounded here, as a hardware write would be
    f16 = v.astype(np.float16)
    assert np.array_equal(s.read(20).view(np.float16), f16)
    assert np.array_equal(s.read_half(10), f16.astype(np.float32))
    assert not s.read(44, offset=20).any()  # the rest of the allocation stays zero


def test_byte_writes_are_seen_by_value_reads_and_the_reverse():
    s = ShadowedSurface(32)
    s.write_half(np.ones(16, np.float32))
    s.write(np.array([2.5, -3.0], np.float16), offset=4)  # a byte write over values: merged
    assert list(s.read_half(4)) == [1.0, 1.0, 2.5, -3.0]
    s.write_half(np.array([7.0], np.float32))
    assert list(s.read(8).view(np.float16)) == [7.0, 1.0, 2.5, -3.0]
    s.view()[0:2] = np.array([0.5], np.float16).view(np.uint8)  # the live bytes
    assert s.read_half(2)[0] == 0.5


def test_live_half_writes_reach_the_bytes():
    s = ShadowedSurface(16)
    s.live_half(8)[2:4] = [1.5, 2.0]
    assert list(s.read(16).view(np.float16)) == [0, 0, 1.5, 2.0, 0, 0, 0, 0]


def test_exact_values_skip_rounding_and_overruns_are_refused():
    s = ShadowedSurface(8)
    s.write_half(np.array([65504.0, 1e5], np.float32))
    assert list(s.read_half(2)) == [65504.0, np.inf]  # overflow is inf, as the cast gives
    with pytest.raises(ValueError, match="overruns a 8-byte surface"):
        s.write_half(np.zeros(5, np.float32))
    with pytest.raises(ValueError, match="overruns a 8-byte surface"):
        s.read_half(5)


def test_adopted_values_are_the_content_and_shared_arrays_never_change():
    s = ShadowedSurface(16)
    v = (rng.standard_normal(8) * 10).astype(np.float16).astype(np.float32)
    assert s.adopt_half(v) and np.array_equal(s.read(16).view(np.float16), v.astype(np.float16))
    assert not s.adopt_half(np.zeros(4, np.float32))                  # not the surface's size
    assert not s.adopt_half(np.zeros((8, 2), np.float32)[:, 0])       # not contiguous
    held = s.share_half(8)
    assert np.shares_memory(held, v)                                  # no copy was made
    s.write_half(np.full(3, 5.0, np.float32))                         # copy-on-write
    assert np.array_equal(held, v) and list(s.read_half(4)) == [5.0, 5.0, 5.0, v[3]]
    held = s.share_half(8)
    s.live_half(8)[0] = -1.0                                          # a staging write: also a copy
    assert held[0] == 5.0 and s.read(2).view(np.float16)[0] == -1.0
    held = s.share_half(8)
    assert s.adopt_half(np.ones(8, np.float32)) and held[0] == -1.0   # the next result replaces it
