"""Model configs, architectures, weight loading and tokenizers.

One file per architecture, named by its HF `model_type` (`gpt2.py`, `llama.py`, `qwen3.py`),
each exporting `Config`, `Model`, `expected_shapes(config)`, `sanitize(weights, config)` (an
HF checkpoint to ours), `unsanitize` (its inverse, for export) and `build(config, weights)`.
`loading.load_model(path)` reads HF, RUN, llama2.c and GGUF checkpoints (`gguf.py`, with the
tokenizer from its metadata, `tokenizer_gguf.py`); `tokenizer.load_tokenizer(path)` reads the
tokenizer files.
"""
