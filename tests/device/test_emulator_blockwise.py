"""constexpr_blockwise_shift_scale (iOS 18) on the emulator against its independent oracle,
coremltools' own op definition: the dense weight the emulator's program makes of random int4,
uint4 and int8 blobs equals coremltools' `materialized_val_inference` of the same op, bit for
bit (fp16 bit patterns, signed zeros included), and coremltools' blob reader reads the packed
data our compiler wrote.

The emulator's dense result is read out through the program itself: the constexpr result,
reshaped to `[1, O, 1, C]`, times an input of ones (x·1 is x, -0 included), returned.
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

NP_CT = {"int4": ct_types.np_int4_dtype, "uint4": ct_types.np_uint4_dtype, "int8": np.int8}
RANGE = {"int4": (-8, 7), "uint4": (0, 15), "int8": (-128, 127)}

# (dtype, data shape, scale shape, offset kind): blocks along the input axis (the weights' form),
# along both axes, a rank-2 tensor, one block per row, odd counts (a half-filled last byte)
CASES = [
    ("uint4", (40, 64, 1, 1), (40, 2, 1, 1), "int"),
    ("uint4", (48, 96, 1, 1), (48, 3, 1, 1), "fp16"),
    ("uint4", (16, 64), (16, 4), None),
    ("int4", (40, 64, 1, 1), (40, 4, 1, 1), "int"),
    ("int4", (32, 48, 1, 1), (8, 3, 1, 1), "fp16"),
    ("int4", (24, 32), (24, 1), None),
    ("int4", (15, 16, 1, 1), (5, 2, 1, 1), "int"),
    ("int8", (32, 64, 1, 1), (32, 2, 1, 1), "int"),
    ("int8", (32, 64, 1, 1), (32, 8, 1, 1), "fp16"),
]


def _case(dtype, shape, sshape, offset, seed):
    rng = np.random.default_rng(seed)
    lo, hi = RANGE[dtype]
    data = rng.integers(lo, hi + 1, shape)
    # scales of both signs over a wide range (products round in fp16, some subnormal)
    scale = (rng.standard_normal(sshape) * 2.0 ** rng.integers(-14, 2, sshape)).astype(np.float16)
    if offset == "int":
        off = rng.integers(lo, hi + 1, sshape)
    elif offset == "fp16":  # GGUF Q4_1's -m/d: not an integer, so data - offset rounds in fp16
        off = (rng.standard_normal(sshape) * 4 + (hi + lo) / 2).astype(np.float16)
    else:
        off = None
    return data, scale, off


def coremltools_dense(dtype, data, scale, off) -> np.ndarray:
    """The op's value as coremltools' iOS18 definition computes it, built as a pymil program."""
    out = {}

    @mb.program(input_specs=[], opset_version=ct.target.iOS18)
    def prog():
        kw = {"data": data.astype(NP_CT[dtype]), "scale": scale}
        if off is not None:
            kw["offset"] = off if off.dtype == np.float16 else off.astype(NP_CT[dtype])
        w = mb.constexpr_blockwise_shift_scale(**kw)
        assert w.op.data.dtype == getattr(ct_types, dtype)  # typed as the sub-byte dtype, not uint8
        out["v"] = w.op.materialized_val_inference()
        return w

    return out["v"]


def emulator_dense(dtype, data, scale, off):
    """(the emulator's dense weight, the compiled artifact)."""
    o, c = data.shape[0], int(np.prod(data.shape[1:]))
    b = GraphBuilder("blockwise")
    x = b.input("x", [1, o, 1, c])
    w = b.constexpr_blockwise_shift_scale(data, dtype, scale, off, name="w")
    b.output("y", b.mul(x, b.reshape(w, [1, o, 1, c], name="flat"), name="y"))
    art = compile_graph(b.build(), STRICT)
    y = Kernel(art, Emulator(STRICT))(x=np.ones((1, o, 1, c), np.float16))["y"]
    return np.asarray(y, np.float16).reshape(data.shape), art


@pytest.mark.parametrize("i", range(len(CASES)))
def test_emulator_equals_coremltools_bit_for_bit(i):
    dtype, shape, sshape, offset = CASES[i]
    data, scale, off = _case(dtype, shape, sshape, offset, seed=i)
    ref = coremltools_dense(dtype, data, scale, off)
    assert ref.dtype == np.float16
    got, art = emulator_dense(dtype, data, scale, off)
    assert f"data = tensor<{dtype}, {list(shape)}>(BLOBFILE" in art.mil_text
    assert np.array_equal(got.view(np.uint16), ref.view(np.uint16)), \
        f"{int((got.view(np.uint16) != ref.view(np.uint16)).sum())} of {ref.size} differ"
    if offset == "fp16" and dtype != "int8":  # the case where fp16 rounds data - offset is exercised
        exact = (data.astype(np.float64) - np.repeat(np.repeat(off.astype(np.float64), shape[0] // sshape[0], 0),
                                                     shape[1] // sshape[1], 1))
        assert not np.array_equal(exact.astype(np.float16).astype(np.float64), exact)


@pytest.mark.parametrize("dtype", ["int4", "uint4"])
def test_coremltools_reads_the_packed_data_we_wrote(tmp_path, dtype):
    data, scale, off = _case(dtype, (23, 48, 1, 1), (23, 3, 1, 1), "int", seed=7)  # 69 offsets: a half byte
    _, art = emulator_dense(dtype, data, scale, off)
    for part, values in (("w_data", data), ("w_offset", off)):
        blob = next(b for p, b in art.weights.items() if p.endswith(f"/{part}.bin"))
        assert len(bytes(blob)) == 128 + (values.size + 1) // 2  # two values a byte
        (tmp_path / f"{part}.bin").write_bytes(bytes(blob))
        reader = milstorage._BlobStorageReader(str(tmp_path / f"{part}.bin"))
        got = np.asarray(getattr(reader, f"read_{dtype}_data")(64))
        assert np.array_equal(got.astype(np.int64), values.reshape(-1))


def test_the_op_is_typed_as_coremltools_types_it():
    from anelm.errors import ShapeError
    from anelm.ir.builder import GraphBuilder

    b = GraphBuilder("bad")
    with pytest.raises(ShapeError, match="divides"):
        b.constexpr_blockwise_shift_scale(np.zeros((8, 6)), "int4", np.ones((8, 4), np.float16))
    with pytest.raises(ShapeError, match="offset"):
        b.constexpr_blockwise_shift_scale(np.zeros((8, 6)), "int4", np.ones((8, 2), np.float16),
                                          np.zeros((8, 3), np.float16))


def test_the_doctor_probe_passes_here_and_catches_an_op_without_offsets(monkeypatch, tmp_path):
    """`anelm doctor`'s op.constexpr_blockwise_shift_scale (doctor/probes_int8.py) on the
    emulator, and on a device whose op drops the offsets (it must fail there)."""
    from anelm.doctor import run_suite, select
    from anelm.doctor.probes_int8 import W4, w4_weights
    from anelm.ir import ops_quant

    q, scale, offset, dense = w4_weights()
    assert np.array_equal(ops_quant.blockwise_dense(q, scale, offset).astype(np.float64), dense)  # exact in fp16
    assert run_suite(Emulator(STRICT), select([W4]))[W4].status == "ok"
    plain = ops_quant.blockwise_dense
    monkeypatch.setattr(ops_quant, "blockwise_dense", lambda d, s, o: plain(d, s, None))
    monkeypatch.setenv("ANELM_CACHE_DIR", str(tmp_path))  # no plan the right op folded before
    assert run_suite(Emulator(STRICT), select([W4]))[W4].status != "ok"


def test_programs_decoding_one_blob_hold_one_fp16_copy():
    """A runner's prefill and decode programs decode the same 4-bit blobs: their convs hold one
    fp16 copy of the weight (emulator.matvec's `decoded_once`), which gives, bit for bit, the
    products of the same conv on coremltools' dense weight stored as fp16."""
    from anelm.device.emulator.matvec import ResidentConv

    data, scale, off = _case("uint4", (48, 96, 1, 1), (48, 3, 1, 1), "fp16", seed=31)
    dense = coremltools_dense("uint4", data, scale, off)
    x = np.random.default_rng(32).standard_normal((1, 96, 1, 32)).astype(np.float16)

    def run(width: int, weight=None):
        b = GraphBuilder("w4conv")
        xv = b.input("x", [1, 96, 1, width])
        w = b.constexpr_blockwise_shift_scale(data, "uint4", scale, off, name="w") if weight is None else weight
        b.output("y", b.conv(xv, w, name="y"))
        k = Kernel(compile_graph(b.build(), STRICT), Emulator(STRICT))
        y = np.asarray(k(x=x[..., :width])["y"], np.float16)
        (held,) = [st.fn.weight for st in k.model.plan.steps if isinstance(st.fn, ResidentConv)]
        return y, held

    (wide, a), (narrow, b) = run(32), run(16)
    assert np.shares_memory(a.bits(), b.bits()) and a.f32 is None
    for got, width in ((wide, 32), (narrow, 16)):
        ref, _ = run(width, dense)
        assert np.array_equal(got.view(np.uint16), ref.view(np.uint16))
