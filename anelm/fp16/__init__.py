"""fp16 numerics, host and emulator alike: the one place values meet fp16's grid and range.

- `bits.py`: float32 <-> fp16 bit patterns (`to_half`, `from_half`, `fold_to_half`), what MIL
  blobs, weights and the runtime's surfaces hold, bit for bit numpy's casts at memory speed;
- `grid.py`: fp16 values kept in float32 arrays (`round_fp16`, `write_fp16_columns`), the
  emulator's working representation and the host's copies of device outputs;
- here: fp16's range. Conversions that `saturate` turn values past it into ±65504 rather than
  inf, in the conversion's own pass: how the trainer's float32 activations enter device surfaces
  (one inf would spread through the step).
"""

from __future__ import annotations

FP16_MAX = 65504.0  # the largest finite fp16 value
