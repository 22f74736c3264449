"""Kernel: an Artifact on a Device, numpy arrays in and out.

    k = Kernel(artifact, device)          # compiled through the program cache
    out = k(x=x)                          # or k.run({"x": x}) -> {"y": array}
    req = k.request()                     # own input surfaces, shared output surfaces
    req.write("x", w, columns=slice(S, S + OC))   # pre-stage weights once
    out = req.run(x=act)                  # ...or only the activation columns each time
    k.close()

One kernel's output can be another's input with no trip through the host: bind one surface
(`Kernel.new_surface`) as an output of the first's request and an input of the second's
(`request(inputs=, outputs=)`), and leave it unread (`run(stay=)`).

Surfaces follow the device's profile: every surface of one direction gets the same allocation
size (at least `min_surface_bytes`), data is packed at offset 0, and surfaces bind in the
profile's order (alphabetical by MIL name in `strict`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Collection

import numpy as np

from ..chip.surfaces import bind_order, surface_sizes
from ..device.base import Device, Surface
from ..device.overflow import warn_overflow, warned
from ..errors import ShapeError
from ..fp16.bits import to_half
from ..fp16.grid import round_fp16, write_fp16_columns
from ..mil.program import storage_dtype
from .cache import ProgramCache, program_cache


def _sizes(specs: list, profile, side: str) -> list[int]:
    """Allocation per surface: the signature's, raised to what the device's profile needs."""
    return surface_sizes([max(s.surface_bytes, s.nbytes) for s in specs], profile, side)


def _as_input(spec, array, surface: Surface, exact: bool = False, saturate: bool = False) -> np.ndarray:
    """The array as the host keeps it for `surface`: fp16 data as the surface's `host_half`."""
    a = np.asarray(array)
    if a.shape != tuple(spec.shape):
        raise ShapeError(f"input '{spec.name}': expected shape {list(spec.shape)}, got {list(a.shape)}")
    if a.dtype.kind not in "biuf":
        raise ShapeError(f"input '{spec.name}': expected numbers castable to {spec.dtype}, got dtype {a.dtype}")
    if spec.dtype != "fp16":
        return np.ascontiguousarray(a, dtype=storage_dtype(spec.dtype))
    return _to_host_half(a, surface.host_half, exact, saturate)


def _to_host_half(a: np.ndarray, host: np.dtype, exact: bool = False, saturate: bool = False) -> np.ndarray:
    """fp16 values in the host dtype: float32 ones are rounded onto the fp16 grid here, unless
    `exact` says they are fp16 values already (a float16 host's cast rounds by itself);
    `saturate`: past fp16's range ±65504, not inf, in the same pass."""
    if saturate and not exact:
        return round_fp16(a, saturate=True) if host == np.float32 else to_half(a, saturate=True)
    if host == np.float32 and a.dtype != np.float16 and not exact:
        return round_fp16(a)
    if a.dtype == host and a.flags.c_contiguous:
        return a  # what the cast below hands back, without its error-state switch
    with np.errstate(over="ignore"):
        return np.ascontiguousarray(a, dtype=host)


class Kernel:
    """A compiled program with its surfaces; callable with numpy arrays."""

    def __init__(self, artifact, device: Device, cache: ProgramCache | None = None,
                 float32_outputs: bool = False, warn_overflow: bool = True, read_columns: int | None = None):
        self.artifact, self.device = artifact, device
        # fp16 diagnostics (docs/chip-profiles.md): the first overflow is named on stderr, once
        # per kernel name; off for kernels where overflow is expected (training's dx kernels,
        # under loss scaling)
        self.warn_overflow = warn_overflow
        # fp16 outputs as float32 arrays of the same values: what numpy callers compute with
        # anyway, and on the emulator it skips a float16 cast each way
        self.float32_outputs = float32_outputs
        # the caller reads only the first n spatial columns of each output (Device.evaluate)
        self._read = {} if read_columns is None else {"read_columns": read_columns}
        self._cache = cache if cache is not None else program_cache()
        p = device.profile
        sig = artifact.signature
        self.inputs = bind_order(sig.inputs, p, "inputs", name=lambda s: s.name)  # binding order
        self.outputs = bind_order(sig.outputs, p, "outputs", name=lambda s: s.name)
        self._declared_outputs = [s.name for s in sig.outputs]
        meta = getattr(artifact, "meta", None) or {}
        self.name = meta.get("name") or f"kernel {artifact.key(p)[:12]}"  # the name it was compiled with
        # io_naming may have prefixed MIL names for binding order; callers keep their names
        self._user = dict(meta.get("aliases", {}))  # mil name -> user name
        self._mil = {u: m for m, u in self._user.items()}
        self._concat = dict(meta.get("concat_outputs", {}))  # rebuilt here on the CPU
        self._in_sizes = _sizes(self.inputs, p, "inputs")
        self._out_sizes = _sizes(self.outputs, p, "outputs")
        self.model = self._cache.acquire(artifact, device)
        self._out_surfaces = [device.new_surface(n) for n in self._out_sizes]  # shared by every request
        self._made: list[Surface] = []  # `new_surface`'s, released with the kernel
        self._lock = threading.Lock()
        self._requests: list[Request] = []
        self._default: Request | None = None
        self.closed = False

    def request(self, inputs: dict[str, Surface] | None = None,
                outputs: dict[str, Surface] | None = None) -> "Request":
        """A request with its own input surfaces (outputs are shared across requests). `inputs`
        binds surfaces made elsewhere to the inputs it names, `outputs` to every output (each
        side's own surfaces then as large as the bound ones, where the profile wants one size);
        the request does not release them. Requests sharing a surface run on one thread."""
        self._check_open()
        bound = {self._mil.get(k, k): s for k, s in (inputs or {}).items()}
        unknown = sorted(set(bound) - {s.name for s in self.inputs})
        if unknown:
            raise ShapeError(f"kernel has no input {unknown}; expected names among {[s.name for s in self.inputs]}")
        sizes = surface_sizes([max(n, bound[s.name].nbytes) if s.name in bound else n
                               for s, n in zip(self.inputs, self._in_sizes)], self.device.profile, "inputs")
        own = {s.name: self.device.new_surface(n) for s, n in zip(self.inputs, sizes) if s.name not in bound}
        outs = None
        if outputs is not None:
            outs = [outputs.get(self._user.get(s.name, s.name), outputs.get(s.name)) for s in self.outputs]
            if None in outs:
                raise ShapeError(f"request outputs: expected a surface for each of {self._declared_outputs}")
        req = Request(self, [bound.get(s.name) or own[s.name] for s in self.inputs], list(own.values()), outs)
        self._requests.append(req)
        return req

    @property
    def input_names(self) -> list[str]:
        """The inputs' names as callers use them, in binding order."""
        return [self._user.get(s.name, s.name) for s in self.inputs]

    def surface_bytes(self, side: str) -> int:
        """The largest allocation this kernel's surfaces of `side` ("inputs", "outputs") need."""
        return max(self._in_sizes if side == "inputs" else self._out_sizes)

    def new_surface(self, nbytes: int) -> Surface:
        """A surface on the kernel's device, released with the kernel, for `request` to bind."""
        self._check_open()
        s = self.device.new_surface(nbytes)
        self._made.append(s)
        return s

    def run(self, arrays: dict[str, np.ndarray], exact: Collection[str] = ()) -> dict[str, np.ndarray]:
        """Every input by MIL name -> every output by returned name (declared dtype and shape).

        Inputs named in `exact` are float arrays of fp16 values already (earlier outputs with
        `float32_outputs`): they are not rounded again.
        """
        self._check_open()
        names = {self._user.get(s.name, s.name) for s in self.inputs}
        missing = sorted(names - {self._user.get(k, k) for k in arrays})
        if missing:
            raise ShapeError(f"kernel inputs: missing {missing}; expected names {sorted(names)}")
        if self._default is None:
            self._default = self.request()
        for name, a in arrays.items():
            self._default.write(name, a, exact=name in exact)
        return self._default.run()

    def __call__(self, **arrays: np.ndarray) -> dict[str, np.ndarray]:
        return self.run(arrays)

    def _evaluate(self, in_surfaces: list[Surface], batched: bool = False, only: tuple[str, ...] | None = None,
                  out_surfaces: list[Surface] | None = None, stay: Collection[str] = ()) -> dict[str, np.ndarray]:
        watch = self.warn_overflow and not warned(self.name)  # nothing to look for once it has warned
        read = {"batched": True} if batched else dict(self._read)  # every column, whatever was promised
        if only is not None:  # by MIL name; the others come back as their surfaces held them
            read["only"] = tuple(self._mil.get(n, n) for n in only)
        outs = self._out_surfaces if out_surfaces is None else out_surfaces
        with self._lock:  # output surfaces are shared: evaluate and read back as one step
            found = self.device.evaluate(self.model, in_surfaces, outs, watch=watch, **read)
            if watch and found is not None:
                warn_overflow(self.name, found)
            got = {}
            for spec, s in zip(self.outputs, outs):
                if self._user.get(spec.name, spec.name) in stay:  # left on the device for another request
                    continue
                if self.float32_outputs and spec.dtype == "fp16":
                    got[spec.name] = s.share_half(math.prod(spec.shape)).reshape(spec.shape)
                else:
                    raw = s.read(spec.nbytes)
                    got[spec.name] = raw.view(storage_dtype(spec.dtype)).reshape(spec.shape)
        out = {self._user.get(n, n): got[n] for n in self._declared_outputs if n in got}
        for name, how in self._concat.items():  # strict rejects concat: join the parts here
            out[name] = np.concatenate([out.pop(part) for part in how["parts"]], axis=how["axis"])
        return out

    def _check_open(self) -> None:
        if self.closed:
            raise ShapeError("kernel is closed; expected a live Kernel")

    def close(self) -> None:
        """Release the surfaces and unpin the program (it stays cached until evicted)."""
        if self.closed:
            return
        self.closed = True
        for req in self._requests:
            req.close()
        for s in (*self._out_surfaces, *self._made):
            s.release()
        self._cache.release(self.model)

    def __enter__(self) -> "Kernel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Request:
    """Input surfaces of one request; inputs written once stay staged across runs."""

    def __init__(self, kernel: Kernel, surfaces: list[Surface], own: list[Surface] | None = None,
                 outputs: list[Surface] | None = None):
        self.kernel = kernel
        self.surfaces = surfaces
        self._own = surfaces if own is None else own  # what `close` releases (not bound ones)
        self._outputs = outputs  # bound output surfaces, else the kernel's shared ones
        self._specs = {s.name: (i, s) for i, s in enumerate(kernel.inputs)}
        self._mirror: dict[str, np.ndarray] = {}  # host copies of inputs written by columns
        self._dirty: set[str] = set()

    def write(self, name: str, array: np.ndarray, columns: slice | None = None, exact: bool = False,
              saturate: bool = False) -> None:
        """Write input `name` whole, or only `columns` of its last (spatial) axis.

        With channel-major `[1, C, 1, S]` layout, columns [a, b) of every channel row are
        the elements c*S + a .. c*S + b: the dynamic-weight packing stages a weight there once.
        `exact` promises float values that already are fp16 values (`round_fp16`'s output), so
        one rounding serves several writes of the same array. `saturate` turns values past fp16's
        range into ±65504 rather than inf as they are converted (activations the CPU computed in
        float32: no separate clamping pass).
        """
        name = self.kernel._mil.get(name, name)
        i, spec = self._spec(name)
        if columns is None:
            a = _as_input(spec, array, self.surfaces[i], exact, saturate)
            self._put(i, spec, a)
            if name in self._mirror:
                self._mirror[name][...] = a
            return
        host, live = self._host(name, spec)
        target = host[..., columns]
        a = np.asarray(array)
        if a.shape != target.shape and a.shape != tuple(d for d in target.shape if d != 1):
            raise ShapeError(f"input '{name}' columns {columns.start}:{columns.stop}: expected shape "
                             f"{list(target.shape)}, got {list(a.shape)}")
        if (spec.dtype == "fp16" and host.dtype == np.float32 and a.ndim == 2 and host.shape[::2] == (1, 1)
                and columns.step in (None, 1)):
            # float32 values, [1, C, 1, W]: rounded straight into place (a .T view by 8x8 blocks)
            start = columns.indices(host.shape[3])[0]
            write_fp16_columns(a, host.reshape(host.shape[1], host.shape[3]), start, exact, saturate)
        else:
            if spec.dtype == "fp16":
                a = _to_host_half(a, host.dtype, exact, saturate)
            host[..., columns] = a.reshape(target.shape)
        if not live:
            self._dirty.add(name)

    def run(self, batched: bool = False, only: tuple[str, ...] | None = None, stay: Collection[str] = (),
            **arrays: np.ndarray) -> dict[str, np.ndarray]:
        """Write the given inputs whole (others keep what was staged), evaluate, read outputs;
        `batched`: every column of the outputs in one pass; `only`: the outputs the caller reads
        (the others are stale) (`Device.evaluate`); `stay`: outputs computed into their (bound)
        surfaces but not read back, for another request to take as input."""
        self.kernel._check_open()
        for name, a in arrays.items():
            self.write(name, a)
        for name in self._dirty:
            i, spec = self._specs[name]
            self._put(i, spec, self._mirror[name])
        self._dirty.clear()
        return self.kernel._evaluate(self.surfaces, batched, only, self._outputs, stay)

    def close(self) -> None:
        for s in self._own:
            s.release()
        self._mirror.clear()

    def _spec(self, name: str):
        if name not in self._specs:
            raise ShapeError(f"kernel has no input '{name}'; expected one of {sorted(self._specs)}")
        return self._specs[name]

    def _put(self, i: int, spec, host: np.ndarray) -> None:
        """Write a host array (as `_as_input` or `_host` keep it) into input surface i."""
        if spec.dtype == "fp16":
            self.surfaces[i].write_half(host, exact=True)
        else:
            self.surfaces[i].write(host)

    def _host(self, name: str, spec) -> tuple[np.ndarray, bool]:
        """The array column writes go to, and whether it is the surface itself (no copy at run)."""
        surface = self.surfaces[self._specs[name][0]]
        live = getattr(surface, "live_half", None)  # the emulator's surfaces hold float32 values
        if spec.dtype == "fp16" and live is not None:
            return live(math.prod(spec.shape)).reshape(spec.shape), True
        if name not in self._mirror:  # a host copy of what was staged so far
            raw = surface.read(spec.nbytes)
            self._mirror[name] = raw.view(storage_dtype(spec.dtype)).reshape(spec.shape).copy()
        return self._mirror[name], False
