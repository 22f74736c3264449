"""Devices: one interface (`base.py`) for the ANE emulator (`emulator*.py`) and the real ANE
(`ane.py` over `ane_framework.py` and `objc.py`), chosen by `select.get_device` (`--device`),
with the ANE's self-test (`selftest.py`) run through the child-process runner (`isolate.py`),
fp16 helpers (`fp16.py`), overflow diagnostics (`overflow.py`) and the host machine's facts
(`machine.py`). Devices run MIL text: they import mil, ir and chip, never the compiler, the
runtime or the kernels.
"""
