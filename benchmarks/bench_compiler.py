"""Compiler and emulator speed.

1. Compile time (graph IR -> passes -> MIL text + BLOBFILE blobs) for the kernels of a
   12-layer dim-768 model (the Stories110M shape: 12 heads, MLP 2048, seq 256).
2. Emulator throughput on a chain of 1x1 convs (the ANE's linear layer) and on a chain of
   matmuls, as a ratio to raw numpy float32 matmuls of the same shapes on this machine,
   in the same run.

    python benchmarks/bench_compiler.py [--layers 12] [--dim 768] [--seq 256]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from anelm.compiler.pipeline import compile_graph
from anelm.device.emulator import Emulator
from anelm.ir.builder import GraphBuilder
from anelm.kernels.blocks import decoder_layer
from anelm.models.names import random_layer
from anelm.models.config import LlamaConfig
from anelm.runtime.kernel import Kernel
from timing import best_of  # benchmarks/timing.py, beside this script


def bench_compile(layers: int, dim: int, heads: int, hidden: int, seq: int) -> None:
    cfg = LlamaConfig(hidden_size=dim, intermediate_size=hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, rms_norm_eps=1e-5, max_position_embeddings=seq)
    weights = [random_layer(cfg, seed=i) for i in range(layers)]
    t = time.perf_counter()
    arts = [compile_graph(decoder_layer(cfg, w, seq, index=i)) for i, w in enumerate(weights)]
    total = time.perf_counter() - t
    mb = sum(len(b) for a in arts for b in a.weights.values()) / 2**20
    print(f"compile: {layers} layer kernels (dim {dim}, {heads} heads, MLP {hidden}, seq {seq}): "
          f"{total * 1e3:.0f} ms total, {total * 1e3 / layers:.0f} ms per layer, {mb:.0f} MiB of blobs")


def chain_graph(kind: str, c: int, s: int, depth: int, ws: list[np.ndarray]):
    b = GraphBuilder(f"{kind}_chain")
    x = b.input("x", [1, c, 1, s])
    h = x
    if kind == "conv":
        for i, w in enumerate(ws):
            h = b.linear(h, w, name=f"l{i}")
    else:  # matmul on [1, 1, S, C] @ [1, 1, C, C]: the dynamic-weight form
        h = b.transpose(b.reshape(x, [1, 1, c, s], name="r"), [0, 1, 3, 2], name="t")
        for i, w in enumerate(ws):
            h = b.matmul(h, b.weight(f"w{i}", w.T[None, None]), name=f"m{i}")
        h = b.reshape(b.transpose(h, [0, 1, 3, 2], name="tb"), [1, c, 1, s], name="rb")
    b.output("y", h)
    return b.build()


def bench_emulator(c: int, s: int, depth: int, repeat: int = 5) -> None:
    rng = np.random.default_rng(0)
    ws = [(rng.standard_normal((c, c)) / np.sqrt(c)).astype(np.float32) for _ in range(depth)]
    x = rng.standard_normal((1, c, 1, s)).astype(np.float32)
    flops = 2 * c * c * s * depth

    def numpy_chain():
        h = x.reshape(c, s)
        for w in ws:
            h = w @ h
        return h

    t_np = best_of(numpy_chain, repeat)
    for kind in ("conv", "matmul"):
        k = Kernel(compile_graph(chain_graph(kind, c, s, depth, ws)), Emulator())
        k(x=x)  # compile and load outside the timing
        t_em = best_of(lambda: k(x=x), repeat)
        print(f"emulator {kind:6s} chain ({depth} x [{c}x{c}] on [1,{c},1,{s}]): {t_em * 1e3:7.2f} ms "
              f"({flops / t_em / 1e9:6.1f} GFLOP/s); numpy float32: {t_np * 1e3:6.2f} ms "
              f"({flops / t_np / 1e9:6.1f} GFLOP/s); ratio emulator/numpy time {t_em / t_np:.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--chain-depth", type=int, default=16)
    a = p.parse_args()
    bench_compile(a.layers, a.dim, a.heads, a.hidden, a.seq)
    bench_emulator(a.dim, a.seq, a.chain_depth)


if __name__ == "__main__":
    main()
