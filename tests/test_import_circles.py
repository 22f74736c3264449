"""No import circle inside a folder: within each top-level package folder, its subfolders
included, the modules import one another in one direction, so each can be read from the ones
it builds on. Imports inside functions count too (a lazy import only hides a circle until the
code runs). Between folders the layer order of tests/test_import_order.py rules circles out."""

from collections import defaultdict
from pathlib import Path

from test_import_order import PACKAGE, imported_modules


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def folder_graphs() -> dict[str, dict[str, set[str]]]:
    """{layer: {module: the modules of the same layer it imports}}: a layer is a top-level folder
    of the package with its subfolders (device/ with device/emulator/ and device/ane/), so a
    circle through a subfolder and its parent counts too."""
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graphs: dict[str, dict[str, set[str]]] = defaultdict(dict)
    for mod, path in paths.items():
        layer = ".".join(mod.split(".")[:2])
        edges = set()
        for _, target in imported_modules(path):
            while target and target not in paths:  # `from x import name`: the module x
                target = target.rpartition(".")[0]
            if target and target != mod and ".".join(target.split(".")[:2]) == layer:
                edges.add(target)
        graphs[layer][mod] = edges
    return graphs


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_inside_a_folder():
    found = {folder: c for folder, g in folder_graphs().items() if (c := circles(g))}
    assert not found, f"import circles inside folders (open them): {found}"


def test_the_check_sees_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
