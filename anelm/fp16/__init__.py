"""fp16 numerics, host and emulator alike: the one place values meet fp16's grid and range.

- `bits.py`: float32 <-> fp16 bit patterns (`to_half`, `from_half`, `fold_to_half`), what MIL
  blobs, weights and the runtime's surfaces hold, bit for bit numpy's casts at memory speed;
- `grid.py`: fp16 values kept in float32 arrays (`round_fp16`, `write_fp16_columns`), the
  emulator's working representation and the host's copies of device outputs;
- here: fp16's range, and the clamp the trainer applies where CPU activations cross into
  device surfaces (a finite ±65504 instead of inf, which one bad step would spread).
"""

from __future__ import annotations

import numpy as np

FP16_MAX = 65504.0  # the largest finite fp16 value


def clamp_fp16(x: np.ndarray) -> np.ndarray:
    """Clamp to ±65504 where CPU activations cross into fp16 device surfaces (inf → finite)."""
    return np.clip(x, -FP16_MAX, FP16_MAX)
