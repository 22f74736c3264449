"""The emulator's plan builder: one MIL Function resolved and checked into an `emulator.plan.Plan`.

`build_plan` decodes every const (inline literals and BLOBFILE blobs), turns every param into a
Python value, folds the ops whose operands are all consts, and checks each statement's declared
types against the op table's inference; `replay_plan` makes the same plan again from the
record of an earlier build (the on-disk kernel cache, `emulator.cache`), without the checks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np

from ...chip.profile import ChipProfile
from ...chip.rejects import reject
from ...errors import BlobError, CompileError, ShapeError
from ...fp16.grid import round_fp16
from ...ir.ops import OP_TABLE, full_params, raw_compute
from ...ir.ops_common import dims
from ...mil.blob import decode_blob
from ...mil.program import BlobRef, Function, Literal, Statement, TensorType, Var
from .accum import accumulated
from .int8 import Int8State, drop_bypassed, note, rewrite
from .matvec import ResidentConv, ResidentWeight, decoded_once, held_conv, resident_conv
from .plan import (FLOAT_DTYPES, MOVEMENT_OPS, Plan, Step, finite_unchanged, make_checked_rounder, make_rounder,
                   node_name, py_value, unchanged)

Resolver = Callable[[str], bytes]
# 4-bit weights decoded at compile time (W4, LUT4/LUT6): their fp16 results wait in `halves` as
# float16, as an fp16 blob does, so a resident conv holds them at 2 bytes a weight, not 4, and
# one copy serves every plan decoding the same operands (`decoded_once`)
DECODED_WEIGHTS = frozenset({"constexpr_blockwise_shift_scale", "constexpr_lut_to_dense"})


@dataclass
class Shared:
    """What a replay of one record makes that no weight changes, for the next plan replayed
    from it (a model's layers: one program text, so one entry's record, with other blobs).
    Nothing changes a Step or a plan's types once the plan is finished (column plans and int8
    rewiring make new lists; `finish` assigns each step the same frees), so the plans share
    them. Literal consts are shared as the runs of one plan share its consts."""

    # per record entry: (what a replay does: "store" a blob, take a "literal", append a "plain"
    # step, hold a conv's weight ("held": the step again with it) or "place" it; the step; the
    # fp16 blob consts decoded for it)
    entries: list[tuple[str, Step | None, tuple[str, ...]]]
    types: dict[str, TensorType]
    literals: dict[str, Any]  # the literal consts, as stored (rounded)


class _Builder:
    """Turns one Function into a Plan (`build`; the checks on names and types happen here), or
    replays the record of an earlier build (`replay`, for the on-disk kernel cache)."""

    def __init__(self, inputs: list[tuple[TensorType, str]], outputs: list[str], resolver: Resolver,
                 profile: ChipProfile):
        self.resolver, self.profile = resolver, profile
        self.plan = Plan(list(inputs), list(outputs), {})
        self.blobs: dict[str, bytes] = {}
        self.int8 = Int8State()  # int8 weights and activations seen so far (emulator.int8)
        for t, name in inputs:
            self.plan.types[name] = t
            self.plan.in_round[name] = make_rounder(t.dtype, profile)
        self.resident: dict[str, ResidentWeight] = {}  # conv weights held fp16 for the decode path
        self.halves: dict[str, np.ndarray] = {}  # fp16 blob consts as blob views (or DECODED_WEIGHTS), not decoded yet
        self.rounders: dict[str, Callable] = {}  # by result dtype: one rounder for every step of the plan
        self.checkers: dict[str, Callable] = {}
        self.decoding: list[str] | None = None  # the halves decoded while a replay places one entry

    def build(self, func: Function) -> Plan:
        for st in func.body:
            self.const(st) if st.op == "const" else self.statement(st)
        for name in func.outputs:
            if name not in self.plan.types:
                raise reject("returned_name", name, self.profile)
        return self.finish()

    def replay(self, record: list[tuple], finished: tuple[list, list] | None = None,
               shared: Shared | None = None) -> tuple[Plan, Shared | None]:
        """The plan `build` made, from its record: no parse, name resolution or type checks.
        `finished`: what `finish` found for it (`finished_parts`), so it is not found again.
        `shared`: what an earlier replay of the same record made that no weight changes,
        reused as it is; else this replay's, returned with the plan (None when `finished`
        did not fit, as then `finish` appends to the steps' frees)."""
        if shared is not None:
            return self._replay_shared(record, finished, shared), shared
        p, entries, literals = self.plan, [], {}
        for entry in record:
            made, self.decoding = len(p.steps), []
            if len(entry) == 2:
                self.store(*entry)
                if isinstance(entry[1], Literal):
                    literals[entry[0]] = p.consts[entry[0]]
                entries.append(("literal" if isinstance(entry[1], Literal) else "store", None, ()))
                continue
            self.place_plain(*entry[:5]) if entry[5] else self.place(*entry[:5])
            step = p.steps[-1] if len(p.steps) > made else None
            kind = "plain" if entry[5] else "held" if step is not None and isinstance(step.fn, ResidentConv) else "place"
            if kind != "plain":  # what Shared keeps holds no weight: a held step without its compute
                step = replace(step, fn=None) if kind == "held" else None
            entries.append((kind, step, tuple(self.decoding)))
        self.decoding = None
        p = self.finish(finished)
        fitted = finished is not None and len(finished[1]) == len(p.steps)
        return p, Shared(entries, dict(p.types), literals) if fitted else None

    def _replay_shared(self, record: list[tuple], finished: tuple[list, list], shared: Shared) -> Plan:
        """`replay` with an earlier replay's plain steps, literal consts and types: only the
        blob consts, the resident conv weights and the steps that fold or rewrite are made again."""
        p, consts, halves, limit = self.plan, self.plan.consts, self.halves, self.profile.accumulator_limit
        p.types = dict(shared.types)  # every name's type, known before the steps that read them
        for entry, (kind, step, decodes) in zip(record, shared.entries):
            self.decoded(decodes)  # the fp16 blob consts the first replay decoded for this step
            if kind == "plain":
                p.steps.append(step)
            elif kind == "store":
                self.store(*entry)
            elif kind == "literal":
                consts[entry[0]] = shared.literals[entry[0]]
            elif kind == "held":  # the step again, with this plan's weight held
                wkey = dict(entry[2])["weight"]
                fn = held_conv(self.resident, wkey, consts.get(wkey, halves.get(wkey)), limit)
                p.steps.append(Step(step.node, step.op, fn, step.tensors, step.params, step.outs, checked=step.checked))
            else:
                self.place(*entry[:5])
        return self.finish(finished)

    def finish(self, finished: tuple[list, list] | None = None) -> Plan:
        p = self.plan
        self.decoded(p.outputs)
        if self.int8.rewired:
            drop_bypassed(p, self.int8)
        if finished is not None and len(finished[1]) == len(p.steps):
            kept, frees = set(finished[0]), finished[1]
            p.consts = {k: v for k, v in p.consts.items() if k in kept}
            for step, free in zip(p.steps, frees):
                step.free = list(free)
            return p
        # keep only the consts a step or the return reads: folded-away operands free their memory
        used = set(p.outputs)
        for step in p.steps:
            used.update(step.keys())
        p.consts = {k: v for k, v in p.consts.items() if k in used}
        _plan_frees(p)
        return p

    # --- operands -------------------------------------------------------------------------
    def literal(self, key: str, arg: Literal | BlobRef) -> str:
        """Store an inline literal or blob as a const named `key`; return the key."""
        self.plan.record.append((key, arg))
        self.store(key, arg)
        return key

    def store(self, key: str, arg: Literal | BlobRef) -> None:
        """A const; fp16 blob values (exact already) wait in `halves`, for a resident conv to hold as they lie."""
        self.plan.types[key] = arg.type
        val = self.decode(arg) if isinstance(arg, BlobRef) else arg.value
        if isinstance(arg, BlobRef) and self.held_half(arg.type.dtype):
            self.halves[key] = val
        else:
            self.plan.consts[key] = val if isinstance(val, str) else make_rounder(arg.type.dtype, self.profile)(val)

    def held_half(self, dtype: str) -> bool:
        """Whether an fp16 const may wait as float16: its values are then the stored ones."""
        return dtype == "fp16" and self.profile.compute_dtype == "fp16" and self.profile.saturate_above is None

    def decoded(self, keys) -> None:
        """The `halves` among `keys` (names or lists of them) into the consts, as float32 fp16 values."""
        for k in (k for key in keys for k in (key if isinstance(key, list) else [key])):
            if k in self.halves and k not in self.plan.consts:
                self.plan.consts[k] = round_fp16(self.halves[k])
                if self.decoding is not None:
                    self.decoding.append(k)

    def decode(self, ref: BlobRef) -> np.ndarray:
        data = self.blob_bytes(ref.path)
        try:
            return decode_blob(data, ref.offset, ref.type.dtype, ref.type.shape or (), source=ref.path)
        except BlobError:
            raise
        except Exception as e:  # noqa: BLE001 - any decoding failure is a bad blob
            raise BlobError(f"{ref.path}: cannot read {ref.type.dtype} {list(dims(ref.type))} "
                            f"at offset {ref.offset}: {e}") from None

    def blob_bytes(self, path: str) -> bytes:
        if path not in self.blobs:
            try:
                self.blobs[path] = self.resolver(path)
            except (KeyError, FileNotFoundError, OSError):
                raise BlobError(f"{path}: no such weight blob was given to the compile") from None
        return self.blobs[path]

    def tensor_key(self, st: Statement, arg_name: str, arg: Any) -> Any:
        if isinstance(arg, tuple):
            return [self.tensor_key(st, f"{arg_name}[{i}]", a) for i, a in enumerate(arg)]
        if isinstance(arg, Var):
            if arg.name not in self.plan.types:
                raise CompileError(node_name(st), f"{st.op} operand '{arg_name}' refers to '{arg.name}', "
                                   "which no input or earlier statement defines")
            return arg.name
        return self.literal(f"{node_name(st)}/{arg_name}", arg)

    def param_value(self, st: Statement, arg_name: str, arg: Any) -> Any:
        if isinstance(arg, Literal):
            return py_value(arg.value)
        key = self.tensor_key(st, arg_name, arg)
        self.decoded([key])
        if not isinstance(key, str) or key not in self.plan.consts:
            raise CompileError(node_name(st), f"{st.op} param '{arg_name}' must be a const, got '{key}'",
                               "bind it to a const statement")
        return py_value(self.plan.consts[key])

    # --- statements -----------------------------------------------------------------------
    def const(self, st: Statement) -> None:
        """`const()[val = ...]`: decoded once, stored under the result name."""
        node = node_name(st)
        val = st.attrs.get("val", st.args.get("val"))
        if not isinstance(val, (Literal, BlobRef)) or len(st.results) != 1:
            raise CompileError(node, "const needs one result and an inline or BLOBFILE val")
        t, name = st.results[0]
        if t.dtype != val.type.dtype or dims(t) != dims(val.type):
            raise ShapeError(f"node '{node}': const declared as {t.dtype} {list(dims(t))}; "
                             f"expected the type of its val, {val.type.dtype} {list(dims(val.type))}")
        self.literal(name, val)

    def statement(self, st: Statement) -> None:
        node = node_name(st)
        op = OP_TABLE.get(st.op)
        if op is None:
            raise reject("op_table", node, self.profile, op=st.op)
        tensors, params = [], {}
        for arg_name, arg in st.operands().items():
            if arg_name in op.inputs:
                tensors.append((arg_name, self.tensor_key(st, arg_name, arg)))
            elif arg_name in op.params:
                params[arg_name] = self.param_value(st, arg_name, arg)
            else:
                raise CompileError(node, f"{st.op} has no argument '{arg_name}'; "
                                   f"expected some of {list(op.inputs) + list(op.params)}")
        if st.op == "scaled_dot_product_attention" and self.profile.sdpa_ignores_mask:
            tensors = [(k, v) for k, v in tensors if k != "attn_mask"]  # the hardware drops it
        try:
            params = full_params(st.op, params)
        except ShapeError as e:
            raise ShapeError(f"node '{node}': {e}") from None
        self.check_types(st, node, tensors, params)
        entry = (node, st.op, tensors, params, [(n, t) for t, n in st.results])
        self.plan.record.append(entry + (self.place(*entry),))

    def place(self, node: str, op: str, tensors: list, params: dict, results: list[tuple[str, TensorType]]) -> bool:
        """A resolved, checked statement into the plan: a step, or a fold of consts. True when
        it is a plain step (the op table's compute, nothing folded, rewritten or remembered for
        int8), which a replay places with `place_plain`."""
        pr = self.profile
        self.decoded(key for name, key in tensors if (op, name) != ("conv", "weight"))  # for resident_conv
        compute = accumulated(op, raw_compute(OP_TABLE[op]), results[0][1].dtype, pr)
        remembered = len(self.int8.weights) + len(self.int8.quantized)
        note(self.int8, op, dict(tensors), self.plan.consts, params, results[0][0])
        plain = remembered == len(self.int8.weights) + len(self.int8.quantized)
        int8 = rewrite(self.int8, op, tensors, params, pr.quantize_rounding, pr.accumulator_limit, pr.accumulator)
        if int8 is not None:  # int8 weights stay int8; the sums are formed as the chip forms them
            compute, tensors, plain = *int8, False
        elif (held := resident_conv(op, tensors, params, self.plan.consts, results[0][1].dtype, pr, self.resident,
                                    self.halves)) is not None:  # fp16 weights for one-column evaluations
            compute, tensors, plain = *held, False
        self.decoded(key for _, key in tensors)
        step = self.step(node, op, compute, tensors, params, results)
        if self.foldable(tensors):
            self.fold(step)
            return False
        self.plan.steps.append(step)
        return plain

    def place_plain(self, node: str, op: str, tensors: list, params: dict, results: list[tuple[str, TensorType]]) -> None:
        """`place` of a step it found plain: the same step, without looking for folds or int8 again."""
        if self.halves:
            self.decoded(key for _, key in tensors)
        compute = accumulated(op, raw_compute(OP_TABLE[op]), results[0][1].dtype, self.profile)
        self.plan.steps.append(self.step(node, op, compute, tensors, params, results))

    def step(self, node: str, op: str, compute: Callable, tensors: list, params: dict,
             results: list[tuple[str, TensorType]]) -> Step:
        """The step of a placed statement, its results' types noted."""
        rounders = [self.rounder(op, tensors, t.dtype) for _, t in results]
        checked = [finite_unchanged if r is unchanged else self.checker(t.dtype) for (_, t), r in zip(results, rounders)]
        self.plan.types.update(results)
        return Step(node, op, compute, tensors, params, [(n, r) for (n, _), r in zip(results, rounders)],
                    checked=checked)

    def checker(self, dtype: str) -> Callable[[Any], tuple[Any, bool]]:
        """make_checked_rounder for a result dtype, made once per plan."""
        if dtype not in self.checkers:
            self.checkers[dtype] = make_checked_rounder(dtype, self.profile)
        return self.checkers[dtype]

    def rounder(self, op: str, tensors, dtype: str) -> Callable[[Any], Any]:
        """Movement ops only rearrange values that are already rounded: rounding again is a no-op."""
        first = tensors[0][1] if tensors else None
        src = self.plan.types.get(first[0] if isinstance(first, list) else first) if first else None
        if op in MOVEMENT_OPS and src is not None and src.dtype == dtype and dtype in FLOAT_DTYPES:
            return unchanged
        if dtype not in self.rounders:
            self.rounders[dtype] = make_rounder(dtype, self.profile, owned=True)
        return self.rounders[dtype]

    def check_types(self, st: Statement, node: str, tensors, params) -> None:
        types = {k: [self.plan.types[i] for i in key] if isinstance(key, list) else self.plan.types[key]
                 for k, key in tensors}
        try:
            got = OP_TABLE[st.op].infer(types, params)
        except ShapeError as e:
            raise ShapeError(f"node '{node}': {e}") from None
        declared = [t for t, _ in st.results]
        if len(got) != len(declared) or any(
                g.dtype != d.dtype or dims(g) != dims(d) for g, d in zip(got, declared)):
            show = lambda ts: ", ".join(f"{t.dtype} {list(dims(t))}" for t in ts)  # noqa: E731
            raise ShapeError(f"node '{node}': {st.op} result declared as {show(declared)}; "
                             f"expected {show(got)} from its operands")

    def foldable(self, tensors) -> bool:
        keys = [i for _, key in tensors for i in (key if isinstance(key, list) else [key])]
        return all(k in self.plan.consts for k in keys)

    def fold(self, step: Step) -> None:
        env = self.plan.consts
        args = {k: [env[i] for i in key] if isinstance(key, list) else env[key] for k, key in step.tensors}
        if step.op in DECODED_WEIGHTS and self.held_half(self.plan.types[step.outs[0][0]].dtype):
            (name, rnd), = step.outs  # fp16 values: as float16, exact

            def decode() -> np.ndarray:
                with np.errstate(all="ignore"):
                    return rnd(step.fn(args, step.params)[0]).astype(np.float16)
            self.halves[name] = decoded_once(step.op, args, step.params, decode)
            return
        with np.errstate(all="ignore"):
            res = step.fn(args, step.params)
        for (name, rnd), r in zip(step.outs, res):
            env[name] = r if isinstance(r, str) else rnd(r)


def _plan_frees(p: Plan) -> None:
    """Mark each computed value to be dropped after the step that reads it last."""
    last: dict[str, int] = {}
    for i, step in enumerate(p.steps):
        for name, _ in step.outs:
            last[name] = i  # a result nobody reads goes right after it is made
        for k in step.keys():
            last[k] = i
    keep = set(p.outputs) | set(p.consts) | {n for _, n in p.inputs}
    for name, i in last.items():
        if name not in keep:
            p.steps[i].free.append(name)


def pruned(p: Plan, outputs: tuple[str, ...]) -> Plan:
    """The steps of `p` that `outputs` need, as a plan of their own: an evaluation whose caller
    reads only those outputs runs nothing else (a decode chunk's first pass wants only the keys
    and values, which come before the attention and the MLP)."""
    need, steps = set(outputs), []
    for st in reversed(p.steps):
        if any(name in need for name, _ in st.outs):
            steps.append(replace(st, free=[]))
            need.update(st.keys())
    q = replace(p, outputs=list(outputs), steps=steps[::-1], record=[])
    _plan_frees(q)
    return q


def finished_parts(p: Plan) -> tuple[list[str], list[list[str]]]:
    """What `finish` found for a plan: the consts it kept, and each step's frees."""
    return list(p.consts), [list(st.free) for st in p.steps]


def build_plan(func: Function, resolver: Resolver | dict[str, bytes], profile: ChipProfile) -> Plan:
    """Resolve `func` once; `resolver` maps a MIL blob path to the whole BLOBFILE bytes."""
    if isinstance(resolver, dict):
        table = resolver
        resolver = table.__getitem__
    return _Builder(func.inputs, func.outputs, resolver, profile).build(func)


def replay_plan(inputs: list[tuple[TensorType, str]], outputs: list[str], record: list[tuple],
                resolver: Resolver | dict[str, bytes], profile: ChipProfile,
                finished: tuple[list, list] | None = None, shared: Shared | None = None) -> tuple[Plan, Shared | None]:
    """`build_plan`'s plan again from its `Plan.record`, with the blobs `resolver` gives, and
    `finished_parts` of it when they were kept; with what `shared` holds of an earlier replay
    of the same record under the same profile, and what it holds (`_Builder.replay`)."""
    if isinstance(resolver, dict):
        resolver = resolver.__getitem__
    return _Builder(inputs, outputs, resolver, profile).replay(record, finished, shared)
