"""Model configs, architectures, weight loading and tokenizers.

One file per architecture, named by its HF `model_type` (`gpt2.py`, `llama.py`, `qwen3.py`),
each exporting `Config`, `Model`, `expected_shapes(config)`, `sanitize(weights, config)` and
`build(config, weights)`. `loading.load_model(path)` reads HF, RUN and llama2.c checkpoints;
`tokenizer.load_tokenizer(path)` reads the tokenizer files.
"""
