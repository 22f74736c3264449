"""The graph IR: a typed SSA graph in the ANE layout `[1, C, 1, S]` (`graph.py`), one op table
(`ops.py` and `ops_*.py`: shape and dtype inference, MIL spelling, float32 compute) and a
fluent builder (`builder.py`) with the composites the compiler and the kernels share. It
imports only mil (for tensor types).
"""
