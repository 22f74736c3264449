"""Quantized weights as stored (docs/quantization.md): the int8 row quantization, W4's 4-bit blocks
(below `BlockQuant`), LUT4/LUT6's palettized rows (`LutQuant`), the HF names of each model
type's quantized linears, and the quantized folder `anelm quantize` writes, read back here.

    DIR/config.json                the source config + "quantization_config": {"quant_method":
                                   "anelm", "scheme": "w8"|"w8a8", "bits": 8, ...}, or for W4
                                   {"scheme": "w4", "bits": 4, "block_size": B, ...}, or
                                   {"scheme": "lut4"|"lut6", "bits": 4|6, "group_size": G, ...}
    DIR/tokenizer.json ...         the source's tokenizer
    DIR/model.safetensors          W4, LUT: the layouts above `BlockQuant`, `LutQuant`; W8/W8A8,
                                   per linear P (HF name: model.layers.0.self_attn.q_proj,
                                   transformer.h.0.attn.c_attn):
        P.weight            I8  [out, in]  symmetric per row, zero point 0
        P.weight_scale      F32 [out]      the weight is P.weight · P.weight_scale[:, None]
        P.input_shift       F32 []         W8: the input is divided by it before the int8 sum
        P.input_scale       F32 []         W8A8: static per-tensor scale of the int8 input
        P.input_fine_scale  F32 []         W8A8: a finer scale for the input's bulk (may be absent)
        P.outlier_channels  I64 [k]        W8A8: input channels kept out of int8 (may be absent)
        P.outlier_weight    F32 [out, k]   their weight columns (zero in P.weight)
                                   every other tensor as the source had it, float32
    DIR/quantization_report.json   what `quantize` measured

Readers get float32 weights (the int8 dequantized, the outlier columns put back) in a `QuantizedWeights`
dict, with the int8 decisions (`QuantPlan`) the kernels are built from (`anelm/kernels/int8.py`).

Rows: a weight row w is stored as q = round(w / s) with s = max|w| / 127, q in [-127, 127]:
symmetric, zero point 0, so a row's largest weight is exactly ±127 and the row scale is
recovered from the dequantized row as max|q·s| / 127. That is what lets the kernels be built
from the dequantized weights: the folds `layer_params` applies to a projection with unit norm
gains (the attention scale, the residual stream scale) multiply whole rows by one factor each,
so requantizing a folded row gives back the same q with the factor in its scale, bit for bit
(tests/quant). One rounding rule, half to even (np.round), as the MIL reference quantizes;
`maderix` rounds half away from zero, which differs only at exact ties, immaterial for weights.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ...mil.blob import pack_bits, unpack_bits
from ..errors import InputError
from ..names import FAMILY, PROJECTIONS, layer_prefix, module_name

METHOD = "anelm"
SCHEMES = ("w8", "w8a8", "w4", "lut4", "lut6")
QMAX = 127  # symmetric: -128 is never used, so negating a row never overflows

SUPPORTED = tuple(FAMILY)


def quantize_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [out, in] -> (q int8 [out, in], scale float32 [out]) with w ≈ q · scale[:, None].
    An all-zero row gets scale 1 (q = 0), so every scale is a positive number."""
    w = np.asarray(w, np.float32)
    peak = np.abs(w).max(axis=1)
    scale = np.where(peak > 0, peak / np.float32(QMAX), np.float32(1.0)).astype(np.float32)
    q = np.clip(np.round(w / scale[:, None]), -QMAX, QMAX).astype(np.int8)
    return q, scale


def dequantize_rows(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return q.astype(np.float32) * np.asarray(scale, np.float32)[:, None]


def power_of_two_above(x: float) -> float:
    """The smallest power of two >= x (>= 1): an exact factor to move between two operands."""
    return 1.0 if x <= 1.0 else float(2.0 ** math.ceil(math.log2(x)))


@dataclass(frozen=True)
class InputQuant:
    """What calibration decided for one linear input (shared by the projections that read it)."""

    shift: float = 1.0  # W8
    act_scale: float | None = None  # W8A8
    keep: np.ndarray | None = None  # W8A8 outlier channels
    fine: float | None = None  # W8A8: the bulk's scale, the input in two int8 products (kernels/qlinear.py)


def family(model_type: str) -> str:
    if model_type not in FAMILY:
        raise InputError(f"quantize supports {', '.join(SUPPORTED)} models; got model_type {model_type!r}")
    return FAMILY[model_type]


def check_supported(config) -> None:
    family(config.model_type)


def linear_names(config) -> list[str]:
    """Every int8 linear of the model, by HF module name, layer by layer: all its projections
    (`names.PROJECTIONS`; the device fuses q, k and v into one conv, `kernels/int8.plan_layer`)."""
    check_supported(config)  # an unknown model type: one InputError line, not a KeyError
    return [module_name(config.model_type, i, role) for i in range(config.num_hidden_layers)
            for role in PROJECTIONS[config.model_type]]


def quant_config(path: Path) -> dict | None:
    """The folder's quantization_config when it is one of ours, else None."""
    f = path / "config.json"
    if not (path.is_dir() and f.is_file()):
        return None
    try:
        qc = json.loads(f.read_text()).get("quantization_config")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return None
    return qc if isinstance(qc, dict) and qc.get("quant_method") == METHOD else None


def refuse_quantized(path, command: str) -> None:
    """One line for the commands that cannot take a quantized folder yet (docs/quantization.md)."""
    if path is not None and quant_config(Path(path)) is not None:
        raise InputError(f"{path} is a quantized folder (anelm quantize); {command} needs the unquantized "
                         "model it came from")


class QuantizedWeights(dict):
    """Float32 weights (dequantized) plus `.quant`, the int8 plan the device pipeline builds from."""

    quant: "QuantPlan"


@dataclass(frozen=True)
class QuantPlan:
    scheme: str
    inputs: dict[str, InputQuant]  # HF linear name -> its input's decisions
    model_type: str  # whose layer prefix the names carry
    blocks: dict[str, "BlockQuant | LutQuant"] = field(default_factory=dict)  # W4/LUT: HF linear name -> its form

    def layer(self, i: int) -> dict[str, InputQuant]:
        """Layer i's decisions by the module names inside the layer (`self_attn.q_proj`), as the
        kernels, which know a layer's parts by role and not the model type's prefix, look them up."""
        return self._in_layer(self.inputs, i)

    def layer_blocks(self, i: int) -> dict[str, "BlockQuant"]:
        """W4/LUT: layer i's 4-bit blocks or palettized rows by the module names inside the layer."""
        return self._in_layer(self.blocks, i)

    def _in_layer(self, d: dict, i: int) -> dict:
        pre = layer_prefix(self.model_type, i)
        return {k[len(pre):]: v for k, v in d.items() if k.startswith(pre)}


def pack(config, weights: dict[str, np.ndarray], qs: dict, plan: QuantPlan) -> dict[str, np.ndarray]:
    """The tensors of model.safetensors: `qs` maps each linear to its (q, scale)."""
    out = {k: np.ascontiguousarray(v, np.float32) for k, v in weights.items()}
    for name in linear_names(config):
        q, scale = qs[name]
        iq = plan.inputs[name]
        out[name + ".weight"] = q
        out[name + ".weight_scale"] = scale.astype(np.float32)
        out[name + ".input_shift"] = np.array(iq.shift, np.float32)
        for key, v in ((".input_scale", iq.act_scale), (".input_fine_scale", iq.fine)):
            if v is not None:
                out[name + key] = np.array(v, np.float32)
        if iq.keep is not None and len(iq.keep):
            out[name + ".outlier_channels"] = np.asarray(iq.keep, np.int64)
            out[name + ".outlier_weight"] = np.ascontiguousarray(weights[name + ".weight"][:, iq.keep], np.float32)
    return out


def unpack(raw: dict[str, np.ndarray], config, scheme: str, source: str) -> tuple[dict, QuantPlan]:
    """model.safetensors' tensors -> (float32 weights as an HF checkpoint holds them, QuantPlan)."""
    if scheme != "w8" and scheme != "w8a8":
        out, plan = (unpack_w4 if scheme == "w4" else unpack_lut)(raw, config, source, scheme)
        return _as_checkpoint(out, config), plan
    out = {k: v for k, v in raw.items() if not k.endswith((".weight_scale", ".input_shift", ".input_scale",
                                                         ".input_fine_scale", ".outlier_channels", ".outlier_weight"))}
    inputs = {}
    for name in linear_names(config):
        try:
            q, scale = raw[name + ".weight"], raw[name + ".weight_scale"]
        except KeyError as e:
            raise InputError(f"{source}: quantized folder lacks {e.args[0]}") from None
        if q.dtype != np.int8:
            raise InputError(f"{source}: {name}.weight is {q.dtype}; expected int8")
        w = dequantize_rows(q, scale)
        keep = raw.get(name + ".outlier_channels")
        if keep is not None:
            w[:, keep] = raw[name + ".outlier_weight"]
        out[name + ".weight"] = w
        act, fine = (raw.get(name + k) for k in (".input_scale", ".input_fine_scale"))
        inputs[name] = InputQuant(float(raw.get(name + ".input_shift", 1.0)), None if act is None else float(act),
                                  keep, None if fine is None else float(fine))
    if scheme == "w8a8" and any(iq.act_scale is None for iq in inputs.values()):
        raise InputError(f"{source}: scheme w8a8 but some linears have no input_scale")
    return _as_checkpoint(out, config), QuantPlan(scheme, inputs, config.model_type)


def _as_checkpoint(out: dict, config) -> dict:
    """The folder holds every linear [out, in], ours; the reader sanitizes from the checkpoint's
    orientation (GPT-2's Conv1D [in, out]), as for any HF folder."""
    from ..registry import architecture

    return architecture(config.model_type).unsanitize(out, config)


def scheme_of(qc: dict, source: str) -> str:
    scheme = qc.get("scheme")
    if scheme not in SCHEMES:
        raise InputError(f"{source}: quantization_config scheme {scheme!r}; expected one of {list(SCHEMES)}")
    return scheme


# --------------------------------------------------------------------------- W4: 4-bit blocks
# A W4 linear P `[out, in]` is stored in blocks of `block_size` inputs along each row, as MIL's
# constexpr_blockwise_shift_scale reads them (w = scale · (data − offset), data uint4):
#     P.weight         U8  [out, in/2]   two uint4 values a byte, the earlier one in the low
#                                        nibble (the BLOBFILE's packing, LSB first)
#     P.weight_scale   F16 [out, in/B]
#     P.weight_offset  F16 [out, in/B]   or U8 (uint4 zero points: GGUF Q4_0's 8)
# and every other 2-D float tensor whose rows divide into blocks (the embedding, an untied head)
# as int8 blocks, GGUF Q8_0's form (w = scale · data: E.weight I8 [rows, cols], E.weight_scale
# F16 [rows, cols/B]), or as P's 4-bit blocks where `quantize` made them so (quant/w4.py's tables)
# A block's offset is fp16 (its minimum on the grid, as Q4_1 stores it), 1.5 bytes a block more
# than a uint4 zero point, which puts 0 on the grid instead of the block's ends: SmolLM2-135M (Q4_1)
# requantized at 32 scores x0.999 (float32 CPU, 128 held-out tokens) with fp16 offsets, x1.364 with zero points.


@dataclass(frozen=True)
class BlockQuant:
    """One linear's 4-bit blocks `[out, in]`: w = scale · (data − offset), block by block."""

    data: np.ndarray  # uint8 [out, in]: uint4 values 0..15
    scale: np.ndarray  # float16 [out, in / block]
    offset: np.ndarray  # float16 [out, in / block], or uint8 uint4 zero points

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape

    @property
    def block(self) -> int:
        return self.data.shape[1] // self.scale.shape[1]

    def dense(self) -> np.ndarray:
        """float32 w, each element (data − offset)·scale rounded once (the product is exact in
        float64). The device's fp16 weight is its fp16 rounding when the offset is an integer."""
        rep = lambda a: np.repeat(np.asarray(a, np.float64), self.block, axis=1)  # noqa: E731
        return ((self.data - rep(self.offset)) * rep(self.scale)).astype(np.float32)

    def rows_scaled(self, factor: np.ndarray) -> "BlockQuant":
        """The same blocks with row r's scales times factor[r] (a fold that scales whole rows)."""
        scale = (self.scale.astype(np.float64) * np.asarray(factor, np.float64)[:, None]).astype(np.float16)
        return BlockQuant(self.data, scale, self.offset)

    @staticmethod
    def stack(parts: list["BlockQuant"]) -> "BlockQuant":
        """Rows of several linears one after another (q, k and v in one conv)."""
        if len(parts) == 1:
            return parts[0]
        return BlockQuant(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("data", "scale", "offset")))


def quantize_blocks(w: np.ndarray, block: int) -> BlockQuant:
    """Each block's min..max onto 16 levels (GGUF Q4_1's grid): scale = (max − min)/15 and
    offset = −min/scale, both fp16, then each weight to the nearest level of that fp16 grid."""
    w = np.asarray(w, np.float32)
    rows, cols = w.shape
    wb = w.reshape(rows, cols // block, block).astype(np.float64)
    lo, hi = wb.min(axis=2), wb.max(axis=2)
    scale = ((hi - lo) / 15).astype(np.float16)
    flat = scale == 0  # a constant block (or a range under fp16's least step): one level, its value
    scale[flat] = 1.0
    offset = (-lo / scale).astype(np.float16)
    s, o = scale.astype(np.float64)[:, :, None], offset.astype(np.float64)[:, :, None]
    q = np.clip(np.round(wb / s + o), 0, 15).astype(np.uint8)
    return BlockQuant(q.reshape(rows, cols), scale, offset)


def quantize_blocks8(w: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """int8 blocks, symmetric (GGUF Q8_0): scale = fp16(max|w| / 127), q = round(w / scale). A
    Q8_0 block read back is exactly itself: its largest |q| is 127 and its d an fp16."""
    w = np.asarray(w, np.float32)
    rows, cols = w.shape
    wb = w.reshape(rows, cols // block, block).astype(np.float64)
    scale = (np.abs(wb).max(axis=2) / QMAX).astype(np.float16)
    scale[scale == 0] = 1.0
    q = np.clip(np.round(wb / scale.astype(np.float64)[:, :, None]), -QMAX, QMAX).astype(np.int8)
    return q.reshape(rows, cols), scale


def dequantize_blocks8(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    block = q.shape[1] // scale.shape[1]
    return (q * np.repeat(scale.astype(np.float32), block, axis=1)).astype(np.float32)


def table_names(config, weights: dict[str, np.ndarray], block: int) -> list[str]:
    """The non-linear tensors W4 stores as int8 blocks: 2-D float tables (embeddings, an untied
    head) whose rows divide into blocks."""
    lin = {n + ".weight" for n in linear_names(config)}
    return [k for k, v in weights.items() if k not in lin and np.ndim(v) == 2 and v.shape[1] % block == 0]


def pack_w4(config, weights: dict[str, np.ndarray], blocks: dict[str, BlockQuant], block: int,
            tables: dict[str, BlockQuant] | None = None) -> dict:
    """The tensors of a W4 folder's model.safetensors (the layout above; `blocks` empty: its
    tables and float tensors, the linears left to the caller); `tables`: {table: its 4-bit blocks}."""
    out = {k: np.ascontiguousarray(v, np.float32) for k, v in weights.items()}
    four = {n + ".weight": blocks[n] for n in (linear_names(config) if blocks else ())} | (tables or {})
    for k in table_names(config, weights, block):
        out[k], out[k + "_scale"] = quantize_blocks8(weights[k], block)
    for k, bq in four.items():
        out[k], out[k + "_scale"], out[k + "_offset"] = pack_bits(bq.data, 4), bq.scale, bq.offset
    return out


def unpack_w4(raw: dict[str, np.ndarray], config, source: str, scheme: str = "w4") -> tuple[dict, QuantPlan]:
    out, blocks = dict(raw), {}
    for name in linear_names(config):
        try:
            packed, scale, offset = (out.pop(name + s) for s in (".weight", ".weight_scale", ".weight_offset"))
        except KeyError as e:
            raise InputError(f"{source}: W4 folder lacks {e.args[0]}") from None
        if packed.dtype != np.uint8 or scale.dtype != np.float16 or offset.dtype not in (np.float16, np.uint8) \
                or scale.shape != offset.shape or packed.shape[0] != scale.shape[0] \
                or (2 * packed.shape[1]) % scale.shape[1]:
            raise InputError(f"{source}: {name}: expected uint8 [out, in/2] 4-bit pairs, fp16 scales and "
                             f"offsets [out, in/block]; got {packed.dtype}{list(packed.shape)}, "
                             f"{scale.dtype}{list(scale.shape)}, {offset.dtype}{list(offset.shape)}")
        blocks[name] = BlockQuant(unpack_bits(packed, 4), scale, offset)
    return _dense(out, blocks, config, scheme)


def _dense(out: dict, blocks: dict, config, scheme: str) -> tuple[dict, QuantPlan]:
    """The linears' float32 weights from their forms, the int8 tables dequantized, and the plan."""
    for name, bq in blocks.items():
        out[name + ".weight"] = bq.dense()
    for k in [k for k in out if k.endswith(".weight_scale")]:  # the tables: int8 or 4-bit blocks
        w, off = k[:-len("_scale")], out.pop(k[:-len("scale")] + "offset", None)
        out[w] = dequantize_blocks8(out[w], out.pop(k)) if off is None else \
            BlockQuant(unpack_bits(out[w], 4), out.pop(k), off).dense()
    return out, QuantPlan(scheme, {n: InputQuant() for n in blocks}, config.model_type, blocks)


# --------------------------------------------------------------------------- LUT4/LUT6: palettized rows
# A LUT linear P `[out, in]` is stored as indices into one table of 2^bits fp16 values per tile of
# G rows by B inputs, as MIL's constexpr_lut_to_dense reads them (w[r, c] = lut[r//G, c//B, indices[r, c]]):
#     P.weight       U8   [out, in·bits/8]      indices packed LSB first, as the BLOBFILE packs them
#                                               (lut4: nibble pairs, the earlier low; lut6: 4 in 3 bytes)
#     P.weight_lut   F16  [out/G, in/B, 2^bits]
TABLE_BLOCK = 32  # 2-D tables (the embedding, an untied head) as W4 stores them: int8 blocks of 32


@dataclass(frozen=True)
class LutQuant:
    """One linear's palettized rows `[out, in]`: w[r, c] = lut[r // group, c // block, indices[r, c]]."""

    indices: np.ndarray  # uint8 [out, in]: 0 .. 2^bits − 1
    lut: np.ndarray  # float16 [out / group, in / block, 2^bits], each table ascending
    out_scale: np.ndarray | None = None  # float32 [out]: row factors no table could take (`rows_scaled`)

    shape, bits = property(lambda s: s.indices.shape), property(lambda s: int(s.lut.shape[2]).bit_length() - 1)
    group, block = (property(lambda s, a=a: s.shape[a] // s.lut.shape[a]) for a in (0, 1))

    def dense(self) -> np.ndarray:
        """float32 w: the table entries the indices name (without `out_scale`)."""
        (o, i), k = self.shape, self.lut.shape[2]
        tile = np.arange(o)[:, None] // self.group * self.lut.shape[1] + np.arange(i) // self.block
        return self.lut.astype(np.float32).reshape(-1)[tile * k + self.indices]

    def rows_scaled(self, factor: np.ndarray) -> "LutQuant":
        """The rows times factor: a group's table takes its rows' factor when they share one (the
        attention and stream scales: one factor a linear); other rows keep it in `out_scale`."""
        f = np.asarray(factor, np.float64).reshape(-1, self.group)
        shared = (np.abs(f - f[:, :1]) <= 1e-6 * np.abs(f[:, :1])).all(axis=1)  # one factor, read off in float32
        lut = np.where(shared[:, None, None], self.lut * f[:, :1, None], self.lut).astype(np.float16)
        rest = np.where(shared[:, None], 1.0, f).reshape(-1)
        return LutQuant(self.indices, lut, None if (rest == 1).all() else rest.astype(np.float32))

    @staticmethod
    def stack(parts: list["LutQuant"]) -> "LutQuant":
        """Rows of several linears one after another (q, k and v: their groups stay apart)."""
        return LutQuant(np.concatenate([p.indices for p in parts]), np.concatenate([p.lut for p in parts]))


def pack_lut(config, weights: dict[str, np.ndarray], luts: dict[str, LutQuant]) -> dict:
    out = pack_w4(config, weights, {}, TABLE_BLOCK)
    for name, lq in luts.items():
        out[name + ".weight"], out[name + ".weight_lut"] = pack_bits(lq.indices, lq.bits), lq.lut
    return out


def unpack_lut(raw: dict[str, np.ndarray], config, source: str, scheme: str) -> tuple[dict, QuantPlan]:
    out, luts, bits = dict(raw), {}, int(scheme[3:])
    for name in linear_names(config):
        packed, lut = out.pop(name + ".weight", None), out.pop(name + ".weight_lut", None)
        if packed is None or lut is None or packed.dtype != np.uint8 or lut.dtype != np.float16 or lut.ndim != 3 \
                or lut.shape[2] != 2 ** bits or packed.shape[0] % lut.shape[0] or (packed.shape[1] * 8) % bits \
                or (packed.shape[1] * 8 // bits) % lut.shape[1]:
            got = ", ".join(f"{getattr(a, 'dtype', 'none')}{list(getattr(a, 'shape', ()))}" for a in (packed, lut))
            raise InputError(f"{source}: {name}: expected .weight uint8 [out, in·{bits}/8] packed indices and "
                             f".weight_lut fp16 tables [out/group, in/block, {2 ** bits}]; got {got}")
        luts[name] = LutQuant(unpack_bits(packed, bits), lut)
    return _dense(out, luts, config, scheme)
