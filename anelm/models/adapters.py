"""LoRA adapters: the spec, the targets, the tensors, PEFT's init and the merge.

An adapter adds `scale · B (A x)` to each targeted projection y = W x, with `scale = alpha / r`,
A float32 [r, in] and B float32 [out, r], exactly as PEFT stores `lora_A.weight` and
`lora_B.weight`. Tensors are keyed by the HF module path without `.weight`
("model.layers.3.self_attn.q_proj", "transformer.h.0.attn.c_attn"); GPT-2's fused `c_attn`
carries one pair for q, k and v together, as PEFT treats it. Weights here are ours, [out, in]
for every projection (GPT-2's Conv1D already turned by `gpt2.sanitize`), so `fan_in_fan_out`
only matters in the files (`formats/peft.py`) and the merge is W += scale · B @ A for all.

Where a checkpoint fuses projections that anelm splits at load (Phi-3's qkv_proj, gate_up_proj:
`Architecture.fused`), the adapter is PEFT's, on the fused module: one A, and B over the fused
rows. A *part* is what one pair adapts: a role, or the roles of a fused module ("q_k_v").
`Adapter.parts` says which rows of the fused B (and with what gain) each of our projections
takes (the module's `fused_rows`): its term is scale · B[rows] (A x), so q, k and v share A.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..errors import UsageError
from .errors import AdapterError
from .names import (DEFAULT_TARGETS, PROJECTIONS, layer_modules, layer_prefix, lora_module, module_name, target_names,
                    target_roles, weight_name)
from .registry import arch, architecture, module

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


def lora_parts(model_type: str) -> dict[str, tuple[str, tuple[str, ...]]]:
    """part -> (the HF module inside a layer its pair sits on, its roles), in data-flow order."""
    fused = arch(model_type).fused
    parts = {}
    for r in PROJECTIONS[model_type]:
        m = lora_module(model_type, r)
        parts.setdefault("_".join(fused[m]) if m in fused else r, (m, fused.get(m, (r,))))
    return parts


def target_modules(config, targets: tuple[str, ...]) -> dict[str, tuple[int, str]]:
    """HF module path -> (layer, part) of every pair `targets` calls for, in layer order."""
    mt = config.model_type
    chosen = {p: m for p, (m, _) in lora_parts(mt).items() if m.rsplit(".", 1)[-1] in targets}
    return {layer_prefix(mt, i) + m: (i, p) for i in range(config.num_hidden_layers) for p, m in chosen.items()}


def projection_shape(config, part: str) -> tuple[int, int]:
    """(out, in) of a layer's projection `part` (a role, or a fused module's: its rows added up),
    in our [out, in] orientation."""

    mt = config.model_type
    shapes = architecture(mt).expected_shapes(config)
    roles = lora_parts(mt)[part][1] if part in lora_parts(mt) else (part,)
    got = [shapes[weight_name(mt, 0, r)] for r in roles]
    return sum(s[0] for s in got), got[0][1]


def fused_parts(config) -> dict[str, tuple[str, np.ndarray, np.ndarray | None]]:
    """Our projection's module inside a layer -> (the fused module its adapter sits on, the
    rows of it that are ours, their gains or None) (module doc); empty where nothing is fused."""
    rows = getattr(module(config.model_type), "fused_rows", None)
    return {} if rows is None else {layer_modules(config.model_type)[r]: v for r, v in rows(config).items()}


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
    parts: dict = field(default_factory=dict)  # `fused_parts` of the base (module doc), set by check_fits

    def _fused(self, module: str) -> tuple[str, np.ndarray, np.ndarray | None] | None:
        """(fused module path, rows, gains) holding our projection `module`'s pair, if fused."""
        for inner, (m, rows, gain) in self.parts.items():
            if module.endswith("." + inner):
                return module[: -len(inner)] + m, rows, gain
        return None

    def _pair(self, module: str) -> tuple[np.ndarray, np.ndarray] | None:
        found = self._fused(module)
        if found is None or found[0] not in self.tensors:
            return self.tensors.get(module)
        (a, b), rows, gain = self.tensors[found[0]], found[1], found[2]
        return a, b[rows] if gain is None else b[rows] * gain[:, None]

    @property
    def rank(self) -> int:
        return self.spec.rank

    def pair(self, layer: int, role: str) -> tuple[np.ndarray, np.ndarray] | None:
        """(A, B) on layer `layer`'s projection `role`, or None where the adapter has none."""
        return self._pair(module_name(self.model_type, layer, role))

    def roles(self) -> tuple[str, ...]:
        """The roles the adapter targets, in data-flow order."""
        mt = self.model_type
        return tuple(r for r in PROJECTIONS[mt] if any(r in target_roles(mt, t) for t in self.spec.targets))

    def delta(self, module: str, x: np.ndarray) -> np.ndarray | None:
        """scale · B (A x) for x [T, in] on module `module`; None where the adapter has none."""
        ab = self._pair(module)
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
    adapter.parts = fused_parts(config)
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
    for path, (_, part) in target_modules(config, spec.targets).items():
        out, inp = projection_shape(config, part)
        bound = 1.0 / math.sqrt(inp)
        tensors[path] = (rng.uniform(-bound, bound, (spec.rank, inp)).astype(np.float32),
                         np.zeros((out, spec.rank), np.float32))
    return Adapter(spec, config.model_type, tensors, fused_parts(config))


def merge_weights(weights: dict[str, np.ndarray], adapter: Adapter) -> dict[str, np.ndarray]:
    """Our weights with the adapter folded in, W += scale · B @ A (a new dict; `weights` is
    untouched). GPT-2's Conv1D is [out, in] here too: `unsanitize` turns the merged one back."""
    out = dict(weights)
    scale = np.float32(adapter.spec.scale)
    used = set()
    for path in [w[: -len(".weight")] for w in weights if w.endswith(".weight")]:
        ab = adapter._pair(path)
        if ab is not None:  # a fused module's pair merges into each of our projections in it
            used.add(path if path in adapter.tensors else adapter._fused(path)[0])
            out[path + ".weight"] = (weights[path + ".weight"] + scale * (ab[1] @ ab[0])).astype(np.float32)
    if set(adapter.tensors) - used:
        raise AdapterError(f"adapter: {sorted(set(adapter.tensors) - used)[0]} is on no weight of this base: "
                           "expected an adapter checked against it (check_fits)")
    return out


__all__ = ["ALL_LINEAR", "Adapter", "LoraSpec", "check_fits", "check_spec", "fused_parts", "init_adapter",
           "lora_parts", "merge_weights", "projection_shape", "resolve_targets", "target_modules"]
