"""The runtime: `Kernel` (`kernel.py`) runs an Artifact on a Device with numpy arrays in and
out (packed surfaces, binding order and sizes from chip/surfaces.py), the program cache that
keeps compiled programs by content (`cache.py`) and the work queue of the training step's
CPU side (`threads.py`).
"""
