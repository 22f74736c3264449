"""A LoRA adapter on the real model: SmolLM2-135M-Instruct (GGUF in ../shared) with a random
non-zero adapter on q_proj and v_proj, `anelm perplexity --adapter` on the emulator under
`strict` against HF transformers + PEFT in float32 on the same windows. The judge is
docs/testing.md's real-model rule (argmax agreement >= 98.5 %, perplexity ratio within 1 %); the adapter moves
the perplexity far more than that. Then, in one runner, a swap to another adapter and a drop
compile nothing."""

from __future__ import annotations

import json

import numpy as np
import pytest

peft = pytest.importorskip("peft")

from anelm.chip.profile import STRICT  # noqa: E402
from anelm.cli.main import main  # noqa: E402
from anelm.device.base import compile_count  # noqa: E402
from anelm.device.emulator import Emulator  # noqa: E402
from anelm.generate.perplexity import perplexity  # noqa: E402
from anelm.generate.pipeline import build_runner  # noqa: E402
from anelm.models.adapters import LoraSpec, init_adapter  # noqa: E402
from anelm.models.formats.peft import save_peft
from hf_tiny import hf_windows  # noqa: E402

AGREEMENT, PPL_RATIO = 0.985, 0.01  # real models (docs/testing.md)
SEQ, TOKENS = 64, 256  # four windows of 64: 30 prefill programs of one bucket


def random_adapter(config, rank, targets, seed, base):
    """PEFT's init with B redrawn N(0, 0.2), which moves the perplexity by tens of %."""
    a = init_adapter(config, LoraSpec(rank, 2.0 * rank, 0.0, targets, base), seed)
    rng = np.random.default_rng(seed + 100)
    for k, (A, B) in a.tensors.items():
        a.tensors[k] = (A, (0.2 * rng.standard_normal(B.shape)).astype(np.float32))
    return a


@pytest.mark.slow
def test_perplexity_with_an_adapter_matches_peft_and_swaps_compile_nothing(smollm, smollm_hf, smollm_gguf,
                                                                          tmp_path, capsys):
    config, weights, _ = smollm
    model, _ = smollm_hf
    a = random_adapter(config, 8, ("q_proj", "v_proj"), 1, str(smollm_gguf))
    b = random_adapter(config, 4, ("v_proj",), 2, str(smollm_gguf))
    save_peft(a, tmp_path / "a")
    prose = smollm_gguf.parents[1] / "text" / "apache-2.0.txt"
    assert main(["perplexity", "--model", str(smollm_gguf), "--adapter", str(tmp_path / "a"), "--data", str(prose),
                 "--seq-len", str(SEQ), "--max-tokens", str(TOKENS), "--json", "--device", "emulator"]) == 0
    out, err = capsys.readouterr()
    res = json.loads(out)
    assert "fp16 overflow" not in err  # the overflow warning (docs/chip-profiles.md): none
    ids = res["tokens"]
    base_nll, _ = hf_windows(model, ids, SEQ)
    pm = peft.PeftModel.from_pretrained(model, tmp_path / "a").eval()
    try:
        ref_nll, rows = hf_windows(pm, ids, SEQ)
    finally:
        pm.unload()  # the session's HF model, as it was
    agree = float(np.mean(np.asarray(res["argmax"]) == np.concatenate(rows).argmax(axis=1)))
    assert agree >= AGREEMENT, f"argmax agreement {agree:.4f}"
    assert abs(res["ppl"] / np.exp(ref_nll) - 1) <= PPL_RATIO, f"perplexity ratio {res['ppl'] / np.exp(ref_nll):.5f}"
    assert abs(np.exp(ref_nll - base_nll) - 1) > 10 * PPL_RATIO  # the adapter matters

    # the swaps on the first window alone: the programs are the CLI's (the program cache has them)
    window = ids[:SEQ]
    runner = build_runner(config, weights, Emulator(STRICT), max_context=SEQ, adapter=a)
    with_a = perplexity(runner, window, SEQ, progress=False).ppl
    compiled, kernels = compile_count(), len(runner.kernels)
    runner.set_adapter(b)
    with_b = perplexity(runner, window, SEQ, progress=False).ppl
    runner.set_adapter(None)
    alone = perplexity(runner, window, SEQ, progress=False).ppl
    assert (compile_count(), len(runner.kernels)) == (compiled, kernels)
    assert abs(alone / np.exp(hf_windows(model, window, SEQ)[0]) - 1) <= PPL_RATIO
    assert len({with_a, with_b, alone}) == 3 and abs(with_b / alone - 1) > 1e-3
    runner.close()
