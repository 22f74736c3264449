"""What an architecture is lives under anelm/models/ (`models/registry.py`): no module outside it
compares a model type or a family name, so adding an architecture touches no other branch.
Parsed with `ast`: a comparison (==, !=, in, not in) whose operand is a `.model_type` attribute,
or a string literal naming a model type or a family, is a branch on the architecture."""

import ast
from pathlib import Path

from anelm.kernels.families import FAMILIES
from anelm.models.registry import MODEL_TYPES, arch

PACKAGE = Path(__file__).resolve().parents[1] / "anelm"
NAMES = set(MODEL_TYPES) | set(FAMILIES) | {arch(t).gguf_arch for t in MODEL_TYPES}


def branches(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for operand in (node.left, *node.comparators):
                if isinstance(operand, ast.Attribute) and operand.attr == "model_type":
                    yield node.lineno, "compares .model_type"
                if isinstance(operand, ast.Constant) and operand.value in NAMES:
                    yield node.lineno, f"compares with {operand.value!r}"


def test_no_branch_on_an_architecture_outside_models():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] == "models":
            continue
        found += [f"{rel}:{line}: {what}" for line, what in branches(ast.parse(path.read_text(encoding="utf-8")))]
    assert not found, "branches on an architecture outside anelm/models/:\n" + "\n".join(found)


def test_the_check_sees_a_branch():
    assert list(branches(ast.parse("if config.model_type == 'x': pass")))
    assert list(branches(ast.parse("cls = A if kind == 'gpt2' else B")))
