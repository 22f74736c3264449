"""`anelm run-mil DIR --inputs IN.npz --out OUT.npz`: execute any kernel folder.

The folder holds `model.mil` and `weights/` (and `signature.json` when we wrote it), whoever
wrote it. IN.npz has one key per MIL input name; arrays are cast to the declared dtype.
OUT.npz gets one key per returned name, in the declared dtype and shape.
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

import numpy as np

from ..errors import AnelmError
from .common import add_device_args


def add_args(p):
    p.add_argument("dir", metavar="DIR", help="kernel folder: model.mil + weights/")
    p.add_argument("--inputs", required=True, metavar="IN.npz", help="one array per MIL input name")
    p.add_argument("--out", required=True, metavar="OUT.npz", help="where to write the outputs")
    add_device_args(p)


def read_npz(path: str) -> dict[str, np.ndarray]:
    if not Path(path).is_file():
        raise AnelmError(f"inputs file '{path}' not found; expected an .npz with one array per MIL input")
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
        raise AnelmError(f"inputs file '{path}' is not a readable .npz: {e}") from None


def run(args) -> int:
    from ..compiler.artifact import Artifact
    from ..runtime.kernel import Kernel

    if not Path(args.dir).is_dir():
        raise AnelmError(f"kernel folder '{args.dir}' not found; expected a folder with model.mil and weights/")
    from ..chip.profile import load_profile
    from ..device.select import get_device

    profile = load_profile(args.profile)
    art = Artifact.load(args.dir, profile)  # bad folders fail before a device is chosen
    arrays = read_npz(args.inputs)
    device = get_device(args.device, profile)
    outputs = Kernel(art, device).run(arrays)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp.npz")
    np.savez(tmp, **outputs)
    tmp.replace(out)
    shapes = ", ".join(f"{k} {list(v.shape)} {v.dtype}" for k, v in outputs.items())
    print(f"anelm: ran {args.dir} on {device.name}: {shapes} -> {out}", file=sys.stderr)
    return 0
