"""The CPU causal LM skeleton shared by every architecture, and the weight check.

An architecture subclasses `CausalLM` and fills in four steps: `positions` (what each layer
needs to know about the token positions, e.g. RoPE tables), `embed`, `block` and `head`.
The skeleton runs them in order and implements the Runner interface
(`anelm.generate.runner.Runner`): `new_cache`, `prefill`, `decode`, plus `forward`.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .errors import ContextError, InputError, LoadError
from .layers import KVCache, linear
from .names import model_weight


def check_weights(weights: dict[str, np.ndarray], expected: dict[str, tuple[int, ...]],
                  source: str = "weights", consume: bool = False) -> dict[str, np.ndarray]:
    """Every expected key present with its shape; returns them as contiguous float32.

    Keys not in `expected` are dropped: checkpoints carry buffers and optimizer state.
    `consume`: the caller gives `weights` up, and each key leaves it once converted, so a
    tensor read from a file map is released as soon as its copy exists (a GPT-2 folder's
    Conv1D matrices are transposed copies: holding every map to the end held the model twice).
    """
    missing = [k for k in expected if k not in weights]
    if missing:
        more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        raise LoadError(f"{source}: missing weights {', '.join(missing[:3])}{more}")
    for k, shape in expected.items():
        got = tuple(np.shape(weights[k]))
        if got != tuple(shape):
            raise LoadError(f"{source}: weight {k} has shape {got}, expected {tuple(shape)}")
    if consume:
        return {k: np.ascontiguousarray(weights.pop(k), dtype=np.float32) for k in expected}
    return {k: np.ascontiguousarray(weights[k], dtype=np.float32) for k in expected}


def init_weights(expected: dict[str, tuple[int, ...]], seed: int = 0, std: float = 0.02) -> dict[str, np.ndarray]:
    """Random weights for `expected`: norm scales 1, biases 0, matrices N(0, std)."""
    rng = np.random.default_rng(seed)
    out = {}
    for k, shape in expected.items():
        if k.endswith(".bias"):
            out[k] = np.zeros(shape, np.float32)
        elif len(shape) == 1:
            out[k] = np.ones(shape, np.float32)
        else:
            out[k] = (rng.standard_normal(shape) * std).astype(np.float32)
    return out


class CausalLM:
    """float32 numpy forward with a KV cache. `device` is what `anelm generate` reports."""

    device = "cpu"
    adapter = None  # the LoRA adapter (`adapters.Adapter`) on the projections, or None

    def __init__(self, config: Any, weights: dict[str, np.ndarray]):
        self.config = config
        self.weights = check_weights(weights, self.expected_shapes(config), f"{config.model_type} weights")

    def set_adapter(self, adapter: Any) -> None:
        """Run with `adapter` from now on (None: the base alone); the base weights stay as they are."""
        if adapter is not None:
            from .adapters import check_fits

            check_fits(adapter, self.config)
        self.adapter = adapter

    def adapted(self, module: str, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """y = W x of projection `module` plus the adapter's scale · B (A x) where it has one."""
        delta = None if self.adapter is None else self.adapter.delta(module, x)
        return y if delta is None else y + delta

    @staticmethod
    def expected_shapes(config: Any) -> dict[str, tuple[int, ...]]:
        raise NotImplementedError

    # --- the four architecture steps ---
    def positions(self, pos: np.ndarray) -> Any:
        return pos

    def embed(self, ids: np.ndarray, pos: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def block(self, i: int, x: np.ndarray, ctx: Any, cache: KVCache) -> np.ndarray:
        raise NotImplementedError

    def final_norm(self, x: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def head(self, x: np.ndarray) -> np.ndarray:
        """Final norm, then the vocabulary projection by the weight named `head_name`."""
        return linear(self.final_norm(x), self.weights[self.head_name])

    @property
    def head_name(self) -> str:
        """The weight the head multiplies by: the embedding when the two are tied."""
        return model_weight(self.config.model_type, "embed" if self.config.tie_word_embeddings else "head")

    # --- Runner interface ---
    def new_cache(self) -> KVCache:
        c = self.config
        return KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, c.max_position_embeddings)

    def prefill(self, ids: Sequence[int], cache: KVCache, last_only: bool = False) -> np.ndarray:
        """Run `ids` at positions cache.length.. and store their K/V; logits [T, V] ([1, V] if last_only)."""
        ids = self._check_ids(ids, cache)
        pos = np.arange(cache.length, cache.length + len(ids))
        ctx = self.positions(pos)
        x = self.embed(ids, pos)  # [T, C]
        for i in range(self.config.num_hidden_layers):
            x = self.block(i, x, ctx, cache)
        cache.advance(len(ids))
        return self.head(x[-1:] if last_only else x)

    def decode(self, token: int, cache: KVCache) -> np.ndarray:
        """One token at position cache.length; logits [V]."""
        return self.prefill([token], cache)[0]

    def stream_peak(self, ids: Sequence[int]) -> float:
        """The largest magnitude that the residual stream, or one layer's update to it, takes
        over `ids`: what the device's fp16 stream must hold (`kernels.layers.stream_scale_for`)."""
        ids = self._check_ids(ids, self.new_cache())
        cache, pos = self.new_cache(), np.arange(len(ids))
        ctx, x = self.positions(pos), self.embed(ids, pos)
        peak = float(np.abs(x).max())
        for i in range(self.config.num_hidden_layers):
            y = self.block(i, x, ctx, cache)
            peak, x = max(peak, float(np.abs(y).max()), float(np.abs(y - x).max())), y
        return peak

    def stream_bound(self) -> float | None:
        """A bound on the residual stream that holds for every input, where the architecture
        gives one from its weights (post-norm models); None here: a pre-norm stream grows by
        what the o and down projections write, which only a measurement bounds in practice."""
        return None

    def forward(self, ids: Sequence[int]) -> np.ndarray:
        """Logits [T, V] of every position, from an empty cache."""
        return self.prefill(ids, self.new_cache())

    def _check_ids(self, ids: Sequence[int], cache: KVCache) -> np.ndarray:
        a = np.asarray(ids, dtype=np.int64).reshape(-1)
        v = self.config.vocab_size
        if a.size == 0:
            raise InputError("no tokens to run: expected at least one token id")
        if a.min() < 0 or a.max() >= v:
            bad = int(a[(a < 0) | (a >= v)][0])
            raise InputError(f"token id {bad} is out of range: expected 0 <= id < vocab_size {v}")
        if cache.length + a.size > cache.capacity:
            raise ContextError(f"{cache.length + a.size} positions exceed the model's context of {cache.capacity}")
        return a
