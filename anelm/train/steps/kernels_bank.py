"""Compiled training kernels on a device, one request per (kernel, layer): the dynamic pipeline.

    bank = DynamicBank(dims, device, weights, n_layers, family_for(config.model_type))
    out = bank.run("qkv", layer, {"xn": xn})          # [C, S] float32 in and out, one sequence
    bank.set_weights(new_weights)                      # restage the weight columns, no compile
    bank.stage_adapters(layer, a, sb)                  # LoRA: restage the adapter blocks only

`KernelBank` holds what both pipelines share: the two weightless attention kernels (one request
for every layer), the per-evaluation flop counts, and `run`, which writes the activation
columns of each packed input and evaluates. Inputs written by columns stay staged in the
request, so the dynamic pipeline writes a layer's weights once per optimizer update and only
the S activation columns per evaluation (maderix/ANE's dynamic-weight trick,
training/training_dynamic/).

With carried probabilities (`Dims.carry_probs`), `run(kind, layer, acts, slot=)` leaves them on
the device: sdpa_fwd of a layer writes them into that layer's surface for `slot`, and sdpa_bwd
reads them from it (`Kernel.request(inputs=, outputs=)`), so they never cross to the host and
back. The slot is the caller's (one per sequence and micro-batch whose backward is pending).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np

from ...compiler.passes.cost import kernel_flops
from ...compiler.pipeline import compile_graph
from ...errors import CompileError
from ...fp16.grid import round_fp16
from ...kernels.families import Family
from ...kernels.training import (BACKWARD, FFN_DX, GRADIENT_INPUTS, WEIGHTLESS, Dims, LoraLayout, adapter_mats,
                                 build_graph, layer_mats, layouts, weighted_kinds)
from ...runtime.kernel import Kernel, Request
from ...runtime.threads import pass_workers

# The backward kernels: their overflow is what dynamic loss scaling expects (the scaler skips
# the step and lowers the scale), so it is not warned per kernel (fp16 overflow
# warnings, docs/chip-profiles.md).
DX_KINDS = frozenset(BACKWARD) | {"sdpa_bwd", FFN_DX}
PROBS = "probs"  # sdpa_fwd's output and sdpa_bwd's input with carried probabilities


class KernelBank:
    """Requests by (kind, layer), the weightless kernels shared by all layers (layer None)."""

    compiles_per_update = 0

    def __init__(self, dims: Dims, device, n_layers: int, family: Family, lora: LoraLayout | None = None,
                 windows: tuple[int | None, ...] | None = None):
        self.dims, self.device, self.n_layers, self.lora = dims, device, n_layers, lora
        self.family = family  # where each layer's matrices are in the HF weights
        self.layouts = layouts(dims, lora)
        self.flops: dict[str, int] = {}
        self._kernels: list[Kernel] = []
        self._req: dict[tuple[str, int | None], Request] = {}
        self._resident: dict[tuple, Request] = {}  # (kind, layer, slot) -> its request (`_kept`)
        self._probs: dict[tuple, object] = {}  # (layer, slot) -> the surface the probabilities stay in
        self._spare: dict[int, dict] = {}  # by kernel: the surfaces every slot's requests of it share
        for kind in WEIGHTLESS:
            self._req[(kind, None)] = self._open(kind, build_graph(kind, dims)).request()
        # layers with a sliding window (Gemma's local layers) share attention kernels of their
        # own mask: one pair per distinct window, which the layers' (kind, layer) keys point at
        for w in dict.fromkeys(w for w in windows or () if w is not None):
            for kind in WEIGHTLESS:
                req = self._open(kind, build_graph(kind, replace(dims, window=w))).request()
                for layer in (i for i, lw in enumerate(windows) if lw == w):
                    self._req[(kind, layer)] = req

    def _open(self, kind: str, graph, cache=None) -> Kernel:
        art = compile_graph(graph, self.device.profile)
        want = sorted(graph.outputs)
        got = [s.name for s in art.signature.outputs]
        if got != want:  # the bank reads outputs by these names
            raise CompileError(kind, f"outputs were renamed to {got}", f"declare {want} alphabetically")
        self.flops[kind] = kernel_flops(art)
        kern = Kernel(art, self.device, cache=cache, float32_outputs=True, warn_overflow=kind not in DX_KINDS)
        self._kernels.append(kern)
        return kern

    def run(self, kind: str, layer: int, acts: dict[str, np.ndarray], slot=None) -> dict[str, np.ndarray]:
        """One evaluation on one sequence: activations `[C, S]` by name -> outputs `[C, S]` float32.
        Forward activations past fp16's range enter as ±65504, not inf (the CPU computed them in
        float32; one overflow would otherwise spread through the step): a clamp in the conversion's
        pass. Gradients enter as they are: an overflow is the loss scaler's cue to skip the step.
        `slot` (sdpa_fwd, sdpa_bwd with carried probabilities): the probabilities stay on the
        device in the layer's surface for that slot, neither returned nor taken (module doc)."""
        req = self._request(kind, layer) if slot is None else self._kept(kind, layer, slot)
        grads = GRADIENT_INPUTS.get(kind, ())
        for name, pk in self.layouts[kind].items():
            if slot is not None and name == PROBS:  # bound to the forward's output
                continue
            cols = pk.columns(self.dims.s)
            for a in pk.acts:
                req.write(name, acts[a], columns=cols[a], saturate=a not in grads)
        out = req.run(stay=(PROBS,) if slot is not None else ())
        return {k: v.reshape(v.shape[1], v.shape[3]) for k, v in out.items()}

    def _request(self, kind: str, layer: int) -> Request:
        return self._req.get((kind, layer)) or self._req[(kind, None)]

    def _kept(self, kind: str, layer: int, slot) -> Request:
        """The request of an attention kernel whose probabilities stay in (layer, slot)'s surface.
        Every surface is as large as the largest of sdpa_fwd's outputs and sdpa_bwd's inputs (one
        allocation size per side); the others are shared by every slot's requests of the kernel
        (each evaluation writes all of its inputs and reads what it returns before the next)."""
        key = (kind, layer, slot)
        if key in self._resident:
            return self._resident[key]
        if not self.dims.carry_probs or kind not in WEIGHTLESS:
            raise ValueError(f"{kind}: only the attention kernels of a bank with carried probabilities take a slot")
        fwd, bwd = (self._request(k, layer).kernel for k in WEIGHTLESS)
        size = max(fwd.surface_bytes("outputs"), bwd.surface_bytes("inputs"))
        probs = self._probs.get((layer, slot))
        if probs is None:
            probs = self._probs[layer, slot] = fwd.new_surface(size)
        if kind == "sdpa_fwd":  # its inputs are the plain request's; its attention output one per kernel
            spare = self._spare.setdefault(id(fwd), {"attn": fwd.new_surface(size)})
            inputs = dict(zip(fwd.input_names, self._request(kind, layer).surfaces))
            req = fwd.request(inputs=inputs, outputs={**spare, PROBS: probs})
        else:
            spare = self._spare.setdefault(id(bwd), {n: bwd.new_surface(size) for n in bwd.input_names if n != PROBS})
            req = bwd.request(inputs={**spare, PROBS: probs})
        self._resident[key] = req
        return req

    def _stage(self, req: Request, kind: str, mats: dict[str, np.ndarray], exact: bool = False) -> None:
        """Write the weight blocks M of a dynamic request into their columns."""
        for name, pk in self.layouts[kind].items():
            cols = pk.columns(self.dims.s)
            for role, _ in pk.weights:
                req.write(name, mats[role], columns=cols[role], exact=exact)

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        raise NotImplementedError

    def stage_adapters(self, layer: int, a: dict[str, np.ndarray], sb: dict[str, np.ndarray]) -> None:
        """Write one layer's adapter blocks (A per adapter, scale·B per kernel role) into every
        kernel that carries them: data only, nothing compiles (`kernels.training` module doc)."""
        for kind in self.lora.kinds():
            req, mats = self._req[(kind, layer)], adapter_mats(kind, self.lora, a, sb)
            for name, pk in self.layouts[kind].items():
                cols = pk.columns(self.dims.s, self.dynamic)
                for key, _ in pk.adapters:
                    req.write(name, mats[key], columns=cols[key])

    def close(self) -> None:
        for k in self._kernels:
            k.close()
        self._kernels.clear()
        self._req.clear()
        self._resident.clear()
        self._probs.clear()
        self._spare.clear()


class _Rounded(dict):
    """fp16-rounded copies of `weights`, each made when a kernel first asks for it."""

    def __init__(self, weights: dict[str, np.ndarray]):
        super().__init__()
        self.weights = weights

    def __missing__(self, name: str) -> np.ndarray:
        self[name] = out = round_fp16(self.weights[name])
        return out


class DynamicBank(KernelBank):
    """Weights travel in the inputs: ten compiles in all, none per update."""

    compiles_per_update = 0
    dynamic = True

    def __init__(self, dims: Dims, device, weights: dict[str, np.ndarray], n_layers: int, family: Family,
                 lora: LoraLayout | None = None, windows: tuple[int | None, ...] | None = None):
        super().__init__(dims, device, n_layers, family, lora, windows)
        for kind in weighted_kinds(dims):
            kern = self._open(kind, build_graph(kind, dims, lora=lora))
            for layer in range(n_layers):
                self._req[(kind, layer)] = kern.request()
        self.set_weights(weights)

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        # Each request owns its surfaces, and the rounding and copies release the GIL:
        # restaging runs one layer per core (the device is idle meanwhile). A layer's matrices
        # are rounded to fp16 once for both the forward (Wᵀ) and the dx (W) kernels.
        def stage(layer):
            rounded = _Rounded(weights)
            for kind in weighted_kinds(self.dims):
                mats = layer_mats(kind, rounded, layer, self.family, self.dims)
                self._stage(self._req[(kind, layer)], kind, mats, exact=True)

        with ThreadPoolExecutor(pass_workers()) as pool:
            list(pool.map(stage, range(self.n_layers)))
