"""INT8 on the ANE (CONTRACTS §10): per-output-channel int8 weights (W8), optionally with int8
activations at static per-tensor scales (W8A8).

    core.py       per-row symmetric quantization; QLinear, a kernel's int8 linear
    graph.py      a QLinear as MIL: constexpr_affine_dequantize weights, quantize/dequantize inputs
    fold.py       norm gains kept out of the int8 matrices, applied to the kernels' inputs
    calibrate.py  activation ranges of every linear input, from the CPU reference
    folder.py     the quantized folder: write, read, recognise, refuse
    command.py    `anelm quantize`: calibrate, quantize, score, write, report
The emulator's int8 arithmetic is in anelm/device/emulator_int8.py.
"""
