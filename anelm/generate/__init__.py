"""Generation, the host side: the Runner interface (`runner.py`: the device pipeline, else the
CPU reference), the device pipeline (`pipeline.py`, with its program sizes and KV cache in
`device_plan.py`) that runs the kernels of `anelm/kernels/`, samplers (`sampling.py`), the
prefill + KV-cache decode loop (`generate.py`) and perplexity (`perplexity.py`)."""
