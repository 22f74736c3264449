"""The programs a benchmark, a training step or a decode runs, compiled on the host.

Compiling here is `compile_graph` (graph -> passes -> MIL + BLOBFILE + cost annotation); nothing
reaches a device. Weights of baked programs are random or zero: only their shapes and dtypes
matter to the cost. Every layer of a model has the same shapes, so one layer's programs stand
for all of them, and each program is compiled once per process (`compiled`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..compiler.pipeline import compile_graph
from ..ir.builder import GraphBuilder
from ..chip.cost import KernelCost

_COMPILED: dict[tuple, tuple[KernelCost, object]] = {}


def compiled(key: tuple, build: Callable[[], object], profile=None) -> tuple[KernelCost, object]:
    """(cost, artifact) of the graph `build()` returns, compiled once per key."""
    if key not in _COMPILED:
        import warnings

        with warnings.catch_warnings():  # a working set past the threshold is what we measure here
            warnings.simplefilter("ignore")
            art = compile_graph(build()) if profile is None else compile_graph(build(), profile)
        _COMPILED[key] = (KernelCost.of(art, str(key[0])), art)
    return _COMPILED[key]


# --------------------------------------------------------------------------- microbenchmarks

def conv_chain_graph(channels: int, spatial: int, depth: int, dtype: str = "fp16"):
    """`depth` 1×1 convs C×C on `[1, C, 1, S]` (maderix's peak benchmark); int8 = W8A8: int8
    weights and int8 activations between layers (quantize → dequantize, scale 1/8)."""
    b = GraphBuilder(f"conv_chain_{dtype}_{channels}x{depth}")
    x = b.input("x", [1, channels, 1, spatial])
    rng = np.random.default_rng(0)
    for i in range(depth):
        w = rng.uniform(2 ** -7, 2 ** -6, (channels, channels, 1, 1)).astype(np.float32)
        if dtype == "int8":
            q = b.quantize(x, 0.125, name=f"q{i}")
            x = b.dequantize(q, 0.125, name=f"dq{i}")
            wq = b.constexpr_affine_dequantize(np.clip(np.round(w / 2 ** -13), -128, 127).astype(np.int8),
                                               2 ** -13, 0, axis=0, name=f"w{i}")
            x = b.conv(x, wq, name=f"conv{i}")
        else:
            x = b.conv(x, w, name=f"conv{i}")
    b.output("y", x)
    return b.build()


def conv_chain(channels: int, spatial: int, depth: int, dtype: str = "fp16") -> KernelCost:
    return compiled(("conv_chain", channels, spatial, depth, dtype),
                    lambda: conv_chain_graph(channels, spatial, depth, dtype))[0]


def matmul_graph(n: int, k: int | None = None, m: int | None = None):
    """One matmul of two runtime operands `[1, 1, M, K] @ [1, 1, K, N]` (the SRAM sweep)."""
    k, m = k or n, m or n
    b = GraphBuilder(f"matmul_{m}x{k}x{n}")
    x = b.input("x", [1, 1, m, k])
    y = b.input("y", [1, 1, k, n])
    b.output("z", b.matmul(x, y, name="mm"))
    return b.build()


def matmul(n: int) -> KernelCost:
    return compiled(("matmul", n), lambda: matmul_graph(n))[0]


def vector_op_graph(op: str, rows: int, cols: int):
    """One vector op over `[1, rows, 1, cols]` (ANEForge's single-op bandwidth roofline);
    softmax and the reduction run along the last axis."""
    b = GraphBuilder(f"{op}_{rows}x{cols}")
    x = b.input("x", [1, rows, 1, cols])
    y = {"softmax": lambda: b.softmax(x, axis=-1, name="y"), "reduce_sum": lambda: b.reduce_sum(x, (-1,), name="y"),
         "gelu": lambda: b.gelu(x, name="y"), "relu": lambda: b.relu(x, name="y")}[op]()
    b.output("out", y)
    return b.build()


def vector_op(op: str, rows: int, cols: int) -> KernelCost:
    from .maderix import IN_MEMORY  # the native gelu is rejected by the strict profile

    return compiled(("vector_op", op, rows, cols), lambda: vector_op_graph(op, rows, cols), IN_MEMORY)[0]


# --------------------------------------------------------------------------- training step

@dataclass(frozen=True)
class StepKernel:
    kind: str
    cost: KernelCost
    forward: bool
    act_in_elements: int    # activation columns the host writes per evaluation
    out_elements: int       # results the host reads back per evaluation
    weight_elements: int    # weight columns restaged per update (dynamic) or baked (static)
    host_traffic: tuple[tuple[str, int], ...] = ()  # elements by how the CPU moves them, where the
                                                    # program's surfaces are not all fp16 (step_model.HOST_BYTES)


def train_kernels(dims, pipeline: str, resident_probs: bool = False) -> list[StepKernel]:
    """The kernels of one layer (anelm/kernels/training.py) for `pipeline`, compiled;
    `resident_probs`: the carried probabilities stay on the device (train/steps/attention.py),
    so the host neither reads them after sdpa_fwd nor writes them before sdpa_bwd."""
    from ..kernels.training import FORWARD, ROLES, WEIGHTLESS, build_graph, layouts, weighted_kinds

    out = []
    for kind in weighted_kinds(dims) + WEIGHTLESS:
        def build(kind=kind):
            if pipeline == "static" and kind in ROLES:
                shapes = {r: pk_w for pk in layouts(dims)[kind].values() for r, pk_w in pk.weights}
                mats = {r: np.zeros((_rows(dims, kind, r), shapes[r]), np.float32) for r in ROLES[kind]}
                return build_graph(kind, dims, mats)
            return build_graph(kind, dims)
        cost, art = compiled(("train", kind, dims, pipeline), build)
        lay = layouts(dims)[kind].values()
        acts = sum(pk.channels * len(pk.acts) * dims.s for pk in lay)
        weights = sum(pk.channels * w for pk in lay for _, w in pk.weights)
        outs = sum(int(np.prod(s.shape)) for s in art.signature.outputs)
        forward = kind in FORWARD or kind == "sdpa_fwd"
        if resident_probs and kind in WEIGHTLESS:
            probs = dims.hq * dims.s * dims.s
            acts, outs = (acts, outs - probs) if forward else (acts - probs, outs)
        out.append(StepKernel(kind, cost, forward, acts, outs, weights))
    return out


def maderix_kernels(dims, layers: int) -> list[StepKernel]:
    """maderix's ten dynamic kernels (anelm/bench/maderix.py) at these shapes, compiled."""
    from . import maderix

    shape = (dims.d, dims.f, dims.hq, dims.hkv, dims.hd, dims.s)
    out = []
    for kind in maderix.KERNELS:
        cost, _ = compiled(("maderix", kind, shape, layers), lambda kind=kind: maderix.build(kind, *shape, layers),
                           maderix.IN_MEMORY)
        acts, outs, weights = maderix.io_elements(kind, *shape)
        out.append(StepKernel(kind, cost, kind in maderix.FORWARD, acts, outs, weights))
    return out


def maderix_v1_kernels(dims) -> list[StepKernel]:
    """The nine kernels of maderix's first dynamic version (anelm/bench/maderix_v1.py), compiled;
    its weights go into the inputs at every evaluation (host_traffic), none after the update."""
    from . import maderix, maderix_v1

    shape = (dims.d, dims.f, dims.hq, dims.s)
    out = []
    for kind in maderix_v1.KERNELS:
        cost, _ = compiled(("maderix_v1", kind, shape), lambda kind=kind: maderix_v1.build(kind, *shape),
                           maderix.IN_MEMORY)
        traffic = tuple(sorted(maderix_v1.host_traffic(kind, *shape).items()))
        out.append(StepKernel(kind, cost, kind in maderix_v1.FORWARD, 0, 0, 0, traffic))
    return out


def static_reference_kernels(dims) -> list[StepKernel]:
    """The six baked programs of maderix's static pipeline and Orion (anelm/bench/maderix_static.py)."""
    from . import maderix, maderix_static

    shape = (dims.d, dims.f, dims.hq, dims.s)
    out = []
    for kind in maderix_static.KERNELS:
        cost, _ = compiled(("maderix_static", kind, shape), lambda kind=kind: maderix_static.build(kind, *shape),
                           maderix.IN_MEMORY)
        acts, outs = maderix_static.io_elements(kind, *shape)
        out.append(StepKernel(kind, cost, kind in maderix_static.FORWARD, acts, outs,
                              int(kind in maderix_static.WEIGHTED)))
    return out


def _rows(dims, kind: str, role: str) -> int:
    from ..kernels.training import layouts

    for pk in layouts(dims)[kind].values():
        if any(r == role for r, _ in pk.weights):
            return pk.channels
    raise KeyError(role)


# --------------------------------------------------------------------------- generation

def decode_program(config, tier: int) -> KernelCost:
    """One layer's decode program over a cache tier (anelm/kernels/decode.py), the token padded
    to the 16-column spatial multiple of the strict profile
    (docs/chip-profiles.md), as the chip runs it."""
    from ..chip.profile import STRICT
    from ..models.names import random_layer
    from ..kernels.decode import decode_layer
    from ..kernels.layers import layer_params, layer_shape

    def build():
        s = layer_shape(config)
        return decode_layer(s, layer_params(s, random_layer(config)), tier, s.family.rotary,
                            columns=STRICT.spatial_multiple_of)
    return compiled(("decode", _config_key(config), tier), build)[0]


def prefill_program(config, bucket: int) -> KernelCost:
    """One layer's prefill program for a bucket (anelm/kernels/blocks.py decoder_layer)."""
    from ..kernels.blocks import decoder_layer
    from ..models.names import random_layer

    return compiled(("prefill", _config_key(config), bucket),
                    lambda: decoder_layer(config, random_layer(config), bucket))[0]


def orion_decode_programs(d: int = 768, hidden: int = 3072, columns: int = 16) -> list[KernelCost]:
    """Orion's two decode programs per GPT-2 layer (mechramc/Orion compiler/frontends/): LN1 +
    q/k/v projections, and LN2 + MLP + residual, fp32 I/O on `[1, D, 1, 16]`; attention and Wo run
    on its CPU."""
    rng = np.random.default_rng(0)

    def lin(o, i):
        return rng.standard_normal((o, i)).astype(np.float32) / np.sqrt(i)

    def proj():
        b = GraphBuilder("orion_decode_proj")
        x = b.cast(b.input("x", [1, d, 1, columns], "fp32"), "fp16", name="x16")
        h = b.layer_norm_decomposed(x, np.ones(d, np.float32), np.zeros(d, np.float32), name="ln1")
        for n in ("k32", "q32", "v32"):
            b.output(n, b.cast(b.linear(h, lin(d, d), np.zeros(d, np.float32), name=n[0]), "fp32", name=n))
        return b.build()

    def ffn():
        b = GraphBuilder("orion_decode_ffn")
        x = b.cast(b.input("x", [1, d, 1, columns], "fp32"), "fp16", name="x16")
        h = b.layer_norm_decomposed(x, np.ones(d, np.float32), np.zeros(d, np.float32), name="ln2")
        h = b.gelu_tanh(b.linear(h, lin(hidden, d), np.zeros(hidden, np.float32), name="fc"))
        y = b.add(x, b.linear(h, lin(d, hidden), np.zeros(d, np.float32), name="proj"), name="resid")
        b.output("hidden", b.cast(y, "fp32", name="hidden"))
        return b.build()

    return [compiled(("orion_decode_proj", d, columns), proj)[0],
            compiled(("orion_decode_ffn", d, hidden, columns), ffn)[0]]


def _config_key(config) -> tuple:
    return tuple(sorted((k, str(v)) for k, v in config.to_dict().items()))
