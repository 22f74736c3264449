"""GGUF files (llama.cpp's format) → an HF-style config, HF-named float32 weights, a tokenizer.

llama.cpp's own reader (the `gguf` package) parses the file and dequantizes every tensor type it
implements. What is ours is the translation to the HF checkpoint a converter started from:
- the config, from the `<arch>.*` metadata, under HF names (`config_from_gguf`);
- the tensor names: for each HF name the architecture expects, `gguf`'s tensor-name map says
  which GGUF tensor holds it, so no name table lives here; a GGUF tensor left over is an error
  rather than a silently dropped weight;
- the layout: what llama.cpp's converter changed, each architecture undoes in its own
  `gguf_weights` (Llama's q/k rows permuted for interleaved RoPE, Gemma's norm gains stored as
  1 + w) and `unsanitize` (GPT-2's projections back to HF's Conv1D [in, out]); an architecture
  names its GGUF `general.architecture` (`Architecture.gguf_arch`, `registry.py`) and reads its own metadata
  where it differs from Llama's (`gguf_config`);
- the tokenizer, from the `tokenizer.*` metadata (`tokenizer/gguf.py`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from ..config import ModelConfig, config_from_dict
from ..errors import ConfigError, LoadError

ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's per-pair RoPE divisors (Llama 3's scaling)
LONGROPE = ("rope_factors_long.weight", "rope_factors_short.weight")  # LongRoPE's factors (Phi-3)
UNKNOWN_TYPE = re.compile(r"(\d+)\)? is not a valid GGMLQuantizationType")  # "np.uint32(99) is not..."


def read_gguf(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, np.ndarray], Any]:
    """(config, float32 weights in the HF checkpoint's names and layout, tokenizer)."""
    from ..registry import architecture, gguf_architectures, model_type_of_gguf
    from ..tokenizer.gguf import tokenizer_from_gguf

    path = Path(path)
    reader = _open(path)
    meta = {k: f.contents() for k, f in reader.fields.items()}
    arch = meta.get("general.architecture")
    if model_type_of_gguf(arch) is None:
        raise LoadError(f"{path}: unsupported GGUF architecture {arch!r}: expected one of "
                        f"{', '.join(gguf_architectures())}")
    tensors = {t.name: t for t in reader.tensors}
    config = config_from_gguf(meta, tensors, path)
    module = architecture(config.model_type)
    # the checkpoint's names: an architecture that splits fused matrices at load says them apart
    shapes = getattr(module, "checkpoint_shapes", module.expected_shapes)(config)
    names = _tensor_names(arch, config, shapes, tensors, path)
    ours = {hf: _dequantize(tensors[g], path) for hf, g in names.items()}
    # what llama.cpp's converter changed (Llama's q/k rows permuted, Gemma's norms stored as 1 + w)
    fix = getattr(module, "gguf_weights", None)
    if fix is not None:
        ours = fix(ours, config)
    return config, module.unsanitize(ours, config), tokenizer_from_gguf(meta, str(path))


def _open(path: Path) -> Any:
    try:
        from gguf import GGUFReader
    except ImportError:  # a runtime dependency, but an environment may lack it
        raise LoadError(f"reading {path} needs the gguf package: pip install 'gguf>=0.16'") from None
    class Reader(GGUFReader):
        # The reader slices its np.memmap once per metadata part (a GGUF's 49k-token vocabulary and
        # merges are ~150k parts), and each memmap slice costs numpy's memmap bookkeeping: a plain
        # ndarray view of the same map reads the same bytes 3.5x faster (3.4 s -> 1 s of a load).
        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, value):
            self._plain = value.view(np.ndarray)

    try:
        return Reader(path)
    except (ValueError, OSError, IndexError, UnicodeDecodeError) as e:
        msg = _truncation(Reader, path) or (str(e).splitlines()[0] if str(e) else type(e).__name__)
        m = UNKNOWN_TYPE.search(msg)
        if m:  # the reader meets the type id while listing tensors, before we see any
            raise LoadError(f"{path}: unknown GGUF tensor type {m.group(1)}: expected a type the gguf "
                            "package reads (F32, F16, BF16, Q4_0 ... Q8_0, K-quants, IQ-quants)") from None
        raise LoadError(f"{path}: not a readable GGUF file ({msg})") from None


def _truncation(reader: type, path: Path) -> str | None:
    """What a failed read comes to when the file ends before a part its header declares (numpy
    says "cannot reshape" or "index out of bounds" there): read again, each part checked. Only
    after a failure: the check on every part would cost a good read ~100 ms."""
    class Checked(reader):
        def _get(self, offset, dtype, count=1, override_order=None):
            end = int(offset) + np.dtype(dtype).itemsize * int(count)
            if end > len(self.data):
                raise EOFError(f"truncated: {len(self.data):,} bytes, and the header declares data up to "
                               f"byte {end:,} at least; expected the whole file (an interrupted download?)")
            return super()._get(offset, dtype, count, override_order)

    try:
        Checked(path)
    except EOFError as e:
        return str(e)
    except Exception:  # noqa: BLE001 - any other failure is not a truncation: the first message stands
        return None
    return None


def _dequantize(t: Any, path: Path) -> np.ndarray:
    from gguf.quants import dequantize

    try:
        w = dequantize(t.data, t.tensor_type)  # numpy shape: the GGML dims reversed, [out, in]
    except NotImplementedError:
        raise LoadError(f"{path}: tensor {t.name} has type {t.tensor_type.name}, which the gguf package "
                        "cannot dequantize: expected a float or quantized weight type") from None
    return np.array(w, dtype=np.float32)  # owned and writable: F32 tensors come back as views of the mapped file


# --- config -----------------------------------------------------------------------------------

def config_from_gguf(meta: dict[str, Any], tensors: dict[str, Any], path: Path) -> ModelConfig:
    """The HF config the converter read, rebuilt from `<arch>.*` metadata (llama.cpp's key names)."""
    arch = meta["general.architecture"]

    def get(key: str, default: Any = None) -> Any:
        v = meta.get(f"{arch}.{key}", default)
        if v is None:
            raise LoadError(f"{path}: GGUF metadata {arch}.{key} is missing")
        return v

    if "token_embd.weight" not in tensors:
        raise LoadError(f"{path}: GGUF tensor token_embd.weight is missing")
    vocab = int(np.prod(tensors["token_embd.weight"].shape) // get("embedding_length"))
    tied = "output.weight" not in tensors  # llama.cpp writes no output tensor for a tied head
    ids = {k: meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "padding")}
    from ..registry import architecture, model_type_of_gguf

    model_type = model_type_of_gguf(arch, meta)
    module = architecture(model_type)
    # an architecture reads its own metadata where it differs from Llama's (GPT-2, Gemma 3)
    d = module.gguf_config(arch, get, path) if hasattr(module, "gguf_config") else llama_config(arch, get, path)
    d.update(model_type=model_type, vocab_size=vocab, tie_word_embeddings=tied,
             bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["padding"])
    if ROPE_FREQS in tensors and "rope_theta" in d:  # Llama 3's scaling: per-pair divisors, no keys
        d["rope_scaling"] = _llama3(_dequantize(tensors[ROPE_FREQS], path), d, arch, path)
    if LONGROPE[0] in tensors:  # LongRoPE: the factors as tensors, no type key (the original context is read)
        d["rope_scaling"] = {"rope_type": "longrope", **{f"{k}_factor": _dequantize(tensors[n], path).tolist()
                                                         for k, n in zip(("long", "short"), LONGROPE)}}
    try:
        return config_from_dict(d, str(path))
    except ConfigError as e:
        raise LoadError(f"{path}: GGUF metadata describes a model we cannot run: {e}") from None


def llama_config(arch: str, get: Any, path: Path) -> dict[str, Any]:
    hidden, heads = get("embedding_length"), get("attention.head_count")
    kv = get("attention.head_count_kv", heads)
    head_dim = get("attention.key_length", hidden // heads)  # Qwen3 sets it apart from hidden / heads
    rot = get("rope.dimension_count", head_dim)
    if rot != head_dim:
        raise LoadError(f"{path}: partial RoPE ({arch}.rope.dimension_count {rot} of head_dim {head_dim}) "
                        "is not supported: expected RoPE over the whole head")
    return dict(hidden_size=hidden, intermediate_size=get("feed_forward_length"), num_hidden_layers=get("block_count"),
                num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                rms_norm_eps=get("attention.layer_norm_rms_epsilon"), rope_theta=get("rope.freq_base", 10000.0),
                rope_scaling=_rope_scaling(arch, get, path), max_position_embeddings=get("context_length"))


def _llama3(divisors: np.ndarray, d: dict[str, Any], arch: str, path: Path) -> dict[str, Any]:
    from ..rope import llama3_from_divisors

    if d.get("rope_scaling") is not None:
        raise LoadError(f"{path}: GGUF has both {arch}.rope.scaling keys and a {ROPE_FREQS} tensor: expected one")
    p = llama3_from_divisors(divisors, d["head_dim"], d["rope_theta"])
    if p is None:
        raise LoadError(f"{path}: GGUF tensor {ROPE_FREQS} holds no Llama 3 RoPE scaling: expected per-pair divisors "
                        "of 1 (short wavelengths), one factor (long ones) and Llama 3's blend between")
    return p


def _rope_scaling(arch: str, get: Any, path: Path) -> dict[str, Any] | None:
    """HF's rope parameters from llama.cpp's `rope.scaling.*` keys (Llama 3's per-pair factors
    come as a tensor instead: `rope_freqs`, read in `config_from_gguf`)."""
    kind = get("rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    if kind != "yarn":
        raise LoadError(f"{path}: unsupported {arch}.rope.scaling.type {kind!r}: expected none, linear or yarn")
    odd = [k for k in ("attn_factor", "yarn_log_multiplier", "yarn_ext_factor", "yarn_attn_factor")
           if get(f"rope.scaling.{k}", "") != ""]
    if odd:
        raise LoadError(f"{path}: {arch}.rope.scaling.{odd[0]} is not supported: expected YaRN as HF defines it "
                        "(factor, original_context_length, yarn_beta_fast, yarn_beta_slow)")
    p = {"rope_type": "yarn", "factor": float(get("rope.scaling.factor")),
         "original_max_position_embeddings": int(get("rope.scaling.original_context_length"))}
    for ours in ("beta_fast", "beta_slow"):
        if (v := get(f"rope.scaling.yarn_{ours}", "")) != "":
            p[ours] = float(v)
    return p


# --- tensors ----------------------------------------------------------------------------------

def _tensor_names(arch: str, config: ModelConfig, expected: dict[str, tuple[int, ...]],
                  tensors: dict[str, Any], path: Path) -> dict[str, str]:
    """HF name -> GGUF name for every weight the architecture expects, from gguf's own name map."""
    import gguf

    by_name = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
    tmap = gguf.get_tensor_name_map(by_name[arch], config.num_hidden_layers)
    names = {hf: tmap.get_name(hf, try_suffixes=(".weight", ".bias")) for hf in expected}
    missing = [f"{g or '?'} ({hf})" for hf, g in names.items() if g not in tensors]
    if missing:
        more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        raise LoadError(f"{path}: GGUF tensors missing: {', '.join(missing[:3])}{more}")
    kind = getattr(config, "rope_type", None)  # tensors the config was read from (`config_from_gguf`)
    read = {ROPE_FREQS} if kind == "llama3" else set(LONGROPE) if kind == "longrope" else set()
    extra = sorted(set(tensors) - set(names.values()) - read)
    if extra:
        raise LoadError(f"{path}: GGUF tensor {extra[0]} is not used by {arch}: expected only the weights "
                        "of the architecture")
    for hf, g in names.items():
        shape = tuple(int(n) for n in reversed(tensors[g].shape))  # GGML lists dims innermost first
        if shape != tuple(expected[hf]):
            raise LoadError(f"{path}: GGUF tensor {g} has shape {shape}, expected {tuple(expected[hf])} for {hf}")
    return names

