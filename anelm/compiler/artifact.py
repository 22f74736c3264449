"""The compiler's output as one value: MIL text + BLOBFILE weights + I/O signature.

An Artifact is written to and read from a kernel folder (docs/architecture.md), the same
layout the private API's temp directory gets, so a folder can be diffed, run with `anelm run-mil`, or
handed to the hardware as is:

    KERNEL/
      model.mil          UTF-8 MIL text
      weights/x.bin      BLOBFILEs, at the paths the MIL names after @model_path/
      signature.json     {"inputs": [{name, dtype, shape, surface_bytes}], "outputs": [...]}
      meta.json          optional, free-form (only when `meta` is not empty)

A folder written by anyone else (just `model.mil` + `weights/`) loads too: the signature is
then derived from the MIL and the chip profile.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..chip.profile import STRICT, ChipProfile
from ..chip.surfaces import surface_sizes
from ..errors import AnelmError, BlobError, CompileError
from ..mil.blob import decode_blob, frozen
from ..mil.folder import MODEL_FILE, weight_file, write_model_folder
from ..mil.parser import parse
from ..mil.program import ITEMSIZE, BlobRef, Function, Program, TensorType

_IOSPEC_KEYS = {"name": str, "dtype": str, "shape": list, "surface_bytes": int}


@dataclass(frozen=True)
class IOSpec:
    """One input or output surface: the declared tensor and the bytes allocated for it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    surface_bytes: int

    @property
    def nbytes(self) -> int:
        """Bytes of packed tensor data; the surface may be larger (the 49,152-byte minimum surface)."""
        return TensorType(self.dtype, self.shape).nbytes


@dataclass
class Signature:
    """Inputs and outputs in MIL declaration order (binding order is the profile's business)."""

    inputs: list[IOSpec]
    outputs: list[IOSpec]

    def to_json(self) -> str:
        def row(s: IOSpec) -> dict:
            return {**asdict(s), "shape": list(s.shape)}

        d = {"inputs": [row(s) for s in self.inputs], "outputs": [row(s) for s in self.outputs]}
        return json.dumps(d, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str = "signature.json") -> "Signature":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise AnelmError(f"{source}: not valid JSON ({e}); expected a signature object") from None
        if not isinstance(d, dict) or not all(isinstance(d.get(k), list) for k in ("inputs", "outputs")):
            raise AnelmError(f"{source}: expected an object with 'inputs' and 'outputs' lists")
        return cls([_iospec(r, source) for r in d["inputs"]], [_iospec(r, source) for r in d["outputs"]])


def _iospec(row, source: str) -> IOSpec:
    ok = isinstance(row, dict) and all(isinstance(row.get(k), t) for k, t in _IOSPEC_KEYS.items())
    if not ok or not all(isinstance(n, int) for n in row["shape"]):
        raise AnelmError(f"{source}: bad surface entry {row!r}; expected name, dtype, shape (ints), surface_bytes")
    return IOSpec(row["name"], row["dtype"], tuple(row["shape"]), row["surface_bytes"])


def _sized(named: list[tuple[str, TensorType]], side: str, profile: ChipProfile) -> list[IOSpec]:
    """Surface sizes for one side, as the profile allocates them (uniform, at least 49,152 bytes)."""
    for name, t in named:
        if t.dtype not in ITEMSIZE:
            raise CompileError(name, f"surface dtype {t.dtype} has no fixed byte size", "use fp16 or fp32 I/O")
    sizes = surface_sizes([t.nbytes for _, t in named], profile, side)
    return [IOSpec(name, t.dtype, tuple(t.shape or ()), n) for (name, t), n in zip(named, sizes)]


def signature_from_function(func: Function, profile: ChipProfile = STRICT) -> Signature:
    """The I/O signature of `func` with surface sizes as `profile` allocates them."""
    types = func.result_types()
    for name in func.outputs:
        if name not in types:
            raise CompileError(name, "returned name is not defined by any statement or input",
                               "return a name that the function binds")
    inputs = [(n, t) for t, n in func.inputs]
    outputs = [(n, types[n]) for n in func.outputs]
    return Signature(_sized(inputs, "inputs", profile), _sized(outputs, "outputs", profile))


def _check_signature(sig: Signature, func: Function, source: str) -> None:
    """signature.json must describe the tensors the MIL declares, in the same order."""
    types = func.result_types()
    declared = {"inputs": [(n, t) for t, n in func.inputs], "outputs": [(n, types.get(n)) for n in func.outputs]}
    for side, specs in (("inputs", sig.inputs), ("outputs", sig.outputs)):
        want = [(n, t.dtype, tuple(t.shape or ())) if t else (n, None, None) for n, t in declared[side]]
        have = [(s.name, s.dtype, s.shape) for s in specs]
        if have != want:
            raise AnelmError(f"{source}: {side} {have} do not match the MIL's {want}")


def blob_refs(prog: Program) -> list[BlobRef]:
    """Every BLOBFILE reference in the program, in text order."""
    out: list[BlobRef] = []

    def visit(v) -> None:
        if isinstance(v, BlobRef):
            out.append(v)
        elif isinstance(v, tuple):
            for x in v:
                visit(x)

    for fn in prog.functions.values():
        for st in fn.body:
            for v in (*st.args.values(), *st.attrs.values()):
                visit(v)
    return out


def _check_blobs(prog: Program, weights: dict[str, bytes]) -> None:
    """Every referenced blob exists and holds the dtype and shape the MIL declares there."""
    for ref in blob_refs(prog):
        if ref.path not in weights:
            raise BlobError(f"the MIL references {ref.path}, which is not among the weights {sorted(weights)}")
        decode_blob(weights[ref.path], ref.offset, ref.type.dtype, ref.type.shape, source=ref.path)


KEY_FORMAT = b"anelm program key 2"  # changes whenever what the key covers changes


def profile_identity(profile: ChipProfile) -> str:
    """The profile's behaviours as canonical JSON: what a compiled program depends on (its name
    and free-form notes do not change a program). Remembered per profile object: a profile is
    frozen, and every program key asks (`asdict` took ~0.1 ms, 4 times per layer program)."""
    seen = _IDENTITIES.get(id(profile))
    if seen is not None and seen[0] is profile:
        return seen[1]
    d = asdict(profile)
    for k in ("name", "notes"):
        d.pop(k)
    ident = json.dumps(d, sort_keys=True)
    if len(_IDENTITIES) >= 64:  # profiles are few; tests make many: a small bound, no weak refs needed
        _IDENTITIES.clear()
    _IDENTITIES[id(profile)] = (profile, ident)  # the profile held, so its id is not reused meanwhile
    return ident


_IDENTITIES: dict[int, tuple[ChipProfile, str]] = {}


def content_key(mil_text: str, weights: dict[str, bytes], profile: ChipProfile = STRICT) -> str:
    """THE key of a program: its MIL text, every blob by MIL path, and the chip profile.

    Every cache of compiled programs uses it (the in-process program cache, the emulator's
    compile folders and its on-disk kernel cache), as aned names compiled programs by content.
    Parts are length-prefixed, so no boundary can shift between the text and the blobs.
    """
    h = hashlib.sha256(KEY_FORMAT)
    parts = [mil_text.encode("utf-8"), profile_identity(profile).encode()]
    parts += [x for p in sorted(weights) for x in (p.encode("utf-8"), weights[p])]
    for part in parts:
        h.update(memoryview(part).nbytes.to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


@dataclass
class Artifact:
    mil_text: str
    weights: dict[str, bytes]  # MIL path ('@model_path/weights/x.bin') -> whole BLOBFILE
    signature: Signature
    meta: dict = field(default_factory=dict)
    _parsed: tuple[str, Program] | None = field(default=None, init=False, repr=False, compare=False)
    _keyed: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def program(self) -> Program:
        """The parsed MIL, parsed once per text."""
        if self._parsed is None or self._parsed[0] is not self.mil_text:
            self._parsed = (self.mil_text, parse(self.mil_text))
        return self._parsed[1]

    def key(self, profile: ChipProfile = STRICT) -> str:
        """`content_key` of this text, these blobs and `profile`, hashed once: the hash of a
        12-layer kernel set reads 170 MB. It is hashed again only when the text or a blob is
        another object (blobs are immutable bytes or read-only views, `mil.blob.frozen`; a
        bytearray is hashed every time)."""
        ident = profile_identity(profile)
        parts = (self.mil_text, tuple(self.weights.items()))
        memo = self._keyed
        if memo is not None and memo[0] == ident and _same_objects(memo[1], parts):
            return memo[2]
        key = content_key(self.mil_text, self.weights, profile)
        if all(frozen(v) is v for v in self.weights.values()):
            self._keyed = (ident, parts, key)
        return key

    def known_key(self, key: str, profile: ChipProfile = STRICT) -> "Artifact":
        """This artifact with its content key under `profile` already known (a stored program
        whose key was hashed when it was built): `key` returns it without reading the blobs."""
        self._keyed = (profile_identity(profile), (self.mil_text, tuple(self.weights.items())), key)
        return self

    def save(self, directory: str | os.PathLike) -> Path:
        """Write the kernel folder; refuses weights that the MIL cannot find or read."""
        root = Path(directory)
        _check_blobs(self.program(), self.weights)
        write_model_folder(root, self.mil_text, self.weights)
        (root / "signature.json").write_text(self.signature.to_json())
        if self.meta:
            (root / "meta.json").write_text(json.dumps(self.meta, indent=2, sort_keys=True) + "\n")
        return root

    @classmethod
    def load(cls, directory: str | os.PathLike, profile: ChipProfile = STRICT) -> "Artifact":
        """Read a kernel folder; without signature.json the signature comes from the MIL and `profile`."""
        root = Path(directory)
        mil_file = root / MODEL_FILE
        if not mil_file.is_file():
            raise AnelmError(f"{root}: no model.mil; expected a kernel folder with model.mil and weights/")
        try:
            text = mil_file.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise AnelmError(f"{mil_file}: byte {e.start} is not UTF-8; expected MIL text in UTF-8") from None
        prog = parse(text, source=str(mil_file))
        weights = {}
        for ref in blob_refs(prog):
            if ref.path in weights:  # several tensors may share one file
                continue
            path = weight_file(root, ref.path)
            if not path.is_file():
                raise BlobError(f"{ref.path}: {path} does not exist; expected the blob the MIL references")
            weights[ref.path] = path.read_bytes()
        _check_blobs(prog, weights)
        art = cls(text, weights, _load_signature(root, prog, profile), _load_meta(root))
        art._parsed = (text, prog)
        return art


def _same_objects(a: tuple, b: tuple) -> bool:
    (text_a, items_a), (text_b, items_b) = a, b
    return text_a is text_b and len(items_a) == len(items_b) and all(
        ka == kb and va is vb for (ka, va), (kb, vb) in zip(items_a, items_b))


def _load_signature(root: Path, prog: Program, profile: ChipProfile) -> Signature:
    path = root / "signature.json"
    if not prog.functions:
        raise AnelmError(f"{root / 'model.mil'}: the program defines no function; expected func main")
    if not path.is_file():
        return signature_from_function(prog.main, profile)
    sig = Signature.from_json(path.read_text(encoding="utf-8"), source=str(path))
    _check_signature(sig, prog.main, str(path))
    return sig


def _load_meta(root: Path) -> dict:
    path = root / "meta.json"
    if not path.is_file():
        return {}
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise AnelmError(f"{path}: not valid JSON ({e}); expected an object") from None
    if not isinstance(meta, dict):
        raise AnelmError(f"{path}: expected a JSON object, found {type(meta).__name__}")
    return meta
