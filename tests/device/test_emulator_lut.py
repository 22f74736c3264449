"""constexpr_lut_to_dense (iOS 18) on the emulator against its independent oracle, coremltools'
own op definition: the dense weight the emulator's program makes of random palettized blobs
(uint1/uint2/uint3/uint4/uint6 indices, one table per group of rows, per row, per tensor, or in
blocks along both axes) equals coremltools' `materialized_val_inference` of the same op, bit for
bit (fp16 bit patterns: signed zeros, subnormals, infs and NaN entries included), and
coremltools' blob reader reads the packed indices our compiler wrote.

The emulator's dense result is read out through the program itself, as in
test_emulator_blockwise.py: the constexpr result, reshaped to `[1, O, 1, C]`, times ones.
"""

import numpy as np
import pytest

from anelm.chip.profile import STRICT
from anelm.compiler.pipeline import compile_graph
from anelm.device.emulator import Emulator
from anelm.ir.builder import GraphBuilder
from anelm.runtime.kernel import Kernel

ct_types = pytest.importorskip("coremltools.converters.mil.mil.types")
ct = pytest.importorskip("coremltools")
mb = pytest.importorskip("coremltools.converters.mil.mil").Builder
milstorage = pytest.importorskip("coremltools.libmilstoragepython")

# (indices dtype, indices shape, the lut's block dims): tables per group of 16 rows (the kernels'
# form), per row, one per tensor, blocks along both axes, rank 2, odd row counts
CASES = [
    ("uint4", (64, 48, 1, 1), (4, 1, 1, 1)),
    ("uint6", (64, 48, 1, 1), (4, 1, 1, 1)),
    ("uint6", (24, 32, 1, 1), (24, 1, 1, 1)),
    ("uint4", (32, 64), (1, 1)),
    ("uint2", (15, 16, 1, 1), (5, 1, 1, 1)),
    ("uint3", (16, 32, 1, 1), (4, 2, 1, 1)),
    ("uint1", (16, 64), (2, 4)),
    ("uint6", (13, 48), (13, 3)),
]


def _case(dtype, shape, blocks, seed):
    rng = np.random.default_rng(seed)
    bits = int(dtype[4:])
    indices = rng.integers(0, 2 ** bits, shape).astype(np.uint8)
    lut = (rng.standard_normal((*blocks, 2 ** bits, 1)) * 2.0 ** rng.integers(-20, 4, (*blocks, 2 ** bits, 1)))
    lut = lut.astype(np.float16)
    flat = lut.reshape(-1)
    flat[:4] = [-0.0, np.inf, -np.inf, np.nan][: flat.size]  # selected as they are: no arithmetic
    return indices, lut


def coremltools_dense(dtype, indices, lut) -> np.ndarray:
    out = {}

    @mb.program(input_specs=[], opset_version=ct.target.iOS18)
    def prog():
        w = mb.constexpr_lut_to_dense(indices=indices.astype(getattr(ct_types, f"np_{dtype}_dtype", np.uint8)),
                                      lut=lut)
        assert w.op.indices.dtype == getattr(ct_types, dtype)  # typed as the sub-byte dtype
        out["v"] = w.op.materialized_val_inference()
        return w

    return out["v"]


def emulator_dense(dtype, indices, lut):
    """(the emulator's dense weight, the compiled artifact)."""
    o, c = indices.shape[0], int(np.prod(indices.shape[1:]))
    b = GraphBuilder("palettized")
    x = b.input("x", [1, o, 1, c])
    w = b.constexpr_lut_to_dense(indices, dtype, lut, name="w")
    b.output("y", b.mul(x, b.reshape(w, [1, o, 1, c], name="flat"), name="y"))
    art = compile_graph(b.build(), STRICT)
    y = Kernel(art, Emulator(STRICT))(x=np.ones((1, o, 1, c), np.float16))["y"]
    return np.asarray(y, np.float16).reshape(indices.shape), art


@pytest.mark.parametrize("i", range(len(CASES)))
def test_emulator_equals_coremltools_bit_for_bit(i):
    dtype, shape, blocks = CASES[i]
    indices, lut = _case(dtype, shape, blocks, seed=i)
    ref = coremltools_dense(dtype, indices, lut)
    assert ref.dtype == np.float16
    got, art = emulator_dense(dtype, indices, lut)
    assert f"indices = tensor<{dtype}, {list(shape)}>(BLOBFILE" in art.mil_text
    assert np.array_equal(got.view(np.uint16), ref.view(np.uint16)), \
        f"{int((got.view(np.uint16) != ref.view(np.uint16)).sum())} of {ref.size} differ"


@pytest.mark.parametrize("dtype", ["uint1", "uint2", "uint3", "uint4", "uint6"])
def test_coremltools_reads_the_packed_indices_we_wrote(tmp_path, dtype):
    """Our BLOBFILE of packed indices is byte for byte coremltools' writer's (161 indices: a
    part-filled last byte, its padding bits in the metadata), its reader reads them back, and
    the compiled program's indices blob is that file."""
    from anelm.mil.blob import encode_tensor

    indices, lut = _case(dtype, (23, 7, 1, 1), (23, 1, 1, 1), seed=7)
    ours = bytes(encode_tensor(indices, dtype))
    assert len(ours) == 128 + -(-indices.size * int(dtype[4:]) // 8)
    writer = milstorage._BlobStorageWriter(str(tmp_path / "theirs.bin"))
    assert getattr(writer, f"write_{dtype}_data")(np.ascontiguousarray(indices.reshape(-1))) == 64
    del writer  # the file is complete once the writer is gone
    assert (tmp_path / "theirs.bin").read_bytes() == ours
    (tmp_path / "ours.bin").write_bytes(ours)
    got = np.asarray(getattr(milstorage._BlobStorageReader(str(tmp_path / "ours.bin")), f"read_{dtype}_data")(64))
    assert np.array_equal(got.astype(np.int64), indices.reshape(-1))
    indices, lut = _case(dtype, (24, 16, 1, 1), (24, 1, 1, 1), seed=8)
    _, art = emulator_dense(dtype, indices, lut)
    blob = next(b for p, b in art.weights.items() if p.endswith("/w_indices.bin"))
    assert bytes(blob) == bytes(encode_tensor(indices, dtype))


def test_the_op_is_typed_as_coremltools_types_it():
    from anelm.errors import ShapeError

    b = GraphBuilder("bad")
    with pytest.raises(ShapeError, match="divide"):
        b.constexpr_lut_to_dense(np.zeros((8, 6)), "uint4", np.ones((3, 1, 16, 1), np.float16))
    with pytest.raises(ShapeError, match="2\\^6"):
        b.constexpr_lut_to_dense(np.zeros((8, 6)), "uint6", np.ones((1, 1, 16, 1), np.float16))
    with pytest.raises(ShapeError, match="scalar lut"):
        b.constexpr_lut_to_dense(np.zeros((8, 6)), "uint4", np.ones((1, 1, 16, 2), np.float16))


def test_the_doctor_probe_passes_here_and_catches_an_op_that_shares_one_table(monkeypatch, tmp_path):
    """`anelm doctor`'s op.constexpr_lut_to_dense (doctor/probes_int8.py) on the emulator, and on a
    device whose op reads every row's indices from the first table (it must fail there)."""
    from anelm.doctor import run_suite, select
    from anelm.doctor.probes_int8 import LUT, lut_weights
    from anelm.ir import ops_quant

    idx, lut, dense = lut_weights()
    assert np.array_equal(ops_quant.lut_dense(idx, lut).astype(np.float64), dense)
    assert run_suite(Emulator(STRICT), select([LUT]))[LUT].status == "ok"
    plain = ops_quant.lut_dense
    monkeypatch.setattr(ops_quant, "lut_dense", lambda i, t: plain(i, np.broadcast_to(t[:1, :1], t.shape)))
    monkeypatch.setenv("ANELM_CACHE_DIR", str(tmp_path))  # no plan the right op folded before
    assert run_suite(Emulator(STRICT), select([LUT]))[LUT].status != "ok"
