"""LongRoPE on the device (Phi-3's long-context variants): the RoPE tables of the sequence being
run, as HF chooses them (`models/rope.py`): the short factors while a sequence holds at most
`original_max_position_embeddings` positions, the long ones for all of it past that, so the
step a sequence passes the original context runs the whole sequence again from position 0
(HF's generation drops its cache there; its pass over a longer sequence is the long factors'
from the start). The runner keeps each cache's token ids for that.

Decode programs take cos/sin as inputs, so they serve both; prefill programs hold their
tables, so a switch drops the prefill programs of the other factors (built again, or found in
the program store under their own recipe). A runner whose context stays within the original
context never switches: every sequence it can hold is short.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..models.layers import layer_inv_freqs
from .device_plan import DeviceCache, _close_requests


class LongRope:
    """A mixin of the device runner: `pipeline.LongRopeRunner` puts it before `DeviceRunner`."""

    def __init__(self, config: Any, *args, **kw):
        super().__init__(config, *args, **kw)
        long = config.at_length(self.plan.context)
        self.freqs = None if long is config else {False: self.inv_freqs, True: layer_inv_freqs(long)}
        self.original = config.rope_scaling["original_max_position_embeddings"]

    def prefill(self, ids: Sequence[int], cache: DeviceCache, last_only: bool = False) -> np.ndarray:
        ids = self.cpu._check_ids(ids, cache)
        if self.freqs is None:
            return super().prefill(ids, cache, last_only)
        n, held = len(ids), list(getattr(cache, "ids", []))[:cache.length]
        long = cache.length + n > self.original
        if long and 0 < cache.length <= self.original:  # passing it: the whole sequence, long
            ids, cache.length, held = np.concatenate([np.asarray(held, np.int64), ids]), 0, []
            _close_requests(cache._requests)  # their surfaces hold the short factors' keys
        if self.inv_freqs is not self.freqs[long]:
            self.inv_freqs = self.freqs[long]
            for key in [k for k in self.kernels if k[0] == "prefill"]:
                self.kernels.pop(key).close()
            self._arts = {k: a for k, a in self._arts.items() if k[0] != "prefill"}
        cache.ids = held + ids.tolist()
        logits = super().prefill(ids, cache, last_only)
        return logits if last_only else logits[-n:]

    def decode(self, token: int, cache: DeviceCache) -> np.ndarray:
        return self.prefill([token], cache)[0] if self.freqs is not None else super().decode(token, cache)
