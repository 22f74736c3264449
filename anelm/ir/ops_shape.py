"""Movement ops: reshape, transpose, slice_by_size, slice_by_index, concat."""

from __future__ import annotations

import math

import numpy as np

from ..mil.program import TensorType
from .op_table import REQUIRED, define
from .ops_common import as_list, axis_of, bad, dims, tensor

# ----------------------------------------------------------------------------- reshape


def reshape_target(src: tuple[int, ...], shape) -> tuple[int, ...]:
    """MIL reshape: -1 is inferred (at most one); 0 copies x's dim when the ranks agree."""
    want = [int(d) for d in as_list(shape)]
    if want.count(-1) > 1:
        bad("at most one -1 in shape", want)
    if 0 in want and len(want) == len(src):
        want = [src[i] if d == 0 else d for i, d in enumerate(want)]
    total = math.prod(int(d) for d in src)  # Python ints: np.prod costs ~10 us a call, once per evaluation
    if -1 in want:
        known = math.prod(d for d in want if d != -1) if len(want) > 1 else 1
        if known <= 0 or total % known:
            bad(f"a shape whose known dims divide the {total} elements of {list(src)}", want)
        want[want.index(-1)] = total // known
    if any(d < 0 for d in want) or math.prod(want) != total:
        bad(f"a shape with the {total} elements of {list(src)}", want)
    return tuple(want)


def _infer_reshape(t, p):
    return [tensor(t["x"].dtype, reshape_target(dims(t["x"]), p["shape"]))]


def _bind_reshape(p, shapes):
    target = reshape_target(shapes[0], p["shape"])
    return lambda a: a.reshape(target)


define("reshape", ("x",), _infer_reshape, lambda x, p: [_bind_reshape(p, (x["x"].shape,))(x["x"])],
       params={"shape": REQUIRED}, bind=_bind_reshape)

# ----------------------------------------------------------------------------- transpose


def _perm(perm, rank):
    pm = [axis_of(int(a), rank, "perm entry") for a in as_list(perm)]
    if sorted(pm) != list(range(rank)):
        bad(f"perm a permutation of 0..{rank - 1}", as_list(perm))
    return pm


def _infer_transpose(t, p):
    shape = dims(t["x"])
    return [tensor(t["x"].dtype, tuple(shape[a] for a in _perm(p["perm"], len(shape))))]


def _bind_transpose(p, shapes):
    perm = _perm(p["perm"], len(shapes[0]))
    return lambda a: np.transpose(a, perm)


define("transpose", ("x",), _infer_transpose, lambda x, p: [_bind_transpose(p, (x["x"].shape,))(x["x"])],
       params={"perm": REQUIRED}, bind=_bind_transpose)

# ----------------------------------------------------------------------------- slice_by_size


def size_slices(shape, begin, size) -> tuple[slice, ...]:
    """slice_by_size: begin may be negative (from the end); size -1 runs to the end."""
    b, s = [int(v) for v in as_list(begin)], [int(v) for v in as_list(size)]
    if len(b) != len(shape) or len(s) != len(shape):
        bad(f"begin and size of length rank(x)={len(shape)}", f"{b} and {s}")
    out = []
    for i, d in enumerate(shape):
        start = b[i] + d if b[i] < 0 else b[i]
        stop = d if s[i] == -1 else start + s[i]
        if not (0 <= start <= d) or not (start <= stop <= d) or (s[i] < 0 and s[i] != -1):
            bad(f"begin+size within dim {i} of size {d}", f"begin {b[i]}, size {s[i]}")
        out.append(slice(start, stop))
    return tuple(out)


def _infer_slice_by_size(t, p):
    sl = size_slices(dims(t["x"]), p["begin"], p["size"])
    return [tensor(t["x"].dtype, tuple(s.stop - s.start for s in sl))]


def _bind_slice_by_size(p, shapes):
    key = size_slices(shapes[0], p["begin"], p["size"])
    return lambda a: a[key]


define("slice_by_size", ("x",), _infer_slice_by_size,
       lambda x, p: [_bind_slice_by_size(p, (x["x"].shape,))(x["x"])],
       params={"begin": REQUIRED, "size": REQUIRED}, bind=_bind_slice_by_size)

# ----------------------------------------------------------------------------- slice_by_index


def index_slices(shape, p) -> tuple[tuple, tuple[int, ...]]:
    """numpy-style key for slice_by_index, and the axes that squeeze_mask removes."""
    r = len(shape)

    def vec(name, default):
        v = p.get(name)
        v = [default] * r if v is None else as_list(v)
        if len(v) != r:
            bad(f"{name} of length rank(x)={r}", v)
        return v
    begin, end, stride = vec("begin", 0), vec("end", 0), vec("stride", 1)
    bm, em, sm = vec("begin_mask", False), vec("end_mask", False), vec("squeeze_mask", False)
    key, squeeze = [], []
    for i, d in enumerate(shape):
        if int(stride[i]) == 0:
            bad(f"nonzero stride on axis {i}", 0)
        if sm[i]:
            idx = int(begin[i]) + (d if int(begin[i]) < 0 else 0)
            if not 0 <= idx < d:
                bad(f"squeeze index on axis {i} in [0, {d})", begin[i])
            key.append(slice(idx, idx + 1))
            squeeze.append(i)
            continue
        key.append(slice(None if bm[i] else int(begin[i]), None if em[i] else int(end[i]), int(stride[i])))
    return tuple(key), tuple(squeeze)


def _infer_slice_by_index(t, p):
    shape = dims(t["x"])
    key, squeeze = index_slices(shape, p)
    out = [len(range(*k.indices(d))) for k, d in zip(key, shape)]
    out = tuple(d for i, d in enumerate(out) if i not in squeeze)
    return [TensorType(t["x"].dtype, out)]


def _bind_slice_by_index(p, shapes):
    key, squeeze = index_slices(shapes[0], p)
    kept = [len(range(*k.indices(d))) for i, (k, d) in enumerate(zip(key, shapes[0])) if i not in squeeze]
    return lambda a: a[key].reshape(kept)


define("slice_by_index", ("x",), _infer_slice_by_index,
       lambda x, p: [_bind_slice_by_index(p, (x["x"].shape,))(x["x"])],
       params={"begin": REQUIRED, "end": REQUIRED, "stride": None,
               "begin_mask": None, "end_mask": None, "squeeze_mask": None}, bind=_bind_slice_by_index)

# ----------------------------------------------------------------------------- concat


def _infer_concat(t, p):
    vals = t["values"]
    if not isinstance(vals, (list, tuple)) or not vals:
        bad("values as a non-empty tuple", vals)
    first = dims(vals[0])
    ax = axis_of(int(p["axis"]), len(first))
    for v in vals[1:]:
        s = dims(v)
        if v.dtype != vals[0].dtype or len(s) != len(first) or \
                any(a != b for i, (a, b) in enumerate(zip(s, first)) if i != ax):
            bad(f"values matching {vals[0].dtype} {list(first)} except on axis {ax}", f"{v.dtype} {list(s)}")
        if p["interleave"] and s != first:
            bad(f"values of one shape {list(first)} when interleave is true", list(s))
    total = sum(dims(v)[ax] for v in vals)
    return [tensor(vals[0].dtype, first[:ax] + (total,) + first[ax + 1:])]


def _concat(x, p):
    vals = list(x["values"])
    ax = int(p["axis"]) % vals[0].ndim
    if not p["interleave"]:
        return [np.concatenate(vals, axis=ax)]
    # interleave: element j of every input, then element j+1: stack behind the axis, then merge
    stacked = np.stack(vals, axis=ax + 1)
    shape = list(vals[0].shape)
    shape[ax] *= len(vals)
    return [stacked.reshape(shape)]


define("concat", ("values",), _infer_concat, _concat, params={"axis": REQUIRED, "interleave": False})
