"""LoRA adapters on the device pipeline (emulator, strict) against PEFT on PyTorch: the logits
of prefill and decode with an adapter, after a swap to a smaller-rank adapter on fewer targets
(zero-padded into the same kernels), and with the adapter dropped, each within docs/testing.md's
whole-model tolerance (LOGITS_TOL: every layer runs in fp16); and none of the three compiles.
`set_adapter` is part of the `Runner` protocol: the CPU reference and the device runner both
satisfy it and swap without compiling.
"""

import numpy as np
import peft
import pytest
from helpers import LOGITS_TOL, rel_err
from hf_tiny import hf_logits, make_hf
from lora_tiny import make_peft

from anelm.chip.profile import STRICT
from anelm.device.base import compile_count
from anelm.device.emulator import Emulator
from anelm.generate.pipeline import build_runner
from anelm.models.formats.peft import load_peft
from anelm.models.errors import AdapterError
from anelm.models.loading import load_model

NOBUDGET = STRICT.replace(compile_budget=10**9)  # the process-wide count spans every test file
IDS = [1, 17, 42, 5, 88, 60, 9, 31, 77, 3, 64, 12, 50]
PROMPT = 9  # prefill 9 positions (bucket 16), decode the remaining 4 through the decode kernels
# (first adapter's targets, second's): the second has rank 2 in the first's rank-4 slots
CASES = {"llama-gqa": (["q_proj", "v_proj", "down_proj"], ["v_proj"]),
         "qwen3-untied": (["q_proj", "k_proj", "o_proj", "up_proj"], ["k_proj", "up_proj"]),
         "gpt2": (["c_attn", "c_proj", "c_fc"], ["c_fc"])}


def fresh_hf(folder):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder).eval()


def device_logits(runner) -> np.ndarray:
    cache = runner.new_cache()
    rows = [runner.prefill(IDS[:PROMPT], cache)]
    rows += [runner.decode(t, cache)[None] for t in IDS[PROMPT:]]
    return np.concatenate(rows)


@pytest.mark.parametrize("kind", list(CASES))
def test_device_logits_with_swapped_and_dropped_adapters_equal_peft(kind, tmp_path):
    first, second = CASES[kind]
    base = make_hf(kind, tmp_path / "base", seed=7)
    pa = make_peft(fresh_hf(tmp_path / "base"), kind, tmp_path / "a", rank=4, seed=1, targets=first)
    pb = make_peft(fresh_hf(tmp_path / "base"), kind, tmp_path / "b", rank=2, seed=2, targets=second)
    config, weights, _ = load_model(tmp_path / "base")
    a, b = load_peft(tmp_path / "a", config), load_peft(tmp_path / "b", config)
    runner = build_runner(config, weights, Emulator(NOBUDGET), adapter=a)

    got, want = device_logits(runner), hf_logits(pa, IDS)
    assert rel_err(got, want) < LOGITS_TOL
    assert rel_err(want, hf_logits(base, IDS)) > 5 * LOGITS_TOL  # the adapter is far outside the tolerance
    compiled, kernels = compile_count(), len(runner.kernels)

    runner.set_adapter(b)
    assert rel_err(device_logits(runner), hf_logits(pb, IDS)) < LOGITS_TOL
    runner.set_adapter(None)
    assert rel_err(device_logits(runner), hf_logits(base, IDS)) < LOGITS_TOL
    runner.set_adapter(a)
    np.testing.assert_array_equal(device_logits(runner), got)
    assert (compile_count(), len(runner.kernels)) == (compiled, kernels)


def test_adapters_beyond_the_slots_are_refused(tmp_path):
    make_hf("llama-gqa", tmp_path / "base", seed=7)
    # strict rounds the kernels' rank up to its spatial multiple: slots of rank 4 hold up to 16
    make_peft(fresh_hf(tmp_path / "base"), "llama-gqa", tmp_path / "big", rank=20, targets=["q_proj"])
    make_peft(fresh_hf(tmp_path / "base"), "llama-gqa", tmp_path / "other", rank=2, targets=["o_proj"])
    config, weights, _ = load_model(tmp_path / "base")
    runner = build_runner(config, weights, Emulator(NOBUDGET), lora_rank=4, lora_targets=("q_proj", "v_proj"))
    with pytest.raises(AdapterError, match=r"adapter of rank 20 on q_proj does not fit the kernels' slots: "
                                           r"expected rank <= 16 on roles q, v"):
        runner.set_adapter(load_peft(tmp_path / "big", config))
    with pytest.raises(AdapterError, match="does not fit the kernels' slots"):
        runner.set_adapter(load_peft(tmp_path / "other", config))
    plain = build_runner(config, weights, Emulator(NOBUDGET))
    plain.prefill([1, 2, 3], plain.new_cache())
    with pytest.raises(AdapterError, match="compiled without adapter inputs"):
        plain.set_adapter(load_peft(tmp_path / "other", config))


def test_both_runners_satisfy_the_protocol_and_swap_adapters_without_compiling(tmp_path):
    """The CPU reference and the device runner are `Runner`s, `set_adapter` included: an adapter,
    None (the base alone) and the adapter again, each with the oracle's logits (PEFT's or the
    base's; the device within LOGITS_TOL, the CPU in float32) and no compile after the first."""
    from anelm.generate.runner import Runner
    from anelm.models.loading import build_model

    base = make_hf("llama-gqa", tmp_path / "base", seed=7)
    pa = make_peft(fresh_hf(tmp_path / "base"), "llama-gqa", tmp_path / "a", rank=4, seed=1)
    config, weights, _ = load_model(tmp_path / "base")
    a = load_peft(tmp_path / "a", config)
    with_a, alone = hf_logits(pa, IDS), hf_logits(base, IDS)
    assert rel_err(with_a, alone) > 5 * LOGITS_TOL  # the swap is visible beyond the tolerance

    class NoAdapters:  # the rest of the interface without set_adapter is not a Runner
        config, device = None, "cpu"
        new_cache = prefill = decode = staticmethod(lambda *a, **k: None)

    assert not isinstance(NoAdapters(), Runner)
    cpu, dev = build_model(config, weights), build_runner(config, weights, Emulator(NOBUDGET), adapter=a)
    for runner, tol in ((cpu, 1e-4), (dev, LOGITS_TOL)):  # the CPU in float32, the device in fp16
        assert isinstance(runner, Runner), type(runner).__name__
        runner.set_adapter(a)
        assert rel_err(device_logits(runner), with_a) < tol
        compiled = compile_count()
        runner.set_adapter(None)
        assert rel_err(device_logits(runner), alone) < tol
        runner.set_adapter(a)
        assert rel_err(device_logits(runner), with_a) < tol
        assert compile_count() == compiled, type(runner).__name__
