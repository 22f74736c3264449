"""The attention kernels of a training step, and where the probabilities wait for the backward.

A mixin of the step classes (`llama.DeviceTrainStep` and those built on it), which hold `bank`,
`kernel_dims`, `n_layers`, `_batch` and `_dev`. With carried probabilities (`Dims.carry_probs`)
sdpa_bwd takes the forward's instead of recomputing them. Where two slots of every layer's, for
each sequence of the batch, fit the budget (`kernels.training_layout.resident_fits`), they stay on
the device (`KernelBank.run(slot=)`): no read back after the forward, no write before the
backward. Each kept forward takes the slot the one before it did not, since a micro-batch's
forward may run beside the last one's head, before that one's backward (`head.StepHead`): of
two forwards whose backward is pending, never the same slot. Else they wait on the host.
"""

from __future__ import annotations

import numpy as np

from ...kernels.training import resident_fits


class StepAttention:
    """`_attend` and `_attend_bwd` of one layer; `_forward` takes a slot per kept forward."""

    _parity = 0
    _slot: int | None = None  # the slot of the forward running now (`_take_slot`)

    def _take_slot(self, keep: bool) -> None:
        """Before a forward: the slot its probabilities stay in, or None (kept on the host where
        carried, or not kept: an evaluation's forward)."""
        self._slot = None
        if keep and resident_fits(self.kernel_dims, self.n_layers, self._batch):
            self._parity ^= 1
            self._slot = self._parity

    def _attend(self, i: int, c: dict) -> np.ndarray:
        """Layer i's attention output from its cache's q, k (`c["att"]`) and v; the probabilities
        stay on the device or in the cache for the backward where the kernels carry them."""
        c["slot"] = self._slot
        out = self._dev("sdpa_fwd", i, slot=c["slot"], **c["att"], v=c["v"])
        if "probs" in out:
            c["probs"] = out["probs"]
        return out["attn"]

    def _attend_bwd(self, i: int, c: dict, dattn: np.ndarray) -> dict[str, np.ndarray]:
        """sdpa_bwd of layer i: dq, dk, dv (before the CPU's inverse RoPE, if it rotates)."""
        carried = {"probs": c["probs"]} if "probs" in c else {}
        return self._dev("sdpa_bwd", i, slot=c.get("slot"), **c["att"], v=c["v"], dattn=dattn, **carried)
