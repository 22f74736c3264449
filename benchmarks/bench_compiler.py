"""Compiler and emulator speed.

1. Cold compile time for the kernels of a 12-layer dim-768 model (the Stories110M shape: 12
   heads, MLP 2048, seq 256), stage by stage: building the graph from float32 weights, the
   passes, MIL text + BLOBFILE blobs, the emulator's parse, and its plan; best of 3 rounds.
   Each stage is timed by the wall clock and by this process's CPU time (on a shared machine
   the wall time includes other jobs). Then the same programs through `Emulator.compile` with
   the kernel cache cold and warm (the content key's hash of every blob included). The floor
   under the graph stage is printed too: the layers' matrices cast to fp16 once (their blobs'
   bytes), into fresh memory (as a compile takes it) and into memory already touched.
2. Emulator throughput on a chain of 1x1 convs (the ANE's linear layer) and on a chain of
   matmuls, as a ratio to raw numpy float32 matmuls of the same shapes on this machine,
   in the same run.

    python benchmarks/bench_compiler.py [--layers 12] [--dim 768] [--seq 256]
"""

from __future__ import annotations

import argparse
import mmap
import os
import tempfile
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


def bench_compile(layers: int, dim: int, heads: int, hidden: int, seq: int, rounds: int = 3) -> None:
    from anelm.chip.profile import STRICT
    from anelm.compiler.pipeline import run_pipeline
    from anelm.compiler.codegen import emit
    from anelm.device.emulator.builder import build_plan
    from anelm.mil.parser import parse
    from anelm.mil.text import print_program

    cfg = LlamaConfig(hidden_size=dim, intermediate_size=hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, rms_norm_eps=1e-5, max_position_embeddings=seq)
    weights = [random_layer(cfg, seed=i) for i in range(layers)]

    def clocks() -> np.ndarray:
        return np.array([time.perf_counter(), time.process_time()])

    def one_round() -> dict[str, np.ndarray]:
        """Seconds per stage, (wall, CPU): on a shared machine the wall time includes others' jobs."""
        t = {k: np.zeros(2) for k in ("graph", "passes", "MIL text + blobs", "parse", "plan")}
        for i, w in enumerate(weights):
            t0 = clocks()
            g = decoder_layer(cfg, w, seq, index=i)
            t1 = clocks()
            g = run_pipeline(g, STRICT)
            t2 = clocks()
            program, blobs = emit(g)
            text = print_program(program)
            t3 = clocks()
            func = parse(text).main
            t4 = clocks()
            build_plan(func, blobs, STRICT)
            t5 = clocks()
            for k, a, b in zip(t, (t0, t1, t2, t3, t4), (t1, t2, t3, t4, t5)):
                t[k] += b - a
        return t

    one_round()  # imports and numba's compiled loops outside the timing
    best = {}
    for _ in range(rounds):
        for k, v in one_round().items():
            best[k] = np.minimum(best.get(k, v), v)
    print(f"cold compile of {layers} layer kernels (dim {dim}, {heads} heads, MLP {hidden}, seq {seq}), "
          f"best of {rounds} rounds per stage (wall time, CPU time of this process):")
    for k, v in {**best, "total": sum(best.values())}.items():
        print(f"  {k:18s} {v[0] * 1e3:7.0f} ms  {v[1] * 1e3:7.0f} ms CPU")
    arts = [compile_graph(decoder_layer(cfg, w, seq, index=i)) for i, w in enumerate(weights)]
    mb = sum(len(b) for a in arts for b in a.weights.values()) / 2**20
    print(f"  ({mb:.0f} MiB of blobs)")
    bench_floor(weights, rounds)
    bench_kernel_cache(arts)


def bench_floor(weights: list[dict[str, np.ndarray]], rounds: int) -> None:
    """What the graph stage cannot go under here: every float32 matrix of the layers cast to fp16
    once (`to_half`, at memory speed), into fresh pages (an anonymous mmap each, so malloc cannot
    hand back pages touched before) and into buffers already touched; best of `rounds`."""
    from anelm.fp16.bits import to_half

    mats = [a for w in weights for a in w.values() if a.ndim == 2]
    reused = [np.empty(a.shape, np.float16) for a in mats]

    def fresh() -> None:
        for a in mats:
            with mmap.mmap(-1, a.size * 2) as m:
                out = np.frombuffer(m, np.float16).reshape(a.shape)
                to_half(a, out=out)
                del out  # the map closes only once no array points into it

    def touched() -> None:
        for a, out in zip(mats, reused):
            to_half(a, out=out)

    touched()  # the buffers' pages are touched once before the timing
    mib = sum(a.size for a in mats) * 2 / 2**20
    for label, fn in (("fresh memory", fresh), ("memory touched before", touched)):
        best = np.full(2, np.inf)
        for _ in range(rounds):
            t = np.array([time.perf_counter(), time.process_time()])
            fn()
            best = np.minimum(best, np.array([time.perf_counter(), time.process_time()]) - t)
        print(f"  floor: {mib:.0f} MiB of fp16 from float32, {label}: {best[0] * 1e3:.0f} ms, "
              f"{best[1] * 1e3:.0f} ms CPU")


def bench_kernel_cache(arts) -> None:
    """Emulator.compile of the same programs: cache off, a cold cache, then a warm one."""
    from anelm.chip.profile import STRICT

    try:
        from anelm.compiler.artifact import content_key
    except ImportError:  # a tree from before the kernel cache
        return
    os.environ["ANELM_CACHE_DIR"] = tempfile.mkdtemp(prefix="anelm-bench-cache-")
    for label, mb in (("kernel cache off", "0"), ("kernel cache cold", None), ("kernel cache warm", None)):
        if mb is None:
            os.environ.pop("ANELM_KERNEL_CACHE_MB", None)
        else:
            os.environ["ANELM_KERNEL_CACHE_MB"] = mb
        dev = Emulator(STRICT.replace(compile_budget=10**9))
        t = time.perf_counter()
        for a in arts:  # as a new process sees them: the key is hashed once per artifact
            dev.compile(a.mil_text, a.weights, key=content_key(a.mil_text, a.weights, dev.profile))
        print(f"Emulator.compile x{len(arts)}, {label} (content key included): "
              f"{(time.perf_counter() - t) * 1e3:.0f} ms")


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
