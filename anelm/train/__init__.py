"""Training, the host side: data and corpora (`data.py`, `corpus.py`), the run's settings and
setup (`settings.py`, `run.py`, `presets.py`, `init.py`), the loop (`loop.py`) with its
optimizer, schedule and loss scaler, the step split between device and CPU (`step.py`, whose
kernels are `anelm/kernels/training.py`, run by `kernels_bank.py` and `pipeline_static.py`;
its CPU half is `cpu_ops.py`), metrics, checkpoints, export and data-parallel training
(`distributed.py`, `dist_*.py`). HF names come from `anelm.models.names`.
"""
