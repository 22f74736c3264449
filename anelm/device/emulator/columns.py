"""Column-separable programs: the emulator evaluates only the spatial columns a caller reads.

`strict` pads every I/O width to 16 columns (docs/chip-profiles.md), so a decode kernel
carries its token in column 0 and 15 columns nobody reads. When no op of a program mixes spatial columns,
column j of every output depends on column j of the inputs alone, and evaluating one column
is enough. Whether a program is so is read off its plan (`column_axes`): each value that
depends on the input columns carries one *column axis*, followed through every step:

- elementwise ops (with broadcasting) keep it, when every other operand has extent 1 there;
- reductions, softmax and layer_norm keep it unless they run along it;
- matmul keeps it in a batch axis or a free (non-contracted) axis, and mixes columns when it
  contracts over it or when both operands carry columns in different places;
- a 1x1, stride-1, unpadded conv keeps it in a spatial or batch axis;
- transpose moves it; reshape keeps it as the last axis when the last dim stays; slices keep
  it when they take the whole axis; every other op with a column-carrying operand mixes.

The column-carrying inputs are those whose last dim is the outputs' common width W; every
output must carry its columns in its last axis (or none at all). A program that passes is
evaluated column by column with a width-1 plan derived from its own (same steps, consts and
weights; only the shapes in reshape and slice params narrowed), whether the caller reads one
column or all of them: the values a caller reads never depend on how many it reads. Only
programs of at most COLUMN_BLOCK columns are evaluated so (one padded block, as decode's):
wider ones (prefill, training) are read whole, and one BLAS product over all their columns
is far cheaper than one per column. A program that mixes columns runs its plan in full.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from ...mil.program import TensorType
from .plan import Plan, Step
from .steps import BoundPlan

COLUMN_BLOCK = 16  # the widest program evaluated column by column: strict's padded decode width

ELEMENTWISE = frozenset({"abs", "add", "cast", "clip", "exp", "gelu", "maximum", "minimum", "mul", "pow",
                         "real_div", "relu", "rsqrt", "sigmoid", "silu", "sqrt", "sub", "tanh"})


class _Mixes(Exception):
    """A step mixes spatial columns (or is not understood): the program is evaluated in full."""


def column_axes(plan: Plan) -> dict[str, int] | None:
    """{value: its column axis} for every value that depends on the input columns, or None
    when some step mixes columns (or the program has no columns to separate)."""
    widths = {_shape(plan, n)[-1] if _shape(plan, n) else None for n in plan.outputs}
    if len(widths) != 1 or None in widths or widths == {1}:
        return None
    width = widths.pop()
    axes = {name: len(t.shape) - 1 for t, name in plan.inputs if t.shape and t.shape[-1] == width}
    if not axes:
        return None
    try:
        for st in plan.steps:
            carried = [(arg, key, axes[key]) for arg, key in st.tensors if isinstance(key, str) and key in axes]
            if any(isinstance(key, list) and any(k in axes for k in key) for _, key in st.tensors):
                raise _Mixes(st.op)  # a tuple operand (concat's values) carrying columns
            if not carried:
                continue
            axis = _follow(plan, st, carried, width)
            for name, _ in st.outs:
                axes[name] = axis
    except _Mixes:
        return None
    for name in plan.outputs:
        if name in axes and axes[name] != len(_shape(plan, name)) - 1:
            return None
    return axes


def _shape(plan: Plan, key: str) -> tuple[int, ...]:
    return tuple(plan.types[key].shape or ())


def _follow(plan: Plan, st: Step, carried: list, width: int) -> int:
    """The column axis of the step's results; raises _Mixes when the step mixes columns."""
    op, p = st.op, st.params
    out_rank = len(_shape(plan, st.outs[0][0]))
    if op in ELEMENTWISE or op in ("quantize", "dequantize"):
        axis = _aligned(plan, st, carried, out_rank)
        if op in ("quantize", "dequantize") and p.get("axis") is not None:
            if p["axis"] % out_rank == axis:
                raise _Mixes(op)  # a scale per column: the scale vector is not narrowed
        return axis
    (arg, key, axis), = carried if len(carried) == 1 else _only(carried, op)
    rank = len(_shape(plan, key))
    if op in ("reduce_sum", "reduce_max", "reduce_mean", "layer_norm", "softmax"):
        along = [p["axis"]] if op == "softmax" else p.get("axes")
        if along is None or arg != "x":
            raise _Mixes(op)
        along = {a % rank for a in along}
        if axis in along:
            raise _Mixes(op)
        if op.startswith("reduce_") and not p.get("keep_dims"):
            return axis - sum(a < axis for a in along)
        return axis
    if op == "transpose":
        return list(p["perm"]).index(axis)
    if op == "reshape":
        if axis != rank - 1 or out_rank == 0 or _shape(plan, st.outs[0][0])[-1] != width:
            raise _Mixes(op)
        return out_rank - 1
    if op == "slice_by_size":
        if p["begin"][axis] != 0 or p["size"][axis] not in (-1, width):
            raise _Mixes(op)
        return axis
    if op == "slice_by_index":
        return _slice_by_index(p, axis, rank, width)
    if op == "conv":
        return _conv(plan, st, arg, axis)
    if op == "matmul":
        return _matmul(plan, st, carried, out_rank)
    raise _Mixes(op)


def _only(carried: list, op: str) -> list:
    if op == "matmul":
        return carried[:1]  # both operands: _matmul looks at each
    raise _Mixes(op)


def _aligned(plan: Plan, st: Step, carried: list, out_rank: int) -> int:
    """Broadcasting aligns dims from the right: one output axis for every carried operand, and
    extent 1 (or no such dim) there for every other operand."""
    axes = {axis + out_rank - len(_shape(plan, key)) for _, key, axis in carried}
    if len(axes) != 1:
        raise _Mixes(st.op)
    axis = axes.pop()
    for _, key in st.tensors:
        if isinstance(key, str) and all(key != k for _, k, _ in carried):
            shape = _shape(plan, key)
            own = axis - (out_rank - len(shape))
            if 0 <= own < len(shape) and shape[own] != 1:
                raise _Mixes(st.op)  # per-column data that is not carried: not narrowed
    return axis


def _slice_by_index(p: dict, axis: int, rank: int, width: int) -> int:
    def flag(name):
        m = p.get(name)
        return bool(m[axis]) if m is not None else False
    begin_ok = flag("begin_mask") or p["begin"][axis] == 0
    end_ok = flag("end_mask") or p["end"][axis] == width
    stride_ok = p.get("stride") is None or p["stride"][axis] == 1
    if not (begin_ok and end_ok and stride_ok) or flag("squeeze_mask"):
        raise _Mixes("slice_by_index")
    return axis


def _conv(plan: Plan, st: Step, arg: str, axis: int) -> int:
    p = st.params
    if arg != "x" or axis == 1:
        raise _Mixes("conv")  # columns in the weight, or in the channels it sums over
    if axis >= 2:
        k = axis - 2
        strides = p.get("strides") or (1, 1)
        pad = p.get("pad") or (0, 0, 0, 0)
        padded = p.get("pad_type") == "same" or (p.get("pad_type") == "custom" and (pad[2 * k] or pad[2 * k + 1]))
        # unpadded at stride 1, the result keeps the width only with a kernel 1 wide along it
        # (an int8 conv holds its weight in the step, so the kernel is read off the shapes)
        same_width = _shape(plan, st.outs[0][0])[axis] == _shape(plan, dict(st.tensors)["x"])[axis]
        if strides[k] != 1 or padded or not same_width:
            raise _Mixes("conv")
    return axis


def _matmul(plan: Plan, st: Step, carried: list, out_rank: int) -> int:
    places = set()
    for arg, key, axis in carried:
        rank = len(_shape(plan, key))
        if rank < 2:
            raise _Mixes("matmul")
        flip = st.params["transpose_x" if arg == "x" else "transpose_y"]
        row, col = (rank - 1, rank - 2) if flip else (rank - 2, rank - 1)  # the operand's rows, columns
        free, contracted = (row, col) if arg == "x" else (col, row)
        if axis == contracted:
            raise _Mixes("matmul")
        if axis == free:
            places.add(out_rank - 2 if arg == "x" else out_rank - 1)
        else:
            places.add(axis + out_rank - rank)  # a batch axis
    if len(places) != 1:
        raise _Mixes("matmul")
    axis = places.pop()
    if axis < out_rank - 2:  # a batch axis: the other operand must broadcast along it
        for arg, key in st.tensors:
            if all(key != k for _, k, _ in carried):
                shape = _shape(plan, key)
                own = axis - (out_rank - len(shape))
                if 0 <= own < len(shape) and shape[own] != 1:
                    raise _Mixes("matmul")
    return axis


# --- the width-1 plan ----------------------------------------------------------------------

def _narrowed(shape, axis: int) -> tuple[int, ...]:
    return tuple(1 if i == axis else d for i, d in enumerate(shape))


def narrow_plan(plan: Plan, axes: dict[str, int], like: ColumnPlan | None = None) -> Plan:
    """The plan of one column: the same steps, consts and rounders, with every column-carrying
    value one column wide and the reshape and slice params that name the width narrowed. `like`:
    the column plan of a plan replayed from the same kernel-cache record (`column_plan`), whose
    one-column steps are taken for the steps the two plans share, and its types (the same)."""
    if like is not None:
        types = like.one.types
    else:
        types = dict(plan.types)
        for name, axis in axes.items():
            t = types[name]
            types[name] = TensorType(t.dtype, _narrowed(t.shape, axis))
    steps = []
    earlier = zip(like.full_steps, like.one.steps) if like is not None and len(like.full_steps) == len(plan.steps) \
        else [(None, None)] * len(plan.steps)
    for st, (full, one) in zip(plan.steps, earlier):
        if full is st:
            steps.append(one)
            continue
        out = st.outs[0][0]
        if out in axes and st.op in ("reshape", "slice_by_size", "slice_by_index"):
            params = dict(st.params)
            key = {"reshape": "shape", "slice_by_size": "size", "slice_by_index": "end"}[st.op]
            axis = len(params[key]) - 1 if st.op == "reshape" else axes[out]
            if not (st.op == "slice_by_size" and params[key][axis] == -1):
                params[key] = list(params[key])
                params[key][axis] = 1
            st = replace(st, params=params)
        steps.append(st)
    inputs = [(types[name], name) for _, name in plan.inputs]
    return replace(plan, inputs=inputs, types=types, steps=steps)  # consts and rounders shared


@dataclass
class ColumnPlan:
    """A column-separable program's evaluation, one column at a time (see the module doc)."""

    width: int
    one: Plan  # the width-1 plan
    carried_inputs: frozenset[str]
    carried_outputs: frozenset[str]
    bound: BoundPlan | None = None  # `one` bound for its many small runs (emulator.steps)
    full_steps: list[Step] = field(default_factory=list, repr=False)  # the full plan's, that `one` narrows

    def __post_init__(self):
        if self.bound is None:
            self.bound = BoundPlan(self.one)

    def run(self, inputs: dict[str, np.ndarray], exact, read: int | None, full: Plan,
            overflow: list | None = None) -> dict[str, np.ndarray]:
        """Columns 0..read-1 of every output (read=None: all); the others are zeros."""
        read = self.width if read is None else max(1, min(read, self.width))
        results: dict[str, np.ndarray] = {}
        for j in range(read):
            column = {n: np.ascontiguousarray(a[..., j:j + 1]) if n in self.carried_inputs else a
                      for n, a in inputs.items()}
            found: list | None = [] if overflow is not None and not overflow else None
            got = self.bound.run(column, exact, overflow=found)
            if found:
                overflow.extend(found)
            for name, a in got.items():
                if name not in self.carried_outputs:
                    results.setdefault(name, a)
                    continue
                if name not in results:
                    results[name] = np.zeros(full.types[name].shape, a.dtype)
                results[name][..., j] = a[..., 0]
        return results


def column_plan(plan: Plan, axes: dict[str, int] | None, like: ColumnPlan | None = None) -> ColumnPlan | None:
    """The column-by-column evaluation of `plan`, or None when it must run in full. `axes` is
    `column_axes(plan)`, found again or kept with the plan's kernel-cache entry. `like`: the
    column plan of another plan replayed from the same record (a model's other layer), whose
    one-column and bound steps serve again for the steps the plans share (`emulator.builder.Shared`)."""
    if axes is None:
        return None
    width = _shape(plan, plan.outputs[0])[-1]
    if width > COLUMN_BLOCK:
        return None
    one = narrow_plan(plan, axes, like)
    return ColumnPlan(width, one, frozenset(n for _, n in plan.inputs if n in axes),
                      frozenset(n for n in plan.outputs if n in axes),
                      BoundPlan(one, like.bound if like is not None else None), list(plan.steps))
