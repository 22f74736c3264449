"""The emulator's on-disk kernel cache: compiled programs kept across processes, weights apart.

aned keeps compiled programs by content on a Mac, and a program it holds is loaded, not
compiled (only cold compiles count). The emulator does the same in `cache_dir("kernels", "emulator")`:
an entry, keyed by `compiler.artifact.content_key` (MIL text, blobs, chip profile), holds the
plan's record (`emulator.plan.Plan.record`: every const's literal or BLOBFILE reference and
every resolved, checked statement, in order), pickled, a few tens of kilobytes. It holds no
weights: a hit replays the record against the blobs the caller passes, which skips parsing,
the compile-time checks, name resolution and type inference, and charges no compile.

The payload is builtins only (tuples, lists, strings, numbers, bytes) and is read with an
unpickler that builds no class at all, so a file planted in the cache folder cannot run code.
"""

from __future__ import annotations

import io
import pickle
import weakref
from dataclasses import dataclass

import numpy as np

from ...caches import cache_dir
from ...chip.profile import ChipProfile
from ...compiler.artifact import profile_identity
from ...mil.program import BlobRef, Literal, TensorType
from ..disk_cache import DiskCache
from .builder import Shared, finished_parts, replay_plan
from .columns import ColumnPlan, column_plan
from .plan import Plan

# the entry's layout: a change makes older entries misses, rebuilt and rewritten. 2: builtins only
# (types as (dtype, shape), arrays as (dtype, shape, bytes)), and no const that only a param read
FORMAT = 2


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"{module}.{name}: a kernel-cache entry holds Python builtins only")


def kernel_store() -> DiskCache:
    """The emulator's folder of the cache directory, bounded by `ANELM_KERNEL_CACHE_MB`."""
    return DiskCache(cache_dir("kernels", "emulator"), FORMAT)


def dump_plan(plan: Plan, axes: dict[str, int] | None) -> bytes:
    """The entry of a built plan: its inputs, outputs and record, as builtins, its column axes
    (`emulator.columns.column_axes`) and what its build's `finish` found. A const that no op
    reads as an operand (a param's value, already in the op's params) is left out."""
    read = set(plan.outputs)
    for entry in plan.record:
        if len(entry) != 2:
            read.update(k for _, key in entry[2] for k in (key if isinstance(key, list) else [key]))
    record = [_const(*e) if len(e) == 2 else (*e[:4], [(n, t.dtype, t.shape) for n, t in e[4]], e[5])
              for e in plan.record if len(e) != 2 or e[0] in read]
    inputs = [(n, t.dtype, t.shape) for t, n in plan.inputs]
    return pickle.dumps((inputs, list(plan.outputs), record, axes, finished_parts(plan)),
                        protocol=pickle.HIGHEST_PROTOCOL)


def _const(key: str, arg: Literal | BlobRef) -> tuple:
    t = arg.type
    if isinstance(arg, BlobRef):
        return ("blob", key, t.dtype, t.shape, arg.path, arg.offset)
    v = arg.value
    value = v if isinstance(v, str) else (np.asarray(v).dtype.str, np.shape(v), np.asarray(v).tobytes())
    return ("literal", key, t.dtype, t.shape, value)


def _record(stored: list[tuple], types: dict[tuple, TensorType]) -> list[tuple]:
    """`Plan.record` again from an entry's builtins; `types` holds each distinct type made once."""
    def typed(dtype, shape):
        t = types.get((dtype, shape))
        if t is None:
            t = types[dtype, shape] = TensorType(dtype, shape)
        return t
    out = []
    for e in stored:
        if e[0] == "blob":
            out.append((e[1], BlobRef(typed(e[2], e[3]), e[4], e[5])))
        elif e[0] == "literal":
            v = e[4]
            value = v if isinstance(v, str) else np.frombuffer(v[2], np.dtype(v[0])).reshape(v[1]).copy()
            out.append((e[1], Literal(typed(e[2], e[3]), value)))
        else:
            out.append((*e[:4], [(n, typed(d, s)) for n, d, s in e[4]], e[5]))
    return out


@dataclass(eq=False)
class _Met:
    """An entry decoded, and what its last load made that the next load of it takes again."""

    inputs: list[tuple[TensorType, str]]
    outputs: list[str]
    record: list[tuple]
    axes: dict[str, int] | None
    finished: tuple[list, list]
    shared: Shared | None = None
    columns: weakref.ref | None = None  # to the last load's ColumnPlan, which holds its weights: not kept alive


# Per process, the entries met lately, decoded, with what their last replay made that no
# weight changes (`emulator.builder.Shared`, and the column plan's steps), by payload and
# profile: a model's layers are one program text with other blobs, so their entries differ in
# key only, and each layer after the first decodes nothing and makes only its weights' consts
# and steps (30 SmolLM2 prefill layers in a new process: ~65 ms of loading to ~14). A profile is
# told by its behaviours (`profile_identity`), what the plans made under it depend on.
_MET: dict[tuple[bytes, str], _Met] = {}
MET_MOST = 64  # entries of tens of kilobytes


def load_plan(payload: bytes | None, weights: dict[str, bytes],
              profile: ChipProfile) -> tuple[Plan, ColumnPlan | None] | None:
    """The plan of a stored entry, with these weights, and its column plan; None when there is none to use."""
    if payload is None:
        return None
    try:
        at = (payload, profile_identity(profile))
        met = _MET.pop(at, None)
        if met is None:
            inputs, outputs, stored, axes, finished = _Unpickler(io.BytesIO(payload)).load()
            met = _Met([(TensorType(d, s), n) for n, d, s in inputs], outputs, _record(stored, {}), axes, finished)
        plan, met.shared = replay_plan(met.inputs, met.outputs, met.record, weights, profile, met.finished, met.shared)
        columns = column_plan(plan, met.axes, met.columns() if met.columns is not None else None)
        met.columns = weakref.ref(columns) if columns is not None else None
    except Exception:  # noqa: BLE001 - an entry that does not replay is a miss: rebuilt and rewritten
        return None
    while len(_MET) >= MET_MOST:
        del _MET[next(iter(_MET))]  # the least recently met
    _MET[at] = met
    return plan, columns
