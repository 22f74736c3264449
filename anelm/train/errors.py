"""Training errors: each is one line naming what was expected and what was found.

They subclass the shared `anelm.errors` classes, so the CLI prints them as `anelm: error: ...`
(exit 2 for `PresetError`, a bad flag value; exit 1 for the rest).
"""

from ..errors import AnelmError, UsageError


class DataError(AnelmError):
    """The `--data` input (or its tokenizer) cannot be used for training."""


class CheckpointError(AnelmError):
    """A checkpoint that is corrupt, or does not match the model being trained."""


class PresetError(UsageError):
    """An unknown `--preset` name."""


class TrainError(AnelmError):
    """The run itself failed, e.g. a non-finite forward loss."""
