"""The device half of a training step: ten kernel graphs shared by every layer.

Per layer (the split of maderix/ANE's dynamic pipeline, with HF semantics):

    forward   qkv        xn                  -> q, k, v        (linear, weights Wqᵀ Wkᵀ Wvᵀ)
              sdpa_fwd   qr, kr, v           -> attn (, probs) (causal attention, no weights)
              wo         attn                -> o              (Woᵀ)
              ffn_up     x2n                 -> gate, h1, h3   (W1ᵀ W3ᵀ, gate = act(h1)·h3)
              ffn_down   gate                -> f              (W2ᵀ)
    backward  ffn_down_dx dy                 -> dgate          (W2)
              ffn_up_dx  dh1, dh3            -> dx             (W1, W3: W1ᵀdh1 + W3ᵀdh3)
              (or both as ffn_dx: dy, h1, h3 -> dh1, dh3, dx, with `Dims.ffn_dx`)
              wo_dx      dx2                 -> dattn          (Wo)
              sdpa_bwd   qr, kr, v, dattn    -> dq, dk, dv     (and probs, or recomputes them)
              qkv_dx     dq, dk, dv          -> dx             (Wq, Wk, Wv)

q and k come rotated by RoPE on the CPU (qr, kr); with `Dims.rope` they come as they are and both
attention kernels rotate them on the tables of an input `rope` (training_attn). What each kernel
input carries (the layouts, LoRA's blocks) is `training_layout.py`.

Inputs and outputs are declared in alphabetical order, so the `strict` binding order
needs no renaming and the names below are the MIL names.
"""

from __future__ import annotations

import numpy as np

from ..errors import ShapeError
from ..ir.builder import GraphBuilder
from ..ir.graph import Graph, Value
from . import training_attn
from .families import Family
# the layouts' names, re-exported: a kernel and its layout are used together
from .training_layout import (BACKWARD, FFN_DX, FORWARD, GRADIENT_INPUTS, KINDS, LORA_INPUT,  # noqa: F401
                              MASK_INPUT, ROLES, WEIGHTED, WEIGHTLESS, Dims, LoraLayout, Packed, a_key, b_key,
                              carry_fits, drop_key, kernel_roles, layouts, mask_key, resident_fits,
                              weighted_kinds)


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

    def lin(self, act: str | Value, role: str) -> Value:
        """y `[1, OC, 1, S]` = Mᵀ·act for the weight block `role`, plus its adapter term; `act`
        an input activation's name, or a value the kernel computed."""
        x = self.act(act) if isinstance(act, str) else act
        act = act if isinstance(act, str) else act.name
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


def _ffn_dx(k: KernelContext) -> dict[str, Value]:
    """ffn_down_dx then ffn_up_dx in one kernel (`Dims.ffn_dx`, the SwiGLU backward inside)."""
    d = _ffn_down_dx(k)
    return {**d, "dx": k.b.add(k.lin(d["dh1"], "w1"), k.lin(d["dh3"], "w3"), name="dx_sum")}


def _wo_dx(k: KernelContext) -> dict[str, Value]:
    return {"dattn": k.lin("dx2", "wo")}


def _qkv_dx(k: KernelContext) -> dict[str, Value]:
    b = k.b
    kv = b.add(k.lin("dk", "wk"), k.lin("dv", "wv"), name="dx_kv")
    return {"dx": b.add(kv, k.lin("dq", "wq"), name="dx_sum")}


_BODY = {"qkv": _qkv, "wo": _wo, "ffn_up": _ffn_up, "ffn_down": _ffn_down,
         "ffn_down_dx": _ffn_down_dx, "ffn_up_dx": _ffn_up_dx, "wo_dx": _wo_dx, "qkv_dx": _qkv_dx, FFN_DX: _ffn_dx,
         "sdpa_fwd": training_attn.sdpa_fwd, "sdpa_bwd": training_attn.sdpa_bwd}


def build_graph(kind: str, m: Dims, mats: dict[str, np.ndarray] | None = None,
                lora: LoraLayout | None = None) -> Graph:
    """Kernel `kind` as a graph: dynamic (weights in the inputs) unless `mats` bakes them;
    with `lora`, the adapter blocks as inputs (module doc)."""
    if kind not in _BODY:
        raise ShapeError(f"unknown training kernel {kind!r}; expected one of {', '.join(KINDS + (FFN_DX,))}")
    if mats is not None and set(mats) != set(kernel_roles(kind, m)):
        raise ShapeError(f"kernel {kind}: expected weights {sorted(kernel_roles(kind, m))}, got {sorted(mats)}")
    if kind == FFN_DX and not (m.ffn_dx and m.swiglu_dx):
        raise ShapeError(f"kernel {FFN_DX} needs Dims.ffn_dx and Dims.swiglu_dx")
    ctx = KernelContext(kind, m, mats if kind in ROLES else None, lora)
    outs = _BODY[kind](ctx)
    for name in sorted(outs):  # alphabetical: the strict binding order, so no renames
        ctx.b.output(name, outs[name])
    return ctx.b.build()
