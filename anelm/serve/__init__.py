"""`anelm serve`: an OpenAI-compatible HTTP server over one model on the device (docs/serving.md).

protocol (requests checked, responses built) -> worker (one device thread, a FIFO of jobs, the
prompt cache) -> server (HTTP, server-sent events, API key); respond turns deltas into bodies.
"""
