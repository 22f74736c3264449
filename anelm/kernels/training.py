"""The device half of a training step: ten kernel graphs shared by every layer.

Per layer (issue 4; the split of maderix-ane-facts §5.1, with HF semantics and RoPE on the CPU):

    forward   qkv        xn                  -> q, k, v        (linear, weights Wqᵀ Wkᵀ Wvᵀ)
              sdpa_fwd   qr, kr, v           -> attn           (causal attention, no weights)
              wo         attn                -> o              (Woᵀ)
              ffn_up     x2n                 -> gate, h1, h3   (W1ᵀ W3ᵀ, gate = silu(h1)·h3)
              ffn_down   gate                -> f              (W2ᵀ)
    backward  ffn_down_dx dy                 -> dgate          (W2)
              ffn_up_dx  dh1, dh3            -> dx             (W1, W3: W1ᵀdh1 + W3ᵀdh3)
              wo_dx      dx2                 -> dattn          (Wo)
              sdpa_bwd   qr, kr, v, dattn    -> dq, dk, dv     (recomputes the probabilities)
              qkv_dx     dq, dk, dv          -> dx             (Wq, Wk, Wv)

A *layout* says what each kernel input carries along its spatial axis: activation blocks of S
columns, then (dynamic pipeline only) weight blocks, each a matrix M `[C, OC]` whose row c sits
in row c of the input. Every block of one input shares its channel count C, which is what
groups the weights (maderix-ane-facts §4): forward kernels stage M = Wᵀ (`[in, out]`), the
dx kernels M = W (`[out, in]`). A projection is y = Mᵀ·x, on the device either
`matmul(M, x, transpose_x)` on slices of the input (dynamic: weights are data, one compile
serves every layer and every update) or a 1×1 conv with Mᵀ baked as a BLOBFILE const (static).
The static graphs keep the same activation packing, so both pipelines run the same way.

Inputs and outputs are declared in alphabetical order, so the `strict` binding order (§2.2)
needs no renaming and the names below are the MIL names.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..chip.profile import padded_width
from ..compiler.passes.cost import graph_flops  # noqa: F401  (re-exported: the kernels' flop count)
from ..errors import ShapeError
from ..ir.builder import GraphBuilder
from ..ir.graph import Graph, Value
from ..models.names import weight_name
from . import training_attn

# weight role of the kernels -> the layer part it is (anelm.models.names)
LAYER_ROLE = {"wq": "q", "wk": "k", "wv": "v", "wo": "o", "w1": "gate", "w3": "up", "w2": "down"}
FORWARD = ("qkv", "wo", "ffn_up", "ffn_down")            # stage Wᵀ
BACKWARD = ("ffn_down_dx", "ffn_up_dx", "wo_dx", "qkv_dx")  # stage W
WEIGHTED = FORWARD + BACKWARD
WEIGHTLESS = ("sdpa_fwd", "sdpa_bwd")
KINDS = WEIGHTED + WEIGHTLESS
# the weight blocks of each kernel's layout (below), without their sizes
ROLES = {"qkv": ("wq", "wk", "wv"), "wo": ("wo",), "ffn_up": ("w1", "w3"), "ffn_down": ("w2",),
         "ffn_down_dx": ("w2",), "ffn_up_dx": ("w1", "w3"), "wo_dx": ("wo",), "qkv_dx": ("wk", "wv", "wq")}


@dataclass(frozen=True)
class Dims:
    """The sizes every kernel is built from; S is one sequence (kernels run per sequence)."""

    d: int      # hidden size
    f: int      # MLP hidden size
    hq: int     # query heads
    hkv: int    # key/value heads
    hd: int     # head dim
    s: int      # tokens per sequence
    # every packed input's width rounds up to this (the profile's spatial_multiple_of, §2.10):
    # the extra columns come after every block, and no kernel reads them
    width_multiple: int = 1

    @property
    def q(self) -> int:
        return self.hq * self.hd

    @property
    def kv(self) -> int:
        return self.hkv * self.hd

    @classmethod
    def from_config(cls, cfg, seq_len: int) -> "Dims":
        return cls(cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                   cfg.num_key_value_heads, cfg.head_dim, int(seq_len))


@dataclass(frozen=True)
class Packed:
    """One kernel input `[1, C, 1, n·S + Σ widths]`: activations, then weight blocks."""

    channels: int
    acts: tuple[str, ...]
    weights: tuple[tuple[str, int], ...] = ()   # (role, columns OC) in column order

    def width(self, s: int, dynamic: bool, multiple: int = 1) -> int:
        return padded_width(len(self.acts) * s + (sum(w for _, w in self.weights) if dynamic else 0), multiple)

    def columns(self, s: int) -> dict[str, slice]:
        """Where each activation and weight block lives along the spatial axis."""
        at = {a: slice(j * s, (j + 1) * s) for j, a in enumerate(self.acts)}
        col = len(self.acts) * s
        for role, w in self.weights:
            at[role] = slice(col, col + w)
            col += w
        return at


def layouts(m: Dims) -> dict[str, dict[str, Packed]]:
    """Every kernel's inputs by MIL name (alphabetical, as they bind)."""
    D, F, Q, KV = m.d, m.f, m.q, m.kv
    return {
        "qkv": {"x": Packed(D, ("xn",), (("wq", Q), ("wk", KV), ("wv", KV)))},
        "wo": {"x": Packed(Q, ("attn",), (("wo", D),))},
        "ffn_up": {"x": Packed(D, ("x2n",), (("w1", F), ("w3", F)))},
        "ffn_down": {"x": Packed(F, ("gate",), (("w2", D),))},
        "ffn_down_dx": {"x": Packed(D, ("dy",), (("w2", F),))},
        "ffn_up_dx": {"x": Packed(F, ("dh1", "dh3"), (("w1", D), ("w3", D)))},
        "wo_dx": {"x": Packed(D, ("dx2",), (("wo", Q),))},
        # two inputs: Wq has Q rows, Wk/Wv have KV rows (strict allows several, uniform sizes)
        "qkv_dx": {"dkv_w": Packed(KV, ("dk", "dv"), (("wk", D), ("wv", D))),
                   "dq_w": Packed(Q, ("dq",), (("wq", D),))},
        "sdpa_fwd": {"k": Packed(KV, ("kr",)), "q": Packed(Q, ("qr",)), "v": Packed(KV, ("v",))},
        "sdpa_bwd": {"da": Packed(Q, ("dattn",)), "k": Packed(KV, ("kr",)),
                     "q": Packed(Q, ("qr",)), "v": Packed(KV, ("v",))},
    }


def layer_mats(kind: str, weights: dict[str, np.ndarray], layer: int,
               model_type: str = "llama") -> dict[str, np.ndarray]:
    """The matrices M a weighted kernel stages for one layer: Wᵀ forward, W for dx."""
    mats = {role: weights[weight_name(model_type, layer, LAYER_ROLE[role])] for role in ROLES.get(kind, ())}
    return {r: w.T for r, w in mats.items()} if kind in FORWARD else mats


class KernelContext:
    """Builds one kernel: finds activations and weights in the packed inputs."""

    def __init__(self, kind: str, m: Dims, mats: dict[str, np.ndarray] | None):
        self.kind, self.m, self.mats = kind, m, mats
        self.b = GraphBuilder(kind)
        self.where: dict[str, tuple[Value, Packed, slice]] = {}
        for name, pk in layouts(m)[kind].items():
            v = self.b.input(name, [1, pk.channels, 1, pk.width(m.s, mats is None, m.width_multiple)])
            for key, cols in pk.columns(m.s).items():
                self.where[key] = (v, pk, cols)
        self._acts: dict[str, Value] = {}

    def _slice(self, key: str, name: str) -> Value:
        v, pk, cols = self.where[key]
        return self.b.slice_by_size(v, [0, 0, 0, cols.start], [1, pk.channels, 1, cols.stop - cols.start],
                                    name=name)

    def act(self, name: str) -> Value:
        """Activation `name` as `[1, C, 1, S]` (sliced once)."""
        if name not in self._acts:
            self._acts[name] = self._slice(name, f"{name}_in")
        return self._acts[name]

    def lin(self, act: str, role: str) -> Value:
        """y `[1, OC, 1, S]` = Mᵀ·act for the weight block `role`."""
        x, s = self.act(act), self.m.s
        c = x.shape[1]
        if self.mats is not None:  # static: Mᵀ `[OC, C]` as a 1×1 conv weight
            return self.b.linear(x, np.ascontiguousarray(self.mats[role].T), name=f"{role}_{act}")
        w = self._slice(role, f"{role}_m")
        oc = w.shape[3]
        w4 = self.b.reshape(w, [1, 1, c, oc], name=f"{role}_m4")        # [1, 1, C, OC]
        x4 = self.b.reshape(x, [1, 1, c, s], name=f"{role}_{act}4")     # [1, 1, C, S]
        y = self.b.matmul(w4, x4, transpose_x=True, name=f"{role}_{act}_mm")  # [1, 1, OC, S]
        return self.b.reshape(y, [1, oc, 1, s], name=f"{role}_{act}")    # [1, OC, 1, S]


# ----------------------------------------------------------------- the kernels' arithmetic

def _qkv(k: KernelContext) -> dict[str, Value]:
    return {"k": k.lin("xn", "wk"), "q": k.lin("xn", "wq"), "v": k.lin("xn", "wv")}


def _wo(k: KernelContext) -> dict[str, Value]:
    return {"o": k.lin("attn", "wo")}


def _ffn_up(k: KernelContext) -> dict[str, Value]:
    b = k.b
    h1, h3 = k.lin("x2n", "w1"), k.lin("x2n", "w3")
    # silu as x·sigmoid(x) (CONTRACTS §2 conservative form)
    act = b.mul(h1, b.sigmoid(h1, name="h1_sig"), name="h1_silu")
    return {"gate": b.mul(act, h3, name="swiglu"), "h1": h1, "h3": h3}


def _ffn_down(k: KernelContext) -> dict[str, Value]:
    return {"f": k.lin("gate", "w2")}


def _ffn_down_dx(k: KernelContext) -> dict[str, Value]:
    return {"dgate": k.lin("dy", "w2")}


def _ffn_up_dx(k: KernelContext) -> dict[str, Value]:
    return {"dx": k.b.add(k.lin("dh1", "w1"), k.lin("dh3", "w3"), name="dx_sum")}


def _wo_dx(k: KernelContext) -> dict[str, Value]:
    return {"dattn": k.lin("dx2", "wo")}


def _qkv_dx(k: KernelContext) -> dict[str, Value]:
    b = k.b
    kv = b.add(k.lin("dk", "wk"), k.lin("dv", "wv"), name="dx_kv")
    return {"dx": b.add(kv, k.lin("dq", "wq"), name="dx_sum")}


_BODY = {"qkv": _qkv, "wo": _wo, "ffn_up": _ffn_up, "ffn_down": _ffn_down,
         "ffn_down_dx": _ffn_down_dx, "ffn_up_dx": _ffn_up_dx, "wo_dx": _wo_dx, "qkv_dx": _qkv_dx,
         "sdpa_fwd": training_attn.sdpa_fwd, "sdpa_bwd": training_attn.sdpa_bwd}


def build_graph(kind: str, m: Dims, mats: dict[str, np.ndarray] | None = None) -> Graph:
    """Kernel `kind` as a graph: dynamic (weights in the inputs) unless `mats` bakes them."""
    if kind not in _BODY:
        raise ShapeError(f"unknown training kernel {kind!r}; expected one of {', '.join(KINDS)}")
    if mats is not None and set(mats) != set(ROLES[kind]):
        raise ShapeError(f"kernel {kind}: expected weights {sorted(ROLES[kind])}, got {sorted(mats)}")
    ctx = KernelContext(kind, m, mats if kind in WEIGHTED else None)
    outs = _BODY[kind](ctx)
    for name in sorted(outs):  # alphabetical: the strict binding order, so no renames
        ctx.b.output(name, outs[name])
    return ctx.b.build()
