"""Devices: one interface (`base.py`) for the ANE emulator (`emulator/`) and the real ANE
(`ane/`: the device over `framework.py` and `objc.py`, and its self-test `selftest.py`, run
through the child-process runner `isolate.py`), chosen by `select.get_device` (`--device`),
overflow diagnostics (`overflow.py`) and the host machine's facts
(`machine.py`). Devices run MIL text: they import mil, ir and chip, never the compiler, the
runtime or the kernels.
"""
