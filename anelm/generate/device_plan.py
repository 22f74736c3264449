"""Sizes of the device pipeline's programs, within the compile budget, and its KV cache.

Programs are compiled per layer (each layer's weights are consts baked into its program, so
layers cannot share one), lazily, the first time a size is needed:

    prefill buckets  P: a prompt of n tokens runs padded to the smallest bucket >= n
    decode tiers     D: a token at position p reads a cache input of the smallest tier > p

Both are I/O widths, so each is a multiple of the profile's `spatial_multiple_of` (16 in
`strict`, §2.10: every ladder below already is; a context that is not gets a last tier rounded
up, its extra positions masked like any unused slot). A process that uses every size compiles
L × (|P| + |D|) programs, and one generation
compiles L × (prefill buckets used + decode tiers used). The budget is 115 cold compiles per
process in `strict` (§2.7: libane stops there; the private compiler fails silently, then
crashes, near 119), of which RESERVE are left to whatever else the process compiles:

    L × (|P| + |D|) <= budget − RESERVE

GPT-2 124M (L = 12, context 1024): P = 16, 64, 256, 1024 and D = 64, 128, 256, 1024 give
12 × 8 = 96 <= 107, a margin of 19 under the budget (23 under the failures); a generation
from a short prompt to position ~100 compiles 12 × (1 + 2) = 36. Programs aned already holds
(`compiledModelExists`) are loaded, not compiled, so a second run costs less. Deeper models get fewer sizes (`plan_sizes`: a ladder is thinned where
neighbouring sizes are closest, and the largest of each always stays): Qwen3-0.6B (L = 28,
context capped at 4096) gets P = 16, 1024 and D = 4096, 84 compiles at most (a margin of 31).
SmolLM2-135M (L = 30) gets the same sizes, 90 compiles at most (a margin of 25). The kernels
that hold a real model's activations (kernels/norms.py, the scaled residual stream) keep one
program per layer and size, so they cost no compiles; a design that split each layer into two
programs would leave (115 − 8) // 60 = 1 size per layer kind, no decode tier besides prefill.

Why tiers rather than one decode program per layer at the full context (which would compile
L × (buckets used + 1)): a decode program reads its whole cache input every step, whatever
the position. On the emulator that is an fp16 -> fp32 conversion of 2 × C × T values per layer
and token; GPT-2 at T = 1024 spends ~60 ms per token on it, at T = 128 ~7 ms, against ~45 ms
for all the rest of the token. The price is up to |D| − 1 extra compiles per layer.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..chip.profile import padded_width
from ..errors import DeviceError

RESERVE = 8  # compiles left for other kernels of the same process
PREFILL_MIN = 16  # smallest bucket: a short prompt costs one 16-column pass
PREFILL_MAX = 1024  # [H, S, S] scores: 12 heads × 1024² × 2 B = 24 MiB, past every chip's measured
# working-set threshold (profile.SRAM_BYTES), so large buckets run slower per FLOP; still far
# cheaper than decoding a long prompt token by token
DECODE_MIN = 64  # smallest cache tier
MAX_CONTEXT = 4096  # default cap on the device context: cache inputs are C × T × 2 bytes each


def generation_context(positions: int) -> int:
    """The device context a one-shot generation of `positions` positions (prompt + new tokens)
    asks for: the next power of two from DECODE_MIN, so decode reads a cache the size of the
    job rather than the model's whole context (llama.cpp and mlx-lm attend only to the cells in
    use), and runs of similar length share program sizes, hence kernel-cache entries. At most
    MAX_CONTEXT, the default cap."""
    return min(MAX_CONTEXT, 1 << max(DECODE_MIN.bit_length() - 1, (max(positions, 1) - 1).bit_length()))


def ladder(lo: int, hi: int) -> list[int]:
    """lo, 2·lo, 4·lo, ... below hi, then hi itself."""
    sizes, s = [], lo
    while s < hi:
        sizes.append(s)
        s *= 2
    return sizes + [hi]


def thin(sizes: list[int]) -> list[int]:
    """Drop the inner size whose neighbours are closest (ties: the larger one)."""
    if len(sizes) <= 1:
        return sizes
    if len(sizes) == 2:
        return sizes[1:]
    _, i = min((sizes[i + 1] / sizes[i - 1], -i) for i in range(1, len(sizes) - 1))
    return sizes[:-i] + sizes[-i + 1:]  # i is the negated index of the dropped size


@dataclass(frozen=True)
class SizePlan:
    prefill: tuple[int, ...]  # buckets, ascending
    decode: tuple[int, ...]  # cache tiers, ascending; the last holds the context
    layers: int
    context: int  # positions a cache holds (the last tier may be wider: a spatial multiple)

    @property
    def max_compiles(self) -> int:
        return self.layers * (len(self.prefill) + len(self.decode))

    def bucket(self, n: int) -> int:
        """The prefill bucket for n tokens; n <= prefill[-1]."""
        return next(b for b in self.prefill if b >= n)

    def tier(self, position: int) -> int:
        """The cache tier for a token at `position`: it reads `position` past keys and writes one."""
        return next(t for t in self.decode if t > position)


def plan_sizes(layers: int, context: int, budget: int, multiple: int = 1) -> SizePlan:
    """Buckets and tiers for a model of `layers` layers and `context` positions within `budget`,
    each a multiple of `multiple` (the profile's spatial_multiple_of: they are I/O widths)."""
    slots = (budget - RESERVE) // layers if budget > RESERVE else 0
    if slots < 2:
        raise DeviceError(f"a {layers}-layer model needs at least {2 * layers} compiles (a prefill and a "
                          f"decode program per layer); the compile budget allows {max(budget - RESERVE, 0)}")
    prefill = ladder(min(PREFILL_MIN, context), min(PREFILL_MAX, context))
    decode = ladder(min(DECODE_MIN, context), context)
    while len(prefill) + len(decode) > slots:
        # Thin the longer ladder, prefill on ties (decode tiers set the cost of every token), but
        # keep a small bucket while decode can give: padding multiplies a short prompt's work.
        if len(decode) > 1 and (len(prefill) <= 2 or len(decode) > len(prefill)):
            decode = thin(decode)
        else:
            prefill = thin(prefill)
    fit = lambda sizes: tuple(sorted({padded_width(n, multiple) for n in sizes}))  # noqa: E731
    return SizePlan(fit(prefill), fit(decode), layers, context)


class DeviceCache:
    """Keys and values of every layer, fp16 `[L, C, W]` (`[1, C, 1, W]` per layer as the
    kernels read them), W grown to the decode tier in use so a layer's slice is one block.

    A sliding-window layer (`rings[layer]` = R, its window rounded up to the spatial multiple)
    keeps a ring: position p in column p mod R, so its decode programs read R columns at most,
    whatever the position (Gemma 3's local layers: 512 of a 4096-position context). Attention
    is over a set of keys, so their order in the ring changes nothing; `kernels.decode.decode_mask`
    hides the columns outside the window.

    While decoding, each layer also has a request of its decode program (`Kernel.request`)
    whose input surfaces hold that layer's cache for the tier in use: filled once when the tier
    is entered, then one column per token (`put`), instead of the whole cache written into the
    surfaces every step (on the emulator that copy was a quarter of a SmolLM2 token).

    `length` counts the positions stored; prefill and decode write at `length`, then advance.
    """

    def __init__(self, layers: int, channels: int, capacity: int, dtype=np.float16,
                 rings: tuple[int | None, ...] | None = None):
        self.length, self.capacity = 0, capacity
        self.k = np.zeros((layers, channels, 0), dtype)
        self.v = np.zeros_like(self.k)
        self.rings = tuple(rings) if rings is not None else (None,) * layers
        self._requests: dict[int, tuple[int, Any]] = {}  # layer -> (width, request)
        weakref.finalize(self, _close_requests, self._requests)

    def columns(self, layer: int, tier: int) -> int:
        """The columns layer `layer`'s decode program reads at `tier`: the tier, or its ring."""
        ring = self.rings[layer]
        return tier if ring is None else min(tier, ring)

    def slot(self, layer: int, position):
        """The column that holds `position` (an int or an array of them) in layer `layer`."""
        ring = self.rings[layer]
        return position if ring is None else position % ring

    def fill(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store positions 0..n-1 (k, v `[C, n]`, a prefill's) of a layer: a ring keeps the last R."""
        n, ring = k.shape[1], self.rings[layer]
        kept = np.arange(n) if ring is None else np.arange(max(0, n - ring), n)
        cols = self.slot(layer, kept)  # positions -> columns (mod R in a ring)
        self.k[layer][:, cols], self.v[layer][:, cols] = k[:, kept], v[:, kept]

    @property
    def width(self) -> int:
        return self.k.shape[2]

    def reserve(self, width: int) -> None:
        """Make room for `width` positions (exactly: the decode inputs are W-wide slices)."""
        if width > self.width:
            self.k, self.v = (_widened(a, width) for a in (self.k, self.v))

    def request(self, layer: int, kernel: Any, width: int, heads: tuple[int, ...]) -> Any:
        """The request of `kernel` (layer's decode program reading `width` columns) holding this
        layer's cache in its `k_cache`/`v_cache` surfaces, shaped `heads`."""
        held = self._requests.get(layer)
        if held is not None and held[0] == width and held[1].kernel is kernel:
            return held[1]
        if held is not None:
            held[1].close()
        req = kernel.request()
        req.write("k_cache", self.k[layer, :, :width].reshape(heads), exact=True)
        req.write("v_cache", self.v[layer, :, :width].reshape(heads), exact=True)
        self._requests[layer] = (width, req)
        return req

    def put(self, layer: int, position: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store one position's keys and values (`[Hkv, 1, Dh, 1]`, fp16 values) of a layer,
        in the host arrays and in the layer's request surfaces."""
        position = self.slot(layer, position)
        self.k[layer, :, position] = k.reshape(-1)  # [Hkv, 1, Dh, 1] -> [C]
        self.v[layer, :, position] = v.reshape(-1)
        held = self._requests.get(layer)
        if held is not None:
            column = slice(position, position + 1)
            held[1].write("k_cache", k, columns=column, exact=True)
            held[1].write("v_cache", v, columns=column, exact=True)

    def advance(self, n: int) -> None:
        self.length += n


def _widened(a: np.ndarray, width: int) -> np.ndarray:
    """a `[L, C, W]` with zero columns up to `width`. Not np.pad, which writes every zero:
    np.zeros maps untouched pages, so a 4096-position cache costs only the columns filled."""
    out = np.zeros(a.shape[:2] + (width,), a.dtype)
    out[:, :, :a.shape[2]] = a
    return out


def _close_requests(requests: dict) -> None:
    for _, req in requests.values():
        req.close()
    requests.clear()


def ring_size(window: int | None, multiple: int) -> int | None:
    """The ring of a layer with a sliding `window` (its columns are I/O widths: a multiple)."""
    return None if window is None else padded_width(window, multiple)
