"""The training step's ends: the embedding, the final norm, the classifier and its loss, wherever
the classifier runs (`head_on`: "cpu", `cpu_ops.head_loss`; "ane", `head_device.DeviceHead`, in
vocabulary tiles on the device). A mixin of `DeviceTrainStep`, whose state it reads."""

from __future__ import annotations

import numpy as np

from ..errors import UsageError
from . import cpu_ops as ops
from .head_device import DeviceHead, tile_rows

HEAD_PLACES = ("cpu", "ane")  # what a step runs; `auto` and `gpu` are resolved before (placement.py)


class StepHead:
    """Where the classifier runs, and the step's head and embedding gradients."""

    def _open_head(self, head_on: str, device) -> None:
        if head_on not in HEAD_PLACES:
            raise UsageError(f"unknown head placement {head_on!r}; expected one of {', '.join(HEAD_PLACES)}")
        self.head_on, self._dhead = head_on, None
        if head_on == "ane":
            v, d, width = self.cfg.vocab_size, self.dims.d, self.kernel_dims.s
            self._dhead = DeviceHead(device, v, d, self.dims.s, width, tile_rows(v, width))
            self._dhead.set_weights(self._head())

    def _head_loss(self, head: np.ndarray, xf: np.ndarray, targets: np.ndarray, scale: float):
        """(loss, dxf, a call giving the classifier's dW or None) where the head runs."""
        name = self._head_name()
        keep, out = self._keep(name), self._out(name)
        if self._dhead is None:
            return ops.head_loss(head, xf, targets, scale, keep, self._count, out=out, add=self._add)
        self._flops += self._dhead.flops * self._batch
        return self._dhead.loss_and_grads(head, xf, targets, scale, self._count, keep, out, self._add)

    def _head_name(self) -> str:
        """The classifier's weight: the head, or the embedding when the two are tied."""
        return self.head if self.head in self.w else self.embed

    def _head(self) -> np.ndarray:
        return self.w[self._head_name()]

    def _final_gain(self) -> np.ndarray:
        """The final norm's gain as applied (its weight here; Gemma's is 1 + w)."""
        return self.w[self.final_norm]

    def _logits(self, xl: np.ndarray) -> np.ndarray:
        xf = ops.rmsnorm_fwd(xl, self._final_gain(), self.cfg.rms_norm_eps)[0]
        return ops.classifier_fwd(self._head(), xf)

    def _loss_head(self, xl: np.ndarray, targets: np.ndarray, scale: float):
        """Final norm, classifier, loss: (loss, dy into the last layer, {norm grad}, a call giving
        the classifier's dW, or None when its gradient is not kept: `ops.head_loss`)."""
        wn, head = self._final_gain(), self._head()
        xf, rf = ops.rmsnorm_fwd(xl, wn, self.cfg.rms_norm_eps)
        loss, dxf, head_dw = self._head_loss(head, xf, targets, scale)
        dy, dwn = ops.rmsnorm_bwd(dxf, xl, wn, rf)
        return loss, dy, {self.final_norm: dwn}, head_dw

    def _embed_bwd(self, dy: np.ndarray, ids: np.ndarray, grads: dict) -> None:
        """Scatter dy into the embedding grad (added to the classifier's when tied)."""
        name = self.embed
        if name not in grads:
            grads[name] = np.zeros_like(self.w[name])
        ops.embed_bwd(dy, ids.reshape(-1), grads[name])
