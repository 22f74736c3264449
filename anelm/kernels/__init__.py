"""Every device graph, inference and training alike.

- `layers.py`: the layer library of the inference kernels (shape, folded weights, norm,
  projections, RoPE, attention, MLP, residual); `norms.py` the scaled norms; `attention.py`
  the causal mask and head layout that inference and training share.
- `prefill.py`, `decode.py`: the generation kernels; `blocks.py` whole layers for `anelm compile`;
  `int8.py` int8 linears (`QLinear` as MIL) and the int8 layers of a quantized model.
- `training.py`, `training_attn.py`: the ten forward and dx kernels of a training step.

I/O widths follow the profile's `spatial_multiple_of` (16 in `strict`): decode runs its token
in column 0 of 16, prefill buckets are multiples of 16, and training pads each sequence (and
each packed input) to the multiple with zero columns the results do not depend on.

The host side (running them, caches, sampling; data, loop, optimizer) is in `generate/` and
`train/`. HF weight names come from `anelm.models.names`, RoPE tables from `anelm.models.layers`;
kernels import ir and models, and are compiled by their callers.
"""
