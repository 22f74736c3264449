"""The device passes of `DeviceRunner` (pipeline.py): a prompt through every layer's prefill
program, and tokens through every layer's decode program, with the KV cache kept on the way.

Decode programs take several tokens at once as well as one (kernels/decode.py): a chunk of up to
the program's padded width runs in two passes where its tokens would take one each, which is
what the tokens a prefill bucket does not hold, and a resumed conversation's new turn, cost (the
emulator runs the first pass only as far as the keys and values: `Device.evaluate(only=...)`). A
chunk is as wide as every layer's cache allows: a ring must keep the window of the chunk's first
token while the chunk's own keys go in (`chunk_width`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..fp16.grid import round_fp16
from ..kernels.decode import decode_mask
from ..kernels.layers import rope_full_tables
from ..models.layers import rope_tables
from .device_plan import DeviceCache


def chunk_width(columns: int, windows: Sequence[int | None], rings: Sequence[int | None]) -> int:
    """The most tokens one decode pass may take: its columns, fewer where a layer's ring holds
    less than its window plus the chunk (a ring of exactly its window takes one token at a time)."""
    return min([columns] + [r - w + 1 for w, r in zip(windows, rings) if r is not None and w is not None])


class DevicePasses:
    """The passes of a DeviceRunner over its compiled programs (`_kernel`), layer by layer."""

    def _prefill_hidden(self, ids: np.ndarray, cache: DeviceCache, seq: int) -> np.ndarray:
        """Positions 0..n-1 through every layer's program of bucket `seq`; fills the cache; [n, D]."""
        n, d = len(ids), self.config.hidden_size
        cache.reserve(self.plan.tier(n - 1))  # room for n positions, in the tier decode reads next
        x = np.zeros((1, d, 1, seq), np.float32)
        x[0, :, 0, :n] = self.cpu.embed(ids, np.arange(n)).T / self.stream_scale  # [n, D] -> [D, n]
        x[..., n:] = x[..., n - 1:n]  # padding: the last token again (below)
        for i in range(len(self.layers)):
            lora = self.lora_inputs[i]
            out = self._kernel("prefill", i, seq).run({"x": x, **lora}, exact=(*lora, *(() if i == 0 else ("x",))))
            cache.fill(i, out["k"].reshape(-1, seq)[:, :n], out["v"].reshape(-1, seq)[:, :n])  # [Hkv,1,Dh,S] -> [C, n]
            x = out["y"]
            # Padding columns restart as copies of the last real column: causal attention keeps
            # them out of real rows, but a masked key's zero probability times an inf value is
            # NaN, so they must stay finite; zeros were not real inputs, and through Gemma's
            # post-norms they reached an int8 down projection's sum of ~127,000 (real ones: 808)
            x[..., n:] = x[..., n - 1:n]
        cache.advance(n)
        return x[0, :, 0, :n].T.astype(np.float32) * self.stream_scale  # [D, n] -> [n, D]

    def _decode_hidden(self, tokens: Sequence[int], cache: DeviceCache) -> np.ndarray:
        """Tokens at positions cache.length.. (at most `chunk_width`) through every layer; appends
        their K/V; [k, D]. One token is one pass of column 0 alone; several, two passes of every
        column (the first's keys and values into the cache, then each column sees those before it)."""
        k, pos, d, s = len(tokens), cache.length, self.config.hidden_size, self.shapes[0]
        tier = self.plan.tier(pos + k - 1)
        cache.reserve(tier)
        # the tokens in columns 0..k-1 of the padded width; one token's padding stays zeros (its
        # program evaluates column 0 alone), a chunk's repeats its last token (finite, as prefill's)
        x = np.zeros((1, d, 1, self.columns), np.float32)
        x[0, :, 0, :k] = self.cpu.embed(np.asarray(tokens), np.arange(pos, pos + k)).T / self.stream_scale
        if k > 1:
            x[..., k:] = x[..., k - 1:k]
        steps: dict[tuple, dict[str, np.ndarray]] = {}  # the step's inputs, made once per kind of layer
        for i in range(len(self.layers)):
            width = cache.columns(i, tier)  # a ring layer reads its ring, whatever the tier
            kind = (width, self.shapes[i].window, id(self.inv_freqs[i]))
            if kind not in steps:
                steps[kind] = self._step_inputs(pos, k, width, self.shapes[i].window, self.rings[i], self.inv_freqs[i])
            heads = (s.kv_heads, 1, s.head_dim, width)
            req = cache.request(i, self._kernel("decode", i, width), width, heads)
            for name, a in (steps[kind] | self.lora_inputs[i]).items():  # fp16 values already
                req.write(name, a, exact=True)
            req.write("x", x, exact=i > 0)
            out = req.run(batched=k > 1, only=("k_new", "v_new") if k > 1 else None)  # a chunk's keys first
            for j in range(k):  # column j: the token at pos + j
                cache.put(i, pos + j, out["k_new"][..., j:j + 1], out["v_new"][..., j:j + 1])
            if k > 1:  # the chunk's keys are in the cache now
                out = req.run(batched=True)
            x[..., :k] = out["y"][..., :k]  # the tokens go on; the padding stays as it was
            if k > 1:
                x[..., k:] = x[..., k - 1:k]
        cache.advance(k)
        return x[0, :, 0, :k].T.astype(np.float32) * self.stream_scale  # [1, D, 1, W] -> [k, D]

    def _step_inputs(self, pos: int, tokens: int, width: int, window: int | None, ring: int | None,
                     inv_freq: np.ndarray | None) -> dict:
        """A decode pass's mask and RoPE inputs for `tokens` tokens from `pos`, for layers of one
        width, window and RoPE base, as fp16."""
        step = {"mask": decode_mask(pos, width, window, ring, self.columns, tokens)}
        if inv_freq is not None:
            positions = pos + np.minimum(np.arange(self.columns), tokens - 1)  # padding: the last token's
            cos, sin = rope_full_tables(*rope_tables(positions, inv_freq))  # [1, 1, Dh, W]
            if tokens == 1:  # one token's padding columns are zeros, as they always were
                cos[..., 1:], sin[..., 1:] = 0.0, 0.0
            step.update(cos=cos, sin=sin)
        return {name: round_fp16(a) for name, a in step.items()}
