"""AdamW, clipping and accumulation against torch.optim.AdamW / clip_grad_norm_ in float32.

Tolerance 2e-6 relative to max|w|: our update is torch's op for op in float32, so after a few
steps the only differences are single roundings (torch fuses the lerp into an FMA); a wrong
bias correction, eps placement or decay order is off by 1e-4 or more already at step one.
"""

import json

import numpy as np
import pytest
import torch

from anelm.errors import ShapeError
from anelm.train import optim
from anelm.train.errors import CheckpointError
from helpers import rel_err

TOL = 2e-6
SHAPES = {"model.embed_tokens.weight": (40, 8), "model.layers.0.mlp.up_proj.weight": (16, 8),
          "model.layers.0.input_layernorm.weight": (8,), "model.norm.weight": (8,)}


def make(seed=0):
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}


def grads_for(step, seed=100):
    rng = np.random.default_rng(seed + step)
    # gradients of mixed size, some tiny, so eps and bias correction both matter
    return {n: (rng.standard_normal(s) * 10.0 ** rng.integers(-6, 1)).astype(np.float32)
            for n, s in SHAPES.items()}


def torch_run(params, lrs, betas, eps, wd):
    tp = {n: torch.tensor(p.copy(), requires_grad=True) for n, p in params.items()}
    groups = [{"params": [tp[n] for n in SHAPES if len(SHAPES[n]) >= 2], "weight_decay": wd},
              {"params": [tp[n] for n in SHAPES if len(SHAPES[n]) < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=lrs[0], betas=betas, eps=eps)
    for i, lr in enumerate(lrs):
        for g in opt.param_groups:
            g["lr"] = lr
        for n, t in tp.items():
            t.grad = torch.tensor(grads_for(i)[n])
        opt.step()
    return {n: t.detach().numpy() for n, t in tp.items()}


@pytest.mark.parametrize("wd,betas,eps", [(0.1, (0.9, 0.95), 1e-8), (0.5, (0.8, 0.999), 1e-6)])
def test_adamw_matches_torch_over_steps_with_groups(wd, betas, eps):
    lrs = [1e-3, 3e-3, 2e-3, 5e-4, 1e-4, 1e-2]  # a changing lr, as a schedule gives
    ours = make()
    ref = torch_run(ours, lrs, betas, eps, wd)
    opt = optim.AdamW(ours, lr=lrs[0], betas=betas, eps=eps, weight_decay=wd)
    for i, lr in enumerate(lrs):
        opt.step(grads_for(i), lr=lr)
    for n in SHAPES:
        assert rel_err(ours[n], ref[n]) < TOL, n
    assert opt.t == len(lrs)
    # decay really applied to matrices only: a zero-decay run differs there and nowhere else
    plain = make()
    opt0 = optim.AdamW(plain, lr=lrs[0], betas=betas, eps=eps, weight_decay=0.0)
    for i, lr in enumerate(lrs):
        opt0.step(grads_for(i), lr=lr)
    assert rel_err(plain["model.norm.weight"], ours["model.norm.weight"]) == 0
    assert rel_err(plain["model.embed_tokens.weight"], ours["model.embed_tokens.weight"]) > 1e-5


def test_adamw_large_tensor_spans_several_chunks():
    rng = np.random.default_rng(3)
    w = {"w": rng.standard_normal((3, optim.CHUNK + 17)).astype(np.float32)}
    g = rng.standard_normal(w["w"].shape).astype(np.float32)
    t = torch.tensor(w["w"].copy(), requires_grad=True)
    topt = torch.optim.AdamW([t], lr=1e-2, weight_decay=0.1)
    ours = optim.AdamW(w, lr=1e-2, betas=(0.9, 0.999), weight_decay=0.1)
    for _ in range(3):
        t.grad = torch.tensor(g)
        topt.step()
        ours.step({"w": g})
    assert rel_err(w["w"], t.detach().numpy()) < TOL


def test_adamw_state_round_trip_continues_identically():
    a, b = make(), make()
    opt_a = optim.AdamW(a, lr=1e-3)
    for i in range(3):
        opt_a.step(grads_for(i))
    tensors, meta = opt_a.state_dict()
    meta = json.loads(json.dumps(meta))  # it must survive JSON, as in checkpoint metadata
    b.update({n: v.copy() for n, v in a.items()})
    opt_b = optim.AdamW(b, lr=5.0)
    opt_b.load_state_dict({k: v.copy() for k, v in tensors.items()}, meta)
    opt_a.step(grads_for(3))
    opt_b.step(grads_for(3))
    assert all(np.array_equal(a[n], b[n]) for n in SHAPES) and opt_b.t == 4
    with pytest.raises(CheckpointError, match="exp_avg"):
        opt_b.load_state_dict({}, meta)


def test_adamw_rejects_bad_gradients_and_dtypes():
    opt = optim.AdamW(make())
    g = grads_for(0)
    g.pop("model.norm.weight")
    with pytest.raises(ShapeError, match="model.norm.weight"):
        opt.step(g)
    with pytest.raises(ShapeError, match="float32"):
        optim.AdamW({"w": np.zeros(3, np.float64)})


def test_param_groups_skip_norms_and_biases():
    groups = optim.param_groups(make(), 0.1)
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
    assert set(groups[1]["names"]) == {"model.layers.0.input_layernorm.weight", "model.norm.weight"}


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clip_grad_norm_matches_torch(max_norm):
    g = grads_for(7, seed=0)
    ts = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES.values()]
    for t, n in zip(ts, SHAPES):
        t.grad = torch.tensor(g[n].copy())
    ref_norm = torch.nn.utils.clip_grad_norm_(ts, max_norm).item()
    norm = optim.clip_grad_norm_(g, max_norm)
    assert abs(norm - ref_norm) / ref_norm < 1e-6
    for t, n in zip(ts, SHAPES):
        assert rel_err(g[n], t.grad.numpy()) < 1e-6


def test_clip_leaves_non_finite_gradients_for_the_scaler():
    g = {"a": np.array([np.inf, 1.0], np.float32)}
    assert not np.isfinite(optim.clip_grad_norm_(g, 1.0)) and g["a"][1] == 1.0


@pytest.mark.parametrize("loss_scale,accum,max_norm", [(1024.0, 1, 0.5), (4096.0, 3, 1e6), (1000.0, 2, 0.0)])
def test_update_scale_unscales_and_clips_as_torch(loss_scale, accum, max_norm):
    # torch: grads / (scale·accum), clip_grad_norm_, AdamW; ours: one factor inside the update
    scaled = {n: g * np.float32(loss_scale * accum) for n, g in grads_for(3, seed=5).items()}
    ours, ref = make(), make()
    tp = {n: torch.tensor(p, requires_grad=True) for n, p in ref.items()}
    for n, t in tp.items():
        t.grad = torch.tensor(scaled[n]) / (loss_scale * accum)
    ref_norm = torch.nn.utils.clip_grad_norm_(list(tp.values()), max_norm or float("inf")).item()
    torch.optim.AdamW(list(tp.values()), lr=1e-2, weight_decay=0.0).step()
    before = {n: g.copy() for n, g in scaled.items()}
    norm, factor = optim.update_scale(scaled, loss_scale, accum, max_norm)
    optim.AdamW(ours, lr=1e-2, weight_decay=0.0).step(scaled, grad_scale=factor)
    assert abs(norm - ref_norm) / ref_norm < 1e-6
    coef = min(max_norm / (ref_norm + 1e-6), 1.0) if max_norm else 1.0  # torch's clip coefficient
    assert factor == pytest.approx(coef / (loss_scale * accum), rel=1e-6)
    for n, t in tp.items():
        assert rel_err(ours[n], t.detach().numpy()) < TOL
        assert np.array_equal(scaled[n], before[n])  # the gradients are read, not modified


def test_update_scale_reports_non_finite_and_survives_float32_overflow():
    assert not np.isfinite(optim.update_scale({"a": np.array([np.inf, 1.0], np.float32)})[0])
    assert np.isnan(optim.update_scale({"a": np.array([np.nan, 1.0], np.float32)})[0])
    big = {"a": np.full(4, 3e38, np.float32)}  # finite, but its float32 squares overflow
    norm, factor = optim.update_scale(big, 2.0 ** 20, 1, 1.0)
    assert norm == pytest.approx(6e38 / 2 ** 20) and factor == pytest.approx(1 / (norm + 1e-6) / 2 ** 20)


def test_accumulation_helpers_average_micro_batches():
    params = make()
    acc = optim.zeros_like(params)
    for i in range(4):
        optim.accumulate_(acc, grads_for(i))
    optim.scale_(acc, 0.25)
    mean = {n: np.mean([grads_for(i)[n] for i in range(4)], axis=0) for n in SHAPES}
    assert all(rel_err(acc[n], mean[n]) < 1e-6 for n in SHAPES)
    optim.zero_(acc)
    assert all(not a.any() for a in acc.values()) and optim.adamw_flops(10) == 140
