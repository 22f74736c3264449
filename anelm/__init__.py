"""anelm: train and run language models on the Apple Neural Engine, or on its emulator.

Data flow, one package per stage, in import order (a package imports only from those above it
in this list; `tests/test_import_order.py` checks it, the README's architecture section says why):
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
    train/     training loop, CPU gradient side, optimizer, checkpoints, export
    quant/     `anelm quantize`: calibrate, quantize, score
    bench/     cost model and benchmarks
    doctor/    conformance suite that measures a chip
    cli/       `anelm ...`
"""

from .caches import send_numba_caches_here

__version__ = "0.1.0"

send_numba_caches_here()  # before any module compiles a numba loop (see caches.py)
