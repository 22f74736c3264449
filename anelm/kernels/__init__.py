"""Every device graph, inference and training alike.

- `layers.py`: the layer library of the inference kernels (shape, folded weights, norm,
  projections, RoPE, attention, MLP, residual); `norms.py` the scaled norms; `attention.py`
  the causal mask and head layout that inference and training share.
- `families/`: one module per architecture family (`gpt2.py`: LayerNorm, biases, GELU, learned
  positions, fused q/k/v; `llama.py`: RMSNorm, RoPE, SwiGLU, GQA, Qwen3's q/k norms) saying how
  its layers differ: the norm, the MLP graph, rotary or not, where each parameter is, the LoRA
  slots. `LayerShape.family` carries it, and the library asks it instead of the model type.
- `prefill.py`, `decode.py`: the generation kernels; `blocks.py` whole layers for `anelm compile`;
  `qlinear.py` quantized linears (`QLinear` as MIL); `int8.py` the layers of a quantized model.
- `training.py`, `training_attn.py`: the ten forward and dx kernels of a training step.

I/O widths follow the profile's `spatial_multiple_of` (16 in `strict`): decode runs its token
in column 0 of 16, prefill buckets are multiples of 16, and training pads each sequence (and
each packed input) to the multiple with zero columns the results do not depend on.

The host side (running them, caches, sampling; data, loop, optimizer) is in `generate/` and
`train/`. HF weight names come from `anelm.models.names` (the families ask it by role), RoPE
tables from `anelm.models.layers`; kernels import ir and models, and are compiled by their
callers. A new architecture is a `models/<model_type>.py` with its names, and a family here
(or membership of one: Qwen3 is a Llama).
"""
