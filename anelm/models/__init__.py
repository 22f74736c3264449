"""Model configs, architectures, weight loading and tokenizers.

One file per architecture, named by its HF `model_type` (`gpt2.py`, `llama.py`, `qwen3.py`),
each exporting `Config`, `Model`, `expected_shapes(config)`, `sanitize(weights, config)` (an
HF checkpoint to ours), `unsanitize` (its inverse, for export) and `build(config, weights)`.
`loading.load_model(path)` reads HF, RUN, llama2.c, GGUF and quantized checkpoints, whose
file formats are in `formats/` (`safetensors_io.py`, `gguf.py`, `llama2c.py`, `quantized.py`,
`peft.py` for adapters); `tokenizer.load_tokenizer(path)` reads the tokenizer files, with the
backends in `tokenizer/` (HF `tokenizers`, SentencePiece and llama2.c, GGUF metadata).

The rest of the package asks here for what an architecture is: HF module and weight names by
role (`names.py`), the CPU building blocks and RoPE tables (`layers.py`), and safetensors
files (`formats/safetensors_io.py`, the one reader and writer). Models import nothing of anelm but
errors and atomic: no graph of the device is built here.
"""
