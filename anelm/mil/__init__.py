"""MIL as text and files: the program model (`program.py`), the printer (`text.py`), the
parser for both dialects in the wild (`parser.py`, `mil.lark`), BLOBFILE weights (`blob.py`)
and the `@model_path/` compile folder (`folder.py`). The lowest layer after errors/atomic:
it imports nothing else of anelm.
"""
