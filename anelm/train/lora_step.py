"""The LoRA training step: the base stays frozen on the device, only the adapters learn.

    step = LoraTrainStep(config, base_weights, device, seq_len=S, rank=8, alpha=16,
                         targets=("q_proj", "v_proj"), adapter=params)
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
from ..kernels.training import LAYER_ROLE, LoraLayout
from ..models.names import layer_modules, layer_prefix
from . import cpu_ops as ops
from .step import DeviceTrainStep

F32 = np.float32
KERNEL_ROLES = {part: (role,) for role, part in LAYER_ROLE.items()}  # layer part -> kernel roles


def target_parts(model_type: str, targets) -> list[str]:
    """The layer parts (anelm.models.names roles) that HF module names `targets` select."""
    mods = layer_modules(model_type)
    parts = [p for p, path in mods.items() if path.rsplit(".", 1)[-1] in set(targets) and p in KERNEL_ROLES]
    unknown = sorted(set(targets) - {mods[p].rsplit(".", 1)[-1] for p in parts})
    if unknown:
        raise UsageError(f"unknown LoRA target {unknown[0]!r} for {model_type}; expected HF module names "
                         f"among {', '.join(mods[p].rsplit('.', 1)[-1] for p in KERNEL_ROLES if p in mods)}")
    return parts


def lora_layout(model_type: str, targets, rank: int) -> LoraLayout:
    parts = target_parts(model_type, targets)
    return LoraLayout(int(rank), tuple((p, KERNEL_ROLES[p]) for p in parts))


def adapter_shapes(config, weights: dict[str, np.ndarray], targets, rank: int) -> dict[str, tuple[int, int]]:
    """Name -> shape of every adapter tensor, layer by layer, A before B."""
    out = {}
    for i in range(config.num_hidden_layers):
        for part in target_parts(config.model_type, targets):
            path = layer_prefix(config.model_type, i) + layer_modules(config.model_type)[part]
            n_out, n_in = weights[path + ".weight"].shape
            if not 1 <= rank <= min(n_in, n_out):
                raise UsageError(f"--rank {rank}: expected 1 <= rank <= {min(n_in, n_out)}, the smaller "
                                 f"side of {path} ({n_out}x{n_in})")
            out[path + ".lora_A.weight"] = (rank, n_in)
            out[path + ".lora_B.weight"] = (n_out, rank)
    return out


class LoraTrainStep(DeviceTrainStep):
    """Loss and the adapters' gradients of a Llama/Qwen3 base (module doc)."""

    def __init__(self, config, weights: dict[str, np.ndarray], device, *, seq_len: int, rank: int,
                 alpha: float, targets, adapter: dict[str, np.ndarray], pipeline: str = "dynamic"):
        self.rank, self.scale = int(rank), float(alpha) / int(rank)
        self.parts = target_parts(config.model_type, targets)
        self.shapes = adapter_shapes(config, weights, targets, rank)
        self.modules = {n[: -len(".lora_A.weight")] for n in self.shapes if n.endswith(".lora_A.weight")}
        super().__init__(config, weights, device, seq_len=seq_len, pipeline=pipeline,
                         lora=lora_layout(config.model_type, targets, rank))
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
        mods, mt = layer_modules(self.cfg.model_type), self.cfg.model_type
        for i in range(self.n_layers):
            a, sb = {}, {}
            for part in self.parts:
                path = layer_prefix(mt, i) + mods[part]
                a[part] = self.adapter[path + ".lora_A.weight"]
                for role in KERNEL_ROLES[part]:
                    sb[role] = F32(self.scale) * self.adapter[path + ".lora_B.weight"]
            self.bank.stage_adapters(i, a, sb)

    # ------------------------------------------------------------------ the hooks
    def _keep(self, name: str) -> bool:
        return name in self.shapes

    def _dw(self, jobs: dict, name: str, dy: np.ndarray, x: np.ndarray) -> None:
        """The adapter gradients of projection `name` (a base weight gets none)."""
        path = name[: -len(".weight")]
        if path not in self.modules:
            return
        a, b, s = self.adapter[path + ".lora_A.weight"], self.adapter[path + ".lora_B.weight"], F32(self.scale)
        jobs[path + ".lora_B.weight"] = self._pool.submit(lambda: s * ops.dw(dy, a @ x))   # s·dy·(A x)ᵀ
        jobs[path + ".lora_A.weight"] = self._pool.submit(lambda: s * ops.dw(b.T @ dy, x))  # s·(Bᵀdy)·xᵀ

    def _embed_bwd(self, dy: np.ndarray, ids: np.ndarray, grads: dict) -> None:
        return  # the embedding is frozen

    def _stats(self, n_tokens: int, t_main: float) -> dict:
        stats = super()._stats(n_tokens, t_main)
        stats["cpu_flops"] = int(stats["cpu_flops"] - self._frozen_flops(n_tokens)
                                 + sum(4 * self.rank * n_tokens * (o + i) for n, (o, i) in self._linears()))
        return stats

    def _linears(self):
        """(path, (out, in)) of every adapted projection."""
        return [(n[: -len(".lora_B.weight")], (shape[0], self.shapes[n.replace("lora_B", "lora_A")][1]))
                for n, shape in self.shapes.items() if n.endswith(".lora_B.weight")]

    def _frozen_flops(self, n: int) -> int:
        """What `cpu_step_flops` counts that a frozen base skips: every dW and the embedding scatter."""
        m, v = self.dims, self.cfg.vocab_size
        per_layer = ops.matmul_flops(m.d, n, 2 * m.q + 2 * m.kv) + ops.matmul_flops(m.d, n, 3 * m.f)
        return self.n_layers * per_layer + ops.matmul_flops(v, m.d, n) + ops.embed_flops(m.d, n, True)
