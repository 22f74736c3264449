"""One training step split as on the hardware: forward and dx on the device, the rest on the CPU.

    step = DeviceTrainStep(config, weights, device, seq_len=S, pipeline="dynamic")
    loss, grads, stats = step.loss_and_grads(x, y, loss_scale=4096.0)   # x, y int [B, S]
    ...optimizer updates the weights...
    step.set_weights(weights)                                          # restage / recompile

Per layer the device runs the ten kernels of `anelm/kernels/training.py` once per sequence
(kernels are built for S tokens; B sequences are B evaluations). Everything between them is
`cpu_ops` on channel-first float32 `[C, B·S]` arrays, the sequences side by side, so each CPU
op and each dW is one call over the whole batch: RMSNorm fwd/bwd, residuals, Qwen3's q/k head norm,
RoPE and its inverse (or, with `rope_on_device`, inside the attention kernels, on cos/sin tables
the CPU writes beside q and k: `kernels.training_attn`), SwiGLU backward, the final norm,
classifier, loss, embedding, and every dW.

dW = dy·xᵀ runs on one worker thread (numpy's BLAS releases the GIL) while the device
evaluates the next kernels; once the device chain is done, the main thread takes the newest
dW jobs not yet started, so both cores finish the queue. The arrays a job reads are never
written afterwards (every CPU op returns a new array), so handing them over is a snapshot
without a copy.

fp16 safety: activations crossing from the CPU into a device surface saturate at ±65504 as
they are converted to fp16 (`KernelBank.run`; a float32 value past fp16's range would otherwise
be inf on the device), in the conversion's own pass rather than a clamping pass of their own. Gradients are not clamped:
with too large a loss scale they overflow to inf/NaN, and they are returned as such (no
exception) so the dynamic loss scaler can see it, skip the step and halve the scale.

The weights the CPU side reads (norms, embedding, head) are the caller's arrays, not copies;
the device holds its own fp16 copies, which change only in `set_weights`.
"""

from __future__ import annotations

import functools
import time
from contextlib import nullcontext
from dataclasses import replace

import numpy as np

from ...chip.profile import padded_width
from ...errors import ShapeError, UsageError
from ...kernels.families import family_for
from ...kernels.training import WEIGHTLESS, Dims, carry_fits
from ...models.config import LlamaConfig
from ...models.names import has_head_norms, layer_prefix, model_weight, weight_name
from ...runtime.threads import Job, WorkQueue, all_blas_threads, share_blas_between
from . import cpu_ops as ops
from .arrays import check_weights as _check_weights
from .attention import StepAttention
from .arrays import padded as _padded
from .gemm import dw_into, fold_into
from .head import StepHead
from .kernels_bank import DynamicBank
from .pipeline_static import StaticBank
from .positions import StepPositions

F32 = np.float32
PIPELINES = ("dynamic", "static")


class DeviceTrainStep(StepPositions, StepAttention, StepHead):
    """Loss and every parameter gradient of a Llama/Qwen3 model, device + CPU (see module doc)."""

    accumulates_in_place = True  # `loss_and_grads(into=)`: the trainer hands it its accumulator

    def __init__(self, config, weights: dict[str, np.ndarray], device, *, seq_len: int,
                 pipeline: str = "dynamic", lora=None, packed: bool = False, head_on: str = "cpu",
                 swiglu_on_device: bool | None = None, embed_on: str = "cpu", rope_on_device: bool | None = None,
                 carry_probs: bool | None = None):
        self._check_config(config)
        if pipeline not in PIPELINES:
            raise UsageError(f"unknown pipeline {pipeline!r}; expected one of {', '.join(PIPELINES)}")
        self.cfg, self.pipeline = config, pipeline
        self.dims = Dims.from_config(config, seq_len)
        # The kernels' sequence is S rounded up to the profile's spatial multiple (16 in strict,
        # docs/chip-profiles.md). The padding columns are zeros in every kernel input and come after every real
        # position: causal attention keeps them out of real queries, and their zero dattn rows
        # add nothing to real keys' gradients, so results are those of S columns.
        multiple = device.profile.spatial_multiple_of
        # `packed`: batches may hold several examples per sequence (`loss_and_grads(positions=)`);
        # the attention kernels then take each sequence's mask as data (`kernels.training`)
        self.packed = bool(packed)
        # the SwiGLU backward in ffn_down_dx (`Dims.swiglu_dx`), by default where the device is
        # the ANE: the emulator runs it as fp16 passes on the host, slower than the CPU's own
        swiglu_dx = (getattr(device, "name", None) == "ane" if swiglu_on_device is None else swiglu_on_device) and \
            self.dims.gated and self.dims.act == "silu" and type(self)._layer_bwd is DeviceTrainStep._layer_bwd
        # RoPE and its inverse inside the attention kernels (`Dims.rope`), by default where the
        # device is the ANE (on the emulator both are fp16 passes on the host, as the CPU's are)
        rope = (getattr(device, "name", None) == "ane" if rope_on_device is None else rope_on_device) and \
            family_for(config.model_type).rotary
        self.n_layers = config.num_hidden_layers
        width = padded_width(seq_len, multiple)
        # sdpa_fwd hands its probabilities to sdpa_bwd (`Dims.carry_probs`), which then skips
        # their recomputation (a softmax on the ANE's slow vector path; on the emulator a few ms
        # a layer either way), where the host can keep them (`carry_fits`)
        carry = carry_fits(replace(self.dims, s=width), self.n_layers) if carry_probs is None else carry_probs
        # with the SwiGLU backward inside, ffn_down_dx and ffn_up_dx as one kernel (`Dims.ffn_dx`;
        # LoRA's adapter blocks keep the two)
        self.kernel_dims = replace(self.dims, s=width, width_multiple=multiple, mask_input=self.packed,
                                   swiglu_dx=swiglu_dx, rope=bool(rope), carry_probs=bool(carry),
                                   ffn_dx=bool(swiglu_dx) and lora is None)
        self.qk_norm = has_head_norms(config.model_type)
        self.embed, self.final_norm, self.head = (model_weight(config.model_type, r)
                                                  for r in ("embed", "final_norm", "head"))
        self.w = _check_weights(config, weights)
        bank = DynamicBank if pipeline == "dynamic" else StaticBank
        # lora: kernels.training.LoraLayout, the adapter blocks of the LoRA step (steps/lora.py)
        self.windows = tuple(config.window(i) for i in range(self.n_layers))
        # sliding-window layers get attention kernels of their own const mask; a packed step's
        # masks are data, the window in them (`_begin`)
        self.bank = bank(self.kernel_dims, device, self.w, self.n_layers, family_for(config.model_type), lora,
                         None if self.packed else self.windows)
        self._pool = WorkQueue("anelm-dw")
        self._blas = share_blas_between(2)  # device evals and dW run BLAS concurrently
        # the forward pass may take every core, but for small matrices (the tiny preset) the
        # extra BLAS threads cost more than they give: measured 41 s vs 37 s for 30 tiny steps
        self._wide = self.dims.d * self.dims.s >= 1 << 16
        self._tables_cache: dict[int, tuple] = {}  # by batch size: the tables of unpacked batches
        self._into, self._add = None, False
        self._deferred: list[Job] = []  # dW jobs of a micro-batch returned with `defer`
        # deferral needs every dW and the embedding's gradient written into the buffers by jobs
        self._can_defer = type(self)._dw is DeviceTrainStep._dw and type(self)._embed_bwd is StepHead._embed_bwd
        self._open_head(head_on, device, embed_on)  # the classifier: on the CPU, in tiles on the device, or the GPU

    @staticmethod
    def _check_config(config) -> None:
        if not isinstance(config, LlamaConfig):
            raise UsageError(f"training needs a Llama or Qwen3 config, got {type(config).__name__}")
        if config.mlp_bias:
            raise UsageError("training supports Llama/Qwen3 layers with bias-free MLPs; expected mlp_bias false")

    @property
    def compiles_per_update(self) -> int:
        """Compiles one `set_weights` costs: 0 dynamic, 8·layers static (strict)."""
        return self.bank.compiles_per_update

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        self.w = _check_weights(self.cfg, weights)
        self.bank.set_weights(self.w)
        self._restage_ends()

    # ------------------------------------------------------------------ public steps
    def loss(self, x: np.ndarray, y: np.ndarray, positions: np.ndarray | None = None) -> float:
        """Mean cross-entropy over the batch's counted targets (those not `ops.IGNORE`), forward only."""
        self._begin(x, y, positions)
        with np.errstate(all="ignore"):
            xf = self._forward(np.asarray(x), keep=False)[0]
            return ops.cross_entropy(self._logits(xf), np.asarray(y).reshape(-1))[0]

    def loss_and_grads(self, x: np.ndarray, y: np.ndarray, loss_scale: float = 1.0, sink=None, *,
                       positions: np.ndarray | None = None,
                       count: float | None = None, into: dict | None = None, add: bool = False,
                       defer: bool = False, ahead: tuple | None = None) -> tuple[float, dict[str, np.ndarray], dict]:
        """(unscaled loss, gradients × loss_scale by weight name, stats).

        The loss is the sum of the cross-entropies of the counted targets (y not `ops.IGNORE`)
        over `count` (default: their number, a mean): the trainer passes a step's count, so
        micro-batches and ranks with different numbers of counted targets add up to the mean
        over the whole step. `positions` `[B, S]` (a step built `packed`): each example's
        positions from 0; the attention stays inside each example (`kernels.attention.example_mask`).
        `sink` (data-parallel training, `distributed.grads.GradReducer`) is offered each layer's
        gradients as soon as the backward has queued them, so it can start reducing them
        while the rest of the backward runs; its `finish` gives the gradients returned. `into`
        (gradient accumulation): buffers by name that each gradient is written into (`add`
        False) or added to, the dW products by the GEMM itself (`gemm.dw_into`); they are
        the gradients returned. `defer` (with `into`, a micro-batch before the last): return
        with the dW products still running on the worker, beside the next call's forward; the
        next call waits for them (the Llama family's step: its dW and embedding write `into`).
        `ahead` (x, y, positions) of the next call, where `head_runs_ahead`: its forward runs while
        the GPU computes this call's head, and that call starts from it."""
        t0 = time.perf_counter()
        pending, self._deferred = self._deferred, []
        defer = defer and into is not None and sink is None and self._can_defer
        for j in pending if sink is not None else ():  # the reducer reads the buffers as it goes
            j.result()
        self._begin(x, y, positions, count)
        self._into, self._add = into, bool(add)
        ids, targets = np.asarray(x), np.asarray(y).reshape(-1)
        jobs: dict[str, Job] = {}
        with np.errstate(all="ignore"):  # inf/NaN under a too-large scale is a result, not an error
            with all_blas_threads() if self._wide and not pending else nullcontext():  # nor a dW job beside it
                xl, caches = self._take_ahead(x) or self._forward(ids, keep=True)
                beside = {"beside": lambda: self._run_ahead(*ahead)} if ahead and self.head_runs_ahead else {}
                loss, dy, grads, head_dw = self._loss_head(xl, targets, float(loss_scale), **beside)
            head = self._head_name()
            if head_dw is not None:
                jobs[head] = self._pool.submit(head_dw)
            if sink is not None and head == self.head and head in jobs:  # tied: the embedding adds to it
                sink.offer({head: jobs[head]})
            for i in reversed(range(self.n_layers)):
                dy = self._layer_bwd(i, dy, caches[i], grads, jobs)
                if sink is not None:
                    p = layer_prefix(self.cfg.model_type, i)
                    sink.offer({n: v for d in (grads, jobs) for n, v in d.items()
                                if n.startswith(p) and self._keep(n)})
            t_wait = time.perf_counter()
            for j in pending:  # first: a job of this micro-batch adds into the same buffers
                j.result()
            if not defer:
                self._pool.help_until_done(list(jobs.values()))
            t_wait = time.perf_counter() - t_wait
            grads.update({n: into[n] if defer else j.result() for n, j in jobs.items()})
            self._t["dw"] = sum(j.seconds for j in (*pending, *jobs.values()) if j.done())
            if self._out(self.embed) is not None and self.embed not in grads:  # scattered into
                grads[self.embed] = self._out(self.embed)
                if not add:
                    grads[self.embed].fill(0.0)
            if defer:  # the scatter too, after the tied classifier's dW into the same buffer
                tied = jobs.get(self.embed)
                self._deferred = [*jobs.values(), self._pool.submit(
                    lambda g=grads, d=dy: (tied and tied.wait(), self._embed_bwd(d, ids, g)))]
            else:
                self._embed_bwd(dy, ids, grads)
            grads = fold_into({n: g for n, g in grads.items() if self._keep(n)}, into, add)
            stats = {}
            if sink is not None:
                grads = sink.finish(grads)
                stats = sink.stats
                t_wait += stats["allreduce_wait_ms"] / 1e3
        return loss, grads, {**self._stats(ids.size, time.perf_counter() - t0 - t_wait), **stats}

    def close(self) -> None:
        self._pool.close()
        self.bank.close()
        self._close_ends()
        if self._blas is not None:
            self._blas.restore_original_limits()
            self._blas = None

    def __enter__(self) -> "DeviceTrainStep":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ plumbing
    def _begin(self, x, y, positions=None, count=None) -> None:
        s = self.dims.s
        x, y = np.asarray(x), np.asarray(y)
        if x.ndim != 2 or x.shape[1] != s or y.shape != x.shape:
            raise ShapeError(f"batch: expected token ids x and targets y of shape [B, {s}], "
                             f"got {list(x.shape)} and {list(y.shape)}")
        if positions is not None and (not self.packed or np.shape(positions) != x.shape):
            raise ShapeError(f"positions: expected [B, {s}] on a step built packed=True, got "
                             f"{list(np.shape(positions))} on a step built packed={self.packed}")
        self._t = {"device": 0.0, "dw": 0.0}
        self._flops = 0
        self._batch = x.shape[0]
        self._count = int((y != ops.IGNORE).sum()) if count is None else count
        self._take_positions(positions)

    def _stats(self, n_tokens: int, t_main: float) -> dict:
        return {"device_flops": int(self._flops),
                "cpu_flops": int(ops.cpu_step_flops(self.cfg.to_dict(), n_tokens, not self.kernel_dims.rope)
                                 + self._fwd_extra(n_tokens)),
                "t_device": self._t["device"], "t_cpu": max(t_main - self._t["device"], 0.0),
                "t_dw": self._t["dw"]}

    def _fwd_extra(self, n: int) -> int:
        """CPU forward work `cpu_step_flops` leaves out: RoPE on q and k, Qwen3's head norm."""
        c = self.dims.q + self.dims.kv
        rope = 0 if self.kernel_dims.rope else ops.rope_flops(c, n)
        per_layer = rope + (ops.rmsnorm_flops(c, n) if self.qk_norm else 0)
        return self.n_layers * per_layer

    def _dev(self, kind: str, layer: int, slot: int | None = None, **acts: np.ndarray) -> dict[str, np.ndarray]:
        """Kernel `kind` of `layer` on each sequence; acts and results `[C, B·S]` float32. A
        packed step's attention kernels get each sequence's mask beside them; `slot`: their
        probabilities stay on the device, in (slot, sequence)'s surface (`StepAttention`)."""
        t0, s, width = time.perf_counter(), self.dims.s, self.kernel_dims.s
        masks = self._attn_masks[self.windows[layer]] if self._attn_masks is not None and kind in WEIGHTLESS else None
        if width == s and self._batch == 1:  # the kernel's results are the batch's: no gathering copy
            out = self.bank.run(kind, layer, acts if masks is None else {**acts, "mask": masks[0]},
                                None if slot is None else (slot, 0))
        else:  # one sequence at a time; padded kernels get zero columns after it
            out = {}
            for b in range(self._batch):
                cols = slice(b * s, (b + 1) * s)
                seq = {n: a[:, cols] if width == s else _padded(a[:, cols], width) for n, a in acts.items()}
                if masks is not None:
                    seq["mask"] = masks[b]
                for n, r in self.bank.run(kind, layer, seq, None if slot is None else (slot, b)).items():
                    if n not in out:
                        out[n] = np.empty((r.shape[0], self._batch * s), F32)
                    out[n][:, cols] = r[:, :s]
        self._flops += self.bank.flops[kind] * self._batch
        self._t["device"] += time.perf_counter() - t0
        return out

    def _keep(self, name: str) -> bool:
        """Whether gradient `name` is returned: every weight's here (LoRA keeps its adapters')."""
        return True

    def _dw(self, jobs: dict, name: str, dy: np.ndarray, x: np.ndarray) -> None:
        """Queue dW = dy·xᵀ for weight `name` on the worker thread (into its buffer, if any)."""
        out, add = self._out(name), self._add
        jobs[name] = self._pool.submit(lambda: ops.dw(dy, x) if out is None else dw_into(out, dy, x, add))

    def _out(self, name: str) -> np.ndarray | None:
        """The buffer gradient `name` accumulates in (`loss_and_grads(into=)`), or None."""
        return None if self._into is None else self._into.get(name)

    def _name(self, layer: int, role: str) -> str:
        return weight_name(self.cfg.model_type, layer, role)

    def _w(self, layer: int, role: str) -> np.ndarray:
        return self.w[self._name(layer, role)]

    def _bias(self, layer: int, role: str, y: np.ndarray) -> np.ndarray:
        """y `[C, B·S]` plus the projection's bias where it has one (Qwen2's q, k, v; attention_bias)."""
        b = self.w.get(weight_name(self.cfg.model_type, layer, role, "bias"))
        return y if b is None else y + b[:, None]

    def _bias_grad(self, grads: dict, layer: int, role: str, dy: np.ndarray) -> None:
        name = weight_name(self.cfg.model_type, layer, role, "bias")
        if name in self.w:
            grads[name] = dy.sum(axis=1)

    # ------------------------------------------------------------------ forward
    def _embed(self, ids: np.ndarray) -> np.ndarray:
        return self._embed_rows(ids)   # [D, B·S]

    def _forward(self, ids: np.ndarray, keep: bool) -> tuple[np.ndarray, list[dict]]:
        self._take_slot(keep)
        x = self._embed(ids)
        caches = []
        for i in range(self.n_layers):
            x, c = self._layer_fwd(i, x)
            if keep:
                caches.append(c)
        return x, caches

    def _layer_fwd(self, i: int, x: np.ndarray) -> tuple[np.ndarray, dict]:
        eps = self.cfg.rms_norm_eps
        c = {"x": x}
        xn, c["r1"] = ops.rmsnorm_fwd(x, self._w(i, "attn_norm"), eps)
        c["xn"] = xn
        qkv = self._dev("qkv", i, xn=c["xn"])
        q, k, c["v"] = self._bias(i, "q", qkv["q"]), self._bias(i, "k", qkv["k"]), self._bias(i, "v", qkv["v"])
        if self.qk_norm:
            c["q0"], c["k0"] = q, k
            q, c["rq"] = ops.head_rmsnorm_fwd(q, self._w(i, "q_norm"), eps)
            k, c["rk"] = ops.head_rmsnorm_fwd(k, self._w(i, "k_norm"), eps)
        c["att"] = self._attention_inputs(i, q, k)
        c["attn"] = self._attend(i, c)
        c["x2"] = x + self._bias(i, "o", self._dev("wo", i, attn=c["attn"])["o"])
        x2n, c["r2"] = ops.rmsnorm_fwd(c["x2"], self._w(i, "mlp_norm"), eps)
        c["x2n"] = x2n
        c.update(self._dev("ffn_up", i, x2n=c["x2n"]))          # gate, h1, h3
        return c["x2"] + self._dev("ffn_down", i, gate=c["gate"])["f"], c

    # ------------------------------------------------------------------ backward
    def _layer_bwd(self, i: int, dy: np.ndarray, c: dict, grads: dict, jobs: dict) -> np.ndarray:
        name = functools.partial(self._name, i)
        if self.kernel_dims.ffn_dx:  # dh1, dh3 and their W1ᵀ, W3ᵀ products from one kernel
            g = self._dev("ffn_dx", i, dy=dy, h1=c["h1"], h3=c["h3"])
            dh1, dh3, dx2n = g["dh1"], g["dh3"], g["dx"]
        elif self.kernel_dims.swiglu_dx:
            g = self._dev("ffn_down_dx", i, dy=dy, h1=c["h1"], h3=c["h3"])
            dh1, dh3 = g["dh1"], g["dh3"]
        else:
            dh1, dh3 = ops.swiglu_bwd(self._dev("ffn_down_dx", i, dy=dy)["dgate"], c["h1"], c["h3"])
        self._dw(jobs, name("down"), dy, c["gate"])
        self._dw(jobs, name("gate"), dh1, c["x2n"])
        self._dw(jobs, name("up"), dh3, c["x2n"])
        if not self.kernel_dims.ffn_dx:
            dx2n = self._dev("ffn_up_dx", i, dh1=dh1, dh3=dh3)["dx"]
        dx2, grads[name("mlp_norm")] = ops.rmsnorm_bwd(
            dx2n, c["x2"], self._w(i, "mlp_norm"), c["r2"])
        dx2 = dx2 + dy
        self._dw(jobs, name("o"), dx2, c["attn"])
        self._bias_grad(grads, i, "o", dx2)
        dattn = self._dev("wo_dx", i, dx2=dx2)["dattn"]
        g = self._attend_bwd(i, c, dattn)
        dq, dk = self._unrotated(i, g)
        if self.qk_norm:
            dq, grads[name("q_norm")] = ops.head_rmsnorm_bwd(
                dq, c["q0"], self._w(i, "q_norm"), c["rq"])
            dk, grads[name("k_norm")] = ops.head_rmsnorm_bwd(
                dk, c["k0"], self._w(i, "k_norm"), c["rk"])
        for n, d in (("q", dq), ("k", dk), ("v", g["dv"])):
            self._dw(jobs, name(n), d, c["xn"])
            self._bias_grad(grads, i, n, d)
        dxn = self._dev("qkv_dx", i, dq=dq, dk=dk, dv=g["dv"])["dx"]
        dx, grads[name("attn_norm")] = ops.rmsnorm_bwd(
            dxn, c["x"], self._w(i, "attn_norm"), c["r1"])
        return dx + dx2
