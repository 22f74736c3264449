"""The external MIL conformance cases (../shared/data/mil-conformance) through the Emulator
and through a Kernel, within each case's index.json tolerance (max|got − ref| / max|ref|, docs/testing.md).

expected.npz was computed independently (numpy, fp16 rounding after each op), so these check
the parser, the blob reader, binding order and op numerics together against an outside oracle.
"""

import json

import numpy as np
import pytest

from anelm.compiler.artifact import Artifact
from anelm.device.base import Surface
from anelm.device.emulator import Emulator, read_packed
from anelm.chip.profile import STRICT
from anelm.runtime.cache import ProgramCache
from anelm.runtime.kernel import Kernel
from helpers import rel_err, shared_path

CASES = ["dyn_matmul", "swiglu_three_outputs", "reduce_max_softmax_channels", "causal_attention_decomposed"]


def load_case(name):
    root = shared_path("data", "mil-conformance")
    index = {c["case"]: c for c in json.loads((root / "index.json").read_text())}
    d = root / name
    with np.load(d / "inputs.npz") as i, np.load(d / "expected.npz") as e:
        return index[name], Artifact.load(d), dict(i), dict(e)



def test_index_lists_the_four_cases():
    root = shared_path("data", "mil-conformance")
    assert sorted(c["case"] for c in json.loads((root / "index.json").read_text())) == sorted(CASES)


@pytest.mark.parametrize("name", CASES)
def test_case_on_emulator_with_alphabetical_surfaces(name):
    case, art, inputs, expected = load_case(name)
    dev = Emulator(STRICT.replace(compile_budget=10**9))
    model = dev.compile(art.mil_text, art.weights)
    dev.load(model)
    ins, outs = [], []
    for n in sorted(case["inputs"]):  # the strict profile binds by MIL name, not declaration
        s = Surface(max(STRICT.min_surface_bytes, 1 << 17))
        s.write(inputs[n].astype(np.float16))
        ins.append(s)
    outs = [Surface(max(STRICT.min_surface_bytes, 1 << 17)) for _ in case["outputs"]]
    dev.evaluate(model, ins, outs)
    types = model.func.result_types()
    for n, s in zip(sorted(case["outputs"]), outs):
        assert rel_err(read_packed(s, types[n]), expected[n]) <= case["tolerance"], n
    dev.close()


@pytest.mark.parametrize("name", CASES)
def test_case_through_kernel(name):
    case, art, inputs, expected = load_case(name)
    dev = Emulator(STRICT.replace(compile_budget=10**9))
    with Kernel(art, dev, cache=ProgramCache()) as k:
        out = k.run(inputs)
    assert set(out) == set(case["outputs"])
    for n in case["outputs"]:
        assert out[n].dtype == np.float16 and out[n].shape == expected[n].shape
        assert rel_err(out[n], expected[n]) <= case["tolerance"], n
