"""The device half of a training step: ten kernel graphs shared by every layer.

Per layer (the split of maderix/ANE's dynamic pipeline, with HF semantics and RoPE on the CPU):

    forward   qkv        xn                  -> q, k, v        (linear, weights Wqᵀ Wkᵀ Wvᵀ)
              sdpa_fwd   qr, kr, v           -> attn           (causal attention, no weights)
              wo         attn                -> o              (Woᵀ)
              ffn_up     x2n                 -> gate, h1, h3   (W1ᵀ W3ᵀ, gate = act(h1)·h3)
              ffn_down   gate                -> f              (W2ᵀ)
    backward  ffn_down_dx dy                 -> dgate          (W2)
              ffn_up_dx  dh1, dh3            -> dx             (W1, W3: W1ᵀdh1 + W3ᵀdh3)
              wo_dx      dx2                 -> dattn          (Wo)
              sdpa_bwd   qr, kr, v, dattn    -> dq, dk, dv     (recomputes the probabilities)
              qkv_dx     dq, dk, dv          -> dx             (Wq, Wk, Wv)

A *layout* says what each kernel input carries along its spatial axis: activation blocks of S
columns, then (dynamic pipeline only) weight blocks, each a matrix M `[C, OC]` whose row c sits
in row c of the input. Every block of one input shares its channel count C, which is what
groups the weights (maderix/ANE's dynamic-weight trick): forward kernels stage M = Wᵀ
(`[in, out]`), the dx kernels M = W (`[out, in]`). A projection is y = Mᵀ·x, on the device either
`matmul(M, x, transpose_x)` on slices of the input (dynamic: weights are data, one compile
serves every layer and every update) or a 1×1 conv with Mᵀ baked as a BLOBFILE const (static).
The static graphs keep the same activation packing, so both pipelines run the same way.

LoRA (`LoraLayout`): a targeted projection adds scale·B·(A·x), with A and B always
staged as data, in both pipelines, so an adapter update or swap compiles nothing. Each
factor is again a block M with y = Mᵀ·x: forward, the input holding x gets Aᵀ `[in, r]` and
a second input `lora` of r channels gets (scale·B)ᵀ `[r, out]`; the dx kernels carry
scale·B `[out, r]` beside dy and A `[r, in]` in `lora`, giving dx += Aᵀ(scale·Bᵀ·dy). One
adapter may cover several kernel roles (GPT-2's fused `c_attn` covers wq, wk, wv): A·x is
computed once and B's rows are split across the roles. Kernels no adapter touches keep
their plain layout, so they compile to the same programs as in full training.
LoRA dropout (`LoraLayout.dropout`; PEFT's y = W·x + s·B·A·dropout(x)) is data too: the
CPU draws the masks. A forward kernel then takes, beside x, each adapter's dropped copy
x·mask/(1-p) as one more activation block (`drop_key`), which A multiplies instead of x; a dx
kernel takes the masks mask/(1-p) in one more input `lora_mask` of the projection's input
channels (`mask_key`), through which the adapter's dx term goes before it joins the base's.

Inputs and outputs are declared in alphabetical order, so the `strict` binding order
needs no renaming and the names below are the MIL names.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..chip.profile import padded_width
from ..errors import ShapeError
from ..ir.builder import GraphBuilder
from ..ir.graph import Graph, Value
from . import training_attn
from .families import Family, family_for

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
    gated: bool = True  # SwiGLU (Llama, Qwen3: W1, W3); False: one up projection (GPT-2, GELU on the CPU)
    # every packed input's width rounds up to this (the profile's spatial_multiple_of):
    # the extra columns come after every block, and no kernel reads them
    width_multiple: int = 1
    act: str = "silu"  # the gate's activation in ffn_up: "silu" or "gelu_tanh" (Gemma)
    attn_scale: float | None = None  # the score scale; None: 1/√hd
    window: int | None = None  # a sliding window of keys (Gemma's local layers); None: all before
    # the attention kernels take their additive mask `[S_q, S_k]` as an input `mask` rather than
    # a const: packed sequences of several examples, each attending only within itself
    mask_input: bool = False
    # ffn_down_dx also takes h1 and h3 and returns dh1, dh3 in place of dgate: the SwiGLU
    # backward on the device (gated SiLU only), so dgate never crosses to the CPU and back
    swiglu_dx: bool = False

    @property
    def q(self) -> int:
        return self.hq * self.hd

    @property
    def kv(self) -> int:
        return self.hkv * self.hd

    @property
    def scale(self) -> float:
        return 1.0 / (self.hd ** 0.5) if self.attn_scale is None else self.attn_scale

    @classmethod
    def from_config(cls, cfg, seq_len: int) -> "Dims":
        f = family_for(cfg.model_type)
        return cls(cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                   cfg.head_dim, int(seq_len), f.gated, act=f.activation, attn_scale=f.attention_scale(cfg, 0))




@dataclass(frozen=True)
class Packed:
    """One kernel input `[1, C, 1, n·S + Σ widths]`: activations, then weight blocks, then
    adapter blocks (staged data in both pipelines), padded to `Dims.width_multiple` columns."""

    channels: int
    acts: tuple[str, ...]
    weights: tuple[tuple[str, int], ...] = ()   # (role, columns OC) in column order
    adapters: tuple[tuple[str, int], ...] = ()  # (block key, columns) after the weights

    def width(self, s: int, dynamic: bool, multiple: int = 1) -> int:
        used = len(self.acts) * s + (sum(w for _, w in self.weights) if dynamic else 0)
        return padded_width(used + sum(w for _, w in self.adapters), multiple)

    def columns(self, s: int, dynamic: bool = True) -> dict[str, slice]:
        """Where each activation, weight and adapter block lives along the spatial axis."""
        at = {a: slice(j * s, (j + 1) * s) for j, a in enumerate(self.acts)}
        col = len(self.acts) * s
        for role, w in (self.weights if dynamic else ()) + self.adapters:
            at[role] = slice(col, col + w)
            col += w
        return at


@dataclass(frozen=True)
class LoraLayout:
    """The adapters a LoRA step stages: rank r and, per adapter, the kernel roles it covers
    (`(("q", ("wq",)), ("v", ("wv",)))` for Llama's q_proj, v_proj; GPT-2's c_attn is
    `("qkv", ("wq", "wk", "wv"))`)."""

    rank: int
    groups: tuple[tuple[str, tuple[str, ...]], ...]
    dropout: bool = False  # the adapters see dropped inputs (module doc): the blocks are always there

    def group_of(self, role: str) -> str | None:
        return next((g for g, roles in self.groups if role in roles), None)

    def kinds(self) -> tuple[str, ...]:
        """The weighted kernels that carry an adapter term."""
        return tuple(k for k in WEIGHTED if any(self.group_of(r) for r in ROLES[k]))


def a_key(group: str) -> str:
    return f"lora_a_{group}"


def b_key(role: str) -> str:
    return f"lora_b_{role}"


def drop_key(group: str) -> str:
    return f"lora_x_{group}"  # forward: the adapter's input x·mask/(1-p), beside x


def mask_key(group: str) -> str:
    return f"lora_mask_{group}"  # dx: mask/(1-p), in the `lora_mask` input


LORA_INPUT = "lora"  # the r-channel input of the second factors (binds in alphabetical order)
MASK_INPUT = "lora_mask"  # dx kernels with dropout: one mask block per adapter (binds after `lora`)


def layouts(m: Dims, lora: LoraLayout | None = None) -> dict[str, dict[str, Packed]]:
    """Every kernel's inputs by MIL name (alphabetical, as they bind), with `lora`'s blocks."""
    base = _plain_layouts(m)
    if lora is None:
        return base
    for kind in lora.kinds():
        base[kind] = _with_adapters(kind, base[kind], lora)
    return base


def _with_adapters(kind: str, ins: dict[str, Packed], lora: LoraLayout) -> dict[str, Packed]:
    """Add the adapter blocks of `kind`: the first factor beside the activation it multiplies,
    the second in the r-channel `lora` input (module doc)."""
    first: dict[str, list] = {name: [] for name in ins}
    drops: dict[str, list] = {name: [] for name in ins}  # forward: dropped copies beside x
    second: list[tuple[str, int]] = []
    masks: dict[str, int] = {}  # dx: mask block -> the input channels it covers
    for name, pk in ins.items():
        for role, oc in pk.weights:
            g = lora.group_of(role)
            if g is None:
                continue
            if kind in FORWARD:   # Aᵀ [in, r] beside x (once per adapter); (sB)ᵀ [r, out] in lora
                if (a_key(g), lora.rank) not in first[name]:
                    first[name].append((a_key(g), lora.rank))
                    drops[name].append(drop_key(g))
                second.append((b_key(role), oc))
            else:                 # sB [out, r] beside dy; A [r, in] in lora (once per adapter)
                first[name].append((b_key(role), lora.rank))
                if (a_key(g), oc) not in second:
                    second.append((a_key(g), oc))
                    masks[mask_key(g)] = oc
    out = {name: replace(pk, acts=pk.acts + (tuple(drops[name]) if lora.dropout else ()),
                         adapters=tuple(first[name])) for name, pk in ins.items()}
    out[LORA_INPUT] = Packed(lora.rank, (), (), tuple(second))
    if lora.dropout and masks:
        out[MASK_INPUT] = Packed(next(iter(masks.values())), tuple(masks))
    return dict(sorted(out.items()))


def _plain_layouts(m: Dims) -> dict[str, dict[str, Packed]]:
    D, F, Q, KV = m.d, m.f, m.q, m.kv
    mask = {"mask": Packed(m.s, ("mask",))} if m.mask_input else {}  # row = query, column = key
    if not m.gated:  # GPT-2: h = W_fc·x2n up, its dx W_fcᵀ·dh (bias and GELU on the CPU)
        return {**_plain_layouts(replace(m, gated=True)),
                "ffn_up": {"x": Packed(D, ("x2n",), (("w1", F),))},
                "ffn_up_dx": {"x": Packed(F, ("dh1",), (("w1", D),))}}
    return {
        "qkv": {"x": Packed(D, ("xn",), (("wq", Q), ("wk", KV), ("wv", KV)))},
        "wo": {"x": Packed(Q, ("attn",), (("wo", D),))},
        "ffn_up": {"x": Packed(D, ("x2n",), (("w1", F), ("w3", F)))},
        "ffn_down": {"x": Packed(F, ("gate",), (("w2", D),))},
        "ffn_down_dx": {"x": Packed(D, ("dy",), (("w2", F),)), **({"h": Packed(F, ("h1", "h3"))} if m.swiglu_dx else {})},
        "ffn_up_dx": {"x": Packed(F, ("dh1", "dh3"), (("w1", D), ("w3", D)))},
        "wo_dx": {"x": Packed(D, ("dx2",), (("wo", Q),))},
        # two inputs: Wq has Q rows, Wk/Wv have KV rows (strict allows several, uniform sizes)
        "qkv_dx": {"dkv_w": Packed(KV, ("dk", "dv"), (("wk", D), ("wv", D))),
                   "dq_w": Packed(Q, ("dq",), (("wq", D),))},
        "sdpa_fwd": {"k": Packed(KV, ("kr",)), "q": Packed(Q, ("qr",)), "v": Packed(KV, ("v",)), **mask},
        "sdpa_bwd": {"da": Packed(Q, ("dattn",)), "k": Packed(KV, ("kr",)),
                     "q": Packed(Q, ("qr",)), "v": Packed(KV, ("v",)), **mask},
    }


def kernel_roles(kind: str, m: Dims) -> tuple[str, ...]:
    """The weight blocks of kernel `kind` (GPT-2's MLP has no W3)."""
    return tuple(r for r in ROLES.get(kind, ()) if m.gated or r != "w3")


def layer_mats(kind: str, weights: dict[str, np.ndarray], layer: int, family: Family,
               m: Dims | None = None) -> dict[str, np.ndarray]:
    """The matrices M a weighted kernel stages for one layer (`family.layer_matrix` finds each
    role's W in the HF weights): Wᵀ forward, W for dx."""
    roles = kernel_roles(kind, m) if m is not None else ROLES.get(kind, ())
    mats = {role: family.layer_matrix(weights, layer, role) for role in roles}
    return {r: w.T for r, w in mats.items()} if kind in FORWARD else mats


def adapter_mats(kind: str, lora: LoraLayout, a: dict[str, np.ndarray],
                 sb: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The adapter blocks kernel `kind` stages for one layer, by block key: from A `[r, in]`
    per adapter and scale·B `[out, r]` per kernel role (an adapter's rows for that role)."""
    out = {}
    for role in ROLES[kind]:
        g = lora.group_of(role)
        if g is None:
            continue
        if kind in FORWARD:
            out[a_key(g)], out[b_key(role)] = a[g].T, sb[role].T
        else:
            out[a_key(g)], out[b_key(role)] = a[g], sb[role]
    return out


class KernelContext:
    """Builds one kernel: finds activations, weights and adapter blocks in the packed inputs."""

    def __init__(self, kind: str, m: Dims, mats: dict[str, np.ndarray] | None,
                 lora: LoraLayout | None = None):
        self.kind, self.m, self.mats, self.lora = kind, m, mats, lora
        self.b = GraphBuilder(kind)
        self.where: dict[str, tuple[Value, Packed, slice]] = {}
        dynamic = mats is None
        for name, pk in sorted(layouts(m, lora)[kind].items()):
            v = self.b.input(name, [1, pk.channels, 1, pk.width(m.s, dynamic, m.width_multiple)])
            for key, cols in pk.columns(m.s, dynamic).items():
                self.where[key] = (v, pk, cols)
        self._acts: dict[str, Value] = {}
        self._first: dict[tuple[str, str], Value] = {}

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
        """y `[1, OC, 1, S]` = Mᵀ·act for the weight block `role`, plus its adapter term."""
        x = self.act(act)
        if self.mats is not None:  # static: Mᵀ `[OC, C]` as a 1×1 conv weight
            y = self.b.linear(x, np.ascontiguousarray(self.mats[role].T), name=f"{role}_{act}")
        else:
            y = self.block_mm(role, x, f"{role}_{act}")
        g = self.lora.group_of(role) if self.lora is not None else None
        if g is None:
            return y
        drop = self.lora.dropout
        if self.kind in FORWARD:  # u = A·x once per adapter (x dropped: its own copy), then (sB_role)·u
            if (g, act) not in self._first:
                xa = self.act(drop_key(g)) if drop else x
                self._first[(g, act)] = self.block_mm(a_key(g), xa, f"lora_u_{g}_{act}")
            extra = self.block_mm(b_key(role), self._first[(g, act)], f"lora_{role}_{act}")
        else:                     # Aᵀ·((sB_role)ᵀ·dy), through the mask with dropout
            v = self.block_mm(b_key(role), x, f"lora_v_{role}_{act}")
            extra = self.block_mm(a_key(g), v, f"lora_{role}_{act}")
            if drop:
                extra = self.b.mul(extra, self.act(mask_key(g)), name=f"lora_{role}_{act}_masked")
        return self.b.add(y, extra, name=f"{role}_{act}_lora")

    def block_mm(self, key: str, x: Value, name: str) -> Value:
        """Mᵀ·x `[1, OC, 1, S]` for the staged block M `[C, OC]` at `key`, x `[1, C, 1, S]`."""
        s, c = self.m.s, x.shape[1]
        w = self._slice(key, f"{name}_m")
        oc = w.shape[3]
        w4 = self.b.reshape(w, [1, 1, c, oc], name=f"{name}_m4")        # [1, 1, C, OC]
        x4 = self.b.reshape(x, [1, 1, c, s], name=f"{name}_x4")         # [1, 1, C, S]
        y = self.b.matmul(w4, x4, transpose_x=True, name=f"{name}_mm")  # [1, 1, OC, S]
        return self.b.reshape(y, [1, oc, 1, s], name=name)              # [1, OC, 1, S]


# ----------------------------------------------------------------- the kernels' arithmetic

def _qkv(k: KernelContext) -> dict[str, Value]:
    return {"k": k.lin("xn", "wk"), "q": k.lin("xn", "wq"), "v": k.lin("xn", "wv")}


def _wo(k: KernelContext) -> dict[str, Value]:
    return {"o": k.lin("attn", "wo")}


def _ffn_up(k: KernelContext) -> dict[str, Value]:
    b = k.b
    if not k.m.gated:
        return {"h1": k.lin("x2n", "w1")}
    h1, h3 = k.lin("x2n", "w1"), k.lin("x2n", "w3")
    if k.m.act == "gelu_tanh":  # Gemma: GELU as x·sigmoid(2u) (strict rejects `gelu`)
        act = b.gelu_tanh(h1, name="h1_gelu", as_sigmoid=True)
    else:  # silu as x·sigmoid(x) (the conservative form)
        act = b.mul(h1, b.sigmoid(h1, name="h1_sig"), name="h1_silu")
    return {"gate": b.mul(act, h3, name="swiglu"), "h1": h1, "h3": h3}


def _ffn_down(k: KernelContext) -> dict[str, Value]:
    return {"f": k.lin("gate", "w2")}


def _ffn_down_dx(k: KernelContext) -> dict[str, Value]:
    if not k.m.swiglu_dx:
        return {"dgate": k.lin("dy", "w2")}
    # gate = silu(h1)·h3, s = σ(h1): dh3 = dgate·silu(h1), dh1 = dgate·h3·(s + silu(h1)·(1 − s))
    b, dgate, h1, h3 = k.b, k.lin("dy", "w2"), k.act("h1"), k.act("h3")
    sig = b.sigmoid(h1, name="h1_sig")
    silu = b.mul(h1, sig, name="h1_silu")
    slope = b.add(sig, b.sub(silu, b.mul(silu, sig, name="silu_sig"), name="silu_rest"), name="silu_grad")
    return {"dh1": b.mul(b.mul(dgate, h3, name="dgate_h3"), slope, name="dh1"),
            "dh3": b.mul(dgate, silu, name="dh3")}


def _ffn_up_dx(k: KernelContext) -> dict[str, Value]:
    if not k.m.gated:
        return {"dx": k.lin("dh1", "w1")}
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


def build_graph(kind: str, m: Dims, mats: dict[str, np.ndarray] | None = None,
                lora: LoraLayout | None = None) -> Graph:
    """Kernel `kind` as a graph: dynamic (weights in the inputs) unless `mats` bakes them;
    with `lora`, the adapter blocks as inputs (module doc)."""
    if kind not in _BODY:
        raise ShapeError(f"unknown training kernel {kind!r}; expected one of {', '.join(KINDS)}")
    if mats is not None and set(mats) != set(kernel_roles(kind, m)):
        raise ShapeError(f"kernel {kind}: expected weights {sorted(kernel_roles(kind, m))}, got {sorted(mats)}")
    ctx = KernelContext(kind, m, mats if kind in WEIGHTED else None, lora)
    outs = _BODY[kind](ctx)
    for name in sorted(outs):  # alphabetical: the strict binding order, so no renames
        ctx.b.output(name, outs[name])
    return ctx.b.build()
