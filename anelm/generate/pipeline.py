"""The device pipeline: GPT-2, Llama and Qwen3 on the ANE (or the emulator) with a KV cache.

    runner = build_runner(config, weights, "emulator")    # a Runner (anelm.generate.runner)
    cache = runner.new_cache()
    logits = runner.prefill(prompt_ids, cache, last_only=True)
    logits = runner.decode(token, cache)

What runs where:
- Embedding (and GPT-2's learned positions) on the CPU: a row lookup, no arithmetic to offload.
- Every decoder layer on the device, one program per layer and size (device_plan.py has the
  budget arithmetic):
  * prefill (`kernels/prefill.py`): the prompt zero-padded to a bucket, x `[1, D, 1, S]` in,
    the next hidden state and the layer's K (post-RoPE) and V out as one multi-output program;
    K/V fill the cache, which keeps the `[1, C, 1, S]` layout the decode programs read.
  * decode (`kernels/decode.py`): one token, x `[1, D, 1, W]` (column 0; W = 16 in `strict`,
    whose I/O widths are multiples of 16, the rest zeros), with the layer's cache, an
    additive mask over the unused slots and RoPE cos/sin as inputs, so the program is compiled
    once per layer and cache tier, never per token; k_new/v_new come back and the host
    appends them at the token's position.
- Final norm and vocabulary projection on the CPU, the projection's weight held as fp16 (as the
  device holds weights: half the bytes a token reads) and multiplied by the emulator's fp16
  matrix-vector product (`device.emulator_matvec`), sums in float32. GPT-2's tied
  wte is 50257 × 768 × 2 B = 73 MiB in fp16, over 15× the measured ~4.7 MB working-set threshold: on the
  device it would take at least three vocabulary chunks (three more programs out of the
  compile budget), each streamed from DRAM for one token's 768 inputs, so the product is
  bandwidth-bound wherever it runs. The CPU reads the fp16 matrix once per token; a tied
  embedding without learned positions is looked up in the same fp16 matrix.

Memory: the programs' weights are folded straight to fp16 (`layer_params(half=True)`, kept for
the programs still to compile, each matrix as the payload of its own BLOBFILE, so the programs'
blobs are views of it and not copies; no float32 transient per layer), then the runner drops
its float32 copies of the layers' matrices; the CPU side keeps the embedding, positions, final norm, head and the layers' norm vectors (for adapters).

A LoRA adapter (`set_adapter`) is kernel input data (`kernels/lora.py`): the kernels are built
with adapter slots of a rank R on a set of projections (those of the first adapter, or
`lora_rank`/`lora_targets`), and any adapter of rank <= R on those projections, or none, is
restaged into the same programs: a swap compiles nothing.

A program an earlier process built is found in the program store (`program_store`) by its
recipe and the layer's weight digests, before anything is built: no graph, passes, codegen or
content-key hash, and its plan comes from the emulator's kernel store (loaded, not compiled).

A prompt that continues a non-empty cache (a chat turn) runs through the decode programs, one
token at a time: prefill programs start at position 0, which is what lets one program serve
every prompt of its bucket. A first prompt runs a bucket, and its tokens past the bucket are
decoded: whichever bucket is predicted fastest so (`prefill_bucket`), which for a prompt much
shorter than its bucket may be a smaller one. Predicted by the chip's cost model on the ANE (a
big bucket is cheap there), by the emulator's own measured rates when it is the device.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

import numpy as np

from ..compiler.artifact import profile_identity
from ..compiler.pipeline import compile_graph
from ..device.base import Device
from ..device.emulator.matvec import HalfMatrix
from ..device.select import get_device
from ..fp16.grid import round_fp16
from ..kernels.decode import decode_layer
from ..kernels.int8 import plan_layer
from ..kernels.layers import layer_params, layer_shape, rope_full_tables, stream_scale_for
from ..kernels.lora import layer_lora, plan_slots
from ..kernels.prefill import prefill_layer
from ..mil.blob import backing_file, blob_backed
from ..models.errors import AdapterError
from ..models.layers import layer_inv_freqs, rope_tables
from ..models.loading import build_model
from ..models.names import layer_prefix, layer_weights, target_roles
from ..runtime.kernel import Kernel
from .device_passes import DevicePasses, chunk_width
from .device_plan import (MAX_CONTEXT, DeviceCache, choose_bucket, decode_groups, evaluation_seconds, plan_sizes,
                          resume_pays, ring_size, serving_buckets)
from .longrope import LongRope
from .program_store import LayerBlobs, digest, find_or_build, program_store, recipe_key


def build_runner(config: Any, weights: dict[str, np.ndarray], device: str | Device = "auto",
                 max_context: int | None = None, profile: Any = None, adapter: Any = None,
                 lora_rank: int | None = None, lora_targets: tuple[str, ...] | None = None,
                 consume: bool = False) -> "DeviceRunner":
    """The device Runner for `config` and sanitized float32 `weights` (anelm.models.loading).

    `device` is "auto" | "ane" | "emulator" (anelm.device.select, under `profile`: a ChipProfile, or None for
    ANELM_PROFILE, else strict) or a Device. `max_context` caps the positions a cache holds (default: the model's
    context, at most MAX_CONTEXT, since every decode step reads its cache tier whole). `adapter`: a LoRA adapter to
    run with (`models.adapters`); `lora_rank`/`lora_targets` (HF module names) reserve kernel slots for the adapters
    to come, when they exceed the first one's. `consume`: the caller gives `weights` up, and the runner removes what
    it has converted from it as it goes (each layer's matrices once they are fp16), so it is not held twice.
    """
    dev = device if isinstance(device, Device) else get_device(device, profile)
    cls = LongRopeRunner if getattr(config, "rope_type", None) == "longrope" else DeviceRunner
    return cls(config, weights, dev, max_context, adapter, lora_rank, lora_targets, consume)


def calibration_ids(config: Any, n: int = 16) -> list[int]:
    """A fixed sequence for measuring the stream's range: BOS (or id 0) first, where pretrained
    models put their largest activations (attention sinks), then ids spread over the vocabulary."""
    first = config.bos_token_id if isinstance(config.bos_token_id, int) else 0
    return [first] + [int(i) for i in np.linspace(0, config.vocab_size - 1, n - 1)]


class DeviceRunner(DevicePasses):
    """A Runner whose decoder layers run as compiled programs on `device` (`DevicePasses`)."""

    def __init__(self, config: Any, weights: dict[str, np.ndarray], device: Device,
                 max_context: int | None = None, adapter: Any = None, lora_rank: int | None = None,
                 lora_targets: tuple[str, ...] | None = None, consume: bool = False):
        self.config = config
        self.cpu = build_model(config, weights)  # checks every weight; embed and head run on it
        self.cpu.set_adapter(adapter)  # the stream's range is measured with the adapter on
        self.dev, self.device = device, device.name
        n = config.num_hidden_layers
        context = min(config.max_position_embeddings, max_context or MAX_CONTEXT)
        self.columns = device.profile.spatial_multiple_of  # the decode token's padded width
        self.plan = plan_sizes(n, context, device.profile.compile_budget, self.columns)
        # the stream's range, measured once on the CPU reference, decides its scale on the device
        self.stream_scale = stream_scale_for(self.cpu.stream_peak(calibration_ids(config)), self.cpu.stream_bound())
        self.shapes = [replace(layer_shape(config, i), stream_scale=self.stream_scale) for i in range(n)]
        # sliding-window layers keep a ring of their window in the cache (DeviceCache)
        self.rings = tuple(ring_size(s.window, self.columns) for s in self.shapes)
        self.chunk = chunk_width(self.columns, [s.window for s in self.shapes], self.rings)  # tokens a pass takes
        # per layer {linear: (W, b)} with the norms' affines and the attention scale folded in
        quant = getattr(weights, "quant", None)  # a quantized folder (models/formats/quantized.py): int8 linears
        self._store = program_store()
        self.layers, self._blobs = [], []  # _blobs: per layer, its weight files by digest (program_store)
        for i, s in enumerate(self.shapes):
            raw = layer_weights(config, self.cpu.weights, i)
            layer = {k: (_half(w), b) for k, (w, b) in
                     (plan_layer(quant, i, s, raw) if quant else layer_params(s, raw, half=True)).items()}
            self.layers.append(layer)
            # hashed once per layer, as its weights are made (part of loading, not of the first
            # program's compile: SmolLM2's 212 MB take ~25-37 ms), for its prefill and decode programs
            self._blobs.append(LayerBlobs.of(layer) if self._store.enabled else None)
            # the layer's float32 matrices go now, not after the last layer (the programs are
            # built from `self.layers`); from the caller's dict too when it gives it up
            prefix = layer_prefix(config.model_type, i)
            for d in (self.cpu.weights, weights) if consume else (self.cpu.weights,):
                for k in [k for k, a in d.items() if k.startswith(prefix) and np.ndim(a) >= 2]:
                    del d[k]
        self.head = HalfMatrix(self.cpu.weights[self.cpu.head_name])
        self.rope = self.shapes[0].family.rotary
        self._keep_cpu_side()
        if consume:  # what the CPU side no longer holds as it was (the float32 head) goes too
            for k in [k for k, a in weights.items() if self.cpu.weights.get(k) is not a]:
                del weights[k]
        # each layer's RoPE frequencies (Gemma's local and global layers differ), shared per base
        self.inv_freqs: list[np.ndarray | None] = layer_inv_freqs(config) if self.rope else [None] * n
        self.kernels: dict[tuple[str, int, int], Kernel] = {}  # (kind, layer, size), compiled on first use
        self.buckets: list[int] = []  # the prefill sizes bound to the plan's slots so far (`prefill_bucket`)
        self._seconds: dict[tuple[str, int], float] = {}  # predicted seconds of one pass, by (kind, size)
        self._arts: dict[tuple[str, int, int], Any] = {}  # programs fetched for their cost, kept for `_kernel`
        self._recipe: tuple | None = None  # (lora slots, the recipe parts every layer shares)
        self._rope_digests: dict[int, str] = {}  # id of an inv_freq array -> its recipe part
        self.quantized = quant is not None
        self.lora_slots, self.lora_inputs = (), [{} for _ in range(n)]  # per layer: input name -> array
        if adapter is not None or lora_rank is not None or lora_targets is not None:
            roles = adapter.roles() if lora_targets is None else tuple(
                dict.fromkeys(r for t in lora_targets for r in target_roles(config.model_type, t)))
            self._reserve(lora_rank or adapter.rank, roles)
        self.set_adapter(adapter)

    def warm(self, on_program=None) -> int:
        """Build (or load from the program store) every program of every size now, so that no
        later prompt waits for a compile (`anelm serve`); the plan fits them in the compile
        budget. The free prefill slots get the buckets that serve prompts of every length best
        (`device_plan.serving_buckets`). `on_program()` is called after each. Returns how many
        there are."""
        self.buckets = list(serving_buckets(self.plan, self.buckets, self.pass_seconds))
        sizes = [("prefill", b) for b in self.buckets] + [("decode", t) for t in self.plan.decode]
        for kind, size in sizes:
            for i in range(self.config.num_hidden_layers):
                self._kernel(kind, i, size)
                if on_program is not None:
                    on_program()
        return len(sizes) * self.config.num_hidden_layers

    # --- Runner interface -------------------------------------------------------------------
    def new_cache(self) -> DeviceCache:
        return DeviceCache(self.config.num_hidden_layers, self.shapes[0].kv_channels, self.plan.context,
                           rings=self.rings)

    def prefill(self, ids: Sequence[int], cache: DeviceCache, last_only: bool = False) -> np.ndarray:
        """Run `ids` at positions cache.length..; logits [T, V] ([1, V] when `last_only`)."""
        ids = self.cpu._check_ids(ids, cache)  # the CPU model's checks: vocabulary and context
        hidden, start = [], 0
        if cache.length == 0:
            bucket = self.prefill_bucket(len(ids))
            start = min(len(ids), bucket)
            hidden.append(self._prefill_hidden(ids[:start], cache, bucket))
        for k in decode_groups(start, len(ids), self.plan, self.pass_seconds, self.chunk):  # the rest
            hidden.append(self._decode_hidden(ids[start:start + k], cache))
            start += k
        h = np.concatenate(hidden)  # [T, D]
        return self._logits(h[-1:] if last_only else h)

    def decode(self, token: int, cache: DeviceCache) -> np.ndarray:
        """One token at position cache.length; logits [V]."""
        self.cpu._check_ids([token], cache)
        return self._logits(self._decode_hidden([int(token)], cache))[0]

    def prefill_bucket(self, n: int) -> int:
        """The bucket a prompt of n tokens on an empty cache prefills with; its tokens past the
        bucket are decoded (`device_plan.choose_bucket`, by the device's predicted times). A
        size not bound yet takes a free prefill slot: the compile budget is never exceeded."""
        bucket = choose_bucket(n, self.plan, self.buckets, self.pass_seconds, self.chunk)
        if bucket not in self.buckets:
            self.buckets.append(bucket)
        return bucket

    def positions_to_reuse(self, n: int, held: int) -> int:
        """Of `held` cached positions of an n-token prompt, how many to keep: all, or none (`resume_pays`)."""
        return held if held == 0 or resume_pays(n, held, self.plan, self.buckets, self.pass_seconds, self.chunk) else 0

    def pass_seconds(self, kind: str, size: int) -> float:
        """Predicted seconds of one pass over every layer of a prefill bucket, a decode tier
        (one token: column 0 alone) or a chunk at a tier (every column of the decode programs),
        from the programs' cost annotations (`device_plan.evaluation_seconds`: the emulator's
        own time when it is the device, else the chip's); a ring layer's decode reads its ring."""
        if (kind, size) not in self._seconds:
            program = "prefill" if kind == "prefill" else "decode"
            share = 1 / self.columns if kind == "decode" else 1.0  # one token: column 0 alone
            widths = [size if kind == "prefill" else min(size, r or size) for r in self.rings]
            each = {w: self._evaluation_seconds(program, widths.index(w), w, share) for w in set(widths)}
            self._seconds[(kind, size)] = sum(each[w] for w in widths)
        return self._seconds[(kind, size)]

    def _evaluation_seconds(self, kind: str, i: int, size: int, share: float) -> float:
        key = (kind, i, size)
        if key in self.kernels:
            art = self.kernels[key].artifact
        else:  # its program, built or found now, is the one `_kernel` compiles if it is chosen
            art = self._arts[key] = self._arts.get(key) or self._program(kind, i, size)
        return evaluation_seconds(art, self.device, share)

    def _logits(self, h: np.ndarray) -> np.ndarray:
        """Hidden states [T, D] -> logits [T, V]: the CPU model's final norm, the fp16 head."""
        return self.head.times(self.cpu.final_norm(h))

    def _keep_cpu_side(self) -> None:
        """The CPU model's float32 head replaced by the fp16 one (its layer matrices went as
        they were converted; the layers' vectors stay: norm gains and shifts, which `set_adapter`
        folds into the adapter inputs, a few kilobytes per layer). A tied embedding is looked up in the fp16 head's rows when the row
        alone is the first layer's input (Llama, Qwen3: the kernel rounds it to fp16 anyway,
        after a power-of-two scale, so nothing changes); GPT-2 adds learned positions first,
        and rounding the row before that sum moved W8A8's activation bins measurably."""
        tied_positions = self.config.tie_word_embeddings and not self.rope
        if not tied_positions:
            self.cpu.weights[self.cpu.head_name] = self.head

    def set_adapter(self, adapter: Any) -> None:
        """Run with LoRA `adapter` from now on (None: the base alone), restaging the kernels'
        adapter inputs: nothing is compiled. The first adapter of a runner built without
        slots sets them, if no kernel is compiled yet."""
        if adapter is None:
            self.cpu.set_adapter(None)
            self.lora_inputs = [{n: np.zeros_like(a) for n, a in d.items()} for d in self.lora_inputs]
            return
        if self.quantized:
            raise AdapterError("adapters on a quantized model are not supported yet: expected the "
                               "unquantized model the adapter was trained on")
        self.cpu.set_adapter(adapter)  # checks it fits the base
        if not self.lora_slots:
            if self.kernels:
                raise AdapterError("this runner's kernels were compiled without adapter inputs: expected "
                                   "an adapter (or lora_rank/lora_targets) when the runner is built")
            self._reserve(adapter.rank, adapter.roles())
        rank, roles = self.lora_slots[0].rank, {r for s in self.lora_slots for r in s.roles}
        if adapter.rank > rank or not set(adapter.roles()) <= roles:
            raise AdapterError(f"adapter of rank {adapter.rank} on {', '.join(adapter.spec.targets)} does not fit "
                               f"the kernels' slots: expected rank <= {rank} on roles {', '.join(sorted(roles))}")
        self.lora_inputs = []
        for i, s in enumerate(self.shapes):
            pairs = {r: ab for r in roles if (ab := adapter.pair(i, r)) is not None}
            arrays = layer_lora(s, self.lora_slots, layer_weights(self.config, self.cpu.weights, i), pairs,
                                adapter.spec.scale)
            self.lora_inputs.append({n: round_fp16(a) for n, a in arrays.items()})  # fp16 values, staged as exact

    def _reserve(self, rank: int, roles: tuple[str, ...]) -> None:
        self.lora_slots = plan_slots(self.config, rank, roles, self.dev.profile.spatial_multiple_of)
        self.lora_inputs = [{n: np.zeros(sh, np.float32) for sl in self.lora_slots
                             for n, sh in sl.input_shapes().items()} for _ in self.shapes]
        self._arts.clear(), self._seconds.clear()  # programs (and their costs) of the old slots

    def close(self) -> None:
        """Release every kernel (the programs stay in the process-wide cache until evicted)."""
        for k in self.kernels.values():
            k.close()
        self.kernels.clear()

    def _kernel(self, kind: str, i: int, size: int) -> Kernel:
        """The program of layer i for a prefill bucket or decode tier, compiled on first use;
        a program stored by an earlier process (`program_store`) is not even built."""
        key = (kind, i, size)
        if key not in self.kernels:
            art = self._arts.pop(key, None) or self._program(kind, i, size)
            # inputs and outputs are declared in alphabetical order: MIL names are ours
            assert not art.meta["aliases"], f"{art.meta['name']}: surfaces were renamed {art.meta['aliases']}"
            # decode reads column 0 alone: the emulator then evaluates that column only
            self.kernels[key] = Kernel(art, self.dev, float32_outputs=True,
                                       read_columns=1 if kind == "decode" else None)
        return self.kernels[key]

    def _program(self, kind: str, i: int, size: int):
        """The artifact of layer i's program: from the program store, or built (and stored)."""
        s, w, profile = self.shapes[i], self.layers[i], self.dev.profile
        name = f"prefill_l{i}_s{size}" if kind == "prefill" else f"decode_l{i}_t{size}"

        def build():
            if kind == "prefill":
                rope = rope_full_tables(*rope_tables(np.arange(size), self.inv_freqs[i])) if self.rope else None
                graph = prefill_layer(s, w, size, rope, name=name, lora=self.lora_slots)
            else:
                graph = decode_layer(s, w, size, self.rope, name=name, columns=self.columns, lora=self.lora_slots)
            return compile_graph(graph, profile)

        blobs = self._blobs[i]
        if blobs is None:  # no store, or a weight neither blob-backed nor an int8 linear: built every time
            return build()
        parts = {"kind": kind, "name": name, "size": size, "shape": repr(s), "family": type(s.family).__qualname__,
                 **self._shared_recipe(), "rope": self._rope_digest(i)}
        return find_or_build(self._store, recipe_key(parts, blobs), blobs, build, profile)

    def _shared_recipe(self) -> dict:
        """The recipe parts every layer's programs share, made once per set of adapter slots."""
        if self._recipe is None or self._recipe[0] is not self.lora_slots:
            self._recipe = (self.lora_slots, {"lora": repr(self.lora_slots), "columns": self.columns,
                                              "profile": profile_identity(self.dev.profile)})
        return self._recipe[1]

    def _rope_digest(self, i: int) -> str | None:
        """The recipe part of layer i's RoPE frequencies, hashed once per distinct array."""
        inv = self.inv_freqs[i]
        if inv is None:
            return None
        if id(inv) not in self._rope_digests:
            self._rope_digests[id(inv)] = f"{inv.dtype.str}:{digest(np.ascontiguousarray(inv))}"
        return self._rope_digests[id(inv)]


class LongRopeRunner(LongRope, DeviceRunner):
    """The device runner of a LongRoPE model (Phi-3): its RoPE tables per sequence (`longrope`)."""


def _half(w):
    """A weight matrix as fp16, held as the payload of its own BLOBFILE (`mil.blob.blob_backed`):
    the programs are compiled from it and their blobs are it, one memory (`layer_params(half=True)`
    folds straight into such payloads); anything else (int8 weights, vectors) as it is."""
    if isinstance(w, np.ndarray) and w.ndim == 2 and w.dtype in (np.float32, np.float16) \
            and backing_file(w, "fp16") is None:
        return blob_backed(w)
    return w
