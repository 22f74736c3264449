"""Errors of model configs, weight loading and tokenizers: one line each, via `AnelmError`."""

from ..errors import AnelmError


class ConfigError(AnelmError):
    """A model config that we cannot run: unsupported type or inconsistent sizes."""


class LoadError(AnelmError):
    """A model file or folder that is missing, truncated, or does not hold what the config says."""


class TokenizerError(AnelmError):
    """A tokenizer file that is missing or unreadable, or a backend that is not installed."""


class InputError(AnelmError):
    """Token ids a model cannot run: out of the vocabulary, or none."""


class ContextError(InputError):
    """More positions than the model's context holds."""


class AdapterError(AnelmError):
    """A LoRA adapter that does not fit: not LoRA, a rank or target the base cannot take,
    tensors shaped for another base, or files that are missing."""
