"""The op table with every op of the project's MIL: `op_table`'s machinery, filled by the
ops_* modules, each of which `define`s its family of ops when imported (op_table.py's module
doc says what an entry holds)."""

from __future__ import annotations

from . import ops_elementwise, ops_linear, ops_quant, ops_reduce, ops_shape  # noqa: F401 - they register
from .op_table import OP_TABLE, REQUIRED, OpDef, define, full_params, infer_node, raw_compute, register

__all__ = ["OP_TABLE", "REQUIRED", "OpDef", "define", "full_params", "infer_node", "raw_compute", "register"]
