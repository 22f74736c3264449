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

LoRA dropout p (PEFT's y = W·x + s·B·A·dropout(x): the base sees x, the adapter x̃ = x·d with
d = mask/(1-p), inverted dropout, one mask per module and token) only in `loss_and_grads`;
`loss` (eval) runs without it. The masks are drawn on the CPU from (seed, step, micro-batch,
rank) (`begin_micro_batch`, which the trainer calls), so a resumed run draws the same ones;
the kernels get x̃ and d as data (`kernels.training`), so nothing compiles per draw. Then
dB = s·dy·(A·x̃)ᵀ, dA = s·(Bᵀ·dy)·x̃ᵀ, and the adapter's dx term is d·(Aᵀ·s·Bᵀ·dy).
"""

from __future__ import annotations

import numpy as np

from ...errors import UsageError
from ...kernels.families import family_for
from ...kernels.training import LoraLayout, drop_key, mask_key
from ...models.adapters import Adapter, LoraSpec, check_spec, fused_parts, lora_parts, projection_shape, target_modules
from ...models.names import layer_modules, layer_prefix
from . import cpu_ops as ops
from .gemma import GemmaTrainStep
from .gpt2 import GPT2TrainStep
from .llama import DeviceTrainStep

F32 = np.float32
A_KEY, B_KEY = ".lora_A.weight", ".lora_B.weight"
DROPOUT_STREAM = 0x10DA  # keeps the masks' draws apart from every other use of the run's seed


def lora_layout(config, spec: LoraSpec) -> LoraLayout:
    """The kernels' view of `spec`: its rank and, per adapted layer part, the kernel roles it
    covers (`Family.part_roles`: GPT-2's fused c_attn covers wq, wk and wv)."""
    parts = dict.fromkeys(role for layer, role in target_modules(config, spec.targets).values() if layer == 0)
    roles, fused = family_for(config.model_type).part_roles, lora_parts(config.model_type)
    kernel = {p: roles[p] if p in roles else sum((roles[r] for r in fused[p][1]), ()) for p in parts}  # Phi-3's
    return LoraLayout(spec.rank, tuple((p, kernel[p]) for p in parts), dropout=spec.dropout > 0)


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


def params_adapter(params: dict[str, np.ndarray], spec: LoraSpec, config) -> Adapter:
    """The trainer's parameters back as an Adapter (for `save_peft`, `merge_weights`)."""
    paths = [n[: -len(A_KEY)] for n in params if n.endswith(A_KEY)]
    return Adapter(spec, config.model_type, {p: (params[p + A_KEY], params[p + B_KEY]) for p in paths},
                   fused_parts(config))


class LoraHooks:
    """The LoRA half of a step (module doc), over a full step class that it follows in the MRO."""

    def __init__(self, config, weights: dict[str, np.ndarray], device, *, seq_len: int, spec: LoraSpec,
                 adapter: dict[str, np.ndarray], pipeline: str = "dynamic", seed: int = 0, packed: bool = False,
                 **placement):
        self.spec, self.rank, self.scale = spec, spec.rank, spec.scale
        self.shapes = adapter_shapes(config, spec)
        self.modules = target_modules(config, spec.targets)  # path -> (layer, part)
        # a fused module's pair (Phi-3's): our projection's weight name -> (its path, role), the
        # part's roles and each one's rows of B and gains (`adapters.fused_parts`)
        self._fused, self._rows, self._dys = {}, {}, {}
        fused, parts, mt = fused_parts(config), lora_parts(config.model_type), config.model_type
        for path, (i, part) in self.modules.items():
            for r in parts[part][1] if len(parts[part][1]) > 1 else ():
                self._fused[f"{layer_prefix(mt, i)}{layer_modules(mt)[r]}.weight"] = (path, r)
                self._rows.setdefault(part, {})[r] = fused[layer_modules(mt)[r]][1:]
        self.seed, self._at, self._masks = int(seed), (0, 0, 0), None
        lay = lora_layout(config, spec)
        super().__init__(config, weights, device, seq_len=seq_len, pipeline=pipeline, lora=lay, packed=packed,
                         **placement)  # head_on, swiglu_on_device, rope_on_device: as the full step's
        self._drops = self._dropout_blocks(lay)
        self.set_weights(adapter)

    def _dropout_blocks(self, lay: LoraLayout) -> dict[tuple[str, int], list[tuple[str, str, str | None]]]:
        """(kind, layer) -> its dropout blocks (block key, module path, the activation a forward
        block is the dropped copy of; None for a dx kernel's mask)."""
        path = {where: p for p, where in self.modules.items()}  # (layer, part) -> module path
        keys = {k: (g, fwd) for g, _ in lay.groups for k, fwd in ((drop_key(g), True), (mask_key(g), False))}
        out = {}
        for kind in lay.kinds():
            for pk in self.bank.layouts[kind].values():
                for a in (a for a in pk.acts if a in keys):
                    g, fwd = keys[a]
                    for i in range(self.n_layers):
                        out.setdefault((kind, i), []).append((a, path[(i, g)], pk.acts[0] if fwd else None))
        return out

    # ------------------------------------------------------------------ dropout
    @property
    def head_runs_ahead(self) -> bool:
        """Not with dropout: the next batch's forward would draw this batch's masks."""
        return super().head_runs_ahead and not self.spec.dropout

    def begin_micro_batch(self, step: int, micro: int, rank: int = 0) -> None:
        """Where the next `loss_and_grads` sits in the run: its masks are drawn from (seed, step,
        micro, rank). A call without this draws at the next micro index."""
        self._at = (int(step), int(micro), int(rank))

    def dropout_masks(self, columns: int, at: tuple[int, int, int] | None = None) -> dict[str, np.ndarray]:
        """d = mask/(1-p) `[in, columns]` per adapted module path (kept: 1/(1-p), dropped: 0), as
        `loss_and_grads` draws them at `at` (step, micro, rank; default: the next call's)."""
        p = self.spec.dropout
        rng = np.random.default_rng([self.seed, DROPOUT_STREAM, *(self._at if at is None else at)])
        keep = F32(1.0 / (1.0 - p))
        return {path: (rng.random((self.shapes[path + A_KEY][1], columns), dtype=F32) >= p) * keep
                for path in self.modules}

    def loss_and_grads(self, x: np.ndarray, y: np.ndarray, loss_scale: float = 1.0, sink=None, **batch):
        if self.spec.dropout:
            self._masks = self.dropout_masks(np.asarray(x).size)
            step, micro, rank = self._at
            self._at = (step, micro + 1, rank)
        try:
            return super().loss_and_grads(x, y, loss_scale, sink, **batch)
        finally:
            self._masks = None

    def _dev(self, kind: str, layer: int, slot: int | None = None, **acts: np.ndarray) -> dict[str, np.ndarray]:
        """The kernel with its dropout blocks: x·d beside x (x itself in eval), or d (module doc)."""
        for key, path, source in self._drops.get((kind, layer), ()):
            d = None if self._masks is None else self._masks[path]
            if source is None:  # a dx kernel: only `loss_and_grads` runs these, with its masks
                acts[key] = d
            else:
                acts[key] = acts[source] if d is None else acts[source] * d
        return super()._dev(kind, layer, slot, **acts)

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
            if part in self._rows:  # Phi-3: each projection's rows of the fused B, with their gains
                for r, (idx, gain) in self._rows[part].items():
                    (role,) = self.bank.family.part_roles[r]
                    sb[role] = b[idx] if gain is None else b[idx] * gain[:, None]
                continue
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
        if name in self._fused:
            return self._fused_dw(jobs, name, dy, x)
        if path not in self.modules:
            return
        a, b, s = self.adapter[path + A_KEY], self.adapter[path + B_KEY], F32(self.scale)
        d = None if self._masks is None else self._masks[path]
        x_in = (lambda: x) if d is None else (lambda: x * d)  # the adapter's input: x̃ = x·d
        jobs[path + B_KEY] = self._pool.submit(lambda: s * ops.dw(dy, a @ x_in()))   # s·dy·(A x̃)ᵀ
        jobs[path + A_KEY] = self._pool.submit(lambda: s * ops.dw(b.T @ dy, x_in()))  # s·(Bᵀdy)·x̃ᵀ

    def _fused_dw(self, jobs: dict, name: str, dy: np.ndarray, x: np.ndarray) -> None:
        """A fused module's gradients once each of its projections has its dy (they share x):
        with our rows' B' = B[rows]·gain and dy stacked alike, dB[rows] = gain·s·dy·(A x)ᵀ and
        dA = s·(B'ᵀ dy)·xᵀ, the sum over the parts of the shared A's gradient."""
        path, role = self._fused[name]
        got = self._dys.setdefault(path, {})
        got[role] = dy
        rows = self._rows[self.modules[path][1]]
        if len(got) < len(rows):
            return
        del self._dys[path]
        idx = np.concatenate([rows[r][0] for r in rows])
        gain = np.concatenate([np.ones(len(rows[r][0]), F32) if rows[r][1] is None else rows[r][1] for r in rows])
        dy_all = np.concatenate([got[r] for r in rows])
        a, s, d = self.adapter[path + A_KEY], F32(self.scale), None if self._masks is None else self._masks[path]
        b = self.adapter[path + B_KEY][idx] * gain[:, None]
        x_in = (lambda: x) if d is None else (lambda: x * d)

        def db():
            out = np.empty_like(self.adapter[path + B_KEY])
            out[idx] = gain[:, None] * (s * ops.dw(dy_all, a @ x_in()))
            return out

        jobs[path + B_KEY] = self._pool.submit(db)
        jobs[path + A_KEY] = self._pool.submit(lambda: s * ops.dw(b.T @ dy_all, x_in()))

    def _embed_bwd(self, dy: np.ndarray, ids: np.ndarray, grads: dict) -> None:
        return  # the embedding is frozen

    def _stats(self, n_tokens: int, t_main: float) -> dict:
        stats = super()._stats(n_tokens, t_main)
        drop = 3 if self.spec.dropout else 0  # x·d for the kernel and for each of dA, dB
        stats["cpu_flops"] = int(stats["cpu_flops"] - self._frozen_flops(n_tokens)
                                 + sum((4 * self.rank * (o + i) + drop * i) * n_tokens for n, (o, i) in self._linears()))
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


class GemmaLoraTrainStep(LoraHooks, GemmaTrainStep):
    """LoRA on a Gemma 3 base."""
