"""Loss scaling (skip / halve / double, state) and the warmup + cosine schedule."""

import json
import math

import numpy as np
import pytest

from anelm.errors import UsageError
from anelm.train import optim
from anelm.train.scaler import (DynamicLossScaler, FixedLossScaler, grads_finite, make_scaler,
                                scaler_from_state)
from anelm.train.schedule import CosineSchedule


def test_dynamic_scaler_skips_halves_and_floors():
    s = DynamicLossScaler(init_scale=4.0, growth_interval=3)
    assert s.update(False) is False and s.scale == 2.0
    assert s.update(False) is False and s.scale == 1.0
    assert s.update(False) is False and s.scale == 1.0  # floor 1
    assert s.skipped == 3


def test_dynamic_scaler_doubles_after_clean_steps_and_caps():
    s = DynamicLossScaler(init_scale=2.0 ** 14, growth_interval=3)
    assert [s.update(True) for _ in range(2)] == [True, True] and s.scale == 2.0 ** 14
    s.update(True)
    assert s.scale == 2.0 ** 15
    s.update(True), s.update(False)  # an overflow resets the clean count
    assert s.scale == 2.0 ** 14 and s.clean == 0
    for _ in range(9):
        s.update(True)
    assert s.scale == 2.0 ** 15  # capped: 2**16 would overflow a scaled dlogit in fp16


def test_scaler_state_round_trips_through_json():
    s = DynamicLossScaler(init_scale=64.0, growth_interval=5)
    for ok in (True, True, False, True):
        s.update(ok)
    t = scaler_from_state(json.loads(json.dumps(s.state_dict())))
    assert isinstance(t, DynamicLossScaler) and t.state_dict() == s.state_dict()
    f = scaler_from_state(FixedLossScaler(128.0).state_dict())
    assert type(f) is FixedLossScaler and f.scale == 128.0


def test_make_scaler_and_fixed_scale():
    assert isinstance(make_scaler(), DynamicLossScaler) and make_scaler().scale == 4096.0
    f = make_scaler("256")
    assert isinstance(f, FixedLossScaler) and f.scale == 256.0
    assert f.update(False) is False and f.scale == 256.0  # fixed: skip, never change
    with pytest.raises(UsageError, match="expected 'dynamic' or a positive number"):
        make_scaler("big")
    with pytest.raises(UsageError, match="positive"):
        make_scaler(-1)


def test_overflowing_step_is_skipped_and_training_recovers():
    # gradients cross fp16 surfaces: scale·g beyond 65504 becomes inf there
    w = {"w": np.ones(4, np.float32)}
    opt, s = optim.AdamW(w, lr=0.1, weight_decay=0.0), DynamicLossScaler(init_scale=2.0 ** 15)
    true_grad = np.array([3.0, -1.0, 0.5, 2.0], np.float32)
    history = []
    for _ in range(4):
        with np.errstate(over="ignore"):
            g = {"w": (true_grad * np.float32(s.scale)).astype(np.float16).astype(np.float32)}
        ok = grads_finite(g)
        scale_used = s.scale
        if s.update(ok):
            opt.step(g, grad_scale=optim.update_scale(g, scale_used)[1])
        history.append((ok, scale_used, w["w"].copy()))
    assert not history[0][0] and np.array_equal(history[0][2], np.ones(4))  # skipped, untouched
    assert history[1][1] == 2.0 ** 14 and history[1][0]  # halved scale fits fp16
    assert opt.t == 3 and np.all(np.sign(1.0 - w["w"]) == np.sign(true_grad))


def test_grads_finite():
    g = {"a": np.full(3, 8.0, np.float32), "b": np.ones(2, np.float32)}
    assert grads_finite(g)
    g["b"][1] = np.nan
    assert not grads_finite(g)
    assert grads_finite({"big": np.full(10, 3e38, np.float32)})  # a big finite sum is not inf


def test_schedule_values():
    s = CosineSchedule(peak_lr=1.0, total_steps=100)  # warmup 5 % = 5 steps, floor 0.1
    assert s.warmup == 5
    assert [round(s(i), 6) for i in range(5)] == [0.2, 0.4, 0.6, 0.8, 1.0]
    assert s(5) == 1.0 and math.isclose(s(99), 0.1)
    assert math.isclose(s(5 + 47), 0.55)  # halfway through the decay
    lrs = [s(i) for i in range(5, 100)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:])) and s(500) == pytest.approx(0.1)


def test_schedule_scales_with_total_steps():
    a, b = CosineSchedule(3e-4, 200), CosineSchedule(3e-4, 2000)
    assert b.warmup == 10 * a.warmup
    assert a(a.warmup + 95) == pytest.approx(b(b.warmup + 950), rel=2e-2)
    assert CosineSchedule(1.0, 10, warmup_steps=0)(0) == 1.0
    with pytest.raises(UsageError, match="total steps"):
        CosineSchedule(1.0, 0)
