"""One test per strict-profile behaviour (docs/chip-profiles.md) showing the Emulator enforces it,
plus the peer switches toggled on."""

import numpy as np
import pytest
from emulator_testkit import LOOSE, STRICT_NB, const, mil, run, ttype

from anelm.device.base import Surface
from anelm.device.emulator import Emulator, read_packed
from anelm.chip.profile import PROFILE_DIR, STRICT, load_profile
from anelm.errors import BlobError, CompileBudgetExceeded, CompileError, DeviceError, ShapeError
from anelm.mil.blob import encode_blob, encode_tensor

X = ("x", "fp16", (1, 8, 1, 16))
T8 = ttype("fp16", (1, 8, 1, 16))
MIN = STRICT.min_surface_bytes
rng = np.random.default_rng(1)


def compile_(text, weights=None, profile=STRICT_NB):
    return Emulator(profile).compile(text, weights or {})


def relu_prog():
    return mil([X], [f'{T8} y = relu(x = x)[name = string("y")];'], ["y"])


# ----------------------------------------------------------------------------- compile-time rejects


def test_rejects_concat_naming_node():
    text = mil([X], [const("ax", 1), const("il", False),
                     f'{ttype("fp16", (1, 16, 1, 16))} y = concat(axis = ax, interleave = il, values = (x, x))[name = string("cat0")];'],
               ["y"])
    with pytest.raises(CompileError, match=r"node 'cat0': op 'concat' is rejected"):
        compile_(text)
    compile_(text, profile=LOOSE)  # the same program is fine where concat is allowed


def test_rejects_gelu():
    with pytest.raises(CompileError, match=r"node 'g1': op 'gelu' is rejected"):
        compile_(mil([X], [f'{T8} y = gelu(x = x)[name = string("g1")];'], ["y"]))


def _conv_body(weight_line, extra_args=""):
    return [const("pt", "valid"), const("st", [1, 1]), const("pd", [0, 0, 0, 0]), const("dl", [1, 1]),
            const("gr", 1), weight_line,
            f'{T8} y = conv({extra_args}dilations = dl, groups = gr, pad = pd, pad_type = pt, strides = st, '
            'weight = W, x = x)[name = string("c1")];']


def _conv_prog(weight_line, extra_args=""):
    return mil([X], _conv_body(weight_line, extra_args), ["y"])


W_BLOB = {"@model_path/weights/w.bin": encode_tensor(np.eye(8, dtype=np.float16).reshape(8, 8, 1, 1))}
W_CONST = (f'{ttype("fp16", (8, 8, 1, 1))} W = const()[name = string("W"), val = {ttype("fp16", (8, 8, 1, 1))}'
           '(BLOBFILE(path = string("@model_path/weights/w.bin"), offset = uint64(64)))];')


def test_rejects_conv_with_bias():
    text = _conv_prog(W_CONST + ' ' + f'{ttype("fp16", (8,))} B = const()[name = string("B"), val = {ttype("fp16", (8,))}([0, 0, 0, 0, 0, 0, 0, 0])];',
                      "bias = B, ")
    with pytest.raises(CompileError, match=r"node 'c1': conv has a bias argument"):
        compile_(text, W_BLOB)
    compile_(_conv_prog(W_CONST), W_BLOB)  # without the bias it compiles


def test_rejects_conv_with_dynamic_weight():
    text = _conv_prog(W_CONST.replace(" W = ", " W0 = ").replace('string("W")', 'string("W0")') + " " +
                      f'{ttype("fp16", (8, 8, 1, 1))} W = relu(x = W0)[name = string("W")];')
    with pytest.raises(CompileError, match=r"node 'c1': conv weight 'W' is the result of relu, not a const"):
        compile_(text, W_BLOB)
    inp = mil([X, ("W", "fp16", (8, 8, 1, 1))], _conv_body(""), ["y"])
    with pytest.raises(CompileError, match=r"conv weight 'W' is a function input"):
        compile_(inp)


def test_rejects_inline_matmul_transpose_literals():
    body = f'{ttype("fp16", (1, 8, 1, 1))} y = matmul(transpose_x = {{}}, transpose_y = tT, x = x, y = x)[name = string("mm")];'
    text = mil([X], [const("tT", True), const("tF", False), body.format("bool(false)")], ["y"])
    with pytest.raises(CompileError, match=r"node 'mm': matmul has an inline transpose_x literal"):
        compile_(text)
    compile_(mil([X], [const("tT", True), const("tF", False), body.format("tF")], ["y"]))


def test_rejects_returned_name_no_statement_defines():
    with pytest.raises(CompileError, match=r"node 'zz': returned name is defined by no statement"):
        compile_(mil([X], [f'{T8} y = relu(x = x)[name = string("y")];'], ["y", "zz"]))


def test_rejects_op_missing_from_op_table():
    with pytest.raises(CompileError, match=r"node 'f': op 'frobnicate' is not in the emulator's op table"):
        compile_(mil([X], [f'{T8} y = frobnicate(x = x)[name = string("f")];'], ["y"]))


def test_rejects_undefined_variable_and_bad_blobs():
    with pytest.raises(CompileError, match=r"node 'r': relu operand 'x' refers to 'nope'"):
        compile_(mil([X], [f'{T8} y = relu(x = nope)[name = string("r")];'], ["y"]))
    with pytest.raises(BlobError, match=r"@model_path/weights/w.bin: no such weight blob"):
        compile_(_conv_prog(W_CONST))
    with pytest.raises(BlobError, match=r"@model_path/weights/w.bin.*sentinel"):
        compile_(_conv_prog(W_CONST.replace("uint64(64)", "uint64(128)")), W_BLOB)


def test_declared_type_must_match_inference():
    with pytest.raises(ShapeError, match=r"node 'y': relu result declared as fp16 \[1, 8, 1, 8\]; expected fp16 \[1, 8, 1, 16\]"):
        compile_(mil([X], [f'{ttype("fp16", (1, 8, 1, 8))} y = relu(x = x)[name = string("y")];'], ["y"]))


# ----------------------------------------------------------------------------- alphabetical surface binding

SUB = mil([("b", "fp16", (1, 8, 1, 16)), ("a", "fp16", (1, 8, 1, 16))],
          [f'{T8} zd = sub(x = b, y = a)[name = string("zd")];', f'{T8} ab = add(x = a, y = a)[name = string("ab")];'],
          ["zd", "ab"])


def _evaluate(profile, order_in, order_out, a, b):
    dev = Emulator(profile)
    m = dev.compile(SUB, {})
    dev.load(m)
    ins = {"a": Surface(MIN), "b": Surface(MIN)}
    ins["a"].write(a)
    ins["b"].write(b)
    outs = {"zd": Surface(MIN), "ab": Surface(MIN)}
    dev.evaluate(m, [ins[n] for n in order_in], [outs[n] for n in order_out])
    return {n: outs[n].view()[: a.nbytes].view(np.float16).reshape(a.shape) for n in outs}


def test_inputs_and_outputs_bind_alphabetically():
    a = rng.standard_normal((1, 8, 1, 16)).astype(np.float16)
    b = (a + 3).astype(np.float16)
    right = _evaluate(STRICT_NB, ["a", "b"], ["ab", "zd"], a, b)
    assert np.allclose(right["zd"], 3, atol=1e-2) and np.allclose(right["ab"], 2 * a.astype(np.float32), rtol=1e-3)
    # binding in declaration order (b, a) / (zd, ab) swaps operands and results
    wrong = _evaluate(STRICT_NB, ["b", "a"], ["zd", "ab"], a, b)
    assert np.allclose(wrong["ab"], -3, atol=1e-2)  # the surface named zd received ab's slot: a - b
    assert np.allclose(wrong["zd"], 2 * b.astype(np.float32), rtol=1e-3)
    declared = _evaluate(STRICT_NB.replace(bind_inputs_alphabetically=False, bind_outputs_alphabetically=False),
                         ["b", "a"], ["zd", "ab"], a, b)
    assert np.allclose(declared["zd"], 3, atol=1e-2)


# ----------------------------------------------------------------------------- surfaces: uniform sizes, a minimum


def _loaded(text, profile=STRICT_NB):
    dev = Emulator(profile)
    m = dev.compile(text, {})
    dev.load(m)
    return dev, m


def test_uniform_sizes_per_direction():
    dev, m = _loaded(SUB)
    with pytest.raises(DeviceError, match=r"input surfaces have sizes \[49152, 65536\].*status 0x1d"):
        dev.evaluate(m, [Surface(MIN), Surface(65536)], [Surface(MIN), Surface(MIN)])
    with pytest.raises(DeviceError, match=r"output surfaces have sizes"):
        dev.evaluate(m, [Surface(MIN), Surface(MIN)], [Surface(MIN), Surface(MIN + 64)])
    dev.evaluate(m, [Surface(65536), Surface(65536)], [Surface(MIN), Surface(MIN)])  # directions judged apart
    with pytest.raises(DeviceError, match=r"request has 1 input surfaces; expected 2 \(a, b\)"):
        dev.evaluate(m, [Surface(MIN)], [Surface(MIN), Surface(MIN)])


def test_minimum_surface_size_and_packed_reads():
    dev, m = _loaded(relu_prog())
    x = rng.standard_normal((1, 8, 1, 16)).astype(np.float16)
    with pytest.raises(DeviceError, match=r"input surface for 'x' has 256 bytes; expected at least 49152.*0x1d"):
        dev.evaluate(m, [Surface(x.nbytes)], [Surface(MIN)])
    inp, out = Surface(MIN * 2), Surface(MIN * 2)
    inp.write(np.full(MIN, -7, np.float16))  # garbage past the packed tensor must be ignored
    inp.write(x)
    out.write(np.full(MIN, 5, np.float16))
    dev.evaluate(m, [inp], [out])
    got = out.view()[: x.nbytes].view(np.float16)
    assert np.array_equal(got, np.maximum(x, 0).reshape(-1))
    assert (out.view()[x.nbytes: MIN * 2].view(np.float16) == 5).all()  # written packed at offset 0 only


def test_evaluate_needs_load():
    dev = Emulator(STRICT_NB)
    m = dev.compile(relu_prog(), {})
    with pytest.raises(DeviceError, match="not loaded"):
        dev.evaluate(m, [Surface(MIN)], [Surface(MIN)])


# ----------------------------------------------------------------------------- semantics


def test_sdpa_ignores_attn_mask():
    q, k, v = (rng.standard_normal((1, 2, 8, 16)).astype(np.float16) for _ in range(3))
    mask = np.where(np.tril(np.ones((8, 8), bool)), 0.0, -1e4).astype(np.float16)
    shp = (1, 2, 8, 16)
    text = mil([("k", "fp16", shp), ("m", "fp16", (8, 8)), ("q", "fp16", shp), ("v", "fp16", shp)],
               [f'{ttype("fp16", shp)} o = scaled_dot_product_attention(attn_mask = m, key = k, query = q, value = v)[name = string("o")];'],
               ["o"])
    ins = {"q": q, "k": k, "v": v, "m": mask}
    s = q.astype(np.float64) @ np.swapaxes(k.astype(np.float64), -1, -2) / 4.0

    def attend(scores):
        e = np.exp(scores - scores.max(-1, keepdims=True))
        return (e / e.sum(-1, keepdims=True)) @ v.astype(np.float64)
    strict = run(text, ins)["o"]
    assert np.abs(strict - attend(s)).max() < 1e-2  # unmasked
    assert np.abs(strict - attend(s + mask)).max() > 0.1
    loose = run(text, ins, profile=STRICT_NB.replace(sdpa_ignores_mask=False))["o"]
    assert np.abs(loose - attend(s + mask)).max() < 1e-2


def _weight_model(profile):
    dev = Emulator(profile)
    m = dev.compile(_conv_prog(W_CONST), W_BLOB)
    dev.load(m)
    return dev, m


def _run_model(dev, m, x):
    inp, out = Surface(MIN), Surface(MIN)
    inp.write(x)
    dev.evaluate(m, [inp], [out])
    return read_packed(out, m.outputs[0][1]).copy()


@pytest.mark.parametrize("reload_reads", [False, True])
def test_weights_read_at_compile_across_unload_load(reload_reads):
    dev, m = _weight_model(STRICT_NB.replace(reload_reads_new_weights=reload_reads))
    assert (m.folder / "model.mil").exists() and (m.folder / "weights" / "w.bin").exists()
    x = rng.standard_normal((1, 8, 1, 16)).astype(np.float16)
    assert np.array_equal(_run_model(dev, m, x), x)  # identity weight
    dev.rewrite_weight(m, "@model_path/weights/w.bin", encode_tensor(2 * np.eye(8, dtype=np.float16).reshape(8, 8, 1, 1)))
    assert (m.folder / "weights" / "w.bin").read_bytes() != W_BLOB["@model_path/weights/w.bin"]
    dev.unload(m)
    dev.load(m)
    got = _run_model(dev, m, x)
    assert np.array_equal(got, 2 * x.astype(np.float32) if reload_reads else x)


def test_a_strict_compile_writes_its_folder_only_when_asked():
    """Nothing reads a strict program's compile folder (weights are read at compile), so compiling
    writes none; asking for it (as rewrite_weight does) writes model.mil and the blobs as compiled."""
    dev, m = _weight_model(STRICT_NB)
    assert not m._folder.exists()
    assert (m.folder / "model.mil").read_text() == _conv_prog(W_CONST)
    assert (m.folder / "weights" / "w.bin").read_bytes() == W_BLOB["@model_path/weights/w.bin"]


def test_compile_budget_raises_at_compile_116(fresh_compile_count, cold_compiles):
    dev = Emulator(STRICT)
    text = relu_prog()
    for _ in range(115):  # the 115-compile budget, a margin under the failures near 119
        dev.compile(text, {})
    assert dev.compile_count == 115
    with pytest.raises(CompileBudgetExceeded, match="budget of 115"):
        dev.compile(text, {})


def test_every_result_is_rounded_to_fp16():
    text = mil([X], [const("d", 0.0001),
                     f'{T8} a = add(x = x, y = d)[name = string("a")];', f'{T8} y = sub(x = a, y = x)[name = string("y")];'],
               ["y"])
    x = np.ones((1, 8, 1, 16), np.float16)
    assert (run(text, {"x": x})["y"] == 0).all()  # 1 + 1e-4 rounds back to 1 in fp16
    assert (run(text, {"x": x}, profile=LOOSE)["y"] > 0).all()


def test_cast_only_at_boundary():
    x32 = ("x", "fp32", (1, 8, 1, 16))
    T32 = ttype("fp32", (1, 8, 1, 16))
    ok = mil([x32], [const("h", "fp16"), const("f", "fp32"), f'{T8} a = cast(dtype = h, x = x)[name = string("a")];',
                     f'{T8} r = relu(x = a)[name = string("r")];', f'{T32} y = cast(dtype = f, x = r)[name = string("y")];'], ["y"])
    x = np.linspace(-2, 2, 128, dtype=np.float32).reshape(1, 8, 1, 16)
    assert np.array_equal(run(ok, {"x": x})["y"], np.maximum(x.astype(np.float16), 0).astype(np.float32))
    mid = mil([X], [const("f", "fp32"), f'{T8} r = relu(x = x)[name = string("r")];',
                    f'{T32} a = cast(dtype = f, x = r)[name = string("c32")];',
                    f'{T32} y = relu(x = a)[name = string("y")];'], ["y"])
    with pytest.raises(CompileError, match=r"node 'c32': cast is allowed only directly on a function input or on a returned value"):
        compile_(mid)
    compile_(mid, profile=LOOSE)


# ----------------------------------------------------------------------------- peer switches


def test_switch_reject_reduce_mean_and_rsqrt():
    red = mil([X], [const("ax", [1]), const("kd", True),
                    f'{ttype("fp16", (1, 1, 1, 16))} y = reduce_mean(axes = ax, keep_dims = kd, x = x)[name = string("rm")];'], ["y"])
    compile_(red)
    with pytest.raises(CompileError, match=r"node 'rm': op 'reduce_mean' is rejected"):
        compile_(red, profile=STRICT_NB.replace(reject_reduce_mean=True))
    rs = mil([X], [f'{T8} y = rsqrt(x = x)[name = string("rs")];'], ["y"])
    compile_(rs)
    with pytest.raises(CompileError, match=r"node 'rs': op 'rsqrt' is rejected"):
        compile_(rs, profile=STRICT_NB.replace(reject_rsqrt=True))


def test_switch_single_chunk_blobs_only():
    two, offsets = encode_blob([np.eye(8, dtype=np.float16).reshape(8, 8, 1, 1), np.ones(8, np.float16)])
    weights = {"@model_path/weights/w.bin": two}
    compile_(_conv_prog(W_CONST), weights)
    with pytest.raises(CompileError, match=r"node 'W': blob file @model_path/weights/w.bin holds 2 chunks"):
        compile_(_conv_prog(W_CONST), weights, profile=STRICT_NB.replace(single_chunk_blobs_only=True))
    compile_(_conv_prog(W_CONST), W_BLOB, profile=STRICT_NB.replace(single_chunk_blobs_only=True))


def test_switch_single_input_only():
    dev, m = _loaded(SUB, STRICT_NB.replace(single_input_only=True))
    with pytest.raises(DeviceError, match=r"request has 2 input surfaces; profile .strict. accepts one input.*0x1d"):
        dev.evaluate(m, [Surface(MIN), Surface(MIN)], [Surface(MIN), Surface(MIN)])


def test_switch_spatial_multiple_of():
    odd = mil([("x", "fp16", (1, 8, 1, 20))], [f'{ttype("fp16", (1, 8, 1, 20))} y = relu(x = x)[name = string("y")];'], ["y"])
    compile_(odd)
    with pytest.raises(CompileError, match=r"node 'x': I/O tensor's last dim 20 is not a multiple of 16"):
        compile_(odd, profile=STRICT_NB.replace(spatial_multiple_of=16))
    compile_(relu_prog(), profile=STRICT_NB.replace(spatial_multiple_of=16))


def test_strict_io_widths_are_multiples_of_16():
    odd = mil([("x", "fp16", (1, 8, 1, 1))], [f'{ttype("fp16", (1, 8, 1, 1))} y = relu(x = x)[name = string("y")];'], ["y"])
    with pytest.raises(CompileError, match=r"node 'x': I/O tensor's last dim 1 is not a multiple of 16"):
        compile_(odd, profile=STRICT)  # the 16-column multiple: Orion's S = 1 fails at evaluation on the chip
    compile_(relu_prog(), profile=STRICT)


def test_switch_saturate_above():
    x = np.array([4000, 4100, -5000, 1], np.float16).reshape(1, 4, 1, 1)
    text = mil([("x", "fp16", x.shape)], [f'{ttype("fp16", x.shape)} y = relu(x = x)[name = string("y")];'], ["y"])
    assert list(run(text, {"x": x})["y"].reshape(-1)) == [4000, 4100, 0, 1]
    sat = run(text, {"x": x}, profile=STRICT_NB.replace(saturate_above=4094.0))["y"].reshape(-1)
    assert list(sat) == [4000, np.inf, 0, 1]


# ----------------------------------------------------------------------------- profile files


def test_strict_json_is_the_builtin_profile():
    path = PROFILE_DIR / "strict.json"
    assert path.read_text() == STRICT.to_json()
    assert load_profile(str(path)) == STRICT


def test_permissive_test_profile_switches_everything_off():
    p = load_profile("permissive-test")
    assert p.rejected_ops == () and not p.cast_only_at_boundary and p.compute_dtype == "fp32"
    compile_(mil([X], [const("ax", 1), const("il", False),
                       f'{ttype("fp16", (1, 16, 1, 16))} y = concat(axis = ax, interleave = il, values = (x, x))[name = string("c")];'],
                 ["y"]), profile=p)
