"""Gemma 3 270M's vocabulary head for one decode token: the CPU's fp16 matvec or device tiles.

The head is Gemma 3's tied embedding, 262,144 × 640 (168M of the model's 270M parameters,
335 MB as fp16). Its input is real: the final-normed hidden states of the first --tokens
tokens of ../shared/data/text/apache-2.0.txt, run through the CPU reference (`build_model`).
Per token, in turns, best of --repeat rounds (one thread for numpy's BLAS, as bench_generate):

(a) cpu: what the runner does today (`DeviceRunner._logits`): `HalfMatrix(head).times(h)`,
    the fp16 patterns widened as they stream past and summed in float32 (`matvec_fp16`);
(b) device, N tiles: the head split into N vocabulary tiles of 262,144 / N rows, each a 1x1
    conv program `[1, 640, 1, 16] -> [1, V/N, 1, 16]` (`GraphBuilder.linear`, `compile_graph`
    for strict), run by `Kernel(..., float32_outputs=True, read_columns=1)` on
    `Emulator(STRICT)` with the token in column 0 of the 16 (strict's spatial multiple), as the
    runner's decode layers run; logits are the tiles' column 0, joined.

strict allows 115 cold compiles per process (the tile counts together must fit; programs found
in the emulator's kernel cache cost none) and at most 65,536 output channels a conv (so N >= 4),
and its conv accumulator turns |sum| >= 32768 into inf: the logits' largest magnitude is
printed beside that limit, with the device logits' error against the CPU's and whether their
argmax agrees. Each device configuration's compile is timed apart (cold or warm, by how many
compiles it charged), not in the per-token figure.

The cost model (`anelm.bench`) gives each tile program's time on --chip (default m4) from its
cost annotation (`eval_time`: dispatch + max(compute, memory)), plus the host's fp16 I/O
conversion per program as `bench.gen_model` charges decode programs; and the CPU head by
`gen_model`'s rule (the larger of its arithmetic and its reads), for the fp32 head the model
assumes and for the fp16 head the runner holds.

    python benchmarks/bench_head.py [--tiles 4,16,64] [--tokens 8] [--repeat 5] [--chip m4]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "text" / "apache-2.0.txt"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiles", default="4,16,64", help="device tile counts to compare (default 4,16,64)")
    p.add_argument("--tokens", type=int, default=8, help="hidden states (tokens) per round (default 8)")
    p.add_argument("--repeat", type=int, default=5, help="rounds per side; the best is kept (default 5)")
    p.add_argument("--threads", type=int, default=1, help="numpy BLAS threads (default 1)")
    p.add_argument("--chip", default="m4", help="the cost model's chip (default m4)")
    return p.parse_args()


def hidden_states(path: Path, n: int):
    """(head weight float32 [V, D], final-normed hidden states float32 [n, D], CPU float32
    logits [n, V]) of the first n tokens of the text, through Gemma 3's CPU reference."""
    import numpy as np

    from anelm.models.loading import build_model, load_model

    config, weights, tok = load_model(path)
    cpu = build_model(config, weights)
    ids = np.array(tok.encode(TEXT.read_text(encoding="utf-8"))[:n])
    pos, cache = np.arange(len(ids)), cpu.new_cache()
    ctx, x = cpu.positions(pos), cpu.embed(ids, pos)
    for i in range(config.num_hidden_layers):
        x = cpu.block(i, x, ctx, cache)
    h = cpu.final_norm(x).astype(np.float32)
    head = cpu.weights[cpu.head_name]
    return head, h, h @ head.T


def tile_graph(w, index: int, columns: int):
    from anelm.ir.builder import GraphBuilder

    b = GraphBuilder(f"head_tile{index}")
    x = b.input("x", [1, w.shape[1], 1, columns])
    b.output("y", b.linear(x, w, name="head"))
    return b.build()


class DeviceHead:
    """The head as `n` tile programs on the emulator, the token in column 0."""

    def __init__(self, head, n: int, device):
        import numpy as np

        from anelm.compiler.pipeline import compile_graph
        from anelm.device.base import compile_count
        from anelm.runtime.kernel import Kernel

        rows = head.shape[0] // n
        assert rows * n == head.shape[0], f"{n} tiles do not divide the vocabulary {head.shape[0]}"
        self.columns = device.profile.spatial_multiple_of
        self.kernels, self.artifacts = [], []
        t, before = time.perf_counter(), compile_count()
        with warnings.catch_warnings():  # every tile is past the working-set threshold: expected here
            warnings.simplefilter("ignore")
            for i in range(n):
                w = head[i * rows:(i + 1) * rows].astype(np.float16)
                art = compile_graph(tile_graph(w, i, self.columns), device.profile)
                self.artifacts.append(art)
                self.kernels.append(Kernel(art, device, float32_outputs=True, read_columns=1))
            self.x = np.zeros((1, head.shape[1], 1, self.columns), np.float32)
            self(np.zeros(head.shape[1], np.float32))  # the programs' plans are made at their first run
        self.build_s, self.compiles = time.perf_counter() - t, compile_count() - before
        self.n, self.rows = n, rows

    def __call__(self, h):
        import numpy as np

        self.x[0, :, 0, 0] = h
        return np.concatenate([k.run({"x": self.x})["y"][0, :, 0, 0] for k in self.kernels])

    def close(self) -> None:
        for k in self.kernels:
            k.close()


def per_token(fn, hs) -> float:
    """Seconds per token of fn over the rows of hs (one call each)."""
    t = time.perf_counter()
    for h in hs:
        fn(h)
    return (time.perf_counter() - t) / len(hs)


def predicted(dev: DeviceHead, vocab: int, d: int, chip) -> dict:
    """The cost model's seconds per token on `chip`: the tiles, and the CPU head (fp32, fp16)."""
    from anelm.chip.cost import KernelCost, eval_time
    from anelm.bench.step_model import IO_BYTES

    tiles = [KernelCost.of(a) for a in dev.artifacts]
    times = [eval_time(k, chip) for k in tiles]
    io = sum(k.io_bytes / 2 * IO_BYTES / chip.cpu_vector_bytes_per_s for k in tiles)  # gen_model._io_s
    cpu = {b: max(2 * vocab * d / chip.cpu_sgemm_flops, b * vocab * d / chip.cpu_dram_bytes_per_s) for b in (4, 2)}
    return {"device_s": sum(t.total_s for t in times) + io, "dispatch_s": sum(t.dispatch_s for t in times),
            "memory_s": sum(t.memory_s for t in times), "io_s": io, "bound": times[0].bound,
            "working_set_mb": tiles[0].working_set_bytes / 1e6, "cpu_fp32_s": cpu[4], "cpu_fp16_s": cpu[2]}


def main() -> int:
    args = parse_args()
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)  # before numpy loads
    import numpy as np

    from anelm.chip.catalog import get_chip
    from anelm.chip.profile import STRICT
    from anelm.device.base import compile_count
    from anelm.device.emulator import Emulator
    from anelm.device.emulator.matvec import HalfMatrix
    from gemma3 import gemma3_gguf  # benchmarks/gemma3.py

    tiles = [int(n) for n in args.tiles.split(",")]
    if sum(tiles) > STRICT.compile_budget - compile_count():
        raise SystemExit(f"--tiles {args.tiles}: {sum(tiles)} programs, over strict's budget of "
                         f"{STRICT.compile_budget} compiles per process (run the rest in another process)")
    path = gemma3_gguf()
    t = time.perf_counter()
    head, hs, ref = hidden_states(path, args.tokens)
    vocab, d = head.shape
    print(f"Gemma 3 270M head: {vocab} x {d} (tied embedding), {vocab * d * 2 / 1e6:.0f} MB as fp16; "
          f"{len(hs)} real hidden states ({time.perf_counter() - t:.1f} s to load and run the CPU reference); "
          f"{args.threads} thread(s); best of {args.repeat} rounds, sides in turns")
    print(f"largest |logit| {np.abs(ref).max():.1f} (strict's accumulator limit: 32768)")
    cpu_head = HalfMatrix(head)
    sides = {"cpu": lambda h: cpu_head.times(h[None])[0]}
    dev = Emulator(STRICT)
    heads = {}
    for n in tiles:
        heads[n] = DeviceHead(head, n, dev)
        sides[f"device {n}"] = heads[n]
    del head  # the tiles hold their own fp16 copies; the CPU head its patterns
    for name, fn in sides.items():  # the logits each side gives, against the float32 product
        got = np.stack([fn(h) for h in hs])
        err = np.abs(got - ref).max()
        agree = int((got.argmax(1) == ref.argmax(1)).sum())
        print(f"{name:>10}: max |logit - float32 logit| {err:.4f}, argmax as float32's for {agree}/{len(hs)} tokens")
    best = {name: float("inf") for name in sides}
    for _ in range(args.repeat):
        for name, fn in sides.items():
            best[name] = min(best[name], per_token(fn, hs))
    chip = get_chip(args.chip)
    cpu_s = best["cpu"]
    print()
    print(f"| head for one token | measured here (ms) | vs cpu | tile rows | tile fp16 MB | compile "
          f"| predicted on {chip.key} (ms) |")
    print("|---|---|---|---|---|---|---|")
    first = None
    for n in tiles:
        p = predicted(heads[n], vocab, d, chip)
        first = first or p
        h = heads[n]
        kind = "cold" if h.compiles else "warm (kernel cache)"
        print(f"| device, {n} tiles | {best[f'device {n}'] * 1e3:.1f} | {best[f'device {n}'] / cpu_s:.2f}x cpu's time "
              f"| {h.rows} | {h.rows * d * 2 / 1e6:.1f} | {h.build_s:.1f} s, {h.compiles} compiles ({kind}) "
              f"| {p['device_s'] * 1e3:.2f} ({p['bound']}-bound; dispatch {p['dispatch_s'] * 1e3:.2f}, "
              f"memory {p['memory_s'] * 1e3:.2f}, host I/O {p['io_s'] * 1e3:.2f}) |")
    print(f"| cpu, fp16 matvec (HalfMatrix.times) | {cpu_s * 1e3:.1f} | 1.00x | | {vocab * d * 2 / 1e6:.0f} | none "
          f"| {first['cpu_fp16_s'] * 1e3:.2f} (fp16 reads; the model's own rule assumes fp32: "
          f"{first['cpu_fp32_s'] * 1e3:.2f}) |")
    fastest = min(best, key=best.get)
    print(f"\nfastest here: {fastest}, {best[fastest] * 1e3:.1f} ms a token; "
          + ", ".join(f"{name} {best[name] / cpu_s:.2f}x cpu's time" for name in best if name != "cpu"))
    for h in heads.values():
        h.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
