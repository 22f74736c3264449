"""Training, the host side.

- `data/`: text, token files and chat/completion JSONL to batches (corpora, examples, packing);
- the run: its settings and setup (`settings.py`, `run.py`, `presets.py`, `init.py`), the loop
  (`loop.py`) with its optimizer, schedule and loss scaler, metrics, checkpoints and export;
- `steps/`: the step split between device and CPU, one per layer family (`llama.py`,
  `gemma.py`, `gpt2.py`) and LoRA (`lora.py`), the head wherever it runs, the CPU ops and dW
  GEMMs; the kernels are `anelm/kernels/training.py`, run by `kernels_bank.py` and
  `pipeline_static.py`;
- `distributed/`: data-parallel training on torch.distributed.
HF names come from `anelm.models.names`.
"""
