"""Sizes of the device pipeline's programs, within the compile budget, and its KV cache.

Programs are compiled per layer (each layer's weights are consts baked into its program, so
layers cannot share one), lazily, the first time a size is needed:

    prefill buckets  P: a prompt of n tokens runs padded to a bucket >= n, or in a smaller
                        bucket with the tokens past it decoded (`choose_bucket`)
    decode tiers     D: a token at position p reads a cache input of the smallest tier > p

Both are I/O widths, so each is a multiple of the profile's `spatial_multiple_of` (16 in
`strict`, docs/chip-profiles.md: every ladder below already is; a context that is not gets a last tier rounded
up, its extra positions masked like any unused slot). A process that uses every size compiles
L × (|P| + |D|) programs, and one generation
compiles L × (prefill buckets used + decode tiers used). The budget is 115 cold compiles per
process in `strict` (docs/chip-profiles.md; libane stops there; the private compiler fails silently, then
crashes, near 119), of which RESERVE are left to whatever else the process compiles:

    L × (|P| + |D|) <= budget − RESERVE

GPT-2 124M (L = 12, context 1024): P = 16, 64, 256, 1024 and D = 64, 128, 256, 1024 give
12 × 8 = 96 <= 107, a margin of 19 under the budget (23 under the failures); a generation
from a short prompt to position ~100 compiles 12 × (1 + 2) = 36. Programs aned already holds
(`compiledModelExists`) are loaded, not compiled, so a second run costs less. Deeper models get fewer sizes (`plan_sizes`: a ladder is thinned where
neighbouring sizes are closest, and the largest of each always stays): Qwen3-0.6B (L = 28,
context capped at 4096) gets P = 16, 1024 and D = 4096, 84 compiles at most (a margin of 31).
SmolLM2-135M (L = 30) gets the same sizes, 90 compiles at most (a margin of 25).

|P| counts slots, not sizes: the largest bucket always holds one, and the others take one of
the slot sizes (16, 32, 48, 64, 96, 128, ...: `slot_sizes`) when a prompt first asks for it, so
a one-shot generation's prompt runs in the size that fits it best (SmolLM2 on the emulator: 32
tokens in 32 columns, 108 ms, not 128 columns, 400 ms), and a server's are chosen for every
prompt length (`serving_buckets`). Once the slots are taken, a prompt much shorter than its
bucket may run a smaller bucket and decode the rest, a token a step or up to 16 in two passes of
the decode programs (`decode_groups`): the predicted times decide (the chip's on the ANE, the
emulator's own when it is the device: `evaluation_seconds`). SmolLM2 at a context of 512 on the
emulator: a 37-token prompt in buckets (16, 512) takes 16 columns and 21 decode steps, ~0.5 s,
not 512 columns, ~2 s; predicted on an M4 the 512 bucket wins (87 ms against 4.8 + 21 × 6.8).
(`serving_buckets` counts the rest in steps: a chunk's saving is left out of its choice.) The kernels
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

import functools
import itertools
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Collection

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


def slot_sizes(lo: int, hi: int) -> list[int]:
    """The sizes a prefill slot may take: the ladder and the points halfway up each of its
    steps (1.5x), so a prompt pads by at most a third (a chat prompt of 35-40 tokens runs 48
    columns, not 64)."""
    steps = ladder(lo, hi)
    return sorted(set(steps) | {s * 3 // 2 for s in steps if s * 3 // 2 < hi})


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
    prefill: tuple[int, ...]  # buckets, ascending: one per prefill slot; the last, the largest, always
    decode: tuple[int, ...]  # cache tiers, ascending; the last holds the context
    layers: int
    context: int  # positions a cache holds (the last tier may be wider: a spatial multiple)
    ladder: tuple[int, ...] = ()  # every size a prefill slot may hold (`choose_bucket`); () = prefill

    @property
    def max_compiles(self) -> int:
        return self.layers * (len(self.prefill) + len(self.decode))

    @property
    def sizes(self) -> tuple[int, ...]:
        return self.ladder or self.prefill

    def bucket(self, n: int) -> int:
        """The smallest of the plan's own buckets that holds n tokens; n <= prefill[-1]."""
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
    every = slot_sizes(min(PREFILL_MIN, context), min(PREFILL_MAX, context))
    decode = ladder(min(DECODE_MIN, context), context)
    while len(prefill) + len(decode) > slots:
        # Thin the longer ladder, prefill on ties (decode tiers set the cost of every token), but
        # keep a small bucket while decode can give: padding multiplies a short prompt's work.
        if len(decode) > 1 and (len(prefill) <= 2 or len(decode) > len(prefill)):
            decode = thin(decode)
        else:
            prefill = thin(prefill)
    fit = lambda sizes: tuple(sorted({padded_width(n, multiple) for n in sizes}))  # noqa: E731
    return SizePlan(fit(prefill), fit(decode), layers, context, fit(every))


Seconds = Callable[[str, int], float]  # predicted seconds of one pass: ("prefill", bucket) or ("decode", tier)


def decode_groups(start: int, stop: int, plan: SizePlan, seconds: Seconds, chunk: int = 1) -> list[int]:
    """How positions start..stop-1 run after a prefill bucket or a held prefix: in order, groups
    of one decode step each, or of up to `chunk` tokens in two passes of every column of their
    tier's programs (`DevicePasses._decode_hidden`) where those are predicted cheaper (two whole
    passes: on the emulator the first runs only the steps the keys need, so less than that)."""
    groups, p = [], start
    stop = min(stop, plan.decode[-1])  # no position past the last tier (a test's longer prompt)
    while p < stop:
        k = min(chunk, stop - p)
        tier = plan.tier(p + k - 1)
        k = k if k > 1 and 2 * seconds("chunk", tier) < k * seconds("decode", tier) else 1
        groups.append(k)
        p += k
    return groups


def decode_seconds(start: int, stop: int, plan: SizePlan, seconds: Seconds, chunk: int = 1) -> float:
    """Predicted seconds of positions start..stop-1 run as `decode_groups` runs them."""
    total, p = 0.0, start
    for k in decode_groups(start, stop, plan, seconds, chunk):
        total += 2 * seconds("chunk", plan.tier(p + k - 1)) if k > 1 else seconds("decode", plan.tier(p))
        p += k
    return total


def bucket_options(n: int, plan: SizePlan, bound: Collection[int]) -> list[int]:
    """The buckets a prompt of n tokens may prefill with: the largest, those bound to a slot
    so far, and while a slot is free every ladder size; of those that hold n, only the
    smallest (the others are the same tokens in more columns)."""
    sizes = set(bound) | {plan.prefill[-1]}
    if len(sizes) < len(plan.prefill):
        sizes |= set(plan.sizes)
    fits = min((b for b in sizes if b >= n), default=None)
    return sorted(b for b in sizes if b < n or b == fits)


def choose_bucket(n: int, plan: SizePlan, bound: Collection[int], seconds: Seconds, chunk: int = 1) -> int:
    """The bucket a prompt of n tokens on an empty cache prefills with: of `bucket_options`,
    the one whose pass plus the decode steps of the tokens past it (prefill programs start at
    position 0) is predicted fastest; ties go to fewer decode steps, then the smaller bucket."""
    def cost(b: int) -> float:
        return seconds("prefill", b) + decode_seconds(min(n, b), n, plan, seconds, chunk)
    return min(bucket_options(n, plan, bound), key=lambda b: (cost(b), -min(n, b), b))


def resume_pays(n: int, held: int, plan: SizePlan, bound: Collection[int], seconds: Seconds, chunk: int = 1) -> bool:
    """Whether a cache holding a prompt's first `held` of n positions should be resumed (the
    rest decoded one by one: prefill programs start at position 0) rather than the whole prompt
    prefilled anew in `choose_bucket`'s bucket: a short shared prefix (a template's first
    line) saves less than the decode steps of a long new turn cost."""
    b = choose_bucket(n, plan, bound, seconds, chunk)
    anew = seconds("prefill", b) + decode_seconds(min(n, b), n, plan, seconds, chunk)
    return decode_seconds(held, n, plan, seconds, chunk) <= anew


def serving_buckets(plan: SizePlan, bound: Collection[int], seconds: Seconds) -> tuple[int, ...]:
    """Every prefill slot's bucket for a server (`DeviceRunner.warm` builds them all first):
    those bound already and the largest, and in the free slots the slot sizes that minimise
    the predicted first-token time of `choose_bucket`'s choice, averaged over prompt lengths
    1..context weighted 1/n (log-uniform: 10-20 tokens as likely as 100-200, the prior of a
    server that knows nothing of its prompts). SmolLM2 (3 slots per layer) at a context of
    512 gets buckets (64, 512) on the emulator, and (128, 512) predicted on an M4. (A prior
    from a chat template's least prompt, ~30 tokens, moves the emulator's to 192: prompts of
    65-512 tokens then outweigh the short ones that most first turns are.)"""
    fixed = sorted(set(bound) | {plan.prefill[-1]})
    spare = [b for b in plan.sizes if b not in fixed]
    free = min(len(plan.prefill) - len(fixed), len(spare))
    if free <= 0:
        return tuple(fixed)
    n = np.arange(1, plan.context + 1)
    steps = [seconds("decode", plan.tier(p)) for p in range(plan.context)]
    done = np.concatenate([[0.0], np.cumsum(steps)])  # done[k]: decode steps at positions 0..k-1

    def mean_first_token(buckets: list[int]) -> float:
        best, below = np.full(len(n), np.inf), 0
        for b in sorted(buckets):  # n > below: b is an option (it holds n and no smaller bucket does, or b < n)
            cost = seconds("prefill", b) + done[n] - done[np.minimum(n, b)]
            best = np.where(n > below, np.minimum(best, cost), best)
            below = b
        return float(best @ (1.0 / n) / np.sum(1.0 / n))
    chosen = min(itertools.combinations(spare, free), key=lambda c: (mean_first_token(fixed + list(c)), c))
    return tuple(sorted(fixed + list(chosen)))


def evaluation_seconds(artifact: Any, device: str, fraction: float = 1.0) -> float:
    """Predicted seconds of one evaluation of a compiled program, from its cost annotation:
    when the emulator is the device, the emulator's own time (`device.emulator_cost`, fitted to
    what it measures; `fraction`: the share of its columns it evaluates); on the ANE the chip's
    (`chip.cost.eval_time` on this machine's chip, M4 elsewhere, plus the host's surface I/O).
    0 for a program without an annotation."""
    cost = (getattr(artifact, "meta", None) or {}).get("cost")
    if not cost:
        return 0.0
    if device == "emulator":
        from ..device.emulator.cost import emulated_seconds

        return emulated_seconds(cost, fraction)
    from ..chip.cost import KernelCost, eval_time, host_io_time

    k, chip = KernelCost.of(artifact), machine_chip()
    return eval_time(k, chip).total_s + host_io_time(k, chip)


@functools.lru_cache(maxsize=1)
def machine_chip() -> Any:
    """This Mac's chip in the cost model's table (`anelm bench --chips`), else its default (M4)."""
    from ..chip.catalog import chip_names, get_chip
    from ..device.machine import collect

    family = (collect().family or "").lower()
    return get_chip(family if family in chip_names() else None)


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
