"""The software ANE: runs parsed MIL text as the hardware would, under a chip profile.

    emu = Emulator()                       # STRICT profile
    model = emu.compile(mil_text, weights) # charges the compile budget; rejects as the ANE does
    emu.load(model)
    emu.evaluate(model, in_surfaces, out_surfaces)

What it reproduces (docs/chip-profiles.md): compile-time rejects (`emulator.checks`), a compile folder
named by the content key with `model.mil` and the blobs (as the private API needs; written
when something reads it, since in `strict` nothing does: writing every program's weights to
/tmp cost a warm SmolLM2 prefill 187 ms), weights
read at compile, positional surface binding in alphabetical order, uniform and minimum surface
sizes, packed reads and writes at offset 0, fp16 rounding of every op result, and the peer
switches of the profile. The execution plan (`emulator.plan`) is built once per cold compile;
the on-disk kernel cache (`emulator.cache`) keeps it, as aned keeps compiled programs, and a
program found there is loaded, not compiled. A column-separable program (`emulator.columns`:
strict's decode kernels, 16 columns with the token in column 0) is evaluated only in the
columns the caller reads.
"""

from __future__ import annotations

import gc
import shutil
import tempfile
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ...chip.profile import STRICT, ChipProfile
from ...chip.surfaces import bind_order, least_surface_bytes, uniform
from ...compiler.artifact import content_key
from ...chip.rejects import reject, rule_on
from ...errors import BlobError, DeviceError
from ...mil.blob import frozen
from ...mil.folder import relative_path, weight_file, write_model_folder
from ...mil.program import Function, TensorType, storage_dtype
from ..base import Device, Surface, charge_compile
from .checks import check_function
from .cache import dump_plan, kernel_store, load_plan
from .columns import ColumnPlan, column_axes, column_plan
from .builder import Resolver, build_plan, pruned
from .plan import Plan
from .surface import ShadowedSurface
from ..overflow import Overflow

BAD_REQUEST = 0x1d  # the status the hardware returns for a request it refuses
_INSIDE: set[str] = set()  # weight keys found inside @model_path/ so far: a model's layers name the same blobs


@dataclass(eq=False)
class EmulatedModel:
    """One compiled program: its folder, parsed function and execution plan."""

    key: str
    _folder: Path  # where the compile folder goes; written on first use (`folder`)
    func: Function | None  # None when the plan came from the kernel cache (no parse happened)
    plan: Plan
    weight_paths: list[str] = field(default_factory=list)
    loaded: bool = False
    inputs: list[tuple[str, TensorType]] = field(default_factory=list)  # in binding order
    outputs: list[tuple[str, TensorType]] = field(default_factory=list)
    columns: ColumnPlan | None = None  # how a column-separable program runs column by column
    checked: tuple = ()  # the input and output surfaces of the last request that passed the checks
    _owners: tuple | None = field(default=None, repr=False)  # (plan, const_owners) for the current plan
    _source: tuple | None = field(default=None, repr=False)  # (mil_text, blobs) until the folder is written
    _pruned: dict = field(default_factory=dict, repr=False)  # outputs -> (the plan cut, the cut)

    def pruned(self, outputs: tuple[str, ...]) -> Plan:
        """The current plan cut to what `outputs` need (`emulator.builder.pruned`), made once
        per plan (a reload's new plan is cut anew)."""
        held = self._pruned.get(outputs)
        if held is None or held[0] is not self.plan:
            held = self._pruned[outputs] = (self.plan, pruned(self.plan, outputs))
        return held[1]

    @property
    def folder(self) -> Path:
        """The compile folder, `model.mil` and the blobs as the private API gets them. Nothing
        in a strict run reads it (weights are read at compile), so it is written when first
        asked for: by `rewrite_weight`, by a profile whose reloads read it, or by a caller."""
        if self._source is not None:
            write_model_folder(self._folder, *self._source)
            self._source = None
        return self._folder

    def const_owners(self) -> set[int]:
        """ids of the arrays that own the plan's consts' memory (found once per plan)."""
        if self._owners is None or self._owners[0] is not self.plan:
            self._owners = (self.plan, frozenset(id(_owner(c)) for c in self.plan.consts.values()
                                                 if isinstance(c, np.ndarray)))
        return set(self._owners[1])


class Emulator(Device):
    """A Device that executes MIL in numpy, enforcing the chip profile's behaviours."""

    name = "emulator"

    def __init__(self, profile: ChipProfile = STRICT):
        super().__init__(profile)
        self._root = Path(tempfile.mkdtemp(prefix="anelm-emulator-"))
        # compile folders live as long as the device (or the process)
        self._cleanup = weakref.finalize(self, shutil.rmtree, str(self._root), True)

    # --- life cycle -------------------------------------------------------------------------
    def compile(self, mil_text: str, weights: dict[str, bytes], key: str | None = None) -> EmulatedModel:
        """A cold compile (charged), or the plan of the on-disk kernel cache (loaded, not charged:
        only cold compiles count). A profile whose reloads read rewritten blobs plans from the
        folder at every load, so it keeps no cache."""
        collecting = gc.isenabled()
        gc.disable()  # a plan is thousands of objects that all live on: the collector would find no garbage
        try:
            return self._compile(mil_text, weights, key)
        finally:
            if collecting:
                gc.enable()

    def _compile(self, mil_text: str, weights: dict[str, bytes], key: str | None) -> EmulatedModel:
        # a snapshot, as the API copies; bytes and read-only views (a runner's blob-backed
        # weights, `mil.blob.blob_backed`) cannot change under the plan, so they are not copied
        weights = {k: frozen(v) for k, v in (weights or {}).items()}
        for path in weights:
            if path not in _INSIDE:
                relative_path(path)  # a key outside @model_path/ is a bad blob reference
                if len(_INSIDE) < 4096:
                    _INSIDE.add(path)
        key = key or content_key(mil_text, weights, self.profile)
        store = None if self.profile.reload_reads_new_weights else kernel_store()
        # weights are read now; later rewrites of the folder change nothing unless the profile says
        loaded = load_plan(store.get(key), weights, self.profile) if store is not None else None
        func = None
        if loaded is not None:
            plan, columns = loaded
        else:
            charge_compile(self.profile.compile_budget)
            from ...mil.parser import parse  # noqa: PLC0415 - a cache hit never needs the parser

            func = parse(mil_text).main
            check_function(func, self.profile, weights)
            plan = build_plan(func, weights, self.profile)
            axes = column_axes(plan)
            columns = column_plan(plan, axes)
            if store is not None:
                store.put(key, dump_plan(plan, axes))
        ins = bind_order([n for _, n in plan.inputs], self.profile, "inputs")
        outs = bind_order(list(plan.outputs), self.profile, "outputs")
        model = EmulatedModel(key, self._root / key[:40], func, plan, sorted(weights), _source=(mil_text, weights),
                              inputs=[(n, plan.types[n]) for n in ins], outputs=[(n, plan.types[n]) for n in outs],
                              columns=columns)
        if self.profile.reload_reads_new_weights:
            model.folder  # noqa: B018 - every load plans from the folder: write it now, as compiled
        return model

    def load(self, model: EmulatedModel) -> None:
        if self.profile.reload_reads_new_weights and model.weight_paths:
            model.plan = build_plan(model.func, _folder_resolver(model.folder), self.profile)
            model.columns = column_plan(model.plan, column_axes(model.plan))
        model.loaded = True

    def unload(self, model: EmulatedModel) -> None:
        model.loaded = False

    def rewrite_weight(self, model: EmulatedModel, path: str, blob: bytes) -> None:
        target = weight_file(model.folder, path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(bytes(blob))

    def close(self) -> None:
        self._cleanup()

    def new_surface(self, nbytes: int) -> ShadowedSurface:
        return ShadowedSurface(nbytes)

    @property
    def host_half(self) -> np.dtype:
        return ShadowedSurface.host_half

    # --- requests ---------------------------------------------------------------------------
    def evaluate(self, model: EmulatedModel, inputs: list[Surface], outputs: list[Surface],
                 watch: bool = False, read_columns: int | None = None, batched: bool = False,
                 only: tuple[str, ...] | None = None) -> Overflow | None:
        if not model.loaded:
            raise DeviceError("evaluate on a model that is not loaded; call load() first", code=BAD_REQUEST)
        request = (list(inputs), list(outputs), [s.nbytes for s in (*inputs, *outputs)])
        if model.checked != request:  # a request's surfaces, checked while they stay as they were
            self._check_request(model, inputs, outputs)
            model.checked = request
        arrays, exact = {}, set()
        for (name, t), s in zip(model.inputs, inputs):
            if t.dtype == "fp16" and isinstance(s, ShadowedSurface):
                arrays[name] = s.half_view(t.numel).reshape(t.shape or ())  # fp16 values already
                exact.add(name)
            else:
                arrays[name] = read_packed(s, t)
        found: list[Overflow] = []
        if only is not None:  # the steps the outputs read need, every column at once
            results = model.pruned(only).run(arrays, exact, overflow=found if watch else None)
        elif model.columns is not None and not batched:  # column-separable: only the columns the caller reads
            results = model.columns.run(arrays, exact, read_columns, model.plan, overflow=found if watch else None)
        else:
            results = model.plan.run(arrays, exact, overflow=found if watch else None)
        rounded = self.profile.compute_dtype == "fp16"  # every result is an fp16 value already
        # A result whose memory is this evaluation's own (not an input's, a const's or another
        # output's) becomes its output surface's content as it is, without a copy.
        taken = {id(_owner(a)) for a in arrays.values()} | model.const_owners()
        for (name, t), s in zip(model.outputs, outputs):
            if name not in results:  # not asked for (`only`): the surface keeps what it held
                continue
            if t.dtype == "fp16" and isinstance(s, ShadowedSurface):
                r, owner = results[name], id(_owner(results[name]))
                if rounded and owner not in taken and s.adopt_half(r):
                    taken.add(owner)
                else:
                    s.write_half(r, exact=rounded)
            else:
                write_packed(s, results[name], t)
        return found[0] if found else None

    def _check_request(self, model: EmulatedModel, inputs: list[Surface], outputs: list[Surface]) -> None:
        p = self.profile
        if rule_on("single_input_only", p) and len(inputs) > 1:
            err = reject("single_input_only", "request", p, count=len(inputs))
            raise DeviceError(f"request has {err.constraint}; fix: {err.fix}", code=BAD_REQUEST)
        for what, surfaces, specs in (("input", inputs, model.inputs), ("output", outputs, model.outputs)):
            if len(surfaces) != len(specs):
                raise DeviceError(f"request has {len(surfaces)} {what} surfaces; expected {len(specs)} "
                                  f"({', '.join(n for n, _ in specs)})", code=BAD_REQUEST)
            sizes = [s.nbytes for s in surfaces]
            if uniform(p, what + "s") and len(set(sizes)) > 1:
                raise DeviceError(f"{what} surfaces have sizes {sizes}; expected one allocation size "
                                  f"for every {what}", code=BAD_REQUEST)
            for (name, t), s in zip(specs, surfaces):
                if s.nbytes < least_surface_bytes(p, t.nbytes):
                    raise DeviceError(f"{what} surface for '{name}' has {s.nbytes} bytes; expected at least "
                                      f"{least_surface_bytes(p, t.nbytes)}", code=BAD_REQUEST)


def _owner(a):
    """The array that owns a's memory (a itself, or the end of its chain of views)."""
    while isinstance(a, np.ndarray) and a.base is not None:
        a = a.base
    return a


def read_packed(surface: Surface, t: TensorType) -> np.ndarray:
    """The first prod(shape) * itemsize bytes of the surface, as the declared tensor."""
    raw = surface.view()[: t.nbytes]
    return raw.view(storage_dtype(t.dtype)).reshape(t.shape or ())


def write_packed(surface: Surface, value: np.ndarray, t: TensorType) -> None:
    surface.write(np.ascontiguousarray(value, dtype=storage_dtype(t.dtype)))


def _folder_resolver(folder: Path) -> Resolver:
    def read(path: str) -> bytes:
        target = weight_file(folder, path)
        if not target.exists():
            raise BlobError(f"{path}: no such file in the compile folder {folder}")
        return target.read_bytes()
    return read

