"""Model configs: one frozen dataclass per architecture, fields named as in HF `config.json`.

`from_dict` drops keys we do not use (HF configs carry dozens), `__post_init__` derives the
defaults HF derives (kv heads = heads, head_dim = hidden / heads) and rejects sizes the
architecture cannot run. `to_dict` writes a `config.json` that `transformers` reads back.
Every config answers the same questions under the Llama names (`hidden_size`, `head_dim`...),
so generic code (runners, the device pipeline) never branches on the architecture.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from .errors import ConfigError
from .rope import RUNNABLE, rope_frequencies, rope_type, standardize

@dataclass(frozen=True)
class BaseConfig:
    model_type: ClassVar[str] = ""
    architecture: ClassVar[str] = ""
    # the keys that fix the weights' shapes: a model's config.json must state them, since a
    # default (a 7B Llama's sizes) would only surface later as weights that do not match
    shape_keys: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BaseConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def to_dict(self) -> dict[str, Any]:
        return {"model_type": self.model_type, "architectures": [self.architecture], **dataclasses.asdict(self)}

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """HF allows one EOS id or a list of them (Llama 3 has three)."""
        e = getattr(self, "eos_token_id", None)
        if e is None:
            return ()
        return tuple(int(i) for i in e) if isinstance(e, (list, tuple)) else (int(e),)

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # frozen: only __post_init__ derives fields

    def _fail(self, what: str) -> ConfigError:
        return ConfigError(f"{self.model_type} config: {what}")

    def _require_positive(self, *names: str) -> None:
        for n in names:
            v = getattr(self, n)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise self._fail(f"{n} must be a positive integer, got {v!r}")

    def _require_divisible(self, a: str, b: str) -> None:
        if getattr(self, a) % getattr(self, b):
            raise self._fail(f"{a} ({getattr(self, a)}) must be divisible by {b} ({getattr(self, b)})")


@dataclass(frozen=True)
class LlamaConfig(BaseConfig):
    model_type: ClassVar[str] = "llama"
    architecture: ClassVar[str] = "LlamaForCausalLM"
    shape_keys: ClassVar[tuple[str, ...]] = ("vocab_size", "hidden_size", "intermediate_size",
                                             "num_hidden_layers", "num_attention_heads")
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None  # None: one KV head per query head (MHA)
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF rope_parameters without rope_theta; None = plain RoPE
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    ACTIVATIONS: ClassVar[tuple[str, ...]] = ("silu",)
    ROPE_TYPES: ClassVar[tuple[str, ...]] = RUNNABLE  # the rope types the architecture runs (`rope.py`)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LlamaConfig":
        # transformers 5 nests rope_theta in `rope_parameters`; 4.x has it top level and
        # the scaling in `rope_scaling`. Both spellings arrive here.
        d = dict(d)
        rp = d.get("rope_parameters") or d.get("rope_scaling")
        if isinstance(rp, dict):
            rp = dict(rp)
            d["rope_theta"] = rp.pop("rope_theta", d.get("rope_theta", cls.rope_theta))
            kind = rp.get("rope_type", rp.get("type", "default"))
            d["rope_scaling"] = None if kind == "default" else rp
        return super().from_dict(d)

    def __post_init__(self):
        self._require_positive("num_attention_heads", "hidden_size")
        if self.num_key_value_heads is None:
            self._set("num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            self._require_divisible("hidden_size", "num_attention_heads")
            self._set("head_dim", self.hidden_size // self.num_attention_heads)
        self._require_positive("vocab_size", "intermediate_size", "num_hidden_layers",
                               "num_key_value_heads", "head_dim", "max_position_embeddings")
        self._require_divisible("num_attention_heads", "num_key_value_heads")
        if self.head_dim % 2:
            raise self._fail(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0:
            raise self._fail(f"rms_norm_eps and rope_theta must be > 0, got {self.rms_norm_eps}, {self.rope_theta}")
        if self.hidden_act not in self.ACTIVATIONS:
            raise self._fail(f"hidden_act must be {' or '.join(map(repr, self.ACTIVATIONS))}, got {self.hidden_act!r}")
        self._check_rope_scaling()

    def _check_rope_scaling(self) -> None:
        """HF's rope parameters completed as HF completes them (`rope.standardize`), or a one-line error."""
        scaling, problem = standardize(self.rope_scaling, self.max_position_embeddings, self.ROPE_TYPES)
        if problem:
            raise self._fail(problem)
        self._set("rope_scaling", scaling)

    def window(self, index: int) -> int | None:
        """The sliding window of layer `index`, or None: every Llama layer attends to all."""
        return None

    def rope(self, index: int) -> tuple[float, dict | None]:
        """(RoPE base, scaling) of layer `index`: the same for every Llama layer."""
        return self.rope_theta, self.rope_scaling

    def attention_factor(self, index: int) -> float:
        """RoPE's gain on cos and sin in layer `index` (YaRN's; 1 for most types): q and k both
        carry it, so the runners scale the scores by its square (`rope.py`)."""
        return rope_frequencies(self.head_dim, *self.rope(index))[1]

    def at_length(self, n: int) -> "LlamaConfig":
        """The config whose RoPE tables are HF's for a sequence of n positions: itself, but past
        a `longrope` original context one whose short factors are the long ones (`rope.py`)."""
        s = self.rope_scaling
        if self.rope_type != "longrope" or n <= s["original_max_position_embeddings"]:
            return self
        return dataclasses.replace(self, rope_scaling={**s, "short_factor": s["long_factor"]})

    @property
    def rope_type(self) -> str:
        return rope_type(self.rope_scaling)

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        # transformers 5 reads `rope_parameters`, 4.x the top-level `rope_theta`: write both.
        d["rope_parameters"] = {**(d.pop("rope_scaling") or {}), "rope_type": self.rope_type,
                                "rope_theta": self.rope_theta}
        return d


@dataclass(frozen=True)
class Qwen3Config(LlamaConfig):
    """Llama plus RMSNorm on each query and key head; head_dim is set, not derived."""

    model_type: ClassVar[str] = "qwen3"
    architecture: ClassVar[str] = "Qwen3ForCausalLM"
    vocab_size: int = 151936
    intermediate_size: int = 22016
    head_dim: int | None = 128  # HF's default: Qwen3 decouples head_dim from hidden / heads
    max_position_embeddings: int = 32768
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    use_sliding_window: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.use_sliding_window:
            raise self._fail("use_sliding_window is not supported: expected false")


@dataclass(frozen=True)
class GPT2Config(BaseConfig):
    model_type: ClassVar[str] = "gpt2"
    architecture: ClassVar[str] = "GPT2LMHeadModel"
    shape_keys: ClassVar[tuple[str, ...]] = ("vocab_size", "n_embd", "n_layer", "n_head")
    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int | None = None  # None: 4 * n_embd
    activation_function: str = "gelu_new"  # the tanh form of GELU
    layer_norm_epsilon: float = 1e-5
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    tie_word_embeddings: bool = True
    bos_token_id: int | None = 50256
    eos_token_id: int | list[int] | None = 50256

    def __post_init__(self):
        self._require_positive("n_embd", "n_head")
        if self.n_inner is None:
            self._set("n_inner", 4 * self.n_embd)
        self._require_positive("vocab_size", "n_positions", "n_layer", "n_inner")
        self._require_divisible("n_embd", "n_head")
        if self.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
            raise self._fail(f"activation_function must be the tanh GELU ('gelu_new'), "
                             f"got {self.activation_function!r}")
        if not self.layer_norm_epsilon > 0:
            raise self._fail(f"layer_norm_epsilon must be > 0, got {self.layer_norm_epsilon}")

    def window(self, index: int) -> int | None:
        """Every GPT-2 layer attends to all the keys before it."""
        return None

    # The Llama names, so code that sizes caches and kernels reads one vocabulary.
    hidden_size = property(lambda self: self.n_embd)
    num_hidden_layers = property(lambda self: self.n_layer)
    num_attention_heads = property(lambda self: self.n_head)
    num_key_value_heads = property(lambda self: self.n_head)
    head_dim = property(lambda self: self.n_embd // self.n_head)
    intermediate_size = property(lambda self: self.n_inner)
    max_position_embeddings = property(lambda self: self.n_positions)


@dataclass(frozen=True)
class Gemma3TextConfig(LlamaConfig):
    """Gemma 3's text model: Llama's fields plus what Gemma adds to a layer (per-head q/k norms,
    norms after attention and MLP with gains 1 + w, a gated GELU, embeddings times √hidden),
    and per layer a kind: `sliding_attention` (a window of `sliding_window` keys, RoPE base
    `rope_local_base_freq`) or `full_attention` (`rope_theta` with `rope_scaling`)."""

    model_type: ClassVar[str] = "gemma3_text"
    architecture: ClassVar[str] = "Gemma3ForCausalLM"
    vocab_size: int = 262208
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 26
    num_attention_heads: int = 8
    num_key_value_heads: int | None = 4
    head_dim: int | None = 256
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 1_000_000.0
    rope_local_base_freq: float = 10_000.0
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = True
    query_pre_attn_scalar: float = 256
    sliding_window: int = 4096
    layer_types: tuple[str, ...] | None = None  # None: five sliding layers, then a full one, repeated
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    bos_token_id: int | None = 2
    eos_token_id: int | list[int] | None = 1
    ACTIVATIONS: ClassVar[tuple[str, ...]] = ("gelu_pytorch_tanh", "gelu_tanh")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Gemma3TextConfig":
        d = dict(d)
        if isinstance(d.get("text_config"), dict):  # a multimodal `gemma3` folder: its text model
            d = {"tie_word_embeddings": d.get("tie_word_embeddings", True), **d["text_config"]}
        d["hidden_act"] = d.get("hidden_activation", d.get("hidden_act", cls.hidden_act))
        rp = d.get("rope_parameters")
        if isinstance(rp, dict) and "full_attention" in rp:  # transformers 5: one per layer kind
            local = rp.get("sliding_attention") or {}
            d["rope_local_base_freq"] = local.get("rope_theta", cls.rope_local_base_freq)
            d["rope_parameters"] = rp.get("full_attention")
        if d.get("layer_types") is not None:
            d["layer_types"] = tuple(d["layer_types"])
        return super().from_dict(d)

    def __post_init__(self):
        super().__post_init__()
        if self.layer_types is None:
            self._set("layer_types", tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                           for i in range(self.num_hidden_layers)))
        kinds = set(self.layer_types)
        if len(self.layer_types) != self.num_hidden_layers or not kinds <= {"full_attention", "sliding_attention"}:
            raise self._fail(f"layer_types must name full_attention or sliding_attention for each of "
                             f"{self.num_hidden_layers} layers, got {list(self.layer_types)}")
        self._require_positive("sliding_window")
        for k in ("final_logit_softcapping", "attn_logit_softcapping"):
            if getattr(self, k) is not None:
                raise self._fail(f"{k} is not supported: expected null, as Gemma 3 has it")
        if not self.query_pre_attn_scalar > 0 or not self.rope_local_base_freq > 0:
            raise self._fail("query_pre_attn_scalar and rope_local_base_freq must be > 0")

    def window(self, index: int) -> int | None:
        """The sliding window of layer `index` (keys it sees, itself included), or None."""
        return self.sliding_window if self.layer_types[index] == "sliding_attention" else None

    def rope(self, index: int) -> tuple[float, dict | None]:
        """(RoPE base, scaling) of layer `index`: local layers have their own base, unscaled."""
        if self.layer_types[index] == "sliding_attention":
            return self.rope_local_base_freq, None
        return self.rope_theta, self.rope_scaling

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d["hidden_activation"] = d.pop("hidden_act")
        d["layer_types"] = list(self.layer_types)
        full = d.pop("rope_parameters")
        d["rope_parameters"] = {"full_attention": full, "sliding_attention": {
            "rope_type": "default", "rope_theta": self.rope_local_base_freq}}
        return d


ModelConfig = LlamaConfig | Qwen3Config | GPT2Config | Gemma3TextConfig

ATTENTION_KINDS = ("full_attention", "sliding_attention")  # HF's `layer_types`


def set_layer_types(c: LlamaConfig, sliding: Any) -> None:
    """HF's `layer_types` of a config whose optional window (`use_sliding_window`,
    `sliding_window`) falls on the layers i where `sliding(i)` holds, unless the config names
    them itself; checked either way (Qwen2, SmolLM3)."""
    windowed = c.use_sliding_window and c.sliding_window is not None
    n = c.num_hidden_layers
    if c.layer_types is None:
        c._set("layer_types", tuple(ATTENTION_KINDS[windowed and sliding(i)] for i in range(n)))
    if len(c.layer_types) != n or not set(c.layer_types) <= set(ATTENTION_KINDS):
        raise c._fail(f"layer_types must name full_attention or sliding_attention for each of {n} layers, "
                      f"got {list(c.layer_types)}")
    if windowed:
        c._require_positive("sliding_window")


def layer_window(c: LlamaConfig, index: int) -> int | None:
    """The window of layer `index` of such a config (keys it sees, itself included), or None."""
    on = c.use_sliding_window and c.layer_types[index] == "sliding_attention"
    return c.sliding_window if on else None


def config_from_dict(d: dict[str, Any], source: str = "config", complete: bool = False) -> ModelConfig:
    """The config for `d["model_type"]`; unknown keys (training args, HF extras) are ignored.
    `complete`: `d` is a model's own config.json, so it must state every one of `shape_keys`."""
    if not isinstance(d, dict):
        raise ConfigError(f"{source}: expected a JSON object, got {type(d).__name__}")
    from .registry import config_class  # the registry imports the architectures, which import this

    cls = config_class(d.get("model_type"), source)
    inner = d["text_config"] if isinstance(d.get("text_config"), dict) else d  # a multimodal folder's text model
    missing = [k for k in cls.shape_keys if k not in inner] if complete else []
    if missing:
        raise ConfigError(f"{source}: {cls.model_type} config is missing {', '.join(missing)}; "
                          f"expected every one of {', '.join(cls.shape_keys)}")
    return cls.from_dict(d)

