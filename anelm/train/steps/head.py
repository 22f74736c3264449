"""The training step's ends: the embedding, the final norm, the classifier and its loss, wherever
the classifier runs (`head_on`: "cpu", `cpu_ops.head_loss`; "ane", `head_device.DeviceHead`, in
vocabulary tiles on the device; "gpu", `head_torch.TorchHead`, on torch's GPU device) and wherever
the embedding runs (`embed_on`: "cpu", or "gpu", `head_torch.TorchEmbedding`). A mixin of
`DeviceTrainStep`, whose state it reads."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ...errors import UsageError
from . import cpu_ops as ops
from .head_device import DeviceHead, tile_rows
from .head_torch import TorchEmbedding, TorchHead, gpu_device

HEAD_PLACES = ("cpu", "ane", "gpu")  # what a step runs; `auto` is resolved before (placement.py)
EMBED_PLACES = ("cpu", "gpu")
# what `_begin` sets for one batch, kept aside while the next batch's forward runs ahead
BATCH_STATE = ("_cos", "_sin", "_attn_masks", "_batch", "_count")


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
        self._ahead, self._head_pool = None, None  # the next batch's forward, run beside the GPU's head
        self._restage_ends()

    @property
    def head_runs_ahead(self) -> bool:
        """Whether `loss_and_grads(ahead=...)` runs the next micro-batch's forward while the head
        runs: the GPU's head only (the ANE's tiles need the device the forward needs; the CPU's
        would take the cores the forward's and dW's work use), with the step's own head."""
        return self.head_on == "gpu" and type(self)._loss_head is StepHead._loss_head

    def _run_ahead(self, x: np.ndarray, y: np.ndarray, positions=None) -> None:
        """The forward of the batch the next `loss_and_grads` gets (`x`, by identity), kept for
        it; this call's batch state restored, its stats holding the forward's time and work."""
        kept = {k: getattr(self, k) for k in (*BATCH_STATE, "_t", "_flops")}
        self._begin(x, y, positions)
        self._ahead = (x, self._forward(np.asarray(x), keep=True))
        t, flops = self._t, self._flops
        for k, v in kept.items():
            setattr(self, k, v)
        self._t, self._flops = {k: v + t[k] for k, v in kept["_t"].items()}, kept["_flops"] + flops

    def _take_ahead(self, x: np.ndarray):
        """(xl, caches) of `x` if the previous call ran its forward ahead, else None."""
        ahead, self._ahead = self._ahead, None
        return ahead[1] if ahead is not None and ahead[0] is x else None

    def _close_ends(self) -> None:
        if self._dhead is not None and hasattr(self._dhead, "close"):
            self._dhead.close()
        if self._head_pool is not None:
            self._head_pool.shutdown()
            self._head_pool = None

    def _restage_ends(self) -> None:
        """The weights the head and the embedding hold where they run away from the CPU's arrays."""
        if self._dhead is not None:
            self._dhead.set_weights(self._head())
        if self._tembed is not None:
            self._tembed.set_weights(self.w[self.embed])

    def _head_loss(self, head: np.ndarray, xf: np.ndarray, targets: np.ndarray, scale: float):
        """(loss, dxf, a call giving the classifier's dW or None) where the head runs."""
        return self._head_call(head, xf, targets, scale)()

    def _head_call(self, head: np.ndarray, xf: np.ndarray, targets: np.ndarray, scale: float):
        """`_head_loss` as a call with this batch's state bound, to run on another thread."""
        name = self._head_name()
        keep, out, count, add = self._keep(name), self._out(name), self._count, self._add
        if self._dhead is None:
            return lambda: ops.head_loss(head, xf, targets, scale, keep, count, out=out, add=add)
        self._flops += getattr(self._dhead, "flops", 0) * self._batch  # the ANE's tiles; not the GPU's
        return lambda: self._dhead.loss_and_grads(head, xf, targets, scale, count, keep, out, add)

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

    def _loss_head(self, xl: np.ndarray, targets: np.ndarray, scale: float, beside=None):
        """Final norm, classifier, loss: (loss, dy into the last layer, {norm grad}, a call giving
        the classifier's dW, or None when its gradient is not kept: `ops.head_loss`). `beside`:
        a call run on this thread while the head runs on the head's own (`head_runs_ahead`)."""
        wn, head = self._final_gain(), self._head()
        xf, rf = ops.rmsnorm_fwd(xl, wn, self.cfg.rms_norm_eps)
        if beside is None:
            loss, dxf, head_dw = self._head_loss(head, xf, targets, scale)
        else:
            if self._head_pool is None:
                self._head_pool = ThreadPoolExecutor(1, thread_name_prefix="anelm-head")
            job = self._head_pool.submit(self._head_call(head, xf, targets, scale))
            beside()
            loss, dxf, head_dw = job.result()
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
