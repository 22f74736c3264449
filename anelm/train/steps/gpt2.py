"""The training step of a GPT-2: the same device kernels as Llama's, GPT-2's layer on the CPU.

Per layer (HF `GPT2LMHeadModel` semantics; weights in our [out, in] orientation, `gpt2.sanitize`):

    xn = LN_1(x)          qkv kernel  (Wq Wk Wv: the row thirds of the fused c_attn)   + bias
    a  = sdpa_fwd(q, k, v)          (causal, 1/√hd; no RoPE: positions are learned)
    x2 = x + wo(a) + b_o            h = ffn_up(LN_2(x2)) + b_fc   (one up projection: `Dims.gated`)
    y  = x2 + ffn_down(gelu_tanh(h)) + b_proj

Biases, both LayerNorms, the tanh GELU and its derivative, the learned position table and the
tied head stay on the CPU, as RMSNorm, SwiGLU's backward and RoPE do for Llama
(`step.DeviceTrainStep`, whose batch handling, dW queue and loss scaling this reuses).
c_attn's gradient is one dW over the stacked dq, dk, dv, as PyTorch's fused layer computes it.
"""

from __future__ import annotations

import functools

import numpy as np

from ...errors import UsageError
from ...models.config import GPT2Config
from ...models.layers import gelu_tanh
from ...models.names import model_weight, weight_name
from . import cpu_ops as ops
from .llama import DeviceTrainStep


class GPT2TrainStep(DeviceTrainStep):
    """Loss and every parameter gradient of a GPT-2, device + CPU (module doc)."""

    wpe = model_weight("gpt2", "positions")  # learned positions, added on the CPU

    @staticmethod
    def _check_config(config) -> None:
        if not isinstance(config, GPT2Config):
            raise UsageError(f"the GPT-2 step needs a GPT-2 config, got {type(config).__name__}")
        if not config.scale_attn_weights or config.scale_attn_by_inverse_layer_idx:
            raise UsageError("GPT-2 training needs attention scaled by 1/sqrt(head_dim): expected "
                             "scale_attn_weights true and scale_attn_by_inverse_layer_idx false")

    def _tables(self, pos: np.ndarray):
        return pos, None  # each column's position (for the wpe rows)

    @property
    def _positions(self) -> np.ndarray:
        return self._cos  # where `_begin` keeps `_tables`' first entry

    def _p(self, i: int, part: str, kind: str = "weight") -> np.ndarray:
        return self.w[weight_name("gpt2", i, part, kind)]

    def _final(self, xl: np.ndarray):
        w = self.w
        bias = self.final_norm.removesuffix("weight") + "bias"
        return ops.layernorm_fwd(xl, w[self.final_norm], w[bias], self.cfg.layer_norm_epsilon)

    def _logits(self, xl: np.ndarray) -> np.ndarray:
        return ops.classifier_fwd(self._head(), self._final(xl)[0])

    def _stats(self, n_tokens: int, t_main: float) -> dict:
        d, f, v, n = self.dims.d, self.dims.f, self.cfg.vocab_size, n_tokens
        per_layer = (2 * (ops.rmsnorm_flops(d, n) + ops.rmsnorm_flops(d, n, backward=True))  # LayerNorms
                     + 6 * d * n + 3 * d * n + f * n                   # residuals, biases and their grads
                     + 30 * f * n                                      # GELU and its derivative
                     + ops.matmul_flops(d, n, 4 * d + 2 * f))          # dW of c_attn, c_proj, c_fc, proj
        head = 3 * ops.matmul_flops(v, d, n) + ops.cross_entropy_flops(v, n) + ops.embed_flops(d, n, True)
        return {"device_flops": int(self._flops), "cpu_flops": int(self.n_layers * per_layer + head),
                "t_device": self._t["device"], "t_cpu": max(t_main - self._t["device"], 0.0),
                "t_dw": self._t["dw"]}

    # ------------------------------------------------------------------ forward
    def _embed(self, ids: np.ndarray) -> np.ndarray:
        w = self.w
        return self._embed_rows(ids) + ops.embed_fwd(w[self.wpe], self._positions)

    def _layer_fwd(self, i: int, x: np.ndarray) -> tuple[np.ndarray, dict]:
        eps, p = self.cfg.layer_norm_epsilon, functools.partial(self._p, i)
        c = {"x": x}
        xn, c["ln1"] = ops.layernorm_fwd(x, p("attn_norm"), p("attn_norm", "bias"), eps)
        c["xn"] = xn
        qkv, (bq, bk, bv) = self._dev("qkv", i, xn=c["xn"]), np.split(p("qkv", "bias"), 3)
        q, k, c["v"] = (qkv[n] + b[:, None] for n, b in (("q", bq), ("k", bk), ("v", bv)))
        c["att"] = {"qr": q, "kr": k}  # no RoPE: the attention kernels take q and k as they are
        c["attn"] = self._attend(i, c)
        c["x2"] = x + self._dev("wo", i, attn=c["attn"])["o"] + p("o", "bias")[:, None]
        x2n, c["ln2"] = ops.layernorm_fwd(c["x2"], p("mlp_norm"), p("mlp_norm", "bias"), eps)
        c["x2n"] = x2n
        c["h1"] = self._dev("ffn_up", i, x2n=c["x2n"])["h1"] + p("fc", "bias")[:, None]
        c["gate"] = gelu_tanh(c["h1"])
        return c["x2"] + self._dev("ffn_down", i, gate=c["gate"])["f"] + p("proj", "bias")[:, None], c

    # ------------------------------------------------------------------ loss and backward
    def _loss_head(self, xl, targets, scale):
        head = self._head()
        xf, saved = self._final(xl)
        loss, dxf, head_dw = self._head_loss(head, xf, targets, scale)
        dy, dw, db = ops.layernorm_bwd(dxf, saved, self.w[self.final_norm])
        return loss, dy, {self.final_norm: dw, self.final_norm.removesuffix("weight") + "bias": db}, head_dw

    def _embed_bwd(self, dy: np.ndarray, ids: np.ndarray, grads: dict) -> None:
        super()._embed_bwd(dy, ids, grads)  # the token table, where the embedding runs
        wpe = self.wpe
        grads[wpe] = ops.embed_bwd(dy, self._positions, np.zeros_like(self.w[wpe]))

    def _layer_bwd(self, i: int, dy: np.ndarray, c: dict, grads: dict, jobs: dict) -> np.ndarray:
        name, p = functools.partial(weight_name, "gpt2", i), functools.partial(self._p, i)
        grads[name("proj", "bias")] = dy.sum(axis=1)
        self._dw(jobs, name("proj"), dy, c["gate"])
        dh = ops.gelu_tanh_bwd(self._dev("ffn_down_dx", i, dy=dy)["dgate"], c["h1"])
        grads[name("fc", "bias")] = dh.sum(axis=1)
        self._dw(jobs, name("fc"), dh, c["x2n"])
        dx2n = self._dev("ffn_up_dx", i, dh1=dh)["dx"]
        dx2, grads[name("mlp_norm")], grads[name("mlp_norm", "bias")] = ops.layernorm_bwd(dx2n, c["ln2"], p("mlp_norm"))
        dx2 = dx2 + dy
        grads[name("o", "bias")] = dx2.sum(axis=1)
        self._dw(jobs, name("o"), dx2, c["attn"])
        dattn = self._dev("wo_dx", i, dx2=dx2)["dattn"]
        g = self._attend_bwd(i, c, dattn)
        dqkv = np.concatenate([g["dq"], g["dk"], g["dv"]])  # [3D, N]: c_attn's output rows
        grads[name("qkv", "bias")] = dqkv.sum(axis=1)
        self._dw(jobs, name("qkv"), dqkv, c["xn"])
        dxn = self._dev("qkv_dx", i, dq=g["dq"], dk=g["dk"], dv=g["dv"])["dx"]
        dx, grads[name("attn_norm")], grads[name("attn_norm", "bias")] = ops.layernorm_bwd(dxn, c["ln1"], p("attn_norm"))
        return dx + dx2
