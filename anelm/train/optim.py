"""AdamW on float32 master weights, gradient clipping and accumulation.

Parameters and gradients are dicts of float32 arrays keyed by HF weight names, in PyTorch
orientation (`[out, in]` for linear weights). The update follows `torch.optim.AdamW` op for
op, in float32 with the same rounding order, so a test can hold it to float32 round-off:

    w ← w·(1 − lr·wd)                      decoupled decay, before the moment updates
    m ← m + (1 − β1)·(g − m)               torch's lerp
    v ← v·β2 + ((1 − β2)·g)·g
    w ← w + (−lr/(1 − β1ᵗ))·m / (√v / √(1 − β2ᵗ) + ε)

eps is added after the bias-corrected √v, as torch does.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable

import numba
import numpy as np

from ..errors import ShapeError
from ..runtime.threads import pass_workers
from .errors import CheckpointError
from .scaler import grads_finite

F32 = np.float32
CHUNK = 1 << 16  # elements per AdamW job: a few thousand jobs in all, shared out to the workers
# chunks are independent, and the compiled update releases the GIL: one worker per core
WORKERS = pass_workers()


@numba.njit(nogil=True, cache=True)
def _adamw_update(p, g, m, v, gs, decay, c1, b2, c2, value, bc2s, eps):  # pragma: no cover - jitted
    """One pass over 1-D float32 chunks, the float32 operations of the module doc in torch's
    order (every operand is float32, so every intermediate is rounded to float32 as in torch)."""
    for i in range(p.size):
        gi = g[i] * gs
        mi = m[i] + (gi - m[i]) * c1
        vi = v[i] * b2 + (gi * c2) * gi
        m[i] = mi
        v[i] = vi
        p[i] = p[i] * decay + (mi * value) / (np.sqrt(vi) / bc2s + eps)


def default_no_decay(name: str, shape: tuple[int, ...]) -> bool:
    """Norm weights and biases (1-D) are not decayed; matrices and embeddings are."""
    return len(shape) < 2


def param_groups(params: dict[str, np.ndarray], weight_decay: float,
                 no_decay: Callable[[str, tuple], bool] = default_no_decay) -> list[dict]:
    """Two torch-style groups: `{"names": [...], "weight_decay": wd}` and the undecayed rest."""
    decay = [n for n, p in params.items() if not no_decay(n, p.shape)]
    rest = [n for n, p in params.items() if no_decay(n, p.shape)]
    return [{"names": decay, "weight_decay": float(weight_decay)},
            {"names": rest, "weight_decay": 0.0}]


class AdamW:
    """torch.optim.AdamW (amsgrad off, maximize off) over a dict of float32 master weights.

    `params` are updated in place by `step`. `groups` defaults to `param_groups(params, wd)`;
    each group only sets weight decay, since the schedule gives one lr to all of them.
    """

    def __init__(self, params: dict[str, np.ndarray], lr: float = 3e-4,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.1, groups: list[dict] | None = None):
        for name, p in params.items():
            if p.dtype != F32 or not p.flags.c_contiguous:
                raise ShapeError(f"AdamW: expected a C-contiguous float32 master weight {name}, "
                                 f"got {p.dtype}")
        self.params = params
        self.lr, self.betas, self.eps = float(lr), (float(betas[0]), float(betas[1])), float(eps)
        self._set_groups(groups if groups is not None else param_groups(params, weight_decay))
        self.t = 0
        self.exp_avg = {n: np.zeros_like(p) for n, p in params.items()}
        self.exp_avg_sq = {n: np.zeros_like(p) for n, p in params.items()}
        self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="anelm-adamw") if WORKERS > 1 else None

    def step(self, grads: dict[str, np.ndarray], lr: float | None = None, grad_scale: float = 1.0) -> None:
        """One update with gradients `grad_scale · grads` (`update_scale` gives the factor that
        unscales and clips in the same pass); `lr` overrides `self.lr`. grads are not modified."""
        if lr is not None:
            self.lr = float(lr)
        for name, p in self.params.items():
            g = grads.get(name)
            if g is None or g.shape != p.shape:
                got = "none" if g is None else list(g.shape)
                raise ShapeError(f"AdamW: expected gradient {name} of shape {list(p.shape)}, got {got}")
        self.t += 1
        b1, b2 = self.betas
        consts = (F32(1.0 - b1), F32(b2), F32(1.0 - b2), F32(-self.lr / (1.0 - b1 ** self.t)),
                  F32(math.sqrt(1.0 - b2 ** self.t)), F32(self.eps))
        # every chunk's arithmetic is the same whichever worker runs it: threads change no bit
        grads = {n: np.ascontiguousarray(grads[n], dtype=F32).reshape(-1) for n in self.params}
        jobs = [(name, lo) for name, p in self.params.items() for lo in range(0, p.size, CHUNK)]
        parts = [(jobs[i::WORKERS], grads, F32(grad_scale), consts) for i in range(WORKERS)]
        if self._pool is None:
            self._update(*parts[0])
        else:
            for f in [self._pool.submit(self._update, *part) for part in parts]:
                f.result()

    def _update(self, jobs, grads, gs, consts) -> None:
        for name, lo in jobs:
            decay = F32(1.0 - self.lr * self.wd[name])  # exactly 1 without decay: p·1 is p
            hi = lo + CHUNK
            _adamw_update(self.params[name].reshape(-1)[lo:hi], grads[name][lo:hi],
                          self.exp_avg[name].reshape(-1)[lo:hi], self.exp_avg_sq[name].reshape(-1)[lo:hi],
                          gs, decay, *consts)

    def state_dict(self) -> tuple[dict[str, np.ndarray], dict]:
        """(tensors `exp_avg.<name>` / `exp_avg_sq.<name>`, JSON-able step + hyperparameters)."""
        tensors = {f"exp_avg.{n}": a for n, a in self.exp_avg.items()}
        tensors.update({f"exp_avg_sq.{n}": a for n, a in self.exp_avg_sq.items()})
        meta = {"step": self.t, "lr": self.lr, "betas": list(self.betas), "eps": self.eps,
                "groups": [{"names": list(g["names"]), "weight_decay": g["weight_decay"]}
                           for g in self.groups]}
        return tensors, meta

    def load_state_dict(self, tensors: dict[str, np.ndarray], meta: dict) -> None:
        """Restore `state_dict()` output; moments are copied into the existing buffers."""
        for kind, store in (("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)):
            for n, buf in store.items():
                a = tensors.get(f"{kind}.{n}")
                if a is None or a.shape != buf.shape:
                    got = "missing" if a is None else f"shape {list(a.shape)}"
                    raise CheckpointError(f"optimizer state {kind}.{n}: expected shape "
                                          f"{list(buf.shape)}, got {got}")
                buf[...] = a
        self.t = int(meta["step"])
        self.lr, self.eps = float(meta["lr"]), float(meta["eps"])
        self.betas = (float(meta["betas"][0]), float(meta["betas"][1]))
        self._set_groups([dict(g) for g in meta["groups"]])

    def _set_groups(self, groups: list[dict]) -> None:
        wd = {n: float(g["weight_decay"]) for g in groups for n in g["names"]}
        if set(wd) != set(self.params):
            raise ShapeError("AdamW: expected param groups covering every parameter exactly, got "
                             f"{len(wd)} grouped names for {len(self.params)} parameters")
        self.groups, self.wd = groups, wd


def adamw_flops(n_params: int) -> int:
    """Elementwise work of one AdamW update: about 14 operations per parameter."""
    return 14 * n_params


# ----------------------------------------------------------- clipping and accumulation

def global_grad_norm(grads: dict[str, np.ndarray] | Iterable[np.ndarray]) -> float:
    """√(Σ‖g‖²) over all gradients (float32 dot products, summed in float64)."""
    arrays = grads.values() if isinstance(grads, dict) else grads
    total = 0.0
    with np.errstate(over="ignore", invalid="ignore"):  # inf/NaN gradients give an inf/NaN norm
        for g in arrays:
            f = g.reshape(-1)
            total += float(np.dot(f, f))
    return math.sqrt(total)


def update_scale(grads: dict[str, np.ndarray], loss_scale: float = 1.0, accum_steps: int = 1,
                 max_norm: float = 0.0) -> tuple[float, float]:
    """(norm of the unscaled gradients, the factor for `AdamW.step(grad_scale=)`), from one
    read of the scaled gradients: unscaling, the finiteness check and clipping in one pass.

    The norm is inf or NaN when any gradient is (the loss scaler then skips the step). The
    factor is 1/(loss_scale·accum_steps), times torch's clip coefficient when `max_norm` > 0.
    """
    unscale = 1.0 / (float(loss_scale) * accum_steps)
    raw = global_grad_norm(grads)
    if not math.isfinite(raw) and grads_finite(grads):
        # finite values whose float32 squares overflowed: square in float64
        raw = global_grad_norm(g.astype(np.float64) for g in grads.values())
    norm = raw * unscale
    coef = min(float(max_norm) / (norm + 1e-6), 1.0) if max_norm > 0 and math.isfinite(norm) else 1.0
    return norm, unscale * coef


def clip_grad_norm_(grads: dict[str, np.ndarray], max_norm: float) -> float:
    """Scale gradients in place so their global norm is at most `max_norm`, as
    `torch.nn.utils.clip_grad_norm_` does (coef = max_norm/(norm + 1e-6), capped at 1).

    Returns the norm before clipping. A non-finite norm leaves the gradients alone: the loss
    scaler skips that step anyway, and torch would only turn them all into NaN.
    """
    norm = global_grad_norm(grads)
    coef = min(float(max_norm) / (norm + 1e-6), 1.0)
    if math.isfinite(norm) and coef < 1.0:
        for g in grads.values():
            g *= F32(coef)
    return norm


def zeros_like(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Fresh float32 gradient buffers, one per parameter, for accumulation."""
    return {n: np.zeros(p.shape, F32) for n, p in params.items()}


def zero_(grads: dict[str, np.ndarray]) -> None:
    """Reset accumulated gradients in place, keeping the buffers."""
    for g in grads.values():
        g.fill(0.0)


def accumulate_(acc: dict[str, np.ndarray], grads: dict[str, np.ndarray]) -> None:
    """acc += grads, per name (micro-batch accumulation)."""
    for n, g in grads.items():
        acc[n] += g


def scale_(grads: dict[str, np.ndarray], factor: float) -> None:
    """Multiply every gradient in place, e.g. by 1/(loss_scale · accum_steps)."""
    f = F32(factor)
    for g in grads.values():
        g *= f
