"""anelm: train and run language models on the Apple Neural Engine, or on its emulator.

Data flow, one package per stage, in import order (a package imports only from those above it
in this list; `tests/test_import_order.py` checks it, docs/architecture.md says why):
    errors, atomic, caches   one-line errors, atomic writes, the cache directory
    mil/       MIL program model, text printer and parser, BLOBFILE weights, the compile folder
    ir/        typed SSA graph, op table, builder
    chip/      chip profiles (the hardware's switches and limits), surface binding and sizes
    models/    configs, architectures (CPU references), HF names, loaders, weight formats, tokenizers
    compiler/  passes, the pipeline that orders them, codegen to MIL, the kernel folder
    device/    Device interface, ANE emulator, real ANE backend, child-process runner
    runtime/   Kernel: compiled program + signature + surfaces, program cache
    kernels/   every device graph: inference (prefill, decode, int8) and training (forward, dx)
    generate/  runners, the device pipeline, prefill + KV-cache decode, sampling
    serve/     `anelm serve`: the OpenAI API over HTTP
    train/     training loop, CPU gradient side, optimizer, checkpoints, export
    quant/     `anelm quantize`: calibrate, quantize, score
    bench/     cost model and benchmarks
    doctor/    conformance suite that measures a chip
    cli/       `anelm ...`
    api.py     the Python API below: `load`, `generate`, `stream_generate`, `finetune`

The Python API, as `anelm` exports it (each imports what it needs when first called, so
`import anelm` stays light; docs/python-api.md has the details):

    model = anelm.load("model.gguf")                  # or an HF folder, a repo id, a RUN folder
    text = anelm.generate(model, "Once upon a time", max_tokens=32)
    for piece in anelm.stream_generate(model, [{"role": "user", "content": "Hi"}]):
        print(piece, end="")
    run = anelm.finetune("model.gguf", "examples/facts", steps=30)   # LoRA; returns the RUN folder
"""

import sys

from .caches import send_numba_caches_here

__version__ = "0.1.0"

send_numba_caches_here()  # before any module compiles a numba loop (see caches.py)

__all__ = ["load", "generate", "stream_generate", "finetune", "__version__"]
API = ("load", "stream_generate", "finetune")


def __getattr__(name: str):
    """The API's functions, from `anelm.api` (which imports what it needs when called)."""
    if name in API:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'anelm' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(API))


class _CallablePackage(type(sys)):
    """`anelm.generate` is the package anelm/generate/ and, called, `anelm.api.generate`: the
    import system binds a subpackage over any function of its parent's name at its first
    import, so the package itself answers the call (its `__init__` is a docstring: cheap)."""

    def __call__(self, model, prompt, **kwargs):
        from .api import generate

        return generate(model, prompt, **kwargs)


from . import generate  # noqa: E402  (the package; see _CallablePackage)

generate.__class__ = _CallablePackage
