"""`anelm quantize`, the tool (docs/quantization.md): calibrate a model on text, quantize its linears
to int8 per output channel (W8), optionally with int8 activations at static per-tensor scales
(W8A8), write the quantized folder, score both models and report. It sits above `train/`
(it publishes the folder as `anelm export` does) and `generate/` (it scores with perplexity).

    calibrate.py  activation ranges of every linear input, from the CPU reference
    command.py    `anelm quantize`: calibrate, quantize, score, write, report

The weight format (rows, the folder, reading it back) is `anelm/models/formats/quantized.py`; the int8
kernels (`QLinear` as MIL) are `anelm/kernels/qlinear.py`; the emulator's int8 arithmetic is
`anelm/device/emulator/int8.py`.
"""
