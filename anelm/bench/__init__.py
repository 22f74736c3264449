"""`anelm bench`: a cost model of the ANE and the CPU side, and benchmarks that measure beside it.
The chips' constants and one program's time on a chip live below, in `anelm/chip/` (catalog.py,
cost.py), where generation reads them too.

    programs.py   the programs a benchmark, a training step or a decode runs, compiled on the host
    step_model.py predicted training step: device kernels + CPU side, overlapped as the trainer does
    gen_model.py  predicted prefill and decode
    reference.py  the published programs as reference configurations, and `validate`
    measure.py    the emulator (or the ANE) timed on the same programs
    baseline.py   --save-baseline / --baseline
    plots.py      the sram and roofline PNGs

The model knows only what the compiled programs and the data file tell it; docs/cost-model.md
says what it does not know. Measurements against PyTorch and HF on the same machine are the
other half of the story, in the repository's `benchmarks/` scripts (docs/benchmarks.md).
"""
