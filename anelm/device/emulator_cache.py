"""The emulator's on-disk kernel cache: compiled programs kept across processes, weights apart.

aned keeps compiled programs by content on a Mac, and a program it holds is loaded, not
compiled (CONTRACTS §2.7). The emulator does the same in `cache_dir("kernels", "emulator")`:
an entry, keyed by `compiler.artifact.content_key` (MIL text, blobs, chip profile), holds the
plan's record (`emulator_plan.Plan.record`: every const's literal or BLOBFILE reference and
every resolved, checked statement, in order), pickled, a few tens of kilobytes. It holds no
weights: a hit replays the record against the blobs the caller passes, which skips parsing,
the compile-time checks, name resolution and type inference, and charges no compile.

The payload is read with an unpickler that builds only the MIL value classes and numpy
arrays, so a file planted in the cache folder cannot run code.
"""

from __future__ import annotations

import io
import pickle

from ..caches import cache_dir
from ..chip.profile import ChipProfile
from .disk_cache import DiskCache
from .emulator_builder import replay_plan
from .emulator_plan import Plan

FORMAT = 1  # the record's layout: a change makes older entries misses, rebuilt and rewritten
_ALLOWED = {
    ("anelm.mil.program", "TensorType"), ("anelm.mil.program", "Literal"), ("anelm.mil.program", "BlobRef"),
    ("numpy", "ndarray"), ("numpy", "dtype"),
    ("numpy._core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "scalar"),
    ("numpy.core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "scalar"),
    ("numpy._core.numeric", "_frombuffer"), ("numpy.core.numeric", "_frombuffer"),
    ("numpy.dtypes", "Float16DType"), ("numpy.dtypes", "Float32DType"), ("numpy.dtypes", "Int32DType"),
    ("numpy.dtypes", "BoolDType"), ("numpy.dtypes", "Int8DType"), ("numpy.dtypes", "UInt8DType"),
    ("numpy.dtypes", "Int16DType"), ("numpy.dtypes", "UInt16DType"), ("numpy.dtypes", "UInt32DType"),
    ("numpy.dtypes", "Int64DType"), ("numpy.dtypes", "UInt64DType"), ("numpy.dtypes", "ObjectDType"),
}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a kernel-cache entry")
        return super().find_class(module, name)


def kernel_store() -> DiskCache:
    """The emulator's folder of the cache directory, bounded by `ANELM_KERNEL_CACHE_MB`."""
    return DiskCache(cache_dir("kernels", "emulator"), FORMAT)


def dump_plan(plan: Plan) -> bytes:
    return pickle.dumps((plan.inputs, plan.outputs, plan.record), protocol=pickle.HIGHEST_PROTOCOL)


def load_plan(payload: bytes | None, weights: dict[str, bytes], profile: ChipProfile) -> Plan | None:
    """The plan of a stored entry, with these weights; None when there is none to use."""
    if payload is None:
        return None
    try:
        inputs, outputs, record = _Unpickler(io.BytesIO(payload)).load()
        return replay_plan(inputs, outputs, record, weights, profile)
    except Exception:  # noqa: BLE001 - an entry that does not replay is a miss: rebuilt and rewritten
        return None
