"""The LoRA training step: the base stays frozen on the device, only the adapters learn.

    spec = LoraSpec(rank=8, alpha=16, targets=("q_proj", "v_proj"))
    step = lora_train_step(config, base_weights, device, seq_len=S, spec=spec, adapter=params)
    loss, grads, stats = step.loss_and_grads(x, y, loss_scale)   # gradients of `params` only
    step.set_weights(params)                                     # restage A, B; compiles nothing

`params` are the adapter tensors as a flat dict, `<module path>.lora_A.weight` `[r, in]` and
`<module path>.lora_B.weight` `[out, r]` (PEFT's orientation and key names without its
`base_model.model.` prefix), so the trainer's AdamW, clipping, checkpoints and the gradient
all-reduce handle them like any weights.

Each targeted projection y = W·x becomes y = W·x + s·B·(A·x), s = alpha / r, on the device
(`kernels.training`, LoRA): W is staged once as in full training and never restaged; A and
scale·B are staged blocks of the same kernel inputs. On the CPU, from what the step already
holds for the projection (its input x and output gradient dy, the pair full training turns
into dW = dy·xᵀ):

    dB = s·dy·(A·x)ᵀ        dA = s·(Bᵀ·dy)·xᵀ          (summed over the batch's columns)

The base gets no weight gradient: no dW, no classifier dW, no embedding scatter, no norm
gradients are returned; dx still flows through everything.
"""

from __future__ import annotations

import numpy as np

from ..errors import UsageError
from ..kernels.families import family_for
from ..kernels.training import LoraLayout
from ..models.adapters import Adapter, LoraSpec, check_spec, projection_shape, target_modules
from . import cpu_ops as ops
from ..models.names import layer_prefix
from .step import DeviceTrainStep
from .step_gpt2 import GPT2TrainStep

F32 = np.float32
A_KEY, B_KEY = ".lora_A.weight", ".lora_B.weight"


def lora_layout(config, spec: LoraSpec) -> LoraLayout:
    """The kernels' view of `spec`: its rank and, per adapted layer part, the kernel roles it
    covers (`Family.part_roles`: GPT-2's fused c_attn covers wq, wk and wv)."""
    parts = dict.fromkeys(role for layer, role in target_modules(config, spec.targets).values() if layer == 0)
    roles = family_for(config.model_type).part_roles
    return LoraLayout(spec.rank, tuple((p, roles[p]) for p in parts))


def adapter_shapes(config, spec: LoraSpec) -> dict[str, tuple[int, int]]:
    """Name -> shape of every adapter tensor (module doc), layer by layer, A before B."""
    check_spec(config, spec, "--rank/--targets")
    out = {}
    for path, (_, role) in target_modules(config, spec.targets).items():
        n_out, n_in = projection_shape(config, role)
        out[path + A_KEY], out[path + B_KEY] = (spec.rank, n_in), (n_out, spec.rank)
    return out


def adapter_params(adapter: Adapter) -> dict[str, np.ndarray]:
    """An Adapter as the trainer's flat, C-contiguous float32 parameter dict."""
    out = {}
    for path, (a, b) in adapter.tensors.items():
        out[path + A_KEY] = np.ascontiguousarray(a, F32)
        out[path + B_KEY] = np.ascontiguousarray(b, F32)
    return out


def params_adapter(params: dict[str, np.ndarray], spec: LoraSpec, model_type: str) -> Adapter:
    """The trainer's parameters back as an Adapter (for `save_peft`)."""
    paths = [n[: -len(A_KEY)] for n in params if n.endswith(A_KEY)]
    return Adapter(spec, model_type, {p: (params[p + A_KEY], params[p + B_KEY]) for p in paths})


def lora_train_step(config, weights: dict[str, np.ndarray], device, **kw) -> "LoraHooks":
    """The LoRA step for the base's architecture (keywords as `LoraHooks`)."""
    cls = GPT2LoraTrainStep if config.model_type == "gpt2" else LoraTrainStep
    return cls(config, weights, device, **kw)


class LoraHooks:
    """The LoRA half of a step (module doc), over a full step class that it follows in the MRO."""

    def __init__(self, config, weights: dict[str, np.ndarray], device, *, seq_len: int, spec: LoraSpec,
                 adapter: dict[str, np.ndarray], pipeline: str = "dynamic"):
        self.spec, self.rank, self.scale = spec, spec.rank, spec.scale
        self.shapes = adapter_shapes(config, spec)
        self.modules = target_modules(config, spec.targets)  # path -> (layer, part)
        super().__init__(config, weights, device, seq_len=seq_len, pipeline=pipeline,
                         lora=lora_layout(config, spec))
        self.set_weights(adapter)

    @property
    def compiles_per_update(self) -> int:
        return 0  # the base never changes; adapters are data in either pipeline

    def set_weights(self, adapter: dict[str, np.ndarray]) -> None:
        """Stage new adapter tensors (the base stays as compiled and staged)."""
        missing = sorted(set(self.shapes) - set(adapter))
        if missing:
            raise UsageError(f"adapter: missing {missing[0]}; expected the {len(self.shapes)} tensors "
                             "of this rank and these targets")
        self.adapter = {n: np.asarray(adapter[n], F32) for n in self.shapes}
        for n, shape in self.shapes.items():
            if self.adapter[n].shape != shape:
                raise UsageError(f"adapter tensor {n}: expected shape {list(shape)}, got "
                                 f"{list(self.adapter[n].shape)}")
        per_layer: list[tuple[dict, dict]] = [({}, {}) for _ in range(self.n_layers)]
        for path, (i, part) in self.modules.items():
            a, sb = per_layer[i]
            a[part], b = self.adapter[path + A_KEY], F32(self.scale) * self.adapter[path + B_KEY]
            roles = self.bank.family.part_roles[part]
            rows = np.cumsum([0] + [len(b) // len(roles)] * len(roles))
            for role, lo, hi in zip(roles, rows[:-1], rows[1:]):  # c_attn: q, k, v rows
                sb[role] = b[lo:hi]
        for i, (a, sb) in enumerate(per_layer):
            self.bank.stage_adapters(i, a, sb)

    # ------------------------------------------------------------------ the hooks
    def _keep(self, name: str) -> bool:
        return name in self.shapes

    def _dw(self, jobs: dict, name: str, dy: np.ndarray, x: np.ndarray) -> None:
        """The adapter gradients of projection `name` (a base weight gets none)."""
        path = name[: -len(".weight")]
        if path not in self.modules:
            return
        a, b, s = self.adapter[path + A_KEY], self.adapter[path + B_KEY], F32(self.scale)
        jobs[path + B_KEY] = self._pool.submit(lambda: s * ops.dw(dy, a @ x))   # s·dy·(A x)ᵀ
        jobs[path + A_KEY] = self._pool.submit(lambda: s * ops.dw(b.T @ dy, x))  # s·(Bᵀdy)·xᵀ

    def _embed_bwd(self, dy: np.ndarray, ids: np.ndarray, grads: dict) -> None:
        return  # the embedding is frozen

    def _stats(self, n_tokens: int, t_main: float) -> dict:
        stats = super()._stats(n_tokens, t_main)
        stats["cpu_flops"] = int(stats["cpu_flops"] - self._frozen_flops(n_tokens)
                                 + sum(4 * self.rank * n_tokens * (o + i) for n, (o, i) in self._linears()))
        return stats

    def _linears(self):
        """(path, (out, in)) of every adapted projection."""
        return [(n[: -len(B_KEY)], (shape[0], self.shapes[n[: -len(B_KEY)] + A_KEY][1]))
                for n, shape in self.shapes.items() if n.endswith(B_KEY)]

    def _frozen_flops(self, n: int) -> int:
        """What the full step's `cpu_flops` counts that a frozen base skips: every layer's dW,
        the classifier's dW and the embedding scatter."""
        prefix = layer_prefix(self.cfg.model_type, 0).split("0")[0]  # "model.layers." / "transformer.h."
        layer_params = sum(w.size for k, w in self.w.items() if k.startswith(prefix) and w.ndim == 2)
        d, v = self.dims.d, self.cfg.vocab_size
        return 2 * n * int(layer_params) + ops.matmul_flops(v, d, n) + ops.embed_flops(d, n, True)


class LoraTrainStep(LoraHooks, DeviceTrainStep):
    """LoRA on a Llama or Qwen3 base."""


class GPT2LoraTrainStep(LoraHooks, GPT2TrainStep):
    """LoRA on a GPT-2 base (one adapter over the fused c_attn, PEFT's fan_in_fan_out)."""
