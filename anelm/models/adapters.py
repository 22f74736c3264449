"""LoRA adapters: the spec, the targets, the tensors, PEFT's init and the merge.

An adapter adds `scale · B (A x)` to each targeted projection y = W x, with `scale = alpha / r`,
A float32 [r, in] and B float32 [out, r], exactly as PEFT stores `lora_A.weight` and
`lora_B.weight`. Tensors are keyed by the HF module path without `.weight`
("model.layers.3.self_attn.q_proj", "transformer.h.0.attn.c_attn"); GPT-2's fused `c_attn`
carries one pair for q, k and v together, as PEFT treats it. Weights here are ours, [out, in]
for every projection (GPT-2's Conv1D already turned by `gpt2.sanitize`), so `fan_in_fan_out`
only matters in the files (`adapters_peft.py`) and the merge is W += scale · B @ A for all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import UsageError
from .errors import AdapterError
from .names import DEFAULT_TARGETS, PROJECTIONS, module_name, target_names, target_roles, weight_name

ALL_LINEAR = "all-linear"


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = ()  # HF module names, as PEFT's target_modules: "q_proj", "c_attn"
    base: str = ""                 # base_model_name_or_path

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def resolve_targets(config, text: str | None) -> tuple[str, ...]:
    """`--targets` (comma-separated HF module names, or `all-linear`; None: the architecture's
    default) -> the target names in data-flow order. Unknown names: one usage line."""
    mt = config.model_type
    valid = target_names(mt)
    if text is None:
        return DEFAULT_TARGETS[mt]
    asked = [t.strip() for t in text.split(",") if t.strip()]
    if asked == [ALL_LINEAR]:
        return valid
    unknown = [t for t in asked if t not in valid]
    if unknown or not asked:
        what = f"unknown target module {unknown[0]!r}" if unknown else "no target modules"
        raise UsageError(f"--targets: {what} for a {mt} model: expected a comma-separated list of "
                         f"{', '.join(valid)}, or {ALL_LINEAR}")
    return tuple(t for t in valid if t in asked)


def target_modules(config, targets: tuple[str, ...]) -> dict[str, tuple[int, str]]:
    """HF module path -> (layer, role) of every projection `targets` covers, in layer order."""
    mt = config.model_type
    roles = [r for r in PROJECTIONS[mt] if any(r in target_roles(mt, t) for t in targets)]
    return {module_name(mt, i, role): (i, role) for i in range(config.num_hidden_layers) for role in roles}


def projection_shape(config, role: str) -> tuple[int, int]:
    """(out, in) of a layer's projection `role`, in our [out, in] orientation."""
    from .loading import architecture  # every layer of a base has the same projection shapes

    return tuple(architecture(config.model_type).expected_shapes(config)[weight_name(config.model_type, 0, role)])


def check_spec(config, spec: LoraSpec, source: str = "adapter") -> None:
    """A spec this base can take: known targets, 1 <= rank <= the narrowest targeted width,
    a finite alpha and a dropout in [0, 1)."""
    valid = target_names(config.model_type)
    bad = [t for t in spec.targets if t not in valid]
    if bad or not spec.targets:
        what = f"targets {bad[0]!r}, which the {config.model_type} base lacks" if bad else "targets nothing"
        raise AdapterError(f"{source}: {what}: expected target modules among {', '.join(valid)}")
    widths = {t: min(projection_shape(config, r)) for t in spec.targets for r in target_roles(config.model_type, t)}
    narrow = min(widths, key=widths.get)
    if not isinstance(spec.rank, int) or not 1 <= spec.rank <= widths[narrow]:
        raise AdapterError(f"{source}: rank {spec.rank!r} does not fit: expected 1 <= rank <= "
                           f"{widths[narrow]} (the width of {narrow})")
    if not math.isfinite(spec.alpha) or not 0 <= spec.dropout < 1:
        raise AdapterError(f"{source}: alpha {spec.alpha!r} and dropout {spec.dropout!r}: "
                           "expected a finite alpha and 0 <= dropout < 1")


@dataclass
class Adapter:
    """A LoRA adapter for one base: `tensors[module path] = (A [r, in], B [out, r])`."""

    spec: LoraSpec
    model_type: str
    tensors: dict[str, tuple[np.ndarray, np.ndarray]]

    @property
    def rank(self) -> int:
        return self.spec.rank

    def pair(self, layer: int, role: str) -> tuple[np.ndarray, np.ndarray] | None:
        """(A, B) on layer `layer`'s projection `role`, or None where the adapter has none."""
        return self.tensors.get(module_name(self.model_type, layer, role))

    def roles(self) -> tuple[str, ...]:
        """The roles the adapter targets, in data-flow order."""
        mt = self.model_type
        return tuple(r for r in PROJECTIONS[mt] if any(r in target_roles(mt, t) for t in self.spec.targets))

    def delta(self, module: str, x: np.ndarray) -> np.ndarray | None:
        """scale · B (A x) for x [T, in] on module `module`; None where the adapter has none."""
        ab = self.tensors.get(module)
        if ab is None:
            return None
        a, b = ab
        return (x @ a.T) @ (b.T * np.float32(self.spec.scale))


def check_fits(adapter: Adapter, config, source: str = "adapter") -> None:
    """Every tensor on a projection this base has, shaped for it: an adapter made for another
    base (other widths, more layers, another architecture) is one line here."""
    if adapter.model_type != config.model_type:
        raise AdapterError(f"{source}: an adapter for a {adapter.model_type} model: expected one for "
                           f"this {config.model_type} base")
    check_spec(config, adapter.spec, source)
    modules, r = target_modules(config, adapter.spec.targets), adapter.rank
    for path, (a, b) in adapter.tensors.items():
        if path not in modules:
            raise AdapterError(f"{source}: targets {path}, which this base lacks: expected "
                               f"{', '.join(adapter.spec.targets)} in layers 0..{config.num_hidden_layers - 1}")
        out, inp = projection_shape(config, modules[path][1])
        if np.shape(a) != (r, inp) or np.shape(b) != (out, r):
            raise AdapterError(f"{source}: {path} has lora_A {list(np.shape(a))} and lora_B {list(np.shape(b))}, "
                               f"expected [{r}, {inp}] and [{out}, {r}]: an adapter for another base?")


def init_adapter(config, spec: LoraSpec, seed: int = 0) -> Adapter:
    """A fresh adapter as PEFT initialises one: A Kaiming-uniform with a = sqrt(5) (bound
    1/sqrt(in), torch's `kaiming_uniform_` on [r, in]), B zero, so it starts as the base."""
    check_spec(config, spec, "--rank/--targets")
    rng = np.random.default_rng(seed)
    tensors = {}
    for path, (_, role) in target_modules(config, spec.targets).items():
        out, inp = projection_shape(config, role)
        bound = 1.0 / math.sqrt(inp)
        tensors[path] = (rng.uniform(-bound, bound, (spec.rank, inp)).astype(np.float32),
                         np.zeros((out, spec.rank), np.float32))
    return Adapter(spec, config.model_type, tensors)


def merge_weights(weights: dict[str, np.ndarray], adapter: Adapter) -> dict[str, np.ndarray]:
    """Our weights with the adapter folded in, W += scale · B @ A (a new dict; `weights` is
    untouched). GPT-2's Conv1D is [out, in] here too: `unsanitize` turns the merged one back."""
    out = dict(weights)
    scale = np.float32(adapter.spec.scale)
    for path, (a, b) in adapter.tensors.items():
        w = path + ".weight"
        out[w] = (weights[w] + scale * (b @ a)).astype(np.float32)
    return out


from .adapters_peft import load_peft, save_peft  # noqa: E402  (the PEFT files; they need Adapter)

__all__ = ["ALL_LINEAR", "Adapter", "LoraSpec", "check_fits", "check_spec", "init_adapter", "load_peft",
           "merge_weights", "projection_shape", "resolve_targets", "save_peft", "target_modules"]
