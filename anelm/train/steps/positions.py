"""What a step's layers need about the positions: RoPE's tables and where RoPE runs (on the CPU,
or inside the attention kernels: `Dims.rope`), and a packed step's attention masks.

A mixin of the step classes (`llama.DeviceTrainStep` and those built on it), which hold `cfg`,
`dims`, `kernel_dims`, `packed` and `windows`; GPT-2 keeps its learned positions in `_tables`' place.
"""

from __future__ import annotations

import numpy as np

from ...kernels.attention import example_mask
from ...models.layers import layer_inv_freqs, per_distinct, rope_full_width, rope_tables
from . import cpu_ops as ops


class StepPositions:
    """Per batch: the tables (`_take_positions`), then per layer RoPE forward and backward."""

    def _take_positions(self, positions: np.ndarray | None) -> None:
        """The batch's tables and masks; unpacked batches (every row at 0..S-1) share them by size."""
        if positions is None:
            if self._batch not in self._tables_cache:
                pos = np.tile(np.arange(self.dims.s), (self._batch, 1))
                self._tables_cache[self._batch] = self._tables(pos.reshape(-1)), self._example_masks(pos)
            (self._cos, self._sin), self._attn_masks = self._tables_cache[self._batch]
        else:
            pos = np.asarray(positions, dtype=np.int64)
            (self._cos, self._sin), self._attn_masks = self._tables(pos.reshape(-1)), self._example_masks(pos)

    def _tables(self, pos: np.ndarray):
        """What the layers need about the positions `[B·S]`: each layer's RoPE cos, sin `[hd, B·S]`
        (HF half-split, rows i and i + hd/2 equal), one pair per distinct RoPE (`config.rope(i)`)."""
        def full(inv):
            cos, sin = rope_tables(pos, inv)
            return rope_full_width(cos), rope_full_width(sin)

        return per_distinct(layer_inv_freqs(self.cfg), full), None

    def _rope(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self._cos[i]  # where `_begin` keeps `_tables`' first entry

    def _attention_inputs(self, i: int, q: np.ndarray, k: np.ndarray) -> dict[str, np.ndarray]:
        """q and k as layer i's attention kernels take them: rotated here, or as they are beside
        the RoPE tables where the kernels rotate (`Dims.rope`)."""
        cos, sin = self._rope(i)
        if self.kernel_dims.rope:
            return {"qr": q, "kr": k, "cos": cos, "sin": sin}
        return {"qr": ops.rope_fwd(q, cos, sin), "kr": ops.rope_fwd(k, cos, sin)}

    def _unrotated(self, i: int, g: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """sdpa_bwd's dq, dk as gradients of q and k before RoPE (the kernel's own where it rotates)."""
        if self.kernel_dims.rope:
            return g["dq"], g["dk"]
        cos, sin = self._rope(i)
        return ops.rope_bwd(g["dq"], cos, sin), ops.rope_bwd(g["dk"], cos, sin)

    def _example_masks(self, pos: np.ndarray) -> dict | None:
        """A packed step's attention masks: window -> `[B, S_k, S_k]` at the kernels' width."""
        if not self.packed:
            return None
        width = self.kernel_dims.s
        return {w: np.stack([example_mask(row, width, w) for row in pos]) for w in dict.fromkeys(self.windows)}
