"""Shape helpers shared by the op families (no op registration here).

Raw `infer` functions raise `ShapeError("expected ..., got ...")` through `bad`; the op table's
wrapper prefixes the op name, and the emulator/compiler prefix the node.
"""

from __future__ import annotations

from typing import Any, NoReturn

import numpy as np

from ..errors import ShapeError
from ..mil.program import TensorType

FLOATS = ("fp16", "fp32")
INTS = ("int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64")


def bad(expected: str, got: object) -> NoReturn:
    raise ShapeError(f"expected {expected}, got {got}")


def dims(t: TensorType) -> tuple[int, ...]:
    """Shape of a type as a tuple; a scalar (`shape None`) is rank 0."""
    return () if t.shape is None else tuple(int(d) for d in t.shape)


def tensor(dtype: str, shape) -> TensorType:
    return TensorType(dtype, tuple(int(d) for d in shape))


def broadcast(a: tuple[int, ...], b: tuple[int, ...], what: str = "shapes") -> tuple[int, ...]:
    """numpy/MIL broadcasting: align right, sizes equal or one of them 1."""
    n = max(len(a), len(b))
    a2, b2 = (1,) * (n - len(a)) + a, (1,) * (n - len(b)) + b
    out = []
    for x, y in zip(a2, b2):
        if x != y and x != 1 and y != 1:
            bad(f"broadcastable {what}", f"{list(a)} and {list(b)}")
        out.append(max(x, y) if min(x, y) != 0 else 0)
    return tuple(out)


def axis_of(axis: int, rank: int, what: str = "axis") -> int:
    if not -rank <= axis < max(rank, 1):
        bad(f"{what} in [{-rank}, {rank})", axis)
    return axis % rank if rank else 0


def axes_of(axes, rank: int, what: str = "axes") -> list[int]:
    """Normalized, sorted, distinct axes; `None` means every axis."""
    if axes is None:
        return list(range(rank))
    ax = [axis_of(int(a), rank, what) for a in as_list(axes)]
    if len(set(ax)) != len(ax):
        bad(f"distinct {what}", list(axes))
    return sorted(ax)


def as_list(v: Any) -> list:
    """A param value as a Python list (a scalar becomes a one-element list)."""
    if isinstance(v, np.ndarray):
        return v.reshape(-1).tolist()
    if isinstance(v, (list, tuple)):
        return list(v)
    return [v]


def need_float(t: TensorType, name: str = "x") -> None:
    if t.dtype not in FLOATS:
        bad(f"{name} of dtype fp16 or fp32", t.dtype)


def same_dtype(a: TensorType, b: TensorType, names: str = "x and y") -> str:
    if a.dtype != b.dtype:
        bad(f"{names} of one dtype", f"{a.dtype} and {b.dtype}")
    return a.dtype


def along_axis(v: np.ndarray, axis: int, rank: int) -> np.ndarray:
    """A scalar or vector quantization parameter shaped to broadcast along `axis`."""
    v = np.asarray(v)
    if v.ndim == 0 or v.size == 1:
        return v.reshape(())
    shape = [1] * rank
    shape[axis] = v.size
    return v.reshape(shape)


def check_axis_param(t: TensorType | None, data: TensorType, axis, name: str) -> None:
    """Scale/zero_point: a scalar or a vector of length data.shape[axis]."""
    if t is None:
        return
    n = int(np.prod(dims(t))) if dims(t) else 1
    if n == 1 and len(dims(t)) <= 1:
        return
    if len(dims(t)) != 1:
        bad(f"{name} as a scalar or a vector", list(dims(t)))
    if axis is None:
        bad(f"an axis for the vector {name}", None)
    ax = axis_of(int(axis), len(dims(data)))
    if n != dims(data)[ax]:
        bad(f"{name} of length {dims(data)[ax]} (shape[{ax}])", n)
