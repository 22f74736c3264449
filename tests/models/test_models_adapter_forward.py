"""The CPU reference with a LoRA adapter: logits equal PEFT's on the same base and adapter
(float32 on both sides, so LOGITS_TOL is loose here: the margin is summation order), and an
adapter swapped or dropped at run time gives the other adapter's, or the base's, logits."""

import numpy as np
import pytest
from helpers import rel_err
from hf_tiny import hf_logits, make_hf
from lora_tiny import make_peft

from anelm.models.formats.peft import load_peft
from anelm.models.errors import AdapterError
from anelm.models.loading import build_model, load_model

FP32_TOL = 1e-4  # float32 against float32: only the order of the sums differs
IDS = [3, 17, 42, 5, 88, 60, 9, 31, 77, 2, 64]


def fresh_hf(folder):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder).eval()


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen3-untied", "gpt2"])
def test_logits_with_an_adapter_equal_peft(kind, tmp_path):
    base_hf = make_hf(kind, tmp_path / "base", seed=2)
    pm = make_peft(fresh_hf(tmp_path / "base"), kind, tmp_path / "a", seed=3)
    make_peft(fresh_hf(tmp_path / "base"), kind, tmp_path / "b", seed=4)
    config, weights, _ = load_model(tmp_path / "base")
    model = build_model(config, weights)
    a, b = load_peft(tmp_path / "a", config), load_peft(tmp_path / "b", config)
    base = model.forward(IDS)

    model.set_adapter(a)
    got, want = model.forward(IDS), hf_logits(pm, IDS)
    assert rel_err(got, want) < FP32_TOL
    assert rel_err(want, base) > 0.05  # the adapter matters to the logits

    model.set_adapter(b)  # swap
    pm_b = fresh_hf(tmp_path / "base")
    import peft

    assert rel_err(model.forward(IDS), hf_logits(peft.PeftModel.from_pretrained(pm_b, tmp_path / "b"), IDS)) < FP32_TOL
    model.set_adapter(None)  # drop
    np.testing.assert_array_equal(model.forward(IDS), base)
    assert rel_err(base, hf_logits(base_hf, IDS)) < FP32_TOL


def test_an_adapter_that_does_not_fit_is_refused(tmp_path):
    make_hf("llama-gqa", tmp_path / "gqa", seed=1)
    make_hf("llama-mha", tmp_path / "mha", seed=1)
    make_peft(fresh_hf(tmp_path / "gqa"), "llama-gqa", tmp_path / "a")
    gqa, mha = load_model(tmp_path / "gqa")[0], load_model(tmp_path / "mha")
    model = build_model(mha[0], mha[1])
    with pytest.raises(AdapterError, match="an adapter for another base"):
        model.set_adapter(load_peft(tmp_path / "a", gqa))
    assert model.adapter is None
