"""`anelm demo`: compile a small Llama layer, run it on the best device, check it against the CPU.

It prints what ran where: the device chosen, the compiled program, the time per evaluation,
and the error against the float32 numpy forward of the same layer.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from .common import add_device_args, device_from_args, positive_int

TOLERANCE = 2e-2  # a transformer block's tolerance (docs/testing.md)


def add_args(p):
    p.add_argument("--dim", type=positive_int, default=256, help="hidden size of the layer (default 256)")
    p.add_argument("--heads", type=positive_int, default=8, help="query heads (default 8)")
    p.add_argument("--kv-heads", type=positive_int, default=4, help="KV heads, dividing --heads (default 4)")
    p.add_argument("--seq", type=positive_int, default=64, help="sequence length (default 64)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and input (default 0)")
    add_device_args(p)


def cpu_reference(cfg, layer_w: dict, x: np.ndarray) -> np.ndarray:
    """The same layer through the numpy model path: x [S, D] -> [S, D]."""
    from ..models import llama
    from ..models.base import init_weights
    from ..models.names import layer_prefix

    full = init_weights(llama.expected_shapes(cfg), seed=0)
    full.update({layer_prefix("llama", 0) + k: v for k, v in layer_w.items()})
    model = llama.build(cfg, full)
    pos = np.arange(x.shape[0])
    return model.block(0, x, model.positions(pos), model.new_cache())


def run(args) -> int:
    from ..compiler.pipeline import compile_graph
    from ..kernels.blocks import decoder_layer
    from ..models.names import random_layer
    from ..models.config import LlamaConfig
    from ..runtime.kernel import Kernel

    d, s = args.dim, args.seq
    cfg = LlamaConfig(vocab_size=256, hidden_size=d, intermediate_size=8 * d // 3, num_hidden_layers=1,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                      rms_norm_eps=1e-5, max_position_embeddings=s)
    w = random_layer(cfg, seed=args.seed)
    device, profile = device_from_args(args)
    t0 = time.perf_counter()
    art = compile_graph(decoder_layer(cfg, w, s), profile)
    kernel = Kernel(art, device)
    x = np.random.default_rng(args.seed).standard_normal((s, d)).astype(np.float32)
    y = kernel(x=x.T.reshape(1, d, 1, s))["y"]  # first call compiles and loads on the device
    compile_ms = 1e3 * (time.perf_counter() - t0)
    t1 = time.perf_counter()
    y = kernel(x=x.T.reshape(1, d, 1, s))["y"]
    eval_ms = 1e3 * (time.perf_counter() - t1)
    ref = cpu_reference(cfg, w, x)
    err = float(np.abs(y.astype(np.float32).reshape(d, s).T - ref).max() / np.abs(ref).max())
    n_ops = sum(1 for line in art.mil_text.splitlines() if " = " in line and "const()" not in line)
    say = lambda m: print(m, file=sys.stderr)  # noqa: E731
    say(f"layer: Llama, dim {d}, {cfg.num_attention_heads} heads / {cfg.num_key_value_heads} KV, seq {s}, "
        f"{n_ops} MIL ops, {len(art.weights)} weight blobs")
    say(f"compile + load on {device.name}: {compile_ms:.0f} ms; one evaluation: {eval_ms:.1f} ms")
    say(f"max error vs float32 CPU reference: {err:.2e} (tolerance {TOLERANCE:.0e}): "
        f"{'ok' if err <= TOLERANCE else 'MISMATCH'}")
    print(f"ran on {device.name}: y {list(y.shape)} {y.dtype}, error {err:.2e}")
    return 0 if err <= TOLERANCE else 1
