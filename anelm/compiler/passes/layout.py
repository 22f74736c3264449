"""Layout passes: conv bias, concat, I/O naming and surface sizes (docs/chip-profiles.md).

What they record for the runtime goes to `graph.meta` and from there to the Artifact meta:
  * `concat_outputs`: {"y": {"parts": ["y_p0", "y_p1"], "axis": 1}} (user-facing part names);
  * `aliases`: {mil_name: user_name} for every input or output renamed for binding order;
  * `surface_bytes`: {"inputs": [n, ...], "outputs": [m, ...]}, the allocation of each surface
    in declared order (one size per direction when the profile wants them uniform).
"""

from __future__ import annotations

from ...chip.profile import STRICT, ChipProfile
from ...chip.surfaces import bind_order, surface_sizes
from ...errors import CompileError
from ...ir.builder import GraphBuilder
from ...ir.graph import Graph, Node, Value, const_type
from ..registry import register_pass


@register_pass("conv_bias_split")
def conv_bias_split(graph: Graph, profile: ChipProfile = STRICT) -> Graph | None:
    """ANE conv takes no bias (a compile-time reject): move it to an add with a [1, C, 1, 1] const.

        tensor<fp16, [1, 32, 1, 16]> y = conv(bias = b, ..., weight = w, x = x)[name = string("y")];
     => tensor<fp16, [1, 32, 1, 16]> y_conv = conv(..., weight = w, x = x)[name = string("y_conv")];
        tensor<fp16, [1, 32, 1, 1]> y_bias = const()[... BLOBFILE ...];
        tensor<fp16, [1, 32, 1, 16]> y = add(x = y_conv, y = y_bias)[name = string("y")];
    """
    todo = [n for n in graph.nodes if n.op == "conv" and n.inputs.get("bias") is not None]
    for n in todo:
        _split_bias(graph, n)
    if not todo:
        return None
    graph.topo_sort()
    return graph


def _split_bias(graph: Graph, n: Node) -> None:
    b = GraphBuilder.on(graph)
    old, bias = n.out, n.inputs.pop("bias")
    graph.release_name(old.name)
    n.name = graph.fresh_name(f"{old.name}_conv")
    n.outputs = [Value(n.name, old.type, n)]
    shape = [1, bias.shape[0]] + [1] * (old.rank - 2)  # per-channel, broadcast over space
    src = bias.producer
    if src is not None and src.is_const and not graph.uses(bias) and not graph.is_output(bias):
        src.value = src.value.reshape(shape)  # sole reader was this conv: reshape the const itself
        src.blob = True
        bias.type = const_type(src.value)
    elif src is not None and src.is_const:
        bias = b.const(src.value.reshape(shape), name=f"{old.name}_bias", blob=True)
    else:
        bias = b.reshape(bias, shape, name=f"{old.name}_bias")
    new = b.add(n.out, bias, name=old.name)
    graph.replace_all_uses(old, new)


def _flatten_concats(graph: Graph) -> bool:
    """concat(concat(a, b), c) on one axis, inner used once -> concat(a, b, c)."""
    changed = False
    for n in graph.nodes:
        if n.op != "concat" or n.params.get("interleave"):
            continue
        parts: list[Value] = []
        for v in n.inputs["values"]:
            p = v.producer
            if p is not None and p.op == "concat" and not p.params.get("interleave") and \
                    _axis(p) == _axis(n) and len(graph.uses(v)) == 1 and not graph.is_output(v):
                parts.extend(p.inputs["values"])
                changed = True
            else:
                parts.append(v)
        n.inputs["values"] = tuple(parts)
    return changed


def _axis(n: Node) -> int:
    return int(n.params["axis"]) % n.out.rank


@register_pass("concat_elimination")
def concat_elimination(graph: Graph, profile: ChipProfile = STRICT) -> Graph | None:
    """A rejected concat that is only returned becomes one output per part; the CPU rebuilds it.

        tensor<fp16, [1, 96, 1, 16]> y = concat(axis = y_axis, interleave = y_interleave, values = (a, b))[...];
        } -> (y);
     => } -> (a, b);          meta["concat_outputs"] = {"y": {"parts": ["y_p0", "y_p1"], "axis": 1}}
    """
    if "concat" not in profile.rejected_ops:
        return None
    changed = _flatten_concats(graph)
    dead = []
    for n in [n for n in graph.nodes if n.op == "concat"]:
        if graph.users(n.out) or n.params.get("interleave"):
            raise CompileError(n.name, f"concat is rejected by profile '{profile.name}' "
                               "(see docs/chip-profiles.md) and "
                               + ("its result is read inside the program" if graph.users(n.out)
                                  else "an interleaved concat cannot be returned as parts"),
                               "keep the parts separate inside the program (apply the consumer per part, "
                               "e.g. one matmul per head) or return them and concatenate on the CPU")
        _split_outputs(graph, n)
        dead.append(n)
    graph.remove_nodes(dead)
    return graph if dead or changed else None


def _split_outputs(graph: Graph, n: Node) -> None:
    new: dict[str, Value] = {}
    record = graph.meta.setdefault("concat_outputs", {})
    for key, v in graph.outputs.items():
        if v is not n.out:
            new[key] = v
            continue
        names = []
        for i, part in enumerate(n.inputs["values"]):
            pk = _free_key(f"{key}_p{i}", graph.outputs, new)
            new[pk] = part
            names.append(pk)
        record[key] = {"parts": names, "axis": _axis(n)}
    graph.outputs = new


def _free_key(key: str, *taken: dict) -> str:
    k, i = key, 0
    while any(k in t for t in taken):
        i += 1
        k = f"{key}_{i}"
    return k


@register_pass("io_naming")
def io_naming(graph: Graph, profile: ChipProfile = STRICT) -> Graph | None:
    """Make MIL names sort in the declared order (surfaces bind alphabetically).

    Returned values take their output names. When the declared order is not alphabetical,
    names get an order-preserving prefix and meta["aliases"] maps them back:

        func main<ios18>(... v, ... q, ... k)   -> (h3, gate, h1)
     => func main<ios18>(... i0_v, ... i1_q, ... i2_k)   -> (o0_h3, o1_gate, o2_h1)
    """
    _check_returnable(graph)
    aliases = graph.meta.setdefault("aliases", {})
    changed = _rename(graph, [(v.name, v) for v in graph.inputs], "i", profile, "inputs", aliases)
    changed |= _rename(graph, list(graph.outputs.items()), "o", profile, "outputs", aliases)
    return graph if changed else None


def _check_returnable(graph: Graph) -> None:
    seen: dict[int, str] = {}
    for key, v in graph.outputs.items():
        if graph.is_input(v):
            raise CompileError(key, f"output '{key}' returns input '{v.name}' unchanged",
                               "use the input on the CPU; the program need not return it")
        if id(v) in seen:
            raise CompileError(key, f"outputs '{seen[id(v)]}' and '{key}' return the same value",
                               "return it once and copy it on the CPU")
        seen[id(v)] = key


def _rename(graph: Graph, items: list[tuple[str, Value]], tag: str, profile: ChipProfile, side: str,
            aliases: dict) -> bool:
    users = [u for u, _ in items]
    want = users
    used = _names_in_use(graph)
    clash = any(u in used and u != v.name for u, v in items)
    if clash or bind_order(users, profile, side) != users:
        width = len(str(len(items) - 1))
        want = [f"{tag}{i:0{width}d}_{u}" for i, u in enumerate(users)]
    changed = False
    for (user, v), mil in zip(items, want):
        if v.name == mil:
            continue
        if mil in used:
            raise CompileError(user, f"cannot name the surface '{mil}': the name is already used",
                               f"rename the value called '{mil}'")
        graph.release_name(mil)  # reserved by a removed node, perhaps, but free now
        graph.rename(v, mil)
        used.add(mil)
        changed = True
        if mil != user:
            aliases[mil] = user
    return changed


def _names_in_use(graph: Graph) -> set[str]:
    return {v.name for v in graph.inputs} | {o.name for n in graph.nodes for o in n.outputs}


@register_pass("uniform_surfaces")
def uniform_surfaces(graph: Graph, profile: ChipProfile = STRICT) -> Graph | None:
    """Annotate (no rewrite) one allocation size per direction (uniform, at least 49,152 bytes).

    Every input surface gets the largest input's byte size, at least `min_surface_bytes`;
    outputs likewise, judged apart. The runtime pads and writes packed data from byte 0.
    """
    record = {"inputs": surface_sizes([v.type.nbytes for v in graph.inputs], profile, "inputs"),
              "outputs": surface_sizes([v.type.nbytes for v in graph.outputs.values()], profile, "outputs")}
    graph.meta["surface_bytes"] = record
    return None  # an annotation: the program itself is unchanged

