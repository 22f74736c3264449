"""What Orion's Stories trainer moves between its CPU arrays and the surfaces, counted from its
source (mechramc/Orion, kernels/training/stories_train.m, orion_train_step).

Orion keeps activations `[S, C]` row-major on the CPU, so every tensor that crosses a surface
goes through `io_write_transpose` / `io_read_transpose`: an fp32<->fp16 conversion of the whole
tensor (NEON, `orion_tensor_{read,write}_f32`) plus a scalar loop that transposes it element by
element and clamps it to ±65504. Orion reads back only the outputs it uses (its output surfaces
are padded to one size, but each read converts `channels·S` elements). Tensors that go from one
surface to another (`orion_tensor_copy_into`) are fp16 memcpys of channel ranges, no transpose.

The tables below list those tensors per layer and micro-step by their channels (d the model
width, f the FFN width, sc = heads·S for the attention probabilities and their gradient).
"""

from __future__ import annotations

# forward: write x into fwdAttn, read wo_out, write x2 into fwdFFN, read w2_out
FORWARD_TRANSPOSED = (("x", "d"), ("wo_out", "d"), ("x2", "d"), ("w2_out", "d"))
# backward: dy into ffnBwd; dx_ffn, dh1, dh3 out; rms2_out and gate for dW; dx2 into sdpaBwd1;
# rms1_out, dq, dk, dv, attn_out for dW; dx_attn out of qkvBwd
BACKWARD_TRANSPOSED = (("dy", "d"), ("dx_ffn", "d"), ("dh1", "f"), ("dh3", "f"), ("rms2_out", "d"),
                       ("gate", "f"), ("dx2", "d"), ("rms1_out", "d"), ("dq", "d"), ("dk", "d"),
                       ("dv", "d"), ("attn_out", "d"), ("dx_attn", "d"))
# surface to surface: h1, h3 into ffnBwd; q, k, v and dx2 (written transposed into a temporary
# surface first) into sdpaBwd1; probs, dp, q, k into sdpaBwd2; dq, dk, dv into qkvBwd
SURFACE_COPIES = (("h1", "f"), ("h3", "f"), ("q", "d"), ("k", "d"), ("v", "d"), ("dx2", "d"),
                  ("probs", "sc"), ("dp", "sc"), ("q", "d"), ("k", "d"), ("dq", "d"), ("dk", "d"), ("dv", "d"))

# bytes per element: the transposing loop reads and writes fp32 (8) on top of the conversion;
# charged as one more streaming pass, a lower bound (no source times a strided, clamping loop)
TRANSPOSE_PASS_BYTES = 8
SURFACE_COPY_BYTES = 4        # fp16 read + fp16 write


def _elements(tensors, d: int, f: int, heads: int, s: int) -> int:
    channels = {"d": d, "f": f, "sc": heads * s}
    return sum(channels[c] for _, c in tensors) * s


def transposed_elements(side: str, d: int, f: int, heads: int, s: int) -> int:
    """Elements one layer's `side` ("forward" or "backward") moves through transposing copies."""
    return _elements(FORWARD_TRANSPOSED if side == "forward" else BACKWARD_TRANSPOSED, d, f, heads, s)


def host_io_bytes(side: str, d: int, f: int, heads: int, s: int, conversion_bytes: int) -> int:
    """CPU bytes of one layer's surface traffic on `side`: each transposed element converted
    (`conversion_bytes`) and transposed, plus the backward's surface-to-surface copies."""
    moved = transposed_elements(side, d, f, heads, s) * (conversion_bytes + TRANSPOSE_PASS_BYTES)
    copies = _elements(SURFACE_COPIES, d, f, heads, s) * SURFACE_COPY_BYTES if side == "backward" else 0
    return moved + copies
