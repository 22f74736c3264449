"""A plan bound for many runs on small tensors: the emulator's one-column decode evaluation.

`Plan.run` looks every operand up by name, builds a dict per step and calls the op table's
compute with the params, which derives shapes, axes and slices from them again on every call.
On a decode token's one-column tensors (a few hundred values per op, some 65 ops per layer)
that bookkeeping costs more than the arithmetic. `BoundPlan` does it once per plan:

- values live in the slots of a list, consts placed in a template at bind time;
- an op whose plain compute (or its fp32 accumulator's `Saturated` wrapper) has a `bind` in
  the op table runs as that compute specialised to the step's params and operand shapes, and
  a one-column conv on a resident fp16 weight as `ResidentConv`'s one-column product, one on
  int8 weights as `W8Conv.column`; every
  other step calls its own compute with its dict of operands, as `Plan.run` does;
- a fresh float32 result of a bound op is rounded to fp16 in place by the rounding loop itself
  (under `strict`'s rounder, and counted for the overflow watch in the same pass); other
  profiles' rounders, and anything else, go through the step's own rounder.

The results are `Plan.run`'s, bit for bit: the same numpy calls in the same order, and the same
rounding after every op. The first overflowing op is found by `overflow.FirstOverflow`, given
the operands of a step whose result was not finite.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from ...fp16.grid import round_fp16, round_fp16_owned, round_fp16_owned_counted
from ...ir.ops import OP_TABLE, raw_compute
from ..overflow import FirstOverflow
from .accum import Saturated, saturate
from .int8 import W8Conv
from .matvec import ResidentConv
from .plan import Plan, Step


def _bound_compute(st: Step, plan: Plan) -> Callable[..., Any] | None:
    """The step's compute as `fn(*operands) -> result`, bound to its params and shapes, or None."""
    op = OP_TABLE.get(st.op)
    if op is None or len(st.outs) != 1:
        return None  # several results
    names, shapes, types = [], [], plan.types
    for name, key in st.tensors:
        if not isinstance(key, str):
            return None  # a tuple operand (concat's)
        names.append(name)
        shapes.append(tuple(map(int, types[key].shape or ())))
    shapes = tuple(shapes)
    fn, limit = st.fn, None
    if isinstance(fn, Saturated):
        fn, limit = fn.compute, fn.limit
    one_column = names == ["x"] and shapes[0][0] * math.prod(shapes[0][2:]) == 1
    if isinstance(fn, ResidentConv) and one_column:
        bound, limit = fn.column, fn.limit  # a decode token's product, without the per-call checks
    elif isinstance(fn, W8Conv) and fn.column is not None and one_column and len(shapes[0]) == 4:
        return fn.column  # an int8 decode product: its limit and row scale applied, fp16 values
    elif op.bind is not None and fn is raw_compute(op) and names == [n for n in op.inputs if n in names]:
        bound = op.bind(st.params, shapes)
    else:
        return None  # an int8 rewrite, a fixed-point accumulator, a conv over columns: its own compute
    if limit is None:
        return bound
    return lambda *a: saturate(bound(*a), limit)


class _Bound:
    """One step: its compute, operand slots and result slots, and how its results are rounded.
    `call` returns the one result of a bound compute (`single`), else the step's list."""

    __slots__ = ("step", "call", "args", "arity", "single", "outs", "rounders", "checked", "fresh")

    def __init__(self, st: Step, plan: Plan, slot: dict[str, int]):
        self.step = st
        bound = _bound_compute(st, plan)
        self.args = tuple(slot[key] if isinstance(key, str) else tuple(slot[k] for k in key) for _, key in st.tensors)
        self.arity = len(self.args) if all(isinstance(i, int) for i in self.args) else -1
        self.outs = tuple(slot[name] for name, _ in st.outs)
        self.rounders = tuple(r for _, r in st.outs)
        self.checked = tuple(st.checked)
        self.single = bound is not None
        # a bound op's result is a fresh array: strict's rounder may round it where it lies
        self.fresh = self.single and self.rounders[0] is round_fp16_owned
        if bound is not None:
            self.call = bound
        else:
            fn, params, names = st.fn, st.params, [k for k, _ in st.tensors]
            self.call = lambda *a: fn(dict(zip(names, a)), params)

    def operands(self, env: list) -> list:
        return [env[i] if isinstance(i, int) else [env[j] for j in i] for i in self.args]


class BoundPlan:
    """`plan` bound for repeated runs (module doc); `run` is `Plan.run`'s. `like`: the BoundPlan
    of a plan of the same program text (a model's other layer, `emulator.columns.column_plan`):
    a step the two plans share, in the same place and slots, is bound once for both."""

    def __init__(self, plan: Plan, like: BoundPlan | None = None):
        self.plan = plan
        names = list(plan.consts) + [n for _, n in plan.inputs]
        names += [n for st in plan.steps for n, _ in st.outs]  # a name met again keeps its first slot
        self.slot = slot = {n: i for i, n in enumerate(dict.fromkeys(names))}
        self.template: list[Any] = [None] * len(slot)
        for name, value in plan.consts.items():
            self.template[slot[name]] = value
        self.inputs = [(slot[n], n, plan.in_round[n]) for _, n in plan.inputs]
        earlier = like.steps if like is not None and like.slot == slot and len(like.steps) == len(plan.steps) \
            else [None] * len(plan.steps)
        self.steps = [b if b is not None and b.step is st else _Bound(st, plan, slot) for st, b in zip(plan.steps, earlier)]
        self.outputs = [(n, slot[n]) for n in plan.outputs]

    def run(self, inputs: dict[str, np.ndarray], exact: set[str] | frozenset = frozenset(),
            overflow: list | None = None) -> dict[str, np.ndarray]:
        env = list(self.template)
        for i, name, rnd in self.inputs:
            env[i] = inputs[name] if name in exact and rnd is round_fp16 else rnd(inputs[name])
        watch = FirstOverflow() if overflow is not None else None
        with np.errstate(all="ignore"):  # fp16 overflow to inf is the modelled behaviour
            for b in self.steps:
                watching = watch is not None and watch.found is None
                a = b.args
                if b.arity == 1:
                    res = b.call(env[a[0]])
                elif b.arity == 2:
                    res = b.call(env[a[0]], env[a[1]])
                else:
                    res = b.call(*b.operands(env))
                if b.single:
                    if not watching:
                        env[b.outs[0]] = b.rounders[0](res)
                        continue
                    if b.fresh:  # rounded where it lies and counted in one pass
                        res, bad = round_fp16_owned_counted(res)
                        if not bad:
                            env[b.outs[0]] = res
                            continue
                    res = [res]
                if not watching:
                    for i, rnd, r in zip(b.outs, b.rounders, res):
                        env[i] = rnd(r)
                    continue
                values = [chk(r) for chk, r in zip(b.checked, res)]
                if all(finite for _, finite in values):
                    for i, (v, _) in zip(b.outs, values):
                        env[i] = v
                else:  # rounding again changes nothing: the watch's step sees the same values
                    self._watched(b, [v for v, _ in values], env, watch)
        if watch is not None and watch.found is not None:
            overflow.append(watch.found)
        return {name: env[i] for name, i in self.outputs}

    @staticmethod
    def _watched(b: _Bound, res: list, env: list, watch: FirstOverflow) -> None:
        """The watch's step with the operands and results by name, as `Plan.run` keeps them."""
        st = b.step
        named = {}
        for (_, key), i in zip(st.tensors, b.args):
            if isinstance(key, str):
                named[key] = env[i]
            else:
                named.update(zip(key, (env[j] for j in i)))
        watch.step(st, res, named)
        for (name, _), i in zip(st.outs, b.outs):
            env[i] = named[name]
