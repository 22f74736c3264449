"""anelm: train and run language models on the Apple Neural Engine, or on its emulator.

Data flow, one package per stage:
    ir/        typed SSA graph, op table, builder
    compiler/  passes (validation, rewrites) and the pipeline that orders them
    mil/       MIL program model, text printer and parser, BLOBFILE weights, codegen
    device/    Device interface, chip profiles, ANE emulator, real ANE backend
    runtime/   Kernel: compiled program + signature + surfaces, program cache
    kernels/   transformer building blocks written with the builder
    models/    configs and architectures, weight loading, tokenizers
    generate/  prefill + KV-cache decode, sampling
    train/     training loop, CPU gradient side, optimizer, checkpoints
    cli/       `anelm ...`
"""

from .caches import send_numba_caches_here

__version__ = "0.1.0"

send_numba_caches_here()  # before any module compiles a numba loop (see caches.py)
