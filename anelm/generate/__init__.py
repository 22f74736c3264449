"""Generation: the Runner interface (`runner.py`), samplers (`sampling.py`) and the
prefill + KV-cache decode loop (`generate.py`)."""
