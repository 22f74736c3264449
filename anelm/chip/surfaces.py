"""How a request's surfaces bind and how big they are (alphabetical binding, uniform sizes per
direction, the 49,152-byte minimum surface; docs/chip-profiles.md): the one definition that the
compiler (signature sizes, io_naming), the runtime (allocations), the emulator (request
checks) and the doctor read.

A side is "inputs" or "outputs"; the two are judged apart.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from .profile import ChipProfile

T = TypeVar("T")


def alphabetical(profile: ChipProfile, side: str) -> bool:
    return profile.bind_inputs_alphabetically if side == "inputs" else profile.bind_outputs_alphabetically


def bind_order(items: Sequence[T], profile: ChipProfile, side: str,
               name: Callable[[T], str] = lambda x: x) -> list[T]:
    """`items` (declared order) in the order the surfaces bind to them: by MIL name where the
    profile binds alphabetically, else as declared."""
    return sorted(items, key=name) if alphabetical(profile, side) else list(items)


def uniform(profile: ChipProfile, side: str) -> bool:
    return profile.uniform_input_sizes if side == "inputs" else profile.uniform_output_sizes


def least_surface_bytes(profile: ChipProfile, nbytes: int) -> int:
    """The smallest allocation a tensor of `nbytes` packed bytes may have."""
    return max(nbytes, profile.min_surface_bytes)


def surface_sizes(nbytes: Sequence[int], profile: ChipProfile, side: str) -> list[int]:
    """The allocation of each surface of one side, for tensors of `nbytes` (or larger
    requests): each at least its tensor and the minimum; one shared size where uniform."""
    sizes = [least_surface_bytes(profile, n) for n in nbytes]
    return [max(sizes)] * len(sizes) if uniform(profile, side) and sizes else sizes
