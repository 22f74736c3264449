"""Generation, the host side: the Runner interface (`runner.py`: the device pipeline, else the
CPU reference), the device pipeline (`pipeline.py`, with its program sizes and KV cache in
`device_plan.py`) that runs the kernels of `anelm/kernels/`, sampling options and samplers
(`sampling.py`), the prefill + KV-cache decode loop and its stream of deltas (`generate.py`),
JSON output by constrained decoding (`constrain.py`), a loaded model ready to answer
(`engine.py`), conversations and their reusable caches (`chat.py`) and perplexity
(`perplexity.py`)."""
