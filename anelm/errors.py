"""Typed errors. Each says what was expected and what was found, in one line.

The CLI prints any `AnelmError` as `anelm: error: <message>` and exits 1 (2 for `UsageError`).
"""


class AnelmError(Exception):
    """Base class for every error the CLI reports as one line."""


class UsageError(AnelmError):
    """Bad command-line usage (exit code 2)."""


class ShapeError(AnelmError):
    """An op got operands whose shapes or dtypes it cannot take."""


class CompileError(AnelmError):
    """A program breaks an ANE constraint. Names the node, the constraint and the fix."""

    def __init__(self, node: str, constraint: str, fix: str = ""):
        self.node, self.constraint, self.fix = node, constraint, fix
        msg = f"node '{node}': {constraint}"
        super().__init__(msg + (f"; fix: {fix}" if fix else ""))


class MILSyntaxError(AnelmError):
    """Malformed MIL text, with line and column."""

    def __init__(self, message: str, line: int, column: int, source: str = "model.mil"):
        self.line, self.column = line, column
        super().__init__(f"{source}:{line}:{column}: {message}")


class BlobError(AnelmError):
    """A BLOBFILE that is missing, truncated, or does not hold what the MIL says."""


class DeviceError(AnelmError):
    """The device refused a request (the hardware would return an error status)."""

    def __init__(self, message: str, code: int | None = None):
        self.code = code
        super().__init__(message if code is None else f"{message} (status 0x{code:x})")


class CompileBudgetExceeded(DeviceError):
    """The per-process compile budget is spent; the process must restart to compile again."""
