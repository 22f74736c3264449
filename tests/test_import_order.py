"""The package keeps the import order of docs/architecture.md: a module imports
only from its own folder and the folders below it, so each layer can be read, tested and
replaced without the ones above."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "anelm"

# lowest first (`api`, the Python API at the top of the package, builds on every layer, the
# CLI's finetune included); modules on one line are peers (errors and atomic import nothing of anelm; caches
# writes its source fingerprint's memo through atomic)
LAYERS = [("errors", "atomic"), ("caches",), ("fp16",), ("mil",), ("ir",), ("chip",), ("models",), ("compiler",), ("device",),
          ("runtime",), ("kernels",), ("generate",), ("serve",), ("train",), ("quant",), ("bench",), ("doctor",),
          ("cli",), ("api",)]
RANK = {name: i for i, group in enumerate(LAYERS) for name in group}
TOP = {"__init__", "__main__"}  # the package itself: its version, and `python -m anelm`


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every `anelm` import in one file, relative ones resolved."""
    package = ["anelm", *path.relative_to(PACKAGE).parts[:-1]]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "anelm"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                if node.module:
                    found.append((node.lineno, ".".join(base + node.module.split("."))))
                else:
                    found += [(node.lineno, ".".join(base + [a.name])) for a in node.names]
            elif node.module and node.module.split(".")[0] == "anelm":
                found.append((node.lineno, node.module))
    return found


def layer_of(module_parts: list[str]) -> str | None:
    """The layer a module of the package belongs to: its first folder (or top-level module);
    None for the package's own `__init__` (`from .. import __version__`)."""
    name = module_parts[0].removesuffix(".py")
    exists = (PACKAGE / name).is_dir() or (PACKAGE / f"{name}.py").is_file()
    return None if name in TOP or not exists else name


def violations() -> list[str]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        own = layer_of(list(path.relative_to(PACKAGE).parts))
        if own is None:
            continue
        assert own in RANK, f"{path}: folder {own!r} has no place in LAYERS (docs/architecture.md)"
        for line, module in imported_modules(path):
            parts = module.split(".")[1:]
            target = layer_of(parts) if parts else None
            if target is None or target == own:
                continue
            assert target in RANK, f"{path}:{line}: {module} is in no layer of LAYERS"
            if RANK[target] >= RANK[own]:
                out.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}")
    return out


# imports against the order that the package still has (issue 11): this list only shrinks
KNOWN: dict[str, str | tuple[str, ...]] = {}


def known(violation: str) -> bool:
    where, module = violation.split(" imports ")
    allowed = KNOWN.get(where.split(":")[0], ())
    return module in ((allowed,) if isinstance(allowed, str) else allowed)


def test_no_module_imports_against_the_layer_order():
    assert [v for v in violations() if not known(v)] == []


def test_the_known_violations_are_still_there():
    """A violation fixed comes off KNOWN, so the list says what is left."""
    found = violations()
    stale = [(f, m) for f, ms in KNOWN.items() for m in ((ms,) if isinstance(ms, str) else ms)
             if not any(v.startswith(f + ":") and v.endswith(" imports " + m) for v in found)]
    assert stale == []


def test_relative_imports_resolve_to_their_folders():
    modules = [m for _, m in imported_modules(PACKAGE / "mil" / "text.py")]
    assert "anelm.errors" in modules and "anelm.mil.program" in modules
