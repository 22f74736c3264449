"""The software ANE: runs parsed MIL text as the hardware would, under a chip profile.

    emu = Emulator()                       # STRICT profile
    model = emu.compile(mil_text, weights) # charges the compile budget; rejects as the ANE does
    emu.load(model)
    emu.evaluate(model, in_surfaces, out_surfaces)

What it reproduces (CONTRACTS §2): compile-time rejects (`emulator_checks`), a compile folder
named by the content hash with `model.mil` and the blobs (as the private API needs), weights
read at compile, positional surface binding in alphabetical order, uniform and minimum surface
sizes, packed reads and writes at offset 0, fp16 rounding of every op result, and the peer
switches of the profile. The execution plan (`emulator_plan`) is built once per compile.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..chip.profile import STRICT, ChipProfile
from ..errors import BlobError, DeviceError
from ..mil.program import Function, TensorType, storage_dtype
from .base import Device, Surface, charge_compile
from .emulator_checks import check_function
from .emulator_plan import Plan, Resolver, build_plan
from .emulator_surface import ShadowedSurface
from .overflow import Overflow

BAD_REQUEST = 0x1d  # the status the hardware returns for a request it refuses
MODEL_PATH = "@model_path/"


def bind_order(names: list[str], alphabetical: bool) -> list[str]:
    """The order surfaces bind in: alphabetical by MIL name on the ANE, else as declared."""
    return sorted(names) if alphabetical else list(names)


def content_key(mil_text: str, weights: dict[str, bytes]) -> str:
    """Hash of the text and every blob: the compile folder's name, like `hexStringIdentifier`."""
    h = hashlib.sha256(mil_text.encode("utf-8"))
    for path in sorted(weights):
        h.update(path.encode("utf-8") + b"\0" + hashlib.sha256(weights[path]).digest())
    return h.hexdigest()


@dataclass(eq=False)
class EmulatedModel:
    """One compiled program: its folder, parsed function and execution plan."""

    key: str
    folder: Path
    func: Function
    plan: Plan
    weight_paths: list[str] = field(default_factory=list)
    loaded: bool = False
    inputs: list[tuple[str, TensorType]] = field(default_factory=list)  # in binding order
    outputs: list[tuple[str, TensorType]] = field(default_factory=list)
    _owners: tuple | None = field(default=None, repr=False)  # (plan, const_owners) for the current plan

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
    def compile(self, mil_text: str, weights: dict[str, bytes]) -> EmulatedModel:
        charge_compile(self.profile.compile_budget)
        from ..mil.parser import parse  # noqa: PLC0415 - the parser pulls in lark; load on use

        func = parse(mil_text).main
        weights = {k: bytes(v) for k, v in (weights or {}).items()}  # a snapshot, as the API copies
        for path in weights:
            _rel_path(path)  # a key outside @model_path/ is a bad blob reference
        check_function(func, self.profile, weights)
        key = content_key(mil_text, weights)
        folder = self._write_folder(key, mil_text, weights)
        # weights are read now; later rewrites of the folder change nothing unless the profile says
        plan = build_plan(func, weights, self.profile)
        types = func.result_types()
        ins = bind_order([n for _, n in func.inputs], self.profile.bind_inputs_alphabetically)
        outs = bind_order(list(func.outputs), self.profile.bind_outputs_alphabetically)
        return EmulatedModel(key, folder, func, plan, sorted(weights),
                             inputs=[(n, types[n]) for n in ins], outputs=[(n, types[n]) for n in outs])

    def load(self, model: EmulatedModel) -> None:
        if self.profile.reload_reads_new_weights and model.weight_paths:
            model.plan = build_plan(model.func, _folder_resolver(model.folder), self.profile)
        model.loaded = True

    def unload(self, model: EmulatedModel) -> None:
        model.loaded = False

    def rewrite_weight(self, model: EmulatedModel, path: str, blob: bytes) -> None:
        target = model.folder / _rel_path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(bytes(blob))

    def close(self) -> None:
        self._cleanup()

    def new_surface(self, nbytes: int) -> ShadowedSurface:
        return ShadowedSurface(nbytes)

    @property
    def host_half(self) -> np.dtype:
        return ShadowedSurface.host_half

    def _write_folder(self, key: str, mil_text: str, weights: dict[str, bytes]) -> Path:
        folder = self._root / key[:40]
        (folder / "weights").mkdir(parents=True, exist_ok=True)
        (folder / "model.mil").write_text(mil_text, encoding="utf-8")
        for path, data in weights.items():
            target = folder / _rel_path(path)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        return folder

    # --- requests ---------------------------------------------------------------------------
    def evaluate(self, model: EmulatedModel, inputs: list[Surface], outputs: list[Surface],
                 watch: bool = False) -> Overflow | None:
        if not model.loaded:
            raise DeviceError("evaluate on a model that is not loaded; call load() first", code=BAD_REQUEST)
        self._check_request(model, inputs, outputs)
        arrays, exact = {}, set()
        for (name, t), s in zip(model.inputs, inputs):
            if t.dtype == "fp16" and isinstance(s, ShadowedSurface):
                arrays[name] = s.half_view(t.numel).reshape(t.shape or ())  # fp16 values already
                exact.add(name)
            else:
                arrays[name] = read_packed(s, t)
        found: list[Overflow] = []
        results = model.plan.run(arrays, exact, overflow=found if watch else None)
        rounded = self.profile.compute_dtype == "fp16"  # every result is an fp16 value already
        # A result whose memory is this evaluation's own (not an input's, a const's or another
        # output's) becomes its output surface's content as it is, without a copy.
        taken = {id(_owner(a)) for a in arrays.values()} | model.const_owners()
        for (name, t), s in zip(model.outputs, outputs):
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
        if p.single_input_only and len(inputs) > 1:
            raise DeviceError(f"request has {len(inputs)} input surfaces; this profile accepts one "
                              "(pack inputs along the spatial axis)", code=BAD_REQUEST)
        for what, surfaces, specs, uniform in (("input", inputs, model.inputs, p.uniform_input_sizes),
                                               ("output", outputs, model.outputs, p.uniform_output_sizes)):
            if len(surfaces) != len(specs):
                raise DeviceError(f"request has {len(surfaces)} {what} surfaces; expected {len(specs)} "
                                  f"({', '.join(n for n, _ in specs)})", code=BAD_REQUEST)
            sizes = [s.nbytes for s in surfaces]
            if uniform and len(set(sizes)) > 1:
                raise DeviceError(f"{what} surfaces have sizes {sizes}; expected one allocation size "
                                  f"for every {what}", code=BAD_REQUEST)
            for (name, t), s in zip(specs, surfaces):
                if s.nbytes < p.min_surface_bytes or s.nbytes < t.nbytes:
                    raise DeviceError(f"{what} surface for '{name}' has {s.nbytes} bytes; expected at least "
                                      f"{max(p.min_surface_bytes, t.nbytes)}", code=BAD_REQUEST)


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


def _rel_path(path: str) -> str:
    """`@model_path/weights/w.bin` -> `weights/w.bin`; anything else is a bad blob key."""
    rel = path[len(MODEL_PATH):] if path.startswith(MODEL_PATH) else ""
    if not rel or rel.startswith("/") or ".." in Path(rel).parts:
        raise BlobError(f"{path}: weight keys must look like '@model_path/weights/<name>.bin'")
    return rel


def _folder_resolver(folder: Path) -> Resolver:
    def read(path: str) -> bytes:
        target = folder / _rel_path(path)
        if not target.exists():
            raise BlobError(f"{path}: no such file in the compile folder {folder}")
        return target.read_bytes()
    return read

