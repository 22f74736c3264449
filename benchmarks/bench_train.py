"""Training step speed: our device step on the emulator against a PyTorch CPU training step.

For the stories110m shape (dim 768, 12 heads, MLP 2048, vocab 32000) at seq 256, in one run
on one machine:
1. our step (`DeviceTrainStep`, dynamic pipeline, `strict` emulator) + AdamW, broken down into
   device evaluations, CPU ops on the main thread, dW on the worker thread and AdamW, against
   a float32 `LlamaForCausalLM` forward + backward + `torch.optim.AdamW` step, same batch;
2. the CPU side alone, op by op on identical shapes: dW matmuls, AdamW, RMSNorm fwd+bwd, RoPE
   fwd+bwd, SwiGLU bwd, classifier + cross-entropy fwd+bwd, embedding fwd+bwd, ours (numpy,
   `cpu_ops` / `optim`) against the same ops in torch (autograd for the elementwise parts),
   each side at its faster thread setting.

    python benchmarks/bench_train.py                  # the full shape (~minutes on 2 cores)
    python benchmarks/bench_train.py --layers 2       # a quick run

Threads: our step runs BLAS on two threads at once (main + dW worker), one BLAS thread each
(`anelm.runtime.threads.share_blas_between`). Torch is timed with its default intra-op pool and
with one thread during warmup, and the faster setting is the one timed: on a shared 2-core
machine its default pool is easily 5x slower when another process takes a core, and the
comparison should not flatter us. Whole steps are taken in turns, one of ours then one of
torch's, and both the best and the median are printed: the machine these figures come from
drifts by tens of percent within a minute. The op-by-op figures are bests.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F

from anelm.device.emulator import Emulator
from anelm.chip.profile import STRICT
from anelm.models.config import LlamaConfig
from anelm.train.steps import cpu_ops as ops
from anelm.train.init import init_weights
from threadpoolctl import threadpool_limits

from anelm.runtime.threads import share_blas_between
from anelm.train.optim import AdamW, update_scale
from anelm.train.steps.llama import DeviceTrainStep
from timing import best_of  # benchmarks/timing.py, beside this script


def make_config(layers: int, seq: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=layers,
                       num_attention_heads=12, num_key_value_heads=12, rms_norm_eps=1e-5,
                       max_position_embeddings=max(seq, 256), tie_word_embeddings=True)


# ------------------------------------------------------------------------- whole steps

class OursStep:
    """Our training step as the training loop runs it: `accum` micro-batches (gradients
    accumulated as the trainer does: inside the dW GEMMs where the step can, else one add per
    micro-batch), unscale + clip + AdamW in one pass (`update_scale`), weights restaged."""

    def __init__(self, cfg, batch, seq, accum=1):
        self.w = init_weights(cfg, seed=0)
        self.step = DeviceTrainStep(cfg, self.w, Emulator(STRICT), seq_len=seq)
        self.opt = AdamW(self.w, lr=1e-4)
        rng = np.random.default_rng(0)
        self.x, self.y = (rng.integers(0, cfg.vocab_size, (batch, seq)) for _ in range(2))
        self.accum = accum
        self.acc = {n: np.zeros_like(p) for n, p in self.w.items()} if accum > 1 else None
        self.fused = getattr(self.step, "accumulates_in_place", False)

    def run(self) -> dict:
        t0 = time.perf_counter()
        st_sum: dict = {}
        if self.acc is not None and not self.fused:
            for g in self.acc.values():
                g.fill(0.0)
        for k in range(self.accum):
            into = {"into": self.acc, "add": k > 0} if self.acc is not None and self.fused else {}
            loss, grads, st = self.step.loss_and_grads(self.x, self.y, loss_scale=1024.0, **into)
            if self.acc is not None and not self.fused:
                for n, g in grads.items():
                    self.acc[n] += g
            st_sum = {key: st_sum.get(key, 0) + v for key, v in st.items()}
        grads, st = (self.acc if self.acc is not None and not self.fused else grads), st_sum
        t1 = time.perf_counter()
        _, factor = update_scale(grads, 1024.0, self.accum, 1.0)
        self.opt.step(grads, grad_scale=factor)
        t2 = time.perf_counter()
        self.step.set_weights(self.w)
        t3 = time.perf_counter()
        return {"total": t3 - t0, "grads": t1 - t0, "device": st["t_device"], "cpu": st["t_cpu"],
                "dw": st["t_dw"], "adamw": t2 - t1, "restage": t3 - t2,
                "device_flops": st["device_flops"], "cpu_flops": st["cpu_flops"]}


class TorchStep:
    """A float32 LlamaForCausalLM forward + backward + clip + torch.optim.AdamW step."""

    def __init__(self, cfg, batch, seq, accum=1):
        from transformers import LlamaConfig as HFConfig, LlamaForCausalLM

        d = {k: v for k, v in cfg.to_dict().items() if k not in ("model_type", "architectures")}
        self.model = LlamaForCausalLM(HFConfig(**d, attn_implementation="sdpa")).float()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, betas=(0.9, 0.95))
        self.x, self.y = (torch.randint(0, cfg.vocab_size, (batch, seq)) for _ in range(2))
        self.vocab, self.accum = cfg.vocab_size, accum

    def run(self) -> float:
        t0 = time.perf_counter()
        for _ in range(self.accum):  # .grad accumulates across the backward calls
            logits = self.model(self.x).logits
            (F.cross_entropy(logits.reshape(-1, self.vocab), self.y.reshape(-1)) / self.accum).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0


def whole_steps(cfg, batch, seq, rounds, warmup, accum=1) -> tuple[list[dict], list[float], int]:
    """(our step rows, torch step times, torch threads): steps taken in turns, one of ours
    then one of torch's, so both sides see the same machine (a shared one drifts by tens of
    percent within a minute). Torch runs at its faster thread setting, chosen during warmup."""
    ours, theirs = OursStep(cfg, batch, seq, accum), TorchStep(cfg, batch, seq, accum)
    default = torch.get_num_threads()
    trial = {}
    for _ in range(warmup):  # warmups first: caches, and the heap growing to its size
        ours.run()
    for n in sorted({default, 1}):
        torch.set_num_threads(n)
        trial[n] = min(theirs.run() for _ in range(warmup))
    threads = min(trial, key=trial.get)
    torch.set_num_threads(threads)
    rows, times = [], []
    for _ in range(rounds):
        rows.append(ours.run())
        times.append(theirs.run())
    ours.step.close()
    torch.set_num_threads(default)
    return rows, times, threads


# --------------------------------------------------------------- the CPU side, op by op

def cpu_side(cfg, n: int, repeat: int) -> list[tuple[str, float, float]]:
    """(part, ours s, torch s) for one step's CPU work over n tokens, identical shapes."""
    d, f, v, L, hd = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers, cfg.head_dim
    rng = np.random.default_rng(1)
    r = lambda *s: rng.standard_normal(s, dtype=np.float32)  # noqa: E731
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a.T))  # noqa: E731  channel-last for torch
    x, dy, wn = r(d, n), r(d, n), np.ones(d, np.float32)
    q, dq = r(d, n), r(d, n)
    h1, h3, dg = r(f, n), r(f, n), r(f, n)
    cos, sin = ops.rope_tables(hd, np.arange(n) % 256, 1e4)
    head, xf, tgt = r(v, d) * 0.02, r(d, n), rng.integers(0, v, n)
    ids = rng.integers(0, v, n)
    dw_shapes = [(d, d)] * 4 + [(f, d), (f, d), (d, f)]
    parts = [
        ("dW (7 per layer + head)", _ours_dw(dw_shapes, n, L, head, xf, r),
         _torch_dw(dw_shapes, n, L, v, d)),
        ("RMSNorm fwd+bwd (2L+1)", lambda: [ops.rmsnorm_bwd(dy, x, wn, ops.rmsnorm_fwd(x, wn, 1e-5)[1])
                                           for _ in range(2 * L + 1)],
         _torch_norm(t(x), t(dy), 2 * L + 1)),
        ("RoPE fwd+bwd (q, k per layer)", lambda: [(ops.rope_fwd(q, cos, sin), ops.rope_bwd(dq, cos, sin))
                                                  for _ in range(2 * L)],
         _torch_rope(t(q), t(dq), torch.from_numpy(cos.T.copy()), torch.from_numpy(sin.T.copy()), 2 * L)),
        ("SwiGLU bwd (per layer)", lambda: [ops.swiglu_bwd(dg, h1, h3) for _ in range(L)],
         _torch_swiglu(t(h1), t(h3), t(dg), L)),
        ("classifier + loss fwd+bwd", lambda: _ours_loss(head, xf, tgt), _torch_loss(head, xf, tgt)),
        ("embedding fwd+bwd", lambda: ops.embed_bwd(ops.embed_fwd(head, ids), ids, np.zeros_like(head)),
         _torch_embed(head, ids)),
        ("AdamW", _ours_adamw(cfg), _torch_adamw(cfg)),
    ]
    out = []
    for name, ours, theirs in parts:
        out.append((name, fastest_ours(ours, repeat), fastest_torch(theirs, repeat)))
    return out


def fastest_ours(fn, repeat: int) -> float:
    """Best time of `fn` with one BLAS thread (as inside the step) and with one per core."""
    import os

    times = []
    for n in sorted({1, os.cpu_count() or 1}):
        with threadpool_limits(limits=n, user_api="blas"):
            fn()
            times.append(best_of(fn, repeat))
    return min(times)


def fastest_torch(fn, repeat: int, warmup: int = 1) -> float:
    """Best time of `fn` under torch's default thread pool and under one thread."""
    default = torch.get_num_threads()
    times = []
    for n in sorted({default, 1}):
        torch.set_num_threads(n)
        for _ in range(warmup):  # warm up at this thread count
            fn()
        times.append(best_of(fn, repeat))
    torch.set_num_threads(default)
    return min(times)


def _ours_dw(shapes, n, layers, head, xf, r):
    # inputs drawn once, outside the timing, as on the torch side
    dys = {s: r(s[0], n) for s in set(shapes)}
    xs = {s: r(s[1], n) for s in set(shapes)}
    dlog = r(head.shape[0], n)

    def run():
        for _ in range(layers):
            for s in shapes:
                ops.dw(dys[s], xs[s])
        ops.dw(dlog, xf)
    return run


def _torch_dw(shapes, n, layers, v, d):
    dys = {s: torch.randn(n, s[0]) for s in set(shapes)}
    xs = {s: torch.randn(n, s[1]) for s in set(shapes)}
    dlog, xf = torch.randn(n, v), torch.randn(n, d)

    def run():
        for _ in range(layers):
            for s in shapes:
                torch.mm(dys[s].T, xs[s])
        torch.mm(dlog.T, xf)
    return run


def _torch_norm(x, dy, count):
    w = torch.ones(x.shape[1], requires_grad=True)

    def run():
        for _ in range(count):
            xx = x.detach().requires_grad_()
            y = xx * torch.rsqrt(xx.pow(2).mean(-1, keepdim=True) + 1e-5) * w
            y.backward(dy)
    return run


def _torch_rope(q, dq, cos, sin, count):
    hd = cos.shape[1]

    def rot(a):
        a = a.view(a.shape[0], -1, hd)
        return torch.cat([-a[..., hd // 2:], a[..., :hd // 2]], -1)

    def run():
        for _ in range(count):
            qq = q.detach().requires_grad_()
            y = (qq.view(qq.shape[0], -1, hd) * cos[:, None] + rot(qq) * sin[:, None])
            y.backward(dq.view_as(y))
    return run


def _torch_swiglu(h1, h3, dg, count):
    def run():
        for _ in range(count):
            a, b = h1.detach().requires_grad_(), h3.detach().requires_grad_()
            (F.silu(a) * b).backward(dg)
    return run


def _ours_loss(head, xf, tgt):
    logits = ops.classifier_fwd(head, xf)
    _, dlog = ops.cross_entropy(logits, tgt, 1024.0)
    return head.T @ dlog


def _torch_loss(head, xf, tgt):
    w, x, y = torch.from_numpy(head), torch.from_numpy(xf.T.copy()), torch.from_numpy(tgt)

    def run():
        xx = x.detach().requires_grad_()
        F.cross_entropy(xx @ w.T, y).backward()  # dW of the head is in the dW row
    return run


def _torch_embed(head, ids):
    w, i = torch.from_numpy(head), torch.from_numpy(ids)

    def run():
        ww = w.detach().requires_grad_()
        e = F.embedding(i, ww)
        e.backward(torch.ones_like(e))
    return run


def _ours_adamw(cfg):
    w = init_weights(cfg, seed=0)
    g = {k: np.full_like(v, 1e-3) for k, v in w.items()}
    opt = AdamW(w, lr=1e-4)
    return lambda: opt.step(g)


def _torch_adamw(cfg):
    ps = [torch.nn.Parameter(torch.from_numpy(v)) for v in init_weights(cfg, seed=0).values()]
    for p in ps:
        p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW(ps, lr=1e-4, betas=(0.9, 0.95))
    return opt.step


# ---------------------------------------------------------------------------- report

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step, on each side")
    ap.add_argument("--steps", type=int, default=5, help="timed steps on each side")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first, on each side")
    a = ap.parse_args()
    share_blas_between(2)  # as inside the step: device evals and dW each get half the cores
    cfg = make_config(a.layers, a.seq)
    n_params = sum(v.size for v in init_weights(cfg, 0).values())
    print(f"stories110m shape, {a.layers} layers ({n_params / 1e6:.1f}M params), batch {a.batch} x seq {a.seq} "
          f"x{a.grad_accum} accum, "
          f"torch {torch.__version__} with {torch.get_num_threads()} threads")
    rows, times, threads = whole_steps(cfg, a.batch, a.seq, a.steps, a.warmup, a.grad_accum)
    ours = min(rows, key=lambda r: r["total"])
    med_ours, med_torch = float(np.median([r["total"] for r in rows])), float(np.median(times))
    print(f"\nwhole training step ({a.steps} steps each, taken in turns, after {a.warmup} warmup steps each):")
    print(f"  ours (emulator)     {ours['total']:8.3f} s   = loss_and_grads {ours['grads']:.3f} "
          f"+ AdamW {ours['adamw']:.3f} + restage weights {ours['restage']:.3f}   (best; median {med_ours:.3f})")
    print(f"    device evals      {ours['device']:8.3f} s   ({ours['device_flops'] / 1e9:.1f} GFLOP)")
    print(f"    CPU ops (main)    {ours['cpu']:8.3f} s   (all CPU work incl. dW: {ours['cpu_flops'] / 1e9:.1f} GFLOP)")
    print(f"    dW (worker; main helps at the end) {ours['dw']:6.3f} s")
    print(f"    AdamW (+ unscale, clip) {ours['adamw']:6.3f} s")
    print(f"  torch fp32 CPU      {min(times):8.3f} s   ({threads} thread{'s' if threads > 1 else ''}; "
          f"median {med_torch:.3f})")
    print(f"  ratio ours / torch  {ours['total'] / min(times):8.2f}x best, {med_ours / med_torch:.2f}x median")
    n = a.batch * a.seq
    rows = cpu_side(cfg, n, repeat=a.steps)
    print(f"\nCPU side alone, op by op over {n} tokens (best of {a.steps}):")
    print(f"  {'part':32s} {'ours s':>9s} {'torch s':>9s} {'ratio':>7s}")
    for name, o, t in rows:
        print(f"  {name:32s} {o:9.4f} {t:9.4f} {o / t:7.2f}x")
    so, st = sum(r[1] for r in rows), sum(r[2] for r in rows)
    print(f"  {'total':32s} {so:9.4f} {st:9.4f} {so / st:7.2f}x")


if __name__ == "__main__":
    main()
