"""What each training kernel's inputs carry: the sizes (`Dims`) and the layouts (`Packed`, `layouts`).

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

The kernels themselves are built in `training.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..chip.profile import padded_width
from .families import family_for

FORWARD = ("qkv", "wo", "ffn_up", "ffn_down")            # stage Wᵀ
BACKWARD = ("ffn_down_dx", "ffn_up_dx", "wo_dx", "qkv_dx")  # stage W
WEIGHTED = FORWARD + BACKWARD
WEIGHTLESS = ("sdpa_fwd", "sdpa_bwd")
KINDS = WEIGHTED + WEIGHTLESS
# ffn_down_dx and ffn_up_dx as one kernel (`Dims.ffn_dx`): dh1 and dh3 go straight on to W1ᵀ, W3ᵀ
FFN_DX = "ffn_dx"
# the gradients each backward kernel takes (the rest of its activations are the forward's)
GRADIENT_INPUTS = {"ffn_down_dx": ("dy",), "ffn_up_dx": ("dh1", "dh3"), "wo_dx": ("dx2",),
                   "qkv_dx": ("dq", "dk", "dv"), "sdpa_bwd": ("dattn",), FFN_DX: ("dy",)}
# the weight blocks of each kernel's layout (below), without their sizes
ROLES = {"qkv": ("wq", "wk", "wv"), "wo": ("wo",), "ffn_up": ("w1", "w3"), "ffn_down": ("w2",),
         "ffn_down_dx": ("w2",), "ffn_up_dx": ("w1", "w3"), "wo_dx": ("wo",), "qkv_dx": ("wk", "wv", "wq"),
         FFN_DX: ("w2", "w1", "w3")}


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
    rope: bool = False  # RoPE inside the attention kernels (training_attn), on the tables in `rope`
    # sdpa_fwd also returns the probabilities `probs` `[Hq·S_q, S_k]` and sdpa_bwd takes them
    # rather than recomputing them (training_attn: a softmax on the slow vector path)
    carry_probs: bool = False
    # with `swiglu_dx`, ffn_down_dx and ffn_up_dx run as one kernel `ffn_dx` (dy, h1, h3 -> dh1,
    # dh3, dx): dh1 and dh3 cross to the CPU (for dW) but not back, and one dispatch is saved
    ffn_dx: bool = False

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


def a_key(group: str) -> str:  # the first factor's block (A or Aᵀ)
    return f"lora_a_{group}"


def b_key(role: str) -> str:  # the second's, per role (scale·B or its transpose)
    return f"lora_b_{role}"


def drop_key(group: str) -> str:
    return f"lora_x_{group}"  # forward: the adapter's input x·mask/(1-p), beside x


def mask_key(group: str) -> str:
    return f"lora_mask_{group}"  # dx: mask/(1-p), in the `lora_mask` input


LORA_INPUT = "lora"  # the r-channel input of the second factors (binds in alphabetical order)
MASK_INPUT = "lora_mask"  # dx kernels with dropout: one mask block per adapter (binds after `lora`)


# sdpa_fwd's probabilities carried to sdpa_bwd are Hq·S² per layer and sequence, kept on the host
# in float32 from a layer's forward to its backward: carried while one sequence's, all layers,
# take at most this (Qwen3-0.6B at S 256: 112 MB; at 512, 451 MB: recomputed)
CARRY_BYTES = 256 << 20


def carry_fits(m: Dims, layers: int) -> bool:
    """Whether the trainer carries the probabilities (`Dims.carry_probs`) at these sizes."""
    return 4 * m.hq * m.s * m.s * layers <= CARRY_BYTES


# ...and leaves them on the device, in fp16 surfaces sdpa_fwd writes and sdpa_bwd reads, rather
# than reading them back and writing them again, while two slots of every layer's, for each
# sequence of a batch (a micro-batch's forward may run ahead of the last one's backward), take
# at most this (Qwen3-0.6B at S 256: 112 MB a sequence)
RESIDENT_BYTES = 512 << 20


def resident_fits(m: Dims, layers: int, batch: int) -> bool:
    """Whether the trainer keeps the carried probabilities on the device for a batch of `batch`."""
    return m.carry_probs and 2 * batch * layers * 2 * m.hq * m.s * m.s <= RESIDENT_BYTES


def weighted_kinds(m: Dims) -> tuple[str, ...]:
    """The weighted kernels a step with these sizes runs, forward ones first."""
    if not m.ffn_dx:
        return WEIGHTED
    return FORWARD + tuple(FFN_DX if k == "ffn_down_dx" else k for k in BACKWARD if k != "ffn_up_dx")


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
    rope = {"rope": Packed(m.hd, ("cos", "sin"))} if m.rope else {}  # `[hd, S]` each, HF's full width
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
        FFN_DX: {"h": Packed(F, ("h1", "h3"), (("w1", D), ("w3", D))), "x": Packed(D, ("dy",), (("w2", F),))},
        "wo_dx": {"x": Packed(D, ("dx2",), (("wo", Q),))},
        # two inputs: Wq has Q rows, Wk/Wv have KV rows (strict allows several, uniform sizes)
        "qkv_dx": {"dkv_w": Packed(KV, ("dk", "dv"), (("wk", D), ("wv", D))),
                   "dq_w": Packed(Q, ("dq",), (("wq", D),))},
        "sdpa_fwd": {"k": Packed(KV, ("kr",)), "q": Packed(Q, ("qr",)), "v": Packed(KV, ("v",)), **mask, **rope},
        "sdpa_bwd": {"da": Packed(Q, ("dattn",)), "k": Packed(KV, ("kr",)), "q": Packed(Q, ("qr",)),
                     "v": Packed(KV, ("v",)), **rope,
                     **({"probs": Packed(m.hq * m.s, ("probs",))} if m.carry_probs else mask)},
    }


def kernel_roles(kind: str, m: Dims) -> tuple[str, ...]:
    """The weight blocks of kernel `kind` (GPT-2's MLP has no W3)."""
    return tuple(r for r in ROLES.get(kind, ()) if m.gated or r != "w3")
