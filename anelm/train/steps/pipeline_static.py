"""The static pipeline: weights baked into each layer's kernels as BLOBFILE consts.

The same eight weighted computations as the dynamic pipeline (`anelm/kernels/training.py`), but the weight
blocks are 1×1 conv consts, so there is one compiled program per (kernel, layer) and a weight
update has to reach the device again:
- `strict` reads weights when a program is compiled (`reload_reads_new_weights = false`;
  docs/chip-profiles.md), so every update recompiles all 8·L programs: `compiles_per_update = 8·L`.
  The trainer compares `compile_count() + compiles_per_update` with the profile's budget (115
  cold compiles in `strict`) and restarts itself (checkpoint + `os.execv`) before a
  compile would raise: a 2-layer model (16 per update) restarts about every 6 updates,
  a 12-layer one (96 per update) before every update.
- a profile whose reloads read rewritten blobs gets the cheaper path: the new blobs are
  written into the program's compile folder (`device.rewrite_weight`), then unload + load.
  No compile: `compiles_per_update = 0`.

Each (kernel, layer) program lives in its own `ProgramCache`: layers never share a compiled
program (a blob rewrite must reach one layer only), and closing a replaced kernel unloads it.
The two weightless attention kernels compile once, as in the dynamic pipeline.

LoRA keeps the base frozen, so its static kernels compile once (8·L + 2) and never again:
the adapter blocks are inputs here too (`kernels.training`), staged by `stage_adapters`.
"""

from __future__ import annotations

import numpy as np

from ...compiler.pipeline import compile_graph
from ...errors import BlobError
from ...kernels.families import Family
from ...kernels.training import Dims, LoraLayout, build_graph, layer_mats, weighted_kinds
from ...runtime.cache import ProgramCache
from ...runtime.kernel import Kernel
from .kernels_bank import KernelBank


class StaticBank(KernelBank):
    dynamic = False

    def __init__(self, dims: Dims, device, weights: dict[str, np.ndarray], n_layers: int, family: Family,
                 lora: LoraLayout | None = None, windows: tuple[int | None, ...] | None = None):
        super().__init__(dims, device, n_layers, family, lora, windows)
        self.reload = bool(device.profile.reload_reads_new_weights)
        self.compiles_per_update = 0 if self.reload else len(weighted_kinds(dims)) * n_layers
        self._slots: dict[tuple[str, int], tuple[Kernel, ProgramCache]] = {}
        for kind in weighted_kinds(dims):
            for layer in range(n_layers):
                self._compile(kind, layer, weights)

    def _graph(self, kind: str, layer: int, weights: dict[str, np.ndarray]):
        return build_graph(kind, self.dims, layer_mats(kind, weights, layer, self.family, self.dims),
                           lora=self.lora)

    def _compile(self, kind: str, layer: int, weights: dict[str, np.ndarray]) -> None:
        """A fresh program for one (kernel, layer); the one it replaces is closed and unloaded."""
        cache = ProgramCache(capacity=1)
        kern = self._open(kind, self._graph(kind, layer, weights), cache=cache)
        old = self._slots.get((kind, layer))
        self._slots[(kind, layer)] = (kern, cache)
        self._req[(kind, layer)] = kern.request()
        if old is not None:
            self._drop(*old)

    def _drop(self, kern: Kernel, cache: ProgramCache) -> None:
        kern.close()
        cache.clear()  # unload now rather than when the cache object is collected
        self._kernels.remove(kern)

    def _reload(self, kind: str, layer: int, weights: dict[str, np.ndarray]) -> None:
        """Rewrite the program's blobs in place and reload it (profiles that allow it)."""
        kern, _ = self._slots[(kind, layer)]
        new = compile_graph(self._graph(kind, layer, weights), self.device.profile)
        if set(new.weights) != set(kern.artifact.weights):
            raise BlobError(f"{kind} layer {layer}: expected blobs {sorted(kern.artifact.weights)}, "
                            f"the rebuilt program has {sorted(new.weights)}")
        for path, blob in new.weights.items():
            self.device.rewrite_weight(kern.model, path, blob)
        self.device.unload(kern.model)
        self.device.load(kern.model)

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        for kind in weighted_kinds(self.dims):
            for layer in range(self.n_layers):
                (self._reload if self.reload else self._compile)(kind, layer, weights)

    def close(self) -> None:
        for kern, cache in self._slots.values():
            kern.close()
            cache.clear()
        self._slots.clear()
        super().close()
