"""The Runner interface: what generation needs from a model, on any device.

The CPU reference (`anelm.models.base.CausalLM`, built by `anelm.models.loading.build_model`)
implements it in numpy; a device pipeline (kernels on the emulator or the ANE) implements it
with compiled prefill buckets and a decode kernel. `generate_step` only talks to this.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np


@runtime_checkable
class Cache(Protocol):
    """A runner's KV cache; the layout is the runner's business."""

    length: int  # positions stored so far; the next token runs at this position
    capacity: int  # most positions it can hold: the model's context


@runtime_checkable
class Runner(Protocol):
    config: Any  # the model's config (anelm.models.config), HF field names
    device: str  # "cpu", "emulator" or "ane": what `anelm generate` reports

    def new_cache(self) -> Cache:
        """An empty cache for one sequence."""
        ...

    def prefill(self, ids: Sequence[int], cache: Cache, last_only: bool = False) -> np.ndarray:
        """Run `ids` at positions cache.length.. and store their keys and values, advancing
        cache.length by len(ids). Returns float32 logits [len(ids), V], or [1, V] for the last
        position only when `last_only` (generation needs no more)."""
        ...

    def decode(self, token: int, cache: Cache) -> np.ndarray:
        """Run one token at position cache.length, advancing it by one. Returns logits [V]."""
        ...

    def set_adapter(self, adapter: Any) -> None:
        """Run with LoRA `adapter` (`anelm.models.adapters.Adapter`) from now on; None runs the
        base alone. The base weights stay as they are and nothing is compiled: a device runner
        restages its kernels' adapter inputs (docs/fine-tuning.md). An adapter that does not fit the
        base (or the device runner's adapter slots) raises AdapterError."""
        ...


def make_runner(config: Any, weights: dict[str, np.ndarray], device: str = "auto",
                max_context: int | None = None, profile: Any = None, adapter: Any = None,
                consume: bool = False) -> Runner:
    """The device pipeline's runner (`anelm.generate.pipeline.build_runner`) when that module
    exists, else the CPU numpy reference; `runner.device` says which one was built.
    `max_context` caps the device pipeline's cache and program sizes; `profile` is the chip
    profile of the device (a ChipProfile; None: ANELM_PROFILE, else strict); `adapter` a LoRA
    adapter (`anelm.models.adapters`) the runner starts with (`set_adapter` swaps it); `consume`:
    the caller gives `weights` up, and the device runner empties it of what it converts."""
    name = f"{__package__}.pipeline"
    try:
        pipeline = importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name:
            raise  # the pipeline exists but something it needs is missing: say so
        from ..models.loading import build_model

        model = build_model(config, weights)
        model.set_adapter(adapter)
        return model
    extra = {} if adapter is None else {"adapter": adapter}  # a pipeline without adapters still serves the base
    return pipeline.build_runner(config, weights, device, max_context, profile=profile, consume=consume, **extra)
