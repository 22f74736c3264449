"""Per op: a tiny MIL program through the Emulator vs an independent float64 numpy or torch reference.

Tolerances (docs/testing.md, max|got-ref|/max|ref|): elementwise 2e-3; matmul, conv, reductions,
softmax 1e-2; attention and layer_norm (a block-like composite) 1e-2. Inputs are fp16 values
(what the surfaces carry); references run in float64 on those same values.
"""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from emulator_testkit import LOOSE, const, mil, run, ttype
from helpers import rel_err
from hypothesis import given, settings
from hypothesis import strategies as st

ELEM, LIN = 2e-3, 1e-2
rng = np.random.default_rng(0)


def h(*shape, scale=1.0):
    """Random fp16 values with edge cases mixed in: zeros, negatives, large magnitudes."""
    a = rng.standard_normal(shape) * scale
    flat = a.reshape(-1)
    flat[: max(1, flat.size // 16)] = 0.0
    flat[-1] = -abs(flat[-1]) - 1.0
    return a.astype(np.float16)


def f64(a):
    return np.asarray(a, np.float64)


def unary_prog(op, shape, extra=()):
    return mil([("x", "fp16", shape)], [*extra, f"{ttype('fp16', shape)} y = {op}[name = string(\"y\")];"], ["y"])


# ----------------------------------------------------------------------------- elementwise

BINARY = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "real_div": np.divide,
    "maximum": np.maximum, "minimum": np.minimum,
}


@pytest.mark.parametrize("op", sorted(BINARY))
@pytest.mark.parametrize("yshape", [(1, 16, 1, 32), (1, 16, 1, 1), (32,)])
def test_binary_broadcast(op, yshape):
    x, y = h(1, 16, 1, 32, scale=100.0), h(*yshape)
    if op == "real_div":
        y = np.where(np.abs(y) < 0.25, np.float16(0.5), y)
    text = mil([("x", "fp16", x.shape), ("y", "fp16", yshape)],
               [f'{ttype("fp16", x.shape)} z = {op}(x = x, y = y)[name = string("z")];'], ["z"])
    got = run(text, {"x": x, "y": y})["z"]
    assert rel_err(got, BINARY[op](f64(x), f64(y))) <= ELEM


def test_scalar_const_operand_and_pow():
    x = np.abs(h(1, 8, 1, 64, scale=10.0)) + np.float16(0.5)
    text = mil([("x", "fp16", x.shape)], [
        const("e", -0.5), const("s", 0.125),
        f'{ttype("fp16", x.shape)} p = pow(x = x, y = e)[name = string("p")];',
        f'{ttype("fp16", x.shape)} z = mul(x = p, y = s)[name = string("z")];'], ["z"])
    assert rel_err(run(text, {"x": x})["z"], f64(x) ** -0.5 * 0.125) <= ELEM


def _sig(v):
    return 1.0 / (1.0 + np.exp(-v))


UNARY = {
    "sqrt": (np.sqrt, True), "exp": (np.exp, False), "tanh": (np.tanh, False),
    "sigmoid": (_sig, False), "silu": (lambda v: v * _sig(v), False), "relu": (lambda v: np.maximum(v, 0), False),
}


@pytest.mark.parametrize("op", sorted(UNARY))
def test_unary(op):
    fn, positive = UNARY[op]
    x = h(1, 32, 1, 48, scale=3.0)
    x = np.abs(x) if positive else x
    got = run(unary_prog("%s(x = x)" % op, x.shape), {"x": x})["y"]
    assert rel_err(got, fn(f64(x))) <= ELEM


def test_rsqrt_with_epsilon():
    x = np.abs(h(1, 8, 1, 64, scale=4.0)) + np.float16(0.01)
    got = run(unary_prog("rsqrt(epsilon = eps, x = x)", x.shape, [const("eps", 0.001)]), {"x": x})["y"]
    assert rel_err(got, 1.0 / np.sqrt(f64(x) + float(np.float16(0.001)))) <= ELEM


@pytest.mark.parametrize("mode,approx", [("EXACT", "none"), ("TANH_APPROXIMATION", "tanh")])
def test_gelu_modes_vs_torch(mode, approx):
    x = h(1, 16, 1, 64, scale=3.0)
    got = run(unary_prog("gelu(mode = m, x = x)", x.shape, [const("m", mode)]), {"x": x}, profile=LOOSE)["y"]
    ref = F.gelu(torch.tensor(f64(x)), approximate=approx).numpy()
    assert rel_err(got, ref) <= ELEM


def test_gelu_sigmoid_approximation():
    x = h(1, 16, 1, 64, scale=3.0)
    got = run(unary_prog("gelu(mode = m, x = x)", x.shape, [const("m", "SIGMOID_APPROXIMATION")]),
              {"x": x}, profile=LOOSE)["y"]
    assert rel_err(got, f64(x) * _sig(1.702 * f64(x))) <= ELEM


def test_clip_and_cast_at_boundary():
    x = h(1, 8, 1, 64, scale=5.0)
    got = run(unary_prog("clip(alpha = a, beta = b, x = x)", x.shape, [const("a", -1.5), const("b", 2.0)]), {"x": x})["y"]
    assert rel_err(got, np.clip(f64(x), -1.5, 2.0)) <= ELEM
    x32 = rng.standard_normal((1, 8, 1, 64)).astype(np.float32)
    text = mil([("x", "fp32", x32.shape)], [const("d", "fp16"),
               f'{ttype("fp16", x32.shape)} y = cast(dtype = d, x = x)[name = string("y")];'], ["y"])
    got = run(text, {"x": x32})["y"]
    assert got.dtype == np.float16 and np.array_equal(got, x32.astype(np.float16))


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(-6e4, 6e4, allow_nan=False, width=16), min_size=4, max_size=4),
       st.lists(st.floats(-300, 300, allow_nan=False, width=16), min_size=4, max_size=4))
def test_property_add_mul_are_fp16_rounded_float64(xs, ys):
    x = np.array(xs, np.float16).reshape(1, 4, 1, 1)
    y = np.array(ys, np.float16).reshape(1, 4, 1, 1)
    text = mil([("x", "fp16", x.shape), ("y", "fp16", y.shape)], [
        f'{ttype("fp16", x.shape)} s = add(x = x, y = y)[name = string("s")];',
        f'{ttype("fp16", x.shape)} p = mul(x = x, y = y)[name = string("p")];'], ["p", "s"])
    out = run(text, {"x": x, "y": y})
    # the exact float64 result rounded once to fp16 is what an fp16 ALU gives (inf past 65504)
    with np.errstate(over="ignore"):
        assert np.array_equal(out["s"], (f64(x) + f64(y)).astype(np.float16))
        assert np.array_equal(out["p"], (f64(x) * f64(y)).astype(np.float16))


# ----------------------------------------------------------------------------- linear


def blob_const(name, arr):
    from anelm.mil.blob import encode_tensor
    path = f"@model_path/weights/{name}.bin"
    line = (f'{ttype("fp16", arr.shape)} {name} = const()[name = string("{name}"), val = {ttype("fp16", arr.shape)}'
            f'(BLOBFILE(path = string("{path}"), offset = uint64(64)))];')
    return line, {path: encode_tensor(arr.astype(np.float16))}


CONV_PARAMS = [const("pt", "valid"), const("st", [1, 1]), const("pd", [0, 0, 0, 0]), const("dl", [1, 1]), const("gr", 1)]


def test_conv_1x1_as_linear():
    x, w = h(1, 64, 1, 128), h(96, 64, 1, 1, scale=0.1)
    wl, blobs = blob_const("W", w)
    text = mil([("x", "fp16", x.shape)], [*CONV_PARAMS, wl,
               f'{ttype("fp16", (1, 96, 1, 128))} y = conv(dilations = dl, groups = gr, pad = pd, pad_type = pt, '
               'strides = st, weight = W, x = x)[name = string("y")];'], ["y"])
    got = run(text, {"x": x}, blobs)["y"]
    ref = np.einsum("oc,ncs->nos", f64(w)[:, :, 0, 0], f64(x)[:, :, 0, :])[:, :, None, :]
    assert rel_err(got, ref) <= LIN


@pytest.mark.parametrize("groups,strides,pad_type,pad,dil", [
    (2, [1, 1], "custom", [1, 1, 0, 2], [1, 1]),
    (4, [2, 1], "same", [0, 0, 0, 0], [1, 2]),
    (2, [2, 2], "same_lower", [0, 0, 0, 0], [1, 1]),
    (1, [1, 2], "valid", [0, 0, 0, 0], [2, 1]),
])
def test_conv_grouped_strided_vs_torch(groups, strides, pad_type, pad, dil):
    x, w, b = h(1, 8, 10, 11), h(12, 8 // groups, 3, 3, scale=0.3), h(12)
    wl, blobs = blob_const("W", w)
    bl, bblobs = blob_const("B", b)
    blobs.update(bblobs)
    torch_pad = [pad[2], pad[3], pad[0], pad[1]]
    ref = F.conv2d(F.pad(torch.tensor(f64(x)), torch_pad) if pad_type == "custom" else torch.tensor(f64(x)),
                   torch.tensor(f64(w)), torch.tensor(f64(b)), stride=strides, groups=groups, dilation=dil,
                   padding="same" if pad_type == "same" and strides == [1, 1] else 0)
    if pad_type.startswith("same") and strides != [1, 1]:  # torch has no strided "same": pad as MIL documents
        ref = _same_conv_ref(x, w, b, strides, dil, groups, lower=pad_type == "same_lower")
    body = [const("pt", pad_type), const("st", strides), const("pd", pad), const("dl", dil), const("gr", groups), wl, bl,
            f'{ttype("fp16", tuple(ref.shape))} y = conv(bias = B, dilations = dl, groups = gr, pad = pd, '
            'pad_type = pt, strides = st, weight = W, x = x)[name = string("y")];']
    got = run(mil([("x", "fp16", x.shape)], body, ["y"]), {"x": x}, blobs, profile=LOOSE)["y"]
    assert rel_err(got, ref.numpy()) <= LIN


def _same_conv_ref(x, w, b, strides, dil, groups, lower):
    pads = []
    for d, k, s, dl in zip(x.shape[2:], w.shape[2:], strides, dil):
        out, dk = -(-d // s), (k - 1) * dl + 1
        total = max((out - 1) * s + dk - d, 0)  # an odd total puts the extra row after (same) or before (same_lower)
        lo = total - total // 2 if lower else total // 2
        pads.append((lo, total - lo))
    xp = F.pad(torch.tensor(f64(x)), [pads[1][0], pads[1][1], pads[0][0], pads[0][1]])
    return F.conv2d(xp, torch.tensor(f64(w)), torch.tensor(f64(b)), stride=strides, dilation=dil, groups=groups)


@pytest.mark.parametrize("xs,ys,tx,ty", [
    ((1, 4, 16, 32), (1, 4, 24, 32), False, True),
    ((1, 4, 32, 16), (1, 4, 32, 24), True, False),
    ((2, 1, 8, 16), (3, 16, 5), False, False),
    ((16, 8), (8, 12), False, False),
])
def test_matmul_batched_broadcast(xs, ys, tx, ty):
    x, y = h(*xs), h(*ys)
    a = np.swapaxes(f64(x), -1, -2) if tx else f64(x)
    b = np.swapaxes(f64(y), -1, -2) if ty else f64(y)
    ref = np.matmul(a, b)
    text = mil([("x", "fp16", xs), ("y", "fp16", ys)], [const("tx", tx), const("ty", ty),
               f'{ttype("fp16", ref.shape)} z = matmul(transpose_x = tx, transpose_y = ty, x = x, y = y)[name = string("z")];'],
               ["z"])
    assert rel_err(run(text, {"x": x, "y": y})["z"], ref) <= LIN


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_sdpa_with_mask_vs_torch(mask_kind):
    q, k, v = h(1, 2, 16, 32), h(1, 2, 24, 32), h(1, 2, 24, 8)
    keep = np.tril(np.ones((16, 24), bool), k=8)
    mask = keep if mask_kind == "bool" else np.where(keep, 0.0, -1e4).astype(np.float16)
    mt = "bool" if mask_kind == "bool" else "fp16"
    text = mil([("q", "fp16", q.shape), ("k", "fp16", k.shape), ("v", "fp16", v.shape), ("m", mt, mask.shape)],
               [f'{ttype("fp16", (1, 2, 16, 8))} o = scaled_dot_product_attention(attn_mask = m, key = k, query = q, '
                'value = v)[name = string("o")];'], ["o"])
    got = run(text, {"q": q, "k": k, "v": v, "m": mask}, profile=LOOSE)["o"]
    tm = torch.tensor(keep) if mask_kind == "bool" else torch.tensor(f64(mask))
    ref = F.scaled_dot_product_attention(torch.tensor(f64(q)), torch.tensor(f64(k)), torch.tensor(f64(v)), attn_mask=tm)
    assert rel_err(got, ref.numpy()) <= LIN


# ----------------------------------------------------------------------------- reductions, norms


@pytest.mark.parametrize("op,fn", [("reduce_sum", np.sum), ("reduce_mean", np.mean), ("reduce_max", np.max)])
@pytest.mark.parametrize("axes,keep", [([1], True), ([-1, 1], False)])
def test_reductions(op, fn, axes, keep):
    x = h(1, 32, 2, 48, scale=4.0)
    ref = fn(f64(x), axis=tuple(axes), keepdims=keep)
    text = mil([("x", "fp16", x.shape)], [const("ax", axes), const("kd", keep),
               f'{ttype("fp16", ref.shape)} y = {op}(axes = ax, keep_dims = kd, x = x)[name = string("y")];'], ["y"])
    assert rel_err(run(text, {"x": x})["y"], ref) <= LIN


@pytest.mark.parametrize("axis", [1, -1])
def test_softmax(axis):
    x = h(1, 64, 1, 40, scale=8.0)
    e = np.exp(f64(x) - f64(x).max(axis=axis, keepdims=True))
    ref = e / e.sum(axis=axis, keepdims=True)
    got = run(unary_prog("softmax(axis = ax, x = x)", x.shape, [const("ax", axis)]), {"x": x})["y"]
    assert rel_err(got, ref) <= LIN


def test_layer_norm_vs_torch():
    x, g, b = h(1, 4, 6, 32, scale=3.0), h(6, 32), h(6, 32)
    gl, blobs = blob_const("g", g)
    bl, bb = blob_const("b", b)
    blobs.update(bb)
    text = mil([("x", "fp16", x.shape)], [const("ax", [2, 3]), const("eps", 1e-5), gl, bl,
               f'{ttype("fp16", x.shape)} y = layer_norm(axes = ax, beta = b, epsilon = eps, gamma = g, x = x)[name = string("y")];'],
               ["y"])
    ref = F.layer_norm(torch.tensor(f64(x)), (6, 32), torch.tensor(f64(g)), torch.tensor(f64(b)), eps=1e-5)
    assert rel_err(run(text, {"x": x}, blobs)["y"], ref.numpy()) <= LIN


# ----------------------------------------------------------------------------- movement


def test_reshape_transpose_slices():
    x = h(1, 8, 1, 30)
    body = [const("r", [1, 2, 4, -1]), const("pm", [0, 2, 3, 1]),
            f'{ttype("fp16", (1, 2, 4, 30))} a = reshape(shape = r, x = x)[name = string("a")];',
            f'{ttype("fp16", (1, 4, 30, 2))} t = transpose(perm = pm, x = a)[name = string("t")];',
            const("bb", [0, 1, 3, 0]), const("ss", [1, -1, 20, 1]),
            f'{ttype("fp16", (1, 3, 20, 1))} s = slice_by_size(begin = bb, size = ss, x = t)[name = string("s")];',
            const("b2", [0, 0, -1, 0]), const("e2", [1, 8, 0, 30]), const("s2", [1, 3, 1, 4]),
            const("em", [False, False, True, False]), const("sq", [True, False, False, False]),
            f'{ttype("fp16", (3, 1, 8))} i = slice_by_index(begin = b2, end = e2, end_mask = em, squeeze_mask = sq, '
            'stride = s2, x = x)[name = string("i")];']
    out = run(mil([("x", "fp16", x.shape)], body, ["i", "s"]), {"x": x})
    t = np.transpose(f64(x).reshape(1, 2, 4, 30), (0, 2, 3, 1))
    assert np.array_equal(out["s"], t[:, 1:4, 3:23, 0:1])
    assert np.array_equal(out["i"], f64(x)[0, 0:8:3, -1:, 0:30:4])


@pytest.mark.parametrize("interleave", [False, True])
def test_concat(interleave):
    a, b = h(1, 4, 1, 6), h(1, 4, 1, 6)
    text = mil([("a", "fp16", a.shape), ("b", "fp16", b.shape)], [const("ax", 1), const("il", interleave),
               f'{ttype("fp16", (1, 8, 1, 6))} y = concat(axis = ax, interleave = il, values = (a, b))[name = string("y")];'],
               ["y"])
    ref = np.stack([f64(a), f64(b)], axis=2).reshape(1, 8, 1, 6) if interleave else np.concatenate([f64(a), f64(b)], 1)
    assert np.array_equal(run(text, {"a": a, "b": b}, profile=LOOSE)["y"], ref)


# ----------------------------------------------------------------------------- quantization


def test_quantize_dequantize_round_trip():
    x = h(1, 4, 1, 32, scale=2.0)
    sc = np.array([0.02, 0.03, 0.05, 0.1], np.float16)
    zp = np.array([0, 3, -2, 1], np.int8)
    body = [f'{ttype("fp16", (4,))} sc = const()[name = string("sc"), val = {ttype("fp16", (4,))}([{", ".join(map(str, sc))}])];',
            f'{ttype("int8", (4,))} zp = const()[name = string("zp"), val = {ttype("int8", (4,))}([0, 3, -2, 1])];',
            const("ax", 1), const("od", "int8"),
            f'{ttype("int8", x.shape)} q = quantize(axis = ax, input = x, output_dtype = od, scale = sc, zero_point = zp)[name = string("q")];',
            f'{ttype("fp16", x.shape)} y = dequantize(axis = ax, input = q, scale = sc, zero_point = zp)[name = string("y")];']
    got = run(mil([("x", "fp16", x.shape)], body, ["y"]), {"x": x}, profile=LOOSE)["y"]
    s, z = f64(sc).reshape(1, 4, 1, 1), f64(zp).reshape(1, 4, 1, 1)
    q = np.clip(np.round(f64(x) / s) + z, -128, 127)
    assert rel_err(got, (q - z) * s) <= ELEM


def test_constexpr_affine_dequantize_feeds_conv():
    from anelm.mil.blob import encode_tensor
    qw = rng.integers(-128, 128, (16, 32, 1, 1)).astype(np.int8)
    x = h(1, 32, 1, 64)
    blob = {"@model_path/weights/q.bin": encode_tensor(qw)}
    wt = ttype("int8", qw.shape)
    body = [*CONV_PARAMS,
            f'{ttype("fp16", qw.shape)} W = constexpr_affine_dequantize()[axis = int32(0), name = string("W"), '
            f'quantized_data = {wt}(BLOBFILE(path = string("@model_path/weights/q.bin"), offset = uint64(64))), '
            'scale = fp16(0.0078125), zero_point = int8(3)];',
            f'{ttype("fp16", (1, 16, 1, 64))} y = conv(dilations = dl, groups = gr, pad = pd, pad_type = pt, '
            'strides = st, weight = W, x = x)[name = string("y")];']
    got = run(mil([("x", "fp16", x.shape)], body, ["y"]), {"x": x}, blob)["y"]
    w = (f64(qw)[:, :, 0, 0] - 3) * 0.0078125
    assert rel_err(got, np.einsum("oc,ncs->nos", w, f64(x)[:, :, 0, :])[:, :, None, :]) <= LIN


# ----------------------------------------------------------------------------- fp16 overflow


def test_fp16_overflow_gives_inf():
    x = np.array([300.0, -300.0, 2.0, 12.0], np.float16).reshape(1, 4, 1, 1)
    text = mil([("x", "fp16", x.shape)], [
        f'{ttype("fp16", x.shape)} sq = mul(x = x, y = x)[name = string("sq")];',
        f'{ttype("fp16", x.shape)} e = exp(x = x)[name = string("e")];'], ["e", "sq"])
    out = run(text, {"x": x})
    assert list(out["sq"].reshape(-1)) == [np.inf, np.inf, 4.0, 144.0]
    assert np.isinf(out["e"].reshape(-1)[[0, 3]]).all() and out["e"].reshape(-1)[1] == 0.0
    assert abs(float(out["e"].reshape(-1)[2]) - math.e ** 2) < 1e-2
