"""LoRA on the device: the adapter term of a projection, with the adapter as kernel inputs.

A targeted projection y = W·x gains `B'·(A'·x + c)`, where A' (stored transposed, `[1, 1, in, R]`),
B' `[1, 1, out, R]` (and, after GPT-2's LayerNorm, c `[1, 1, 1, R]`) are kernel INPUTS, not
consts, so an adapter
is data: swapping one, or dropping it (zeros), restages inputs and compiles nothing, and a
kernel built for rank R serves every adapter of rank r <= R, zero-padded (exactly: the padded
rows of A' meet zero columns of B'). The host folds into them what `layer_params` folds into
W: LoRA's scale alpha/r and the attention scale (q rows) and the stream scale (the o, down and
proj rows, which write into the residual stream) into B', the norm's gain into A' (the kernel
reads the normalised x without its affine), and LayerNorm's shift as c = A·shift.

One *slot* per kernel projection (`qkv`, `o`, `gate`, `up`, `down`, `fc`, `proj`). Llama and
Qwen3 fuse q, k and v into one projection, so their `qkv` slot stacks one R-row block of A'
per targeted role and B' holds each role's B in its rows and its block's columns (block
diagonal); GPT-2's `c_attn` adapter is one block over the fused rows, as PEFT treats it.
Inputs are named `lora_<slot>_a`, `_b`, `_c`: a kernel declares them with its own, sorted
(surfaces bind alphabetically). Every one of them has R along its spatial axis, and R is
the rank rounded up to the profile's spatial multiple (16 in strict): zero rows again.

    term = lora_term(b, x, a, bm)       # [1, out, 1, S], for any GraphBuilder: the training kernels' too
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..chip.profile import padded_width
from ..ir.builder import GraphBuilder
from ..ir.graph import Value
from .families import family_for


@dataclass(frozen=True)
class Slot:
    """The adapter inputs of one kernel projection."""

    key: str                      # the kernel projection ("qkv", "o", ...)
    roles: tuple[str, ...]        # the targeted roles, one R-row block of A' each
    rank: int                     # R, rows per block
    inp: int                      # the projection's input channels
    out: int                      # its output channels (all its roles' rows)
    row_offsets: tuple[int, ...]  # each targeted role's first output row
    row_counts: tuple[int, ...]   # and its number of output rows
    shifted: bool                 # GPT-2's LayerNorm shift comes before it: c is an input

    @property
    def rows(self) -> int:
        return len(self.roles) * self.rank

    def input_shapes(self) -> dict[str, list[int]]:
        shapes = {f"lora_{self.key}_a": [1, 1, self.inp, self.rows], f"lora_{self.key}_b": [1, 1, self.out, self.rows]}
        if self.shifted:
            shapes[f"lora_{self.key}_c"] = [1, 1, 1, self.rows]
        return shapes


def plan_slots(config, rank: int, roles: tuple[str, ...], multiple: int = 1) -> tuple[Slot, ...]:
    """The slots of every layer kernel for adapters of rank <= `rank` on model `roles`; each
    slot's rank rounds up to `multiple`, the profile's spatial multiple (its inputs' width)."""
    from ..models.adapters import projection_shape

    rank = padded_width(rank, multiple)
    family = family_for(config.model_type)
    slots = []
    for key, members in family.slot_roles.items():
        shapes = {r: projection_shape(config, r) for r in members}  # (out, in)
        starts = dict(zip(members, np.cumsum([0] + [shapes[r][0] for r in members]).tolist()))
        chosen = tuple(r for r in members if r in roles)
        if chosen:
            slots.append(Slot(key, chosen, rank, shapes[members[0]][1], sum(o for o, _ in shapes.values()),
                              tuple(starts[r] for r in chosen), tuple(shapes[r][0] for r in chosen),
                              family.layer_norm and family.reads_norm(key) is not None))
    return tuple(slots)


def slot_input_shapes(slots: tuple[Slot, ...]) -> dict[str, list[int]]:
    return {n: sh for s in slots for n, sh in s.input_shapes().items()}


def slot_values(inputs: dict[str, Value], slots: tuple[Slot, ...]) -> dict[str, tuple[Value, Value, Value | None]]:
    """slot key -> its declared (a, b, c or None) input Values."""
    return {s.key: (inputs[f"lora_{s.key}_a"], inputs[f"lora_{s.key}_b"], inputs.get(f"lora_{s.key}_c"))
            for s in slots}


# --- the graph piece --------------------------------------------------------------------------

def lora_term(b: GraphBuilder, x: Value, a: Value, bm: Value, c: Value | None = None, name: str = "lora") -> Value:
    """B·(A·x + c) for x `[1, in, 1, S]`, a = Aᵀ `[1, 1, in, R]`, bm `[1, 1, out, R]`, c
    `[1, 1, 1, R]` (or None): `[1, out, 1, S]`, two matmuls over inputs (no conv: strict wants
    conv weights const)."""
    inp, seq = x.shape[1], x.shape[3]
    x4 = b.reshape(x, [1, 1, inp, seq], name=f"{name}_x4")                  # [1, 1, in, S]
    h = b.matmul(a, x4, transpose_x=True, name=f"{name}_ax")               # [1, 1, R, S]
    if c is not None:
        h = b.add(h, b.reshape(c, [1, 1, c.shape[3], 1], name=f"{name}_c_t"), name=f"{name}_axc")
    d = b.matmul(bm, h, name=f"{name}_bax")                                 # [1, 1, out, S]
    return b.reshape(d, [1, bm.shape[2], 1, seq], name=name)               # [1, out, 1, S]


def add_lora(b: GraphBuilder, y: Value, x: Value, lora: dict | None, key: str) -> Value:
    """y plus the adapter term of projection `key` when the kernel has a slot for it."""
    if not lora or key not in lora:
        return y
    a, bm, c = lora[key]
    return b.add(y, lora_term(b, x, a, bm, c, name=f"{key}_lora"), name=f"{key}_adapted")


# --- the host side ----------------------------------------------------------------------------

def layer_lora(s, slots: tuple[Slot, ...], w: dict[str, np.ndarray], pairs: dict, scale: float
               ) -> dict[str, np.ndarray]:
    """The input arrays of one layer's slots (float32): `w` the layer's HF weights (names inside
    the layer, as `layer_params` takes them), `pairs` role -> (A [r, in], B [out, r]) of the
    adapter (roles it lacks are zeros: the base alone), `scale` the adapter's alpha/r. `s` is
    the layer's LayerShape (the attention and stream scales)."""
    f = s.family
    q_scale = 1.0 if f.head_norms(w) else s.scale  # Qwen3: in q_norm
    arrays = {}
    for slot in slots:
        a = np.zeros((slot.rows, slot.inp), np.float32)
        bm = np.zeros((slot.out, slot.rows), np.float32)
        c = np.zeros((slot.rows, 1), np.float32)
        norm = f.reads_norm(slot.key)
        gain, shift = f.affine(w, norm) if norm else (None, None)
        for j, (role, row, count) in enumerate(zip(slot.roles, slot.row_offsets, slot.row_counts)):
            if role not in pairs:
                continue
            A, B = pairs[role]
            r, cols = A.shape[0], slice(j * slot.rank, j * slot.rank + A.shape[0])
            a[cols] = A if gain is None else A * gain[None, :]
            if shift is not None:
                c[cols, 0] = A @ shift
            bm[row:row + count, cols] = B * np.float32(scale)
            if role in ("q", "qkv"):  # the attention scale rides on the query rows
                q_rows = slice(row, row + (s.d if role == "qkv" else count))
                bm[q_rows, cols] *= np.float32(q_scale)
        if slot.key in f.stream_writers:
            bm /= np.float32(s.stream_scale)
        arrays[f"lora_{slot.key}_a"] = np.ascontiguousarray(a.T)[None, None]
        arrays[f"lora_{slot.key}_b"] = bm[None, None]
        if slot.shifted:
            arrays[f"lora_{slot.key}_c"] = c.reshape(1, 1, 1, -1)
    return arrays
