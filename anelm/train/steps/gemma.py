"""The training step of a Gemma 3: Llama's device kernels, Gemma's layer on the CPU.

Per layer (HF `Gemma3ForCausalLM` semantics; every norm's gain is 1 + w, `norm` below):

    xn = norm(x)                  qkv kernel                q, k: per-head norms, then RoPE
    a  = sdpa_fwd(q, k, v)        (this layer's window and base; scores × query_pre_attn_scalar^-½)
    x2 = x + norm(wo(a))          (the post-attention norm: the stream gets a normed output)
    x2n = norm(x2)                ffn_up: gate = gelu_tanh(h1) · h3 on the device
    y  = x2 + norm(ffn_down(gate))

The embedding enters times √hidden (HF rounds the factor to the weights' dtype, float32 here)
and the head is tied to the unscaled embedding. Sliding layers use the bank's window kernels
(`KernelBank`, one pair per window) and their own RoPE base (`config.rope`); everything else,
the batch handling, the dW queue, loss scaling and the chunked classifier loss, is
`step.DeviceTrainStep`'s. The residual stream stays on the CPU in float32: only normed
activations and the projections' outputs cross into fp16, so the stream's range (103,795 on
Gemma 3 270M) never reaches the device here.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from ...errors import UsageError
from ...kernels.training import GRADIENT_INPUTS
from ...models.config import Gemma3TextConfig
from . import cpu_ops as ops
from .llama import DeviceTrainStep

F32 = np.float32


class GemmaTrainStep(DeviceTrainStep):
    """Loss and every parameter gradient of a Gemma 3, device + CPU (module doc)."""

    @staticmethod
    def _check_config(config) -> None:
        if not isinstance(config, Gemma3TextConfig):
            raise UsageError(f"the Gemma step needs a Gemma 3 config, got {type(config).__name__}")
        if config.attention_bias:
            raise UsageError("Gemma training supports bias-free layers; expected attention_bias false")

    def _gain(self, i: int | None, role: str) -> np.ndarray:
        """A norm's gain as applied, 1 + w (the family's `gain_offset`; i None: the final norm)."""
        return F32(self.bank.family.gain_offset) + (self.w[self.final_norm] if i is None else self._w(i, role))

    def _norm(self, x: np.ndarray, i: int | None, role: str) -> tuple[np.ndarray, np.ndarray]:
        return ops.rmsnorm_fwd(x, self._gain(i, role), self.cfg.rms_norm_eps)

    @functools.cached_property
    def _embed_scale(self) -> np.float32:
        return F32(math.sqrt(self.cfg.hidden_size))

    def _dev(self, kind: str, layer: int, slot: int | None = None, **acts: np.ndarray) -> dict[str, np.ndarray]:
        """A backward kernel on its gradients divided by a power of two that brings their peak
        into (1/2, 1], its results multiplied back: exact, as each result is linear in them.

        A post-norm's backward multiplies the gradient by its gain over the RMS of its input
        (Gemma 3 270M: 6.4 into ffn_down_dx at a loss scale of 1), so at the scaler's starting
        scale (2^12) the attention backward's dOᵀ·V passed the accumulator's 32,768 and the
        first steps were skipped while the scale fell. Normalised, the device never overflows;
        the loss scale still keeps the CPU's float32 gradients clear of underflow."""
        names = GRADIENT_INPUTS.get(kind, ())  # every result is linear in them (sdpa_bwd's in dattn)
        peak = max((float(np.abs(acts[n]).max()) for n in names), default=0.0)
        if not (0.0 < peak < np.inf):  # nothing to scale, or an inf the loss scaler must see
            return super()._dev(kind, layer, slot, **acts)
        f = F32(2.0 ** -math.ceil(math.log2(peak)))
        out = super()._dev(kind, layer, slot, **{n: a * f if n in names else a for n, a in acts.items()})
        return {n: v / f for n, v in out.items()}

    # ------------------------------------------------------------------ forward
    def _embed(self, ids: np.ndarray) -> np.ndarray:
        return super()._embed(ids) * self._embed_scale

    def _final_gain(self) -> np.ndarray:
        return self._gain(None, "final")

    def _layer_fwd(self, i: int, x: np.ndarray) -> tuple[np.ndarray, dict]:
        eps = self.cfg.rms_norm_eps
        c = {"x": x}
        xn, c["r1"] = self._norm(x, i, "attn_norm")
        c["xn"] = xn
        qkv = self._dev("qkv", i, xn=c["xn"])
        c["q0"], c["k0"], c["v"] = qkv["q"], qkv["k"], qkv["v"]
        q, c["rq"] = ops.head_rmsnorm_fwd(c["q0"], self._gain(i, "q_norm"), eps)
        k, c["rk"] = ops.head_rmsnorm_fwd(c["k0"], self._gain(i, "k_norm"), eps)
        c["att"] = self._attention_inputs(i, q, k)
        c["attn"] = self._attend(i, c)
        c["o"] = self._dev("wo", i, attn=c["attn"])["o"]
        on, c["ro"] = self._norm(c["o"], i, "attn_post_norm")
        c["x2"] = x + on
        x2n, c["r2"] = self._norm(c["x2"], i, "mlp_norm")
        c["x2n"] = x2n
        c.update(self._dev("ffn_up", i, x2n=c["x2n"]))          # gate, h1, h3
        c["f"] = self._dev("ffn_down", i, gate=c["gate"])["f"]
        fn, c["rf"] = self._norm(c["f"], i, "mlp_post_norm")
        return c["x2"] + fn, c

    # ------------------------------------------------------------------ loss and backward
    def _embed_bwd(self, dy: np.ndarray, ids: np.ndarray, grads: dict) -> None:
        super()._embed_bwd(dy * self._embed_scale, ids, grads)

    def _layer_bwd(self, i: int, dy: np.ndarray, c: dict, grads: dict, jobs: dict) -> np.ndarray:
        name, gain = functools.partial(self._name, i), functools.partial(self._gain, i)
        df, grads[name("mlp_post_norm")] = ops.rmsnorm_bwd(dy, c["f"], gain("mlp_post_norm"), c["rf"])
        dgate = self._dev("ffn_down_dx", i, dy=df)["dgate"]
        dh1, dh3 = ops.gelu_gated_bwd(dgate, c["h1"], c["h3"])
        self._dw(jobs, name("down"), df, c["gate"])
        self._dw(jobs, name("gate"), dh1, c["x2n"])
        self._dw(jobs, name("up"), dh3, c["x2n"])
        dx2n = self._dev("ffn_up_dx", i, dh1=dh1, dh3=dh3)["dx"]
        dx2, grads[name("mlp_norm")] = ops.rmsnorm_bwd(dx2n, c["x2"], gain("mlp_norm"), c["r2"])
        dx2 = dx2 + dy
        do, grads[name("attn_post_norm")] = ops.rmsnorm_bwd(dx2, c["o"], gain("attn_post_norm"), c["ro"])
        self._dw(jobs, name("o"), do, c["attn"])
        dattn = self._dev("wo_dx", i, dx2=do)["dattn"]
        g = self._attend_bwd(i, c, dattn)
        dq, dk = self._unrotated(i, g)
        dq, grads[name("q_norm")] = ops.head_rmsnorm_bwd(dq, c["q0"], gain("q_norm"), c["rq"])
        dk, grads[name("k_norm")] = ops.head_rmsnorm_bwd(dk, c["k0"], gain("k_norm"), c["rk"])
        for n, d in (("q", dq), ("k", dk), ("v", g["dv"])):
            self._dw(jobs, name(n), d, c["xn"])
        dxn = self._dev("qkv_dx", i, dq=dq, dk=dk, dv=g["dv"])["dx"]
        dx, grads[name("attn_norm")] = ops.rmsnorm_bwd(dxn, c["x"], gain("attn_norm"), c["r1"])
        return dx + dx2

    def _fwd_extra(self, n: int) -> int:
        """CPU forward work `cpu_step_flops` leaves out: RoPE and the head norms on q and k, the
        two post-norms, the GELU in place of SiLU's backward (counted as its equal)."""
        c, d = self.dims.q + self.dims.kv, self.dims.d
        rope = 0 if self.kernel_dims.rope else ops.rope_flops(c, n)
        per_layer = rope + ops.rmsnorm_flops(c, n) + 2 * ops.rmsnorm_flops(d, n, backward=True)
        return self.n_layers * per_layer
