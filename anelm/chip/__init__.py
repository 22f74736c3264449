"""What a chip does, as data: its profile (`profile.py`, JSON switches and limits), how a
request's surfaces bind and how big they are (`surfaces.py`), and the compile-time rules those
switches turn on (`rejects.py`: one table, one message per rule). The compiler avoids them, the
emulator enforces them, the doctor measures them; all three read them from here. `strict` puts
I/O widths in multiples of 16 (`spatial_multiple_of`).

What a chip costs, as data too: its constants and the published figures they come from
(`catalog.py`, anelm/data/ane_chips.json), and one evaluation of a compiled program as time on it
(`cost.py`): `anelm bench` predicts with them, generation picks its prefill sizes with them."""
