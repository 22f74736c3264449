"""Phi-3, Phi-3.5 and Phi-4-mini (HF `phi3`): Llama's layers, whose checkpoint fuses q, k and v
into one `qkv_proj` (rows q, then k, then v) and gate and up into one `gate_up_proj` (rows
gate, then up); LongRoPE in the long-context variants (`rope.py`), a partial rotation
(Phi-4-mini turns 3/4 of each head), a window on every layer where the config sets
`sliding_window` (Phi-3-mini: 2047; HF's eager attention keeps to it, as Mistral's), a tied
head (Phi-4-mini).

`sanitize` splits the fused matrices into Llama's projections, so every runner (the CPU
reference, the device programs, the training step) is Llama's, and `unsanitize` fuses them
back. `fused_rows` says which rows of a fused matrix each of ours holds, and with what gain:
- a partial rotation lays each q and k head out as [rotated first half, passed first half,
  rotated second half, passed second half]: RoPE's tables over the whole head pair i with
  i + head_dim/2, the passed pairs turning by 0 (`rope.py`), which are then HF's pairs
  (i, i + rot/2); q·k is unchanged, q and k being permuted alike;
- HF multiplies cos and sin, so the rotated dimensions only, by LongRoPE's attention factor g,
  which the runners fold into the score scale as g² (`rope.py`): q's passed rows carry 1/g².
LoRA adapters sit on the fused modules, as PEFT names them (`Architecture.fused`); `adapters.py`
maps their rows to ours by `fused_rows`.

llama.cpp's converter (GGUF `phi3`) keeps the fused matrices (`attn_qkv`, `ffn_up` holding gate
and up) and HF's q/k rows (NEOX RoPE), writes the rotated dimensions as `rope.dimension_count`,
the window as `attention.sliding_window` (0: none), and LongRoPE's factors as the tensors
`rope_factors_long` / `rope_factors_short` (read by `gguf.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np

from . import llama
from .config import LlamaConfig
from .layers import layer_inv_freqs, per_distinct, rope_tables
from .rope import rope_type

ATTN, MLP = "self_attn.qkv_proj", "mlp.gate_up_proj"
# LoRA on every linear by default, as Microsoft's Phi-3 fine-tuning sample ("all-linear")
ARCH = replace(llama.ARCH, model_type="phi3", gguf_arch="phi3", fused={ATTN: ("q", "k", "v"), MLP: ("gate", "up")},
               default_targets=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))


@dataclass(frozen=True)
class Config(LlamaConfig):
    model_type: ClassVar[str] = "phi3"
    architecture: ClassVar[str] = "Phi3ForCausalLM"
    vocab_size: int = 32064
    hidden_size: int = 3072
    intermediate_size: int = 8192
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    original_max_position_embeddings: int = 4096  # LongRoPE's switch; HF's key wins over the parameters'
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 32000
    pad_token_id: int | None = 32000  # kept for export
    sliding_window: int | None = None
    partial_rotary_factor: float = 1.0
    ROPE_TYPES: ClassVar[tuple[str, ...]] = ("default", "longrope")  # HF's Phi-3 takes these two

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Config":
        d = {k: v for k, v in d.items() if k not in ("attention_bias", "mlp_bias")}  # Phi-3 has no biases
        rp = d.pop("rope_scaling", None) or d.get("rope_parameters")  # HF's order: rope_scaling first
        if isinstance(rp, dict):
            rp = dict(rp)
            d["partial_rotary_factor"] = rp.pop("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
            if rp.get("rope_type", rp.get("type")) in ("su", "yarn"):  # HF's Phi-3 reads both as LongRoPE
                rp.pop("type", None)
                rp["rope_type"] = "longrope"
            d["rope_parameters"] = rp
        return super().from_dict(d)

    def __post_init__(self):
        if rope_type(self.rope_scaling) == "longrope":  # HF: the top-level original context wins
            self._set("rope_scaling", {**self.rope_scaling,
                                       "original_max_position_embeddings": self.original_max_position_embeddings})
        super().__post_init__()
        self._require_positive("original_max_position_embeddings")
        if self.sliding_window is not None:
            self._require_positive("sliding_window")
        rot = int(self.head_dim * self.partial_rotary_factor)
        if not 0 < rot <= self.head_dim or rot % 2 or (self.head_dim - rot) % 2:
            raise self._fail(f"partial_rotary_factor {self.partial_rotary_factor} turns {rot} of head_dim "
                             f"{self.head_dim}: expected an even number, with an even number left")
        s = self.rope_scaling or {}
        if any(len(s.get(k, [0] * (rot // 2))) != rot // 2 for k in ("short_factor", "long_factor")):
            raise self._fail(f"longrope short_factor and long_factor must have {rot // 2} values each")

    def rope(self, index: int) -> tuple[float, dict | None]:
        """(RoPE base, scaling) of every layer, the partial rotation in the scaling (`rope.py`)."""
        if self.partial_rotary_factor == 1.0:
            return self.rope_theta, self.rope_scaling
        return self.rope_theta, {**(self.rope_scaling or {"rope_type": "default"}),
                                 "partial_rotary_factor": self.partial_rotary_factor}

    def window(self, index: int) -> int | None:
        return self.sliding_window

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        for k in ("attention_bias", "mlp_bias"):
            d.pop(k)
        d["rope_parameters"]["partial_rotary_factor"] = d["partial_rotary_factor"]
        return d


def fused_rows(c: Config) -> dict[str, tuple[str, np.ndarray, np.ndarray | None]]:
    """role -> (the fused module holding it, the fused matrix's rows that are ours in our
    order, our rows' gains or None): the layout of the module doc."""
    hd, f = c.head_dim, c.intermediate_size
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    rot = int(hd * c.partial_rotary_factor)
    h, p, ar = rot // 2, (hd - rot) // 2, np.arange
    order = np.concatenate([ar(h), rot + ar(p), h + ar(h), rot + p + ar(p)])
    gain, g = None, c.attention_factor(0)
    if p and g != 1.0:
        gain = np.ones(hd, np.float32)
        gain[h:h + p] = gain[hd // 2 + h:] = np.float32(1.0 / (g * g))
        gain = np.tile(gain, c.num_attention_heads)

    def heads(n: int, start: int) -> np.ndarray:
        return start + (ar(n)[:, None] * hd + order[None, :]).reshape(-1)

    return {"q": (ATTN, heads(c.num_attention_heads, 0), gain), "k": (ATTN, heads(c.num_key_value_heads, q), None),
            "v": (ATTN, ar(q + kv, q + 2 * kv), None), "gate": (MLP, ar(f), None), "up": (MLP, ar(f, 2 * f), None)}


expected_shapes = llama.expected_shapes


def checkpoint_shapes(c: Config) -> dict[str, tuple[int, ...]]:
    """HF's names and shapes, the fused matrices (what a GGUF holds)."""
    shapes = dict(expected_shapes(c))
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        for m, roles in ARCH.fused.items():
            parts = [shapes.pop(f"{p}{ARCH.modules[r]}.weight") for r in roles]
            shapes[f"{p}{m}.weight"] = (sum(s[0] for s in parts), parts[0][1])
    return shapes


def sanitize(weights: dict[str, np.ndarray], config: Config) -> dict[str, np.ndarray]:
    """Llama's, and each fused matrix split into our projections (a checkpoint already split,
    a training run's, passes as it is)."""
    out, rows = llama.sanitize(weights, config), fused_rows(config)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        fused = {m: out.pop(f"{p}{m}.weight") for m in ARCH.fused if f"{p}{m}.weight" in out}
        for role, (m, idx, gain) in rows.items():
            if m in fused:
                w = np.asarray(fused[m], np.float32)[idx]
                out[f"{p}{ARCH.modules[role]}.weight"] = w if gain is None else w * gain[:, None]
    return out


def unsanitize(weights: dict[str, np.ndarray], config: Config) -> dict[str, np.ndarray]:
    """Our projections fused back into HF's matrices (the inverse of `sanitize`; HF's pass as they are)."""
    out, rows = dict(weights), fused_rows(config)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        for m, roles in ARCH.fused.items():
            names = [f"{p}{ARCH.modules[r]}.weight" for r in roles]
            if not all(n in out for n in names):
                continue
            parts = [out.pop(n) for n in names]
            w = np.empty((sum(len(a) for a in parts), parts[0].shape[1]), np.float32)
            for r, a in zip(roles, parts):
                _, idx, gain = rows[r]
                w[idx] = a if gain is None else a / gain[:, None]
            out[f"{p}{m}.weight"] = w
    return out


def gguf_config(arch: str, get, path) -> dict:
    """Llama's keys, the rotated dimensions (of hidden / heads, as llama.cpp counts them), the
    window (0: none) and the original context; LongRoPE's factors are tensors (`gguf.py`)."""
    from .formats.gguf import llama_config

    hd = get("embedding_length") // get("attention.head_count")
    rot = int(get("rope.dimension_count", hd))
    d = llama_config(arch, lambda k, default=None: hd if k == "rope.dimension_count" else get(k, default), path)
    d.update(partial_rotary_factor=rot / hd, sliding_window=int(get("attention.sliding_window", 0)) or None,
             original_max_position_embeddings=int(get("rope.scaling.original_context_length", get("context_length"))))
    return d


class Model(llama.Model):
    """Llama's reference, in the config's window, with LongRoPE's factors chosen per sequence
    as HF chooses them (`rope.py`): a pass of n positions takes the long ones when n passes the
    original context, and the step a sequence passes it runs the whole sequence again."""

    def __init__(self, config: Config, weights: dict[str, np.ndarray]):
        super().__init__(config, weights)
        long = config.at_length(config.max_position_embeddings)
        self.long_freqs = None if long is config else layer_inv_freqs(long)

    def positions(self, pos: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        long = self.long_freqs is not None and int(pos.max()) + 1 > self.config.original_max_position_embeddings
        return per_distinct(self.long_freqs if long else self.inv_freqs, lambda inv: rope_tables(pos, inv))

    def new_cache(self):
        cache = super().new_cache()
        cache.ids = None if self.long_freqs is None else []  # the sequence, run again where LongRoPE switches
        return cache

    def prefill(self, ids, cache, last_only: bool = False) -> np.ndarray:
        ids, held = self._check_ids(ids, cache), getattr(cache, "ids", None)
        old, n = self.config.original_max_position_embeddings, len(ids)
        if self.long_freqs is not None and held is not None and 0 < cache.length <= old < cache.length + n:
            ids, cache.length = np.concatenate([np.asarray(held, np.int64), ids]), 0
            held.clear()
        logits = super().prefill(ids, cache, last_only)
        if held is not None:
            held.extend(ids.tolist())
        return logits if last_only else logits[-n:]


def build(config: Config, weights: dict[str, np.ndarray]) -> Model:
    return Model(config, weights)
