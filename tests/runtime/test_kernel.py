"""Kernel and the program cache on the Emulator: surfaces, binding, casting, requests, eviction."""

import numpy as np
import pytest

from anelm.compiler.artifact import Artifact, signature_from_function
from anelm.device.base import Surface, compile_count
from anelm.device.emulator import Emulator
from anelm.chip.profile import STRICT
from anelm.errors import ShapeError
from anelm.mil.parser import parse
from anelm.runtime.cache import ProgramCache
from anelm.runtime.kernel import Kernel

PROFILE = STRICT.replace(compile_budget=10**9)
HEAD = ('program(1.3)\n[buildInfo = dict<string, string>({{"coremlc-version", "3505.4.1"}})]\n{\n')
rng = np.random.default_rng(3)


def artifact(params, body, outputs, profile=PROFILE):
    text = f"{HEAD}    func main<ios18>({params}) {{\n" + "".join(f"        {b}\n" for b in body) + \
           f"    }} -> ({outputs});\n}}\n"
    return Artifact(text, {}, signature_from_function(parse(text).main, profile))


T = "tensor<fp16, [1, 8, 1, 16]>"
# declared (b, a) and (zd, ab): neither direction is alphabetical
SUB = artifact(f"{T} b, {T} a", [f'{T} zd = sub(x = b, y = a)[name = string("zd")];',
                                 f'{T} ab = add(x = a, y = a)[name = string("ab")];'], "zd, ab")


class Recording(Emulator):
    """An Emulator that remembers the surfaces of each request."""

    def __init__(self, profile=PROFILE):
        super().__init__(profile)
        self.seen = []

    def evaluate(self, model, inputs, outputs, watch=False):
        self.seen.append(([s.nbytes for s in inputs], [s.nbytes for s in outputs]))
        return super().evaluate(model, inputs, outputs, watch)


def test_run_binds_by_name_and_returns_declared_dtype_shape_order():
    dev = Recording()
    a = rng.standard_normal((1, 8, 1, 16))  # float64 in: cast to the declared fp16
    b = a + 3.0
    with Kernel(SUB, dev, cache=ProgramCache()) as k:
        out = k(a=a, b=b)
        assert list(out) == ["zd", "ab"]
        assert out["zd"].dtype == np.float16 and out["zd"].shape == (1, 8, 1, 16)
        a16, b16 = a.astype(np.float16).astype(np.float64), b.astype(np.float16).astype(np.float64)
        assert np.array_equal(out["zd"], (b16 - a16).astype(np.float16))
        assert np.array_equal(out["ab"], (2 * a16).astype(np.float16))
    # uniform sizes per direction, at least the 49,152-byte minimum
    assert dev.seen == [([49152, 49152], [49152, 49152])]


def test_declaration_order_profile_binds_as_declared():
    prof = PROFILE.replace(bind_inputs_alphabetically=False, bind_outputs_alphabetically=False)
    a = rng.standard_normal((1, 8, 1, 16)).astype(np.float16)
    with Kernel(SUB, Emulator(prof), cache=ProgramCache()) as k:
        out = k.run({"a": a, "b": a})
    assert (out["zd"] == 0).all() and np.array_equal(out["ab"], (2 * a.astype(np.float32)).astype(np.float16))


def test_uniform_size_is_the_largest_surface():
    big = "tensor<fp16, [1, 64, 1, 512]>"
    # a signature written for a chip without the size rules: the strict device still gets uniform sizes
    free = PROFILE.replace(uniform_input_sizes=False, uniform_output_sizes=False, min_surface_bytes=0)
    art = artifact(f"{T} a, {big} w", [f'{T} y = relu(x = a)[name = string("y")];',
                                       f'{big} z = relu(x = w)[name = string("z")];'], "y, z", free)
    assert [s.surface_bytes for s in art.signature.inputs] == [256, 65536]
    dev = Recording()
    with Kernel(art, dev, cache=ProgramCache()) as k:
        k(a=np.ones((1, 8, 1, 16)), w=np.ones((1, 64, 1, 512)))
    assert dev.seen == [([65536, 65536], [65536, 65536])]


def test_input_errors_are_one_line():
    with Kernel(SUB, Emulator(PROFILE), cache=ProgramCache()) as k:
        good = np.zeros((1, 8, 1, 16))
        with pytest.raises(ShapeError, match=r"^input 'a': expected shape \[1, 8, 1, 16\], got \[8, 16\]$"):
            k(a=np.zeros((8, 16)), b=good)
        with pytest.raises(ShapeError, match=r"missing \['b'\]"):
            k(a=good)
        with pytest.raises(ShapeError, match=r"kernel has no input 'c'"):
            k(a=good, b=good, c=good)
    with pytest.raises(ShapeError, match="closed"):
        k(a=good, b=good)


class ByteSurfaces(Emulator):
    """Hands out plain byte surfaces, as the hardware backend does: requests keep host copies."""

    def new_surface(self, nbytes):
        return Surface(nbytes)


@pytest.mark.parametrize("device", [Emulator, ByteSurfaces])
def test_requests_stage_weight_columns_and_share_outputs(device):
    ic, s, oc = 16, 32, 16  # the packed width s + oc a multiple of 16 (the spatial multiple)
    x_t = f"tensor<fp16, [1, {ic}, 1, {s + oc}]>"
    body = ['tensor<int32, [4]> ba = const()[name = string("ba"), val = tensor<int32, [4]>([0, 0, 0, 0])];',
            f'tensor<int32, [4]> sa = const()[name = string("sa"), val = tensor<int32, [4]>([1, {ic}, 1, {s}])];',
            f'tensor<int32, [4]> bw = const()[name = string("bw"), val = tensor<int32, [4]>([0, 0, 0, {s}])];',
            f'tensor<int32, [4]> sw = const()[name = string("sw"), val = tensor<int32, [4]>([1, {ic}, 1, {oc}])];',
            f'tensor<fp16, [1, {ic}, 1, {s}]> act = slice_by_size(begin = ba, size = sa, x = x)[name = string("act")];',
            f'tensor<fp16, [1, {ic}, 1, {oc}]> w = slice_by_size(begin = bw, size = sw, x = x)[name = string("w")];',
            'bool tT = const()[name = string("tT"), val = bool(true)];',
            'bool tF = const()[name = string("tF"), val = bool(false)];',
            f'tensor<fp16, [1, {ic}, 1, {s}]> xs = relu(x = act)[name = string("xs")];',
            f'tensor<int32, [4]> ra = const()[name = string("ra"), val = tensor<int32, [4]>([1, 1, {ic}, {s}])];',
            f'tensor<int32, [4]> rw = const()[name = string("rw"), val = tensor<int32, [4]>([1, 1, {ic}, {oc}])];',
            f'tensor<fp16, [1, 1, {ic}, {s}]> a2 = reshape(shape = ra, x = xs)[name = string("a2")];',
            f'tensor<fp16, [1, 1, {ic}, {oc}]> w2 = reshape(shape = rw, x = w)[name = string("w2")];',
            f'tensor<fp16, [1, 1, {oc}, {s}]> y = matmul(transpose_x = tT, transpose_y = tF, x = w2, y = a2)[name = string("y")];']
    art = artifact(f"{x_t} x", body, "y")
    w1, w2 = (rng.standard_normal((ic, oc)).astype(np.float16) for _ in range(2))
    with Kernel(art, device(PROFILE), cache=ProgramCache()) as k:
        r1, r2 = k.request(), k.request()
        r1.write("x", w1, columns=slice(s, s + oc))  # [C, n] for a [1, C, 1, n] column block
        r2.write("x", w2[None, :, None, :], columns=slice(s, s + oc))
        for _ in range(2):
            act = rng.standard_normal((1, ic, 1, s)).astype(np.float16)
            a64 = np.maximum(act[0, :, 0, :].astype(np.float64), 0)
            r1.write("x", act, columns=slice(0, s))
            y1 = r1.run()["y"].copy()
            r2.write("x", act, columns=slice(0, s))
            y2 = r2.run()["y"]
            for y, w in ((y1, w1), (y2, w2)):
                ref = w.astype(np.float64).T @ a64
                assert np.abs(y[0, 0] - ref).max() / np.abs(ref).max() < 1e-2
        with pytest.raises(ShapeError, match=r"input 'x' columns 0:32: expected shape \[1, 16, 1, 32\], got \[16, 31\]"):
            r1.write("x", np.zeros((ic, s - 1)), columns=slice(0, s))


@pytest.mark.parametrize("device", [Emulator, ByteSurfaces])
def test_float32_outputs_hold_the_fp16_values(device):
    a = rng.standard_normal((1, 8, 1, 16)) * 1e3
    b = a * 70  # some differences overflow fp16: inf on both paths
    with Kernel(SUB, device(PROFILE), cache=ProgramCache()) as k16, \
            Kernel(SUB, device(PROFILE), cache=ProgramCache(), float32_outputs=True) as k32:
        with np.errstate(over="ignore"):
            ref, got = k16(a=a, b=b), k32(a=a.astype(np.float32), b=b.astype(np.float32))
        for name in ("zd", "ab"):
            assert got[name].dtype == np.float32 and ref[name].dtype == np.float16
            assert np.array_equal(got[name], ref[name].astype(np.float32))
        assert np.isinf(got["zd"]).any()


def test_float32_outputs_stay_as_returned_and_never_alias_inputs_or_consts():
    # outputs of a view of an input, of a const, of a reshape of a fresh result, and a real op
    t = "tensor<fp16, [1, 4, 1, 16]>"
    body = ['tensor<int32, [4]> sh = const()[name = string("sh"), val = tensor<int32, [4]>([1, 4, 1, 16])];',
            f'{t} same = reshape(shape = sh, x = a)[name = string("same")];',
            f'{t} c = const()[name = string("c"), val = {t}([' + ", ".join(["1.5"] * 64) + '])];',
            f'{t} fresh = add(x = a, y = c)[name = string("fresh")];',
            f'{t} re = reshape(shape = sh, x = fresh)[name = string("re")];']
    exact_size = PROFILE.replace(min_surface_bytes=64)  # surfaces as large as the outputs: adoptable
    art = artifact(f"{t} a", body, "same, c, re", exact_size)
    emu = Emulator(exact_size)
    with Kernel(art, emu, cache=ProgramCache(), float32_outputs=True) as k:
        req = k.request()
        a1 = rng.standard_normal((1, 4, 1, 16)).astype(np.float16).astype(np.float32)
        first = req.run(a=a1)
        kept = {n: v.copy() for n, v in first.items()}
        first["c"][...] = 0.0  # a caller writing into a result must not reach the program's const
        req.write("a", np.zeros((4, 4), np.float32), columns=slice(0, 4))  # staging into the input
        second = req.run(a=-a1)
        for n in ("same", "re"):
            assert np.array_equal(first[n], kept[n])  # earlier results are not overwritten
        want_re = (-a1 + np.float32(1.5)).astype(np.float16).astype(np.float32)
        assert np.array_equal(second["same"], -a1) and np.array_equal(second["re"], want_re)
        assert np.array_equal(second["c"], np.full((1, 4, 1, 16), 1.5, np.float32))


def test_cache_compiles_once_and_evicts_lru_unpinned(cold_compiles):
    cache, dev = ProgramCache(capacity=1), Emulator(PROFILE)
    before = compile_count()
    k1, k2 = Kernel(SUB, dev, cache=cache), Kernel(SUB, dev, cache=cache)
    assert compile_count() - before == 1 and cache.hits == 1 and k1.model is k2.model
    other = artifact(f"{T} x", [f'{T} y = relu(x = x)[name = string("y")];'], "y")
    k3 = Kernel(other, dev, cache=cache)
    assert len(cache) == 2 and k1.model.loaded  # pinned entries are never unloaded
    k1.close(), k2.close()
    assert len(cache) == 1 and not k1.model.loaded  # over capacity: the LRU unpinned entry went
    Kernel(SUB, Emulator(PROFILE), cache=cache).close()  # another device compiles its own
    assert compile_count() - before == 3
    k3.close()
    assert cache.clear() == 1 and len(cache) == 0 and not k3.model.loaded


def test_close_releases_surfaces():
    k = Kernel(SUB, Emulator(PROFILE), cache=ProgramCache())
    req = k.request()
    k.close()
    assert all(s.nbytes == 0 for s in req.surfaces + k._out_surfaces)


def test_kernel_maps_renamed_io_and_rebuilds_returned_concat():
    """io_naming renames non-alphabetical I/O and concat_elimination splits a returned concat;
    the Kernel hides both: callers use their own names and get the joined array back."""
    from anelm.compiler.pipeline import compile_graph
    from anelm.device.emulator import Emulator
    from anelm.ir.builder import GraphBuilder
    from anelm.runtime.kernel import Kernel

    b = GraphBuilder("io")
    zed = b.input("zed", [1, 4, 1, 16])
    abc = b.input("abc", [1, 4, 1, 16])
    b.output("out", b.concat([b.mul(zed, 2.0, name="twice"), b.sub(zed, abc, name="diff")], axis=1))
    b.output("alpha", b.add(zed, abc, name="plus"))
    art = compile_graph(b.build())
    assert art.meta["aliases"] and "out" in art.meta["concat_outputs"]
    rng = np.random.default_rng(0)
    z, a = (rng.standard_normal((1, 4, 1, 16)).astype(np.float16) for _ in range(2))
    got = Kernel(art, Emulator())(zed=z, abc=a)
    zf, af = z.astype(np.float64), a.astype(np.float64)
    np.testing.assert_allclose(got["out"], np.concatenate([2 * zf, zf - af], axis=1), atol=4e-3)
    np.testing.assert_allclose(got["alpha"], zf + af, atol=4e-3)
    assert set(got) == {"out", "alpha"}


@pytest.mark.parametrize("device", [Emulator, ByteSurfaces])
def test_an_output_bound_as_another_requests_input_stays_on_the_device(device):
    """One kernel's output surface bound as the next one's input (`request(inputs=, outputs=)`),
    left unread (`run(stay=)`): the second's results are those of the value read back and written
    again; a request releases only its own surfaces."""
    a, b = (rng.standard_normal((1, 8, 1, 16)).astype(np.float16) for _ in range(2))
    dev = device(PROFILE)
    with Kernel(SUB, dev, cache=ProgramCache()) as k1, Kernel(SUB, dev, cache=ProgramCache()) as k2:
        via_host = k2.run({"a": k1.run({"a": a, "b": b})["ab"], "b": b})
        ab, zd = (k1.new_surface(k1.surface_bytes("outputs")) for _ in range(2))
        first, second = k1.request(outputs={"zd": zd, "ab": ab}), k2.request(inputs={"a": ab})
        assert set(first.run(stay=("ab",), a=a, b=b)) == {"zd"}
        got = second.run(b=b)
        for name, want in via_host.items():
            assert np.array_equal(got[name], want), name
        second.close()
        assert ab.nbytes == k1.surface_bytes("outputs") == 49152  # bound: not released with `second`
        with pytest.raises(ShapeError, match="expected a surface for each"):
            k1.request(outputs={"zd": zd})
        with pytest.raises(ShapeError, match="no input"):
            k1.request(inputs={"c": ab})
