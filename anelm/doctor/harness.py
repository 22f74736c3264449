"""Running one probe on one device, with the surfaces exactly as the probe asks.

Probes talk to the Device interface directly (compile, load, new_surface, evaluate,
unload), not through the runtime, so that each one controls surface sizes, their order,
and what sits in the padding. An observation's `outcome` is what is compared across
devices and against a profile's prediction:

    ok            ran and matched the float64 reference within the op's tolerance
    rejected      compile or load refused the program (an AnelmError from the device)
    wrong-result  ran, but the numbers are off (err is max|got-ref| / max|ref|)
    error         evaluate refused the request (e.g. status 0x1d for a bad surface)
    crash         anything else: a bug in the device layer, never predicted
    skipped       the probe could not be set up here (says why)
    <value>       a behaviour reading: binding order, mask ignored/applied, ...
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

from ..chip.profile import STRICT, ChipProfile
from ..chip.surfaces import surface_sizes
from ..errors import AnelmError
from ..mil.program import NUMPY_DTYPES

MIN_BYTES = STRICT.min_surface_bytes  # the 49,152-byte minimum surface: probes not about sizes keep to it
PAD_BYTE = 0x5A  # padding and untouched outputs read as fp16 203.25: never a plausible result
# the tolerances of docs/testing.md, relative to max|ref|
ELEMENTWISE, REDUCTION, BLOCK = 2e-3, 1e-2, 2e-2


class Rejected(Exception):
    """compile or load refused the program."""


class EvalFailed(Exception):
    """evaluate refused the request."""


class Skip(Exception):
    """The probe cannot run here (a missing module, an unrunnable setup)."""


@dataclass
class Observation:
    probe: str
    status: str
    value: str | None = None
    err: float | None = None
    tol: float | None = None
    detail: str = ""
    seconds: float = 0.0

    @property
    def outcome(self) -> str:
        return self.value if (self.status == "ok" and self.value is not None) else self.status

    def to_dict(self) -> dict:
        d = asdict(self)
        d["outcome"] = self.outcome
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Observation":
        return cls(**{k: v for k, v in d.items() if k != "outcome"})


@dataclass(frozen=True)
class Probe:
    name: str
    grade: int  # 1 single ops, 2 binding and surfaces, 3 semantics, 4 transformer kernels, 5 budget
    what: str  # one line: what it checks
    run: Callable[["Harness"], Observation]  # raises Rejected / EvalFailed / Skip for those outcomes
    expect: Callable[[ChipProfile], str]  # the outcome a device following the profile gives
    ops: tuple[str, ...] = field(default=())


def compare(got: np.ndarray, ref: np.ndarray, tol: float, value: str | None = None) -> Observation:
    """ok within `tol` of the reference, else wrong-result; non-finite where ref is finite fails."""
    err = rel_err(got, ref)
    status = "ok" if err <= tol else "wrong-result"
    detail = "" if status == "ok" else f"max relative error {err:.3g} > {tol:g}"
    return Observation("", status, value if status == "ok" else None, err, tol, detail)


def rel_err(got, ref) -> float:
    """max|got - ref| / max|ref| in float64; inf when shapes differ or got is NaN/inf wrongly."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if got.shape != ref.shape:
        return float("inf")
    same_inf = np.isinf(got) & np.isinf(ref) & (np.sign(got) == np.sign(ref))
    with np.errstate(invalid="ignore"):  # inf - inf is handled by same_inf
        diff = np.where(same_inf, 0.0, np.abs(got - ref))
    if np.isnan(diff).any():
        return float("inf")
    scale = np.max(np.abs(np.where(np.isinf(ref), 0.0, ref)), initial=0.0) or 1.0
    return float(np.max(diff, initial=0.0) / scale)


def data(shape, lo: float, hi: float, seed: int, dtype: str = "fp16") -> np.ndarray:
    """Deterministic uniform data in [lo, hi], already rounded to the surface dtype."""
    rng = np.random.default_rng(seed)
    return rng.uniform(lo, hi, size=shape).astype(NUMPY_DTYPES[dtype])


def f64(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float64)


def blob(*arrays: np.ndarray) -> tuple[bytes, list[int]]:
    """A BLOBFILE holding `arrays` and each one's MIL offset (anelm.mil.blob writes the bytes)."""
    try:
        from ..mil.blob import encode_blob, encode_tensor  # noqa: PLC0415
    except ImportError as e:
        raise Skip(f"anelm.mil.blob is not available: {e}") from None
    if len(arrays) == 1:
        return encode_tensor(arrays[0]), [64]  # a single-tensor file: metadata right after the header
    return encode_blob(list(arrays))


class Program:
    """A compiled probe program on one device; `run` binds surfaces by position."""

    def __init__(self, harness: "Harness", model):
        self.h, self.model, self.loaded = harness, model, False

    def load(self) -> None:
        try:
            self.h.device.load(self.model)
        except AnelmError as e:
            raise Rejected(f"load: {e}") from None
        self.loaded = True

    def unload(self) -> None:
        self.h.device.unload(self.model)
        self.loaded = False

    def rewrite(self, path: str, blob: bytes) -> None:
        self.h.device.rewrite_weight(self.model, path, blob)

    def run(self, inputs: list[np.ndarray], outputs: list[tuple[str, tuple]],
            in_bytes=None, out_bytes=None) -> list[np.ndarray]:
        """Evaluate once. `inputs` in surface order; `outputs` as (dtype, shape) per surface.

        Sizes: None = one uniform size, max(49,152, largest tensor); an int = every surface;
        a list = per surface. Padding is PAD_BYTE; data is packed at offset 0.
        """
        out_nbytes = [int(np.prod(s)) * np.dtype(NUMPY_DTYPES[d]).itemsize for d, s in outputs]
        ins = [self.h.surface(n, a) for n, a in zip(_sizes(in_bytes, [a.nbytes for a in inputs]), inputs)]
        outs = [self.h.surface(n) for n in _sizes(out_bytes, out_nbytes)]
        try:
            self.h.device.evaluate(self.model, ins, outs)
        except AnelmError as e:
            raise EvalFailed(f"evaluate: {e}") from None
        return [s.read(n).view(NUMPY_DTYPES[d]).reshape(shape)
                for s, n, (d, shape) in zip(outs, out_nbytes, outputs)]


def _sizes(spec, tensor_bytes: list[int]) -> list[int]:
    if spec is None:
        return surface_sizes(tensor_bytes, STRICT, "inputs")  # strict's: one size, at least MIN_BYTES
    if isinstance(spec, int):
        return [spec] * len(tensor_bytes)
    return list(spec)


class Harness:
    """One probe's view of a device; `close()` releases every surface and model it made."""

    def __init__(self, device):
        self.device = device
        self._surfaces, self._programs = [], []

    def compile(self, mil_text: str, weights: dict[str, bytes] | None = None) -> Program:
        try:
            model = self.device.compile(mil_text, weights or {})
        except AnelmError as e:
            raise Rejected(f"compile: {e}") from None
        prog = Program(self, model)
        self._programs.append(prog)
        return prog

    def run(self, mil_text: str, inputs, outputs, weights=None, in_bytes=None, out_bytes=None):
        """compile + load + one evaluate."""
        prog = self.compile(mil_text, weights)
        prog.load()
        return prog.run(inputs, outputs, in_bytes, out_bytes)

    def surface(self, nbytes: int, array: np.ndarray | None = None):
        s = self.device.new_surface(nbytes)
        self._surfaces.append(s)
        s.write(np.full(nbytes, PAD_BYTE, np.uint8))
        if array is not None:
            s.write(np.ascontiguousarray(array))
        return s

    def close(self) -> None:
        for s in self._surfaces:
            s.release()
        for p in self._programs:
            try:
                if p.loaded:
                    p.unload()
            except AnelmError:
                pass
            release = getattr(p.model, "release", None)  # hardware models own ObjC objects and a folder
            if release is not None:
                release()
        self._surfaces, self._programs = [], []


def run_probe(probe: Probe, device) -> Observation:
    """Run one probe; every failure becomes an observation, never an exception."""
    h, t0 = Harness(device), time.perf_counter()
    try:
        obs = probe.run(h)
    except Rejected as e:
        obs = Observation("", "rejected", detail=str(e))
    except EvalFailed as e:
        obs = Observation("", "error", detail=str(e))
    except Skip as e:
        obs = Observation("", "skipped", detail=str(e))
    except Exception as e:  # noqa: BLE001 - a device bug is a finding, not a doctor crash
        obs = Observation("", "crash", detail=f"{type(e).__name__}: {e}")
    finally:
        try:
            h.close()
        except Exception:  # noqa: BLE001
            pass
    obs.probe, obs.seconds = probe.name, round(time.perf_counter() - t0, 4)
    return obs
