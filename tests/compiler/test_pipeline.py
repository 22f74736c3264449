"""compile_graph end to end: MIL text that parses back, named consts, meta, debug verification,
and programs that run on the emulator to match independent references."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from anelm.compiler import registry
from anelm.compiler.pipeline import PIPELINE, compile_graph, run_pipeline
from anelm.chip.profile import STRICT
from anelm.errors import CompileError
from anelm.ir.builder import GraphBuilder
from anelm.mil.blob import decode_blob
from anelm.mil.parser import parse
from anelm.mil.text import print_program
from graph_ref_interp import evaluate
from helpers import rel_err, rms_norm_graph

RNG = np.random.default_rng(8)
NOBUDGET = STRICT.replace(compile_budget=10**9)


def block():
    """RMSNorm -> linear+bias -> gelu -> reduce_mean, fp32 surfaces cast at the boundary."""
    b = GraphBuilder("blk")
    x = b.input("x", [1, 16, 1, 32], "fp32")
    h = rms_norm_graph(b, b.cast(x, "fp16", name="x16"), RNG.standard_normal(16), name="rms")
    h = b.conv(h, RNG.standard_normal((16, 16)) * 0.25, bias=RNG.standard_normal(16), name="proj")
    h = b.gelu(h, name="act")
    b.output("y", b.cast(h, "fp32"))
    b.output("m", b.cast(b.reduce_mean(h, axes=[1]), "fp32"))
    return b.build()


def test_every_pipeline_name_is_registered():
    for entry in PIPELINE:
        for name in (entry,) if isinstance(entry, str) else entry:
            assert registry.get_pass(name).pass_name == name


def test_small_graph_compiles_to_parseable_mil_with_named_consts():
    g = block()
    before = str(g)
    art = compile_graph(g)
    text = art.mil_text
    assert str(g) == before  # the caller's graph is not touched
    assert print_program(parse(text)) == text
    for needle in ('string proj_conv_pad_type = const()', 'tensor<int32, [2]> proj_conv_strides = const()',
                   'fp16 rms_nhalf = const()[name = string("rms_nhalf"), val = fp16(-0.5)]',
                   'string x16_dtype = const()', "func main<ios18>(tensor<fp32, [1, 16, 1, 32]> x)",
                   "@model_path/weights/proj_weight.bin", "@model_path/weights/proj_bias.bin"):
        assert needle in text, needle
    for banned in ("gelu(", "reduce_mean(", "(bias =", ", bias =", "identity("):
        assert banned not in text
    prog = parse(text)
    assert prog.main.outputs == ["o0_y", "o1_m"]  # declared y, m: not alphabetical
    assert [s.name for s in art.signature.outputs] == ["o0_y", "o1_m"]
    assert art.meta["aliases"] == {"o0_y": "y", "o1_m": "m"}
    assert art.signature.inputs[0].surface_bytes == 49152
    assert set(art.weights) == {r.path for r in _blob_refs(prog)}
    assert {"sram", "surface_bytes", "warnings", "passes", "concat_outputs"} <= set(art.meta)
    assert art.meta["passes"][:2] == ["decompose", "conv_bias_split"]
    json.dumps(art.meta)  # meta goes to meta.json


def _blob_refs(prog):
    from anelm.compiler.artifact import blob_refs
    return blob_refs(prog)


def test_pipeline_numerics_match_float64_reference():
    g = block()
    xv = RNG.standard_normal((1, 16, 1, 32)).astype(np.float32)
    ref = evaluate(g, [xv])
    out = evaluate(run_pipeline(g), [xv])
    assert rel_err(out["y"], ref["y"]) < 2e-3 and rel_err(out["m"], ref["m"]) < 2e-3


def test_inner_concat_is_a_compile_error():
    b = GraphBuilder()
    x = b.input("x", [1, 8, 1, 16])
    cat = b.concat([x, b.relu(x)], axis=1, name="cat")
    b.output("y", b.exp(cat))
    with pytest.raises(CompileError, match="node 'cat'.*fix:"):
        compile_graph(b.build())


def test_debug_1_verifies_between_passes(monkeypatch):
    def breaks_ssa(graph, profile=STRICT):
        graph.nodes.reverse()
        return graph
    monkeypatch.setitem(registry.PASSES, "test_breaks_ssa", breaks_ssa)
    monkeypatch.setenv("ANELM_DEBUG", "1")
    with pytest.raises(CompileError, match="after pass 'test_breaks_ssa'"):
        run_pipeline(block(), passes=["decompose", "test_breaks_ssa"])
    monkeypatch.setenv("ANELM_DEBUG", "0")
    run_pipeline(block(), passes=["test_breaks_ssa"])  # unchecked without the flag


def test_debug_2_prints_graph(monkeypatch, capsys):
    monkeypatch.setenv("ANELM_DEBUG", "2")
    run_pipeline(block(), passes=["decompose", "dead_code_elimination"])
    err = capsys.readouterr().err
    assert "--- after decompose\ngraph blk(" in err and "after dead_code_elimination (no change)" in err


def test_identity_on_a_returned_value_keeps_output_name():
    b = GraphBuilder()
    x = b.input("x", [1, 8, 1, 16])
    b.output("y", b.reshape(b.relu(x), [1, 8, 1, 16]))  # output() names the reshape "y"
    art = compile_graph(b.build())
    assert parse(art.mil_text).main.outputs == ["y"] and "reshape(" not in art.mil_text


# --- on the emulator -------------------------------------------------------------------------

def run_on_emulator(art, inputs_by_user_name):
    from anelm.device.emulator import Emulator
    from anelm.runtime.kernel import Kernel
    with Kernel(art, Emulator(NOBUDGET)) as k:  # the Kernel maps aliases and joins concats
        return k.run(inputs_by_user_name)


def conformance(case):
    # ../shared beside the repo holds the conformance programs; a user's clone lacks it
    root = Path(__file__).resolve().parents[3] / "shared" / "data" / "mil-conformance" / case
    if not root.exists():
        pytest.skip(f"{root} is absent: ../shared (external fixtures) is not part of a user's clone")
    tol = next(c["tolerance"] for c in json.loads((root.parent / "index.json").read_text()) if c["case"] == case)
    return root, dict(np.load(root / "inputs.npz")), dict(np.load(root / "expected.npz")), tol


def test_swiglu_conformance_case_on_emulator():
    root, ins, want, tol = conformance("swiglu_three_outputs")
    w1, w3 = (decode_blob((root / "weights" / f).read_bytes(), 64, "fp16", (128, 64, 1, 1)) for f in ("w1.bin", "w3.bin"))
    b = GraphBuilder("swiglu")
    x = b.input("x", [1, 64, 1, 128])
    h1, h3 = b.conv(x, w1, name="c1"), b.conv(x, w3, name="c3")
    gate = b.silu(h1) * h3
    for name, v in (("h3", h3), ("gate", gate), ("h1", h1)):  # not alphabetical, as the case
        b.output(name, v)
    art = compile_graph(b.build(), NOBUDGET)
    assert "silu(" not in art.mil_text and "sigmoid(" in art.mil_text
    got = run_on_emulator(art, ins)
    for name in ("h1", "h3", "gate"):
        assert rel_err(got[name], want[name]) <= tol, name


def test_causal_attention_conformance_case_on_emulator():
    root, ins, want, tol = conformance("causal_attention_decomposed")
    mask = decode_blob((root / "weights" / "mask.bin").read_bytes(), 64, "fp16", (1, 1, 64, 64))
    b = GraphBuilder("attn")
    v, q, k = (b.input(n, [1, 4, 64, 32]) for n in "vqk")  # declared v, q, k as the case
    b.output("o", b.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    art = compile_graph(b.build(), NOBUDGET)
    assert "scaled_dot_product_attention(" not in art.mil_text and "softmax(" in art.mil_text
    assert [s.name for s in art.signature.inputs] == ["i0_v", "i1_q", "i2_k"]
    got = run_on_emulator(art, ins)
    assert rel_err(got["o"], want["o"]) <= tol


def test_returned_concat_runs_as_parts_and_reassembles():
    b = GraphBuilder("heads")
    x = b.input("x", [1, 32, 1, 16])
    wa, wb = RNG.standard_normal((16, 32)) * 0.2, RNG.standard_normal((8, 32)) * 0.2
    b.output("y", b.concat([b.linear(x, wa, name="ha"), b.sigmoid(b.linear(x, wb, name="hb"))], axis=1))
    g = b.build()
    art = compile_graph(g, NOBUDGET)
    assert "concat(" not in art.mil_text
    rec = art.meta["concat_outputs"]["y"]
    xv = RNG.standard_normal((1, 32, 1, 16)).astype(np.float16)
    got = run_on_emulator(art, {"x": xv})
    assert not set(rec["parts"]) & set(got)  # the parts come back joined as y
    y = got["y"]
    ref = np.concatenate([np.einsum("oi,bihs->bohs", wa, xv.astype(np.float64)),
                          1 / (1 + np.exp(-np.einsum("oi,bihs->bohs", wb, xv.astype(np.float64))))], axis=1)
    assert rel_err(y, ref) < 1e-2  # matmul-class tolerance (docs/testing.md)


def test_gelu_block_on_emulator_matches_float64():
    g = block()
    art = compile_graph(g, NOBUDGET)
    xv = RNG.standard_normal((1, 16, 1, 32)).astype(np.float32)
    got = run_on_emulator(art, {"x": xv})
    ref = evaluate(g, [xv])
    assert rel_err(got["y"], ref["y"]) < 2e-2 and rel_err(got["m"], ref["m"]) < 2e-2  # a block (docs/testing.md)
    assert math.isfinite(float(np.abs(got["y"]).max()))
