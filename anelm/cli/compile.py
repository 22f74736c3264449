"""`anelm compile`: write the kernels of a transformer layer as kernel folders for inspection.

    anelm compile --arch llama --dim 768 --heads 12 --hidden 2048 --seq 256 --out kernels/
    anelm compile --kind train --dim 768 --heads 12 --hidden 2048 --seq 256 --out kernels/

`--kind layer` (default) writes whole decoder layers with baked weights, as inference runs
them; `--kind train` writes the ten dynamic-weight training kernels (forward and dx), which
take their weights in the input's spatial columns and so compile once for every layer.
Each folder holds `model.mil`, `weights/*.bin` and `signature.json`; `anelm run-mil` runs it.
Weights are random (seeded).

`--out` gets an index, `kernels.json`, listing the kernel folders: the mark that `compile` wrote
the folder. A marked folder is replaced whole (built beside it, then renamed), so no kernel of
an earlier compile survives; a non-empty folder without the mark is refused, untouched.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from ..atomic import atomic_dir
from ..errors import AnelmError
from ..models.registry import MODEL_TYPES
from .common import positive_int

INDEX = "kernels.json"  # at the top of --out: {"written_by": "anelm compile", "kernels": [folder, ...]}


def add_args(p):
    p.add_argument("--kind", choices=["layer", "train"], default="layer",
                   help="decoder layers (inference) or the dynamic training kernels")
    p.add_argument("--arch", choices=MODEL_TYPES, default="llama",
                   help="architecture of the layers (default llama)")
    p.add_argument("--dim", type=positive_int, default=256, help="hidden size (default 256)")
    p.add_argument("--heads", type=positive_int, default=4, help="query heads (default 4)")
    p.add_argument("--kv-heads", type=positive_int, default=None, help="KV heads (default: --heads)")
    p.add_argument("--head-dim", type=positive_int, default=None, help="default: dim / heads")
    p.add_argument("--hidden", type=positive_int, default=None, help="MLP size (default: 4·dim for gpt2, 8/3·dim else)")
    p.add_argument("--seq", type=positive_int, default=64, help="sequence length (default 64)")
    p.add_argument("--layers", type=positive_int, default=1, help="how many layers (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    p.add_argument("--profile", default=None, metavar="PATH", help="chip profile the kernels must obey")
    p.add_argument("--out", default="kernels",
                   help="output folder, replaced whole if an earlier compile wrote it (default ./kernels)")


def layer_config(args):
    """The model config the flags describe, under HF's field names for every architecture
    (its `from_dict` keeps its own); its checks give the errors."""
    from ..kernels.families import family_for
    from ..models.registry import config_class

    if not family_for(args.arch).rotary and (args.kv_heads not in (None, args.heads) or args.head_dim is not None):
        raise AnelmError(f"{args.arch} has one KV head per query head and head dim = dim / heads; "
                         "drop --kv-heads/--head-dim")
    hd = args.head_dim or (args.dim // args.heads if args.dim % args.heads == 0 else None)
    if hd is None:
        raise AnelmError(f"--dim ({args.dim}) must be divisible by --heads ({args.heads}), or give --head-dim")
    if hd % 2:
        raise AnelmError(f"head dim must be even for RoPE, got {hd}")
    sizes = {"hidden_size": args.dim, "intermediate_size": args.hidden or 8 * args.dim // 3,
             "num_hidden_layers": args.layers, "num_attention_heads": args.heads,
             "num_key_value_heads": args.kv_heads or args.heads, "head_dim": hd, "rms_norm_eps": 1e-5,
             "rope_theta": 10000.0, "max_position_embeddings": max(args.seq, 2048),
             # GPT-2's names: an MLP of 4·dim unless --hidden says otherwise
             "n_embd": args.dim, "n_head": args.heads, "n_layer": args.layers, "n_inner": args.hidden,
             "n_positions": max(args.seq, 1024)}
    return config_class(args.arch).from_dict(sizes)


def graphs(args, cfg, multiple: int = 1):
    """(folder name, graph) for each kernel to write; packed training inputs are padded to
    `multiple` columns (the profile's spatial_multiple_of)."""
    if args.kind == "train":
        from dataclasses import replace

        from ..kernels.training import KINDS, Dims, build_graph

        dims = replace(Dims.from_config(cfg, args.seq), width_multiple=multiple)
        return [(kind, build_graph(kind, dims)) for kind in KINDS]
    from ..kernels.blocks import decoder_layer
    from ..models.names import random_layer

    return [(f"layer{i:02d}", decoder_layer(cfg, random_layer(cfg, args.seed + i), args.seq, index=i))
            for i in range(args.layers)]


def run(args) -> int:
    from ..compiler.pipeline import compile_graph
    from ..chip.profile import load_profile

    profile = load_profile(args.profile)
    cfg = layer_config(args)
    out = Path(args.out)
    check_replaceable(out)
    kernels = graphs(args, cfg, profile.spatial_multiple_of)
    with atomic_dir(out) as build:
        for name, graph in kernels:
            t0 = time.perf_counter()
            art = compile_graph(graph, profile)
            ms = 1e3 * (time.perf_counter() - t0)
            art.save(build / name)
            wmb = sum(len(b) for b in art.weights.values()) / 2**20
            n_ops = sum(1 for line in art.mil_text.splitlines() if "= " in line and "const()" not in line)
            print(f"{out / name}: {n_ops} ops, {len(art.weights)} weight blobs ({wmb:.2f} MiB), "
                  f"compiled in {ms:.0f} ms", file=sys.stderr)
        index = {"written_by": "anelm compile", "kernels": [name for name, _ in kernels]}
        (build / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return 0


def check_replaceable(out: Path) -> None:
    """`out` may be replaced: absent, an empty folder, or a folder an earlier compile marked."""
    if out.exists() and not out.is_dir():
        raise AnelmError(f"--out '{out}' is a file; expected a folder for the kernel folders")
    if out.is_dir() and any(out.iterdir()) and not (out / INDEX).is_file():
        raise AnelmError(f"--out '{out}' is not empty and has no {INDEX}, so anelm compile did not write it; "
                         f"expected a new or empty folder, or one an earlier compile wrote (it is replaced)")
