"""The emulator's execution plan: a MIL function resolved once, run many times.

At compile time (`emulator.builder`) every const is decoded (inline literals and BLOBFILE blobs), every param is
turned into a Python value, ops whose operands are all consts are folded (constexpr_* among
them), and each statement's declared types are checked against the op table's inference.
What is left is a flat list of steps: `compute(arrays, params)` then a rounding of each result
to its declared dtype, floats to the profile's compute dtype (fp16: the ANE computes in fp16,
so every op result is rounded, and overflow gives inf).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ...chip.profile import ChipProfile
from ...fp16.grid import round_fp16, round_fp16_owned, round_fp16_owned_counted
from ...mil.program import Statement, TensorType, storage_dtype
from ..overflow import FirstOverflow

FLOAT_DTYPES = ("fp16", "fp32")


def node_name(st: Statement) -> str:
    """The statement's `name` attribute, else its first result variable."""
    return st.name or st.results[0][1]


def make_rounder(dtype: str, profile: ChipProfile, owned: bool = False) -> Callable[[Any], Any]:
    """Round a float32 result to what the hardware stores for `dtype`. `owned`: the arrays are
    fresh op results nobody else holds, rounded in place where possible (an op that hands back
    an operand hands back fp16 values, which rounding leaves as they are)."""
    if dtype in FLOAT_DTYPES:
        limit = profile.saturate_above
        if profile.compute_dtype == "fp16":
            base = round_fp16_owned if owned else round_fp16
        else:
            base = _as_f32
        if limit is None:
            return base

        def saturating(a):
            return _saturate(base(a), limit)
        return saturating
    if dtype == "string":
        return lambda a: a
    target = storage_dtype(dtype)
    return lambda a: np.asarray(a).astype(target)


def _saturate(r: np.ndarray, limit: float) -> np.ndarray:
    # Q.4x16 activations: magnitudes past the limit saturate to +-inf
    big = np.abs(r) > limit
    r[big] = np.copysign(np.float32(np.inf), r[big])
    return r


def make_checked_rounder(dtype: str, profile: ChipProfile) -> Callable[[Any], tuple[Any, bool]]:
    """make_rounder(owned=True) that also says whether every result is finite. Only fp16 compute
    is watched (the overflow warning is about fp16); the rounding pass counts the non-finite
    values, so a clean result costs one extra read of memory still in cache."""
    if dtype not in FLOAT_DTYPES or profile.compute_dtype != "fp16":
        plain = make_rounder(dtype, profile, owned=True)
        return lambda a: (plain(a), True)
    limit = profile.saturate_above

    def checked(a):
        r, bad = round_fp16_owned_counted(a)
        if limit is not None:
            r = _saturate(r, limit)
            bad = bad or int(np.count_nonzero(np.isinf(r)))
        return r, bad == 0
    return checked


# ops whose results are some of their operand's values, rearranged (no arithmetic)
MOVEMENT_OPS = frozenset({"reshape", "transpose", "slice_by_size", "slice_by_index", "concat", "identity"})


def unchanged(a: Any) -> Any:
    return a


def finite_unchanged(a: Any) -> tuple[Any, bool]:
    return a, True  # rearranged values: a non-finite one was already so in the operand


def _as_f32(a: Any) -> np.ndarray:
    return np.array(a, dtype=np.float32)  # a copy: results never alias an input


def py_value(v: Any) -> Any:
    """A const as a Python param value: str, scalar, or (nested) list."""
    if isinstance(v, str):
        return v
    a = np.asarray(v)
    if a.dtype.kind in "US":
        return str(a.reshape(-1)[0]) if a.size == 1 else a.tolist()
    return a.item() if a.ndim == 0 else a.tolist()


@dataclass
class Step:
    node: str
    op: str
    fn: Callable
    tensors: list[tuple[str, Any]]  # operand -> env key, or list of keys for a tuple operand
    params: dict[str, Any]
    outs: list[tuple[str, Callable]]  # result name, rounder
    free: list[str] = field(default_factory=list)  # values last read here: dropped after the step
    checked: list[Callable] = field(default_factory=list)  # per result: rounder -> (value, all finite)

    def keys(self) -> list[str]:
        """Every env key the step reads, tuple operands flattened."""
        return [i for _, key in self.tensors for i in (key if isinstance(key, list) else [key])]


@dataclass
class Plan:
    inputs: list[tuple[TensorType, str]]
    outputs: list[str]
    types: dict[str, TensorType]
    consts: dict[str, Any] = field(default_factory=dict)
    steps: list[Step] = field(default_factory=list)
    in_round: dict[str, Callable] = field(default_factory=dict)
    # what the builder did after resolving and checking, in order, for emulator_record to replay:
    # (const key, Literal | BlobRef) per const; (node, op, tensors, params, results) per op
    record: list[tuple] = field(default_factory=list, repr=False)

    def run(self, inputs: dict[str, np.ndarray], exact: set[str] | frozenset = frozenset(),
            overflow: list | None = None) -> dict[str, np.ndarray]:
        """Execute on arrays already shaped as declared (rounded here like every value).

        Inputs named in `exact` are float32 arrays of fp16 values: they are read, never copied
        or modified, and skip the rounding when it would change nothing. With `overflow` (a
        list), the first op in execution order whose result is inf or NaN although its operands
        were finite is appended to it as an `Overflow` (docs/chip-profiles.md).
        """
        env = dict(self.consts)
        for _, name in self.inputs:
            rnd = self.in_round[name]
            env[name] = inputs[name] if name in exact and rnd is round_fp16 else rnd(inputs[name])
        watch = FirstOverflow() if overflow is not None else None
        with np.errstate(all="ignore"):  # fp16 overflow to inf is the modelled behaviour
            for st in self.steps:
                args = {k: [env[i] for i in key] if isinstance(key, list) else env[key]
                        for k, key in st.tensors}
                res = st.fn(args, st.params)
                if watch is None or watch.found is not None:
                    for (name, rnd), r in zip(st.outs, res):
                        env[name] = rnd(r)
                else:
                    watch.step(st, res, env)
                for name in st.free:  # keeps the working set to the live values, not the whole run
                    del env[name]
        if watch is not None and watch.found is not None:
            overflow.append(watch.found)
        return {name: env[name] for name in self.outputs}
