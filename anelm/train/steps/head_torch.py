"""The classifier with its loss, and the embedding, on a torch device (`--head-on gpu`,
`--embed-on gpu`): the Mac's GPU through torch's `mps`, or CUDA where present.

    head = TorchHead(torch_device)
    head.set_weights(W)                       # W [V, D]: the device's copy, restaged per update
    loss, dxf, dw_call = head.loss_and_grads(W, xf, targets, scale, count, want_dw, out, add)

The same contract as `cpu_ops.head_loss` (the loss over the counted targets, gradients times the
loss scale, dW as a call the step's worker runs) and the same arithmetic in float32: logits, a
max-shifted softmax, (softmax − onehot)·scale/count, dx = Wᵀ·dlogits. dW = dlogits·xfᵀ is left to
the call: on a GPU the product runs there while the ANE runs the layers' backward, and the call,
on the CPU's dW worker, waits for it and writes it into the gradient buffer. Past HEAD_CHUNK
logits the positions go in chunks, as on the CPU, and dW accumulates on the device.

Which torch device "gpu" means (`gpu_device`): `mps`, else `cuda`; `ANELM_GPU` names another
(`cpu` runs the same path on the host: how the tests and this machine exercise it).
"""

from __future__ import annotations

import os

import numpy as np

from ...errors import UsageError
from .cpu_ops import HEAD_CHUNK, IGNORE

F32 = np.float32


def _torch():
    try:
        import torch
    except ImportError:
        raise UsageError("--head-on gpu / --embed-on gpu need torch; expected it installed "
                         "(pip install 'torch==2.13.0')") from None
    return torch


def gpu_device(name: str | None = None) -> str:
    """The torch device `gpu` means here: `name`, else $ANELM_GPU, else mps, else cuda."""
    torch = _torch()
    name = name or os.environ.get("ANELM_GPU")
    if name:
        try:
            torch.empty(1, device=name)
        except (RuntimeError, ValueError) as e:
            raise UsageError(f"ANELM_GPU={name!r}: torch cannot use that device ({str(e).splitlines()[0]})") from None
        return name
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return "mps"
    if torch.cuda.is_available():
        return "cuda"
    raise UsageError("gpu placement: torch finds no GPU here (neither mps nor cuda); expected a Mac "
                     "with Metal or a CUDA device, or --head-on/--embed-on ane|cpu")


class TorchHead:
    """The classifier's weight on the torch device, and the loss with its gradients there."""

    def __init__(self, device: str):
        self.torch, self.device, self._w = _torch(), device, None

    def set_weights(self, head: np.ndarray) -> None:
        # a copy on every device (on `cpu` too): what the device holds is what was staged
        self._w = self.torch.tensor(np.asarray(head, F32), device=self.device)

    def loss_and_grads(self, head: np.ndarray, xf: np.ndarray, targets: np.ndarray, scale: float = 1.0,
                       count: int | None = None, want_dw: bool = True, out: np.ndarray | None = None,
                       add: bool = False):
        """(loss, dxf `[D, N]`, a call giving dW `[V, D]` or None): `cpu_ops.head_loss`'s contract."""
        torch, w = self.torch, self._w
        v, n = w.shape[0], xf.shape[1]
        t = np.asarray(targets).reshape(-1)
        keep = t != IGNORE
        count = int(keep.sum()) if count is None else count
        k = float(F32(scale) / F32(max(count, 1)))
        x = torch.from_numpy(np.ascontiguousarray(xf, F32)).to(self.device)
        tk = torch.from_numpy(np.where(keep, t, 0)).to(self.device)
        kept = torch.from_numpy(keep).to(self.device)
        step = max(1, HEAD_CHUNK // v)
        loss, dx, dw, last = 0.0, torch.empty_like(x), None, None
        for lo in range(0, n, step):
            cols = slice(lo, min(n, lo + step))
            logits = w @ x[:, cols]                                   # [V, n]
            mx = logits.amax(dim=0)
            p = torch.exp(logits - mx)
            z = p.sum(dim=0)
            idx = torch.arange(logits.shape[1], device=self.device)
            each = torch.log(z) - (logits[tk[cols], idx] - mx)
            loss += float(each[kept[cols]].cpu().numpy().sum(dtype=np.float64))  # mps has no float64
            p *= (k / z) * kept[cols]                                 # ignored columns: no gradient
            p[tk[cols], idx] -= k * kept[cols]
            dx[:, cols] = w.T @ p
            if want_dw and lo + step < n:  # more chunks: accumulate on the device
                dw = p @ x[:, cols].T if dw is None else dw.addmm_(p, x[:, cols].T)
            last = (p, cols)
        dxf = dx.cpu().numpy()
        if not want_dw:
            return loss / max(count, 1), dxf, None

        def dw_call():
            p, cols = last
            total = p @ x[:, cols].T if dw is None else dw.addmm_(p, x[:, cols].T)
            return _into(total, out, add)
        return loss / max(count, 1), dxf, dw_call


def _into(grad, out: np.ndarray | None, add: bool) -> np.ndarray:
    """The device's gradient as the CPU's buffer holds it: written into `out`, added to it, or new."""
    g = grad.cpu().numpy()
    if out is None:
        return g
    if add:
        out += g
    else:
        out[...] = g
    return out


class TorchEmbedding:
    """The embedding's gather and scatter-add on the torch device (the table restaged per update)."""

    def __init__(self, device: str):
        self.torch, self.device, self._w = _torch(), device, None

    def set_weights(self, table: np.ndarray) -> None:
        self._w = self.torch.tensor(np.asarray(table, F32), device=self.device)

    def forward(self, ids: np.ndarray) -> np.ndarray:
        """Rows of the table for ids `[N]`, channel-first `[D, N]` (`cpu_ops.embed_fwd`)."""
        i = np.asarray(ids).reshape(-1)
        if i.size and (i.min() < 0 or i.max() >= self._w.shape[0]):
            raise UsageError(f"embedding: expected token ids in [0, {self._w.shape[0]}), got [{i.min()}, {i.max()}]")
        return np.ascontiguousarray(self._w[self.torch.from_numpy(i).to(self.device)].T.cpu().numpy())

    def backward(self, dy: np.ndarray, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Scatter-add dy `[D, N]` into `out` `[V, D]` (`cpu_ops.embed_bwd`): on the device, then
        the rows it touched added to the CPU's buffer."""
        torch = self.torch
        i = torch.from_numpy(np.asarray(ids).reshape(-1)).to(self.device)
        rows, inverse = torch.unique(i, return_inverse=True)
        part = torch.zeros((rows.shape[0], dy.shape[0]), dtype=torch.float32, device=self.device)
        part.index_add_(0, inverse, torch.from_numpy(np.ascontiguousarray(dy.T, F32)).to(self.device))
        out[rows.cpu().numpy()] += part.cpu().numpy()
        return out
