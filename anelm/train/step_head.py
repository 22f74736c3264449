"""The training step's ends: the embedding, the final norm, the classifier and its loss, wherever
the classifier runs (`head_on`: "cpu", `cpu_ops.head_loss`; "ane", `head_device.DeviceHead`, in
vocabulary tiles on the device; "gpu", `head_torch.TorchHead`, on torch's GPU device) and wherever
the embedding runs (`embed_on`: "cpu", or "gpu", `head_torch.TorchEmbedding`). A mixin of
`DeviceTrainStep`, whose state it reads."""

from __future__ import annotations

import numpy as np

from ..errors import UsageError
from . import cpu_ops as ops
from .head_device import DeviceHead, tile_rows
from .head_torch import TorchEmbedding, TorchHead, gpu_device

HEAD_PLACES = ("cpu", "ane", "gpu")  # what a step runs; `auto` is resolved before (placement.py)
EMBED_PLACES = ("cpu", "gpu")


class StepHead:
    """Where the classifier runs, and the step's head and embedding gradients."""

    def _open_head(self, head_on: str, device, embed_on: str = "cpu") -> None:
        if head_on not in HEAD_PLACES:
            raise UsageError(f"unknown head placement {head_on!r}; expected one of {', '.join(HEAD_PLACES)}")
        if embed_on not in EMBED_PLACES:
            raise UsageError(f"unknown embedding placement {embed_on!r}; expected one of {', '.join(EMBED_PLACES)}")
        self.head_on, self.embed_on, self._dhead, self._tembed = head_on, embed_on, None, None
        if head_on == "ane":
            v, d, width = self.cfg.vocab_size, self.dims.d, self.kernel_dims.s
            self._dhead = DeviceHead(device, v, d, self.dims.s, width, tile_rows(v, width))
        elif head_on == "gpu":
            self._dhead = TorchHead(gpu_device())
        if embed_on == "gpu":
            self._tembed = TorchEmbedding(gpu_device())
        self._restage_ends()

    def _restage_ends(self) -> None:
        """The weights the head and the embedding hold where they run away from the CPU's arrays."""
        if self._dhead is not None:
            self._dhead.set_weights(self._head())
        if self._tembed is not None:
            self._tembed.set_weights(self.w[self.embed])

    def _head_loss(self, head: np.ndarray, xf: np.ndarray, targets: np.ndarray, scale: float):
        """(loss, dxf, a call giving the classifier's dW or None) where the head runs."""
        name = self._head_name()
        keep, out = self._keep(name), self._out(name)
        if self._dhead is None:
            return ops.head_loss(head, xf, targets, scale, keep, self._count, out=out, add=self._add)
        self._flops += getattr(self._dhead, "flops", 0) * self._batch  # the ANE's tiles; not the GPU's
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

    def _embed_rows(self, ids: np.ndarray) -> np.ndarray:
        """The embedding's rows for ids, channel-first `[D, B·S]`, where the embedding runs."""
        if self._tembed is not None:
            return self._tembed.forward(ids)
        return ops.embed_fwd(self.w[self.embed], ids.reshape(-1))

    def _embed_bwd(self, dy: np.ndarray, ids: np.ndarray, grads: dict) -> None:
        """Scatter dy into the embedding grad (added to the classifier's when tied)."""
        name = self.embed
        if name not in grads:
            grads[name] = np.zeros_like(self.w[name])
        if self._tembed is not None:
            self._tembed.backward(dy, ids.reshape(-1), grads[name])
        else:
            ops.embed_bwd(dy, ids.reshape(-1), grads[name])
