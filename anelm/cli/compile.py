"""`anelm compile`: write the kernels of a transformer layer as kernel folders for inspection.

    anelm compile --arch llama --dim 768 --heads 12 --hidden 2048 --seq 256 --out kernels/
    anelm compile --kind train --dim 768 --heads 12 --hidden 2048 --seq 256 --out kernels/

`--kind layer` (default) writes whole decoder layers with baked weights, as inference runs
them; `--kind train` writes the ten dynamic-weight training kernels (forward and dx), which
take their weights in the input's spatial columns and so compile once for every layer.
Each folder holds `model.mil`, `weights/*.bin` and `signature.json`; `anelm run-mil` runs it.
Weights are random (seeded) unless `--model` names an HF folder to take layer weights from.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import SimpleNamespace

from ..errors import AnelmError
from .common import positive_int


def add_args(p):
    p.add_argument("--kind", choices=["layer", "train"], default="layer",
                   help="decoder layers (inference) or the dynamic training kernels")
    p.add_argument("--arch", choices=["llama", "qwen3", "gpt2"], default="llama")
    p.add_argument("--dim", type=positive_int, default=256, help="hidden size (default 256)")
    p.add_argument("--heads", type=positive_int, default=4, help="query heads (default 4)")
    p.add_argument("--kv-heads", type=positive_int, default=None, help="KV heads (default: --heads)")
    p.add_argument("--head-dim", type=positive_int, default=None, help="default: dim / heads")
    p.add_argument("--hidden", type=positive_int, default=None, help="MLP size (default: 4·dim for gpt2, 8/3·dim else)")
    p.add_argument("--seq", type=positive_int, default=64, help="sequence length (default 64)")
    p.add_argument("--layers", type=positive_int, default=1, help="how many layers (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", default=None, metavar="PATH", help="chip profile the kernels must obey")
    p.add_argument("--out", default="kernels", help="output folder (default ./kernels)")


def layer_config(args) -> SimpleNamespace:
    kv = args.kv_heads or args.heads
    hd = args.head_dim or args.dim // args.heads
    if args.heads % kv:
        raise AnelmError(f"--heads ({args.heads}) must be a multiple of --kv-heads ({kv})")
    if args.head_dim is None and args.dim % args.heads:
        raise AnelmError(f"--dim ({args.dim}) must be divisible by --heads ({args.heads}), or give --head-dim")
    if hd % 2:
        raise AnelmError(f"head dim must be even for RoPE, got {hd}")
    hidden = args.hidden or (4 * args.dim if args.arch == "gpt2" else 8 * args.dim // 3)
    return SimpleNamespace(hidden_size=args.dim, num_attention_heads=args.heads, num_key_value_heads=kv,
                           head_dim=hd, intermediate_size=hidden, rms_norm_eps=1e-5, rope_theta=10000.0,
                           n_embd=args.dim, n_head=args.heads, layer_norm_epsilon=1e-5)


def layer_graph(arch: str, cfg, seed: int, seq: int):
    from ..kernels.blocks import gpt2_block, llama_block, random_gpt2_layer, random_llama_layer

    if arch == "gpt2":
        return gpt2_block(cfg, random_gpt2_layer(cfg.hidden_size, cfg.intermediate_size, seed), seq)
    w = random_llama_layer(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                           cfg.intermediate_size, cfg.head_dim, qk_norm=arch == "qwen3", seed=seed)
    return llama_block(cfg, w, seq)


def graphs(args, cfg):
    """(folder name, graph) for each kernel to write."""
    if args.kind == "train":
        if args.arch == "gpt2":
            raise AnelmError("--kind train supports the Llama family (llama, qwen3), not gpt2")
        from ..train.kernels import KINDS, Dims, build_graph

        dims = Dims(cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                    cfg.num_key_value_heads, cfg.head_dim, args.seq)
        return [(kind, build_graph(kind, dims)) for kind in KINDS]
    return [(f"layer{i:02d}", layer_graph(args.arch, cfg, args.seed + i, args.seq)) for i in range(args.layers)]


def run(args) -> int:
    from ..compiler.pipeline import compile_graph
    from ..device.profile import load_profile

    profile = load_profile(args.profile)
    cfg = layer_config(args)
    out = Path(args.out)
    for name, graph in graphs(args, cfg):
        t0 = time.perf_counter()
        art = compile_graph(graph, profile)
        ms = 1e3 * (time.perf_counter() - t0)
        folder = out / name
        art.save(folder)
        wmb = sum(len(b) for b in art.weights.values()) / 2**20
        n_ops = sum(1 for line in art.mil_text.splitlines() if "= " in line and "const()" not in line)
        print(f"{folder}: {n_ops} ops, {len(art.weights)} weight blobs ({wmb:.2f} MiB), "
              f"compiled in {ms:.0f} ms", file=sys.stderr)
    return 0
