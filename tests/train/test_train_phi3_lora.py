"""LoRA on Phi-3, whose checkpoint fuses q/k/v (`qkv_proj`) and gate/up (`gate_up_proj`) where
anelm splits them: one A shared by the parts, B split row-wise (`models/adapters.py`).

- The LoRA step (base frozen on the emulator) against PEFT autograd on HF's Phi3ForCausalLM
  (eager attention): the loss and the gradient of every lora_A and lora_B, the fused ones'
  dA summed over the parts, under a partial rotation (6 of 8 dims) and LongRoPE past its
  original context (the step's 16 positions run the long factors, as HF's pass of 16 does),
  with the tolerances of tests/train/test_train_lora_step.py (docs/testing.md).
- `anelm finetune` on a tiny Phi-3 with the default targets (every linear, the fused ones
  among them) writes a PEFT adapter on `qkv_proj`/`gate_up_proj` that PEFT loads onto HF's model
  with our logits.
"""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import family_tiny
import hf_tiny
from helpers import GRAD_COSINE, GRAD_TOL, rel_err

from anelm.chip.profile import STRICT
from anelm.cli.main import main
from anelm.device import base
from anelm.device.emulator import Emulator
from anelm.models.adapters import LoraSpec
from anelm.models.formats.peft import load_peft
from anelm.models.config import config_from_dict
from anelm.models.loading import architecture, build_model, load_model
from anelm.train.steps import lora_train_step

peft = pytest.importorskip("peft")
transformers = hf_tiny.transformers

S, B, RANK, ALPHA, SCALE = 16, 2, 4, 8.0, 1024.0
PROFILE = STRICT.replace(compile_budget=10**9)
TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@pytest.fixture(autouse=True, scope="module")
def _compile_count_as_found():
    yield
    base.reset_compile_count()


@pytest.fixture(scope="module")
def reference():
    """(our config, base weights, the adapter by our names, x, y, PEFT's loss and grads)."""
    hf_cfg = transformers.Phi3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                     original_max_position_embeddings=8, partial_rotary_factor=0.75,
                                     rope_scaling={"type": "longrope", "short_factor": [1.0, 1.25, 2.0],
                                                   "long_factor": [1.0, 2.0, 4.0]},
                                     pad_token_id=0, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(hf_cfg).float().eval()
    hf_tiny.randomize(model, seed=2, std=0.2)
    cfg = config_from_dict(hf_cfg.to_dict())
    weights = architecture("phi3").sanitize({n: t.detach().numpy().copy() for n, t in model.state_dict().items()}, cfg)
    pm = peft.get_peft_model(model, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(TARGETS)))
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.2)  # non-zero B, or dA is zero
    rng = np.random.default_rng(1)
    x, y = rng.integers(0, 64, (B, S)), rng.integers(0, 64, (B, S))
    logits = pm(torch.tensor(x)).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.tensor(y).reshape(-1))
    loss.backward()
    ours = lambda n: n.replace("base_model.model.", "", 1).replace(".default", "")  # noqa: E731
    adapter = {ours(n): p.detach().numpy().copy() for n, p in pm.named_parameters() if "lora_" in n}
    grads = {ours(n): p.grad.numpy().copy() for n, p in pm.named_parameters() if "lora_" in n}
    return cfg, weights, adapter, x, y, loss.item(), grads


@pytest.mark.parametrize("pipeline", ["dynamic", "static"])
def test_fused_adapter_gradients_match_peft(reference, pipeline):
    cfg, weights, adapter, x, y, ref_loss, ref_grads = reference
    assert cfg.rope_type == "longrope" and S > cfg.original_max_position_embeddings
    with lora_train_step(cfg, weights, Emulator(PROFILE), seq_len=S, spec=LoraSpec(RANK, ALPHA, 0.0, TARGETS),
                         adapter=adapter, pipeline=pipeline) as step:
        loss, grads, _ = step.loss_and_grads(x, y, loss_scale=SCALE)
    assert abs(loss - ref_loss) / ref_loss <= 1e-2
    assert set(grads) == set(ref_grads) and any(".qkv_proj.lora_A" in n for n in grads)
    for name, want in ref_grads.items():
        got = grads[name] / SCALE
        cos = np.dot(got.ravel(), want.ravel()) / (np.linalg.norm(got) * np.linalg.norm(want))
        assert got.shape == want.shape and rel_err(got, want) <= GRAD_TOL and cos >= GRAD_COSINE, (name, cos)


def test_finetune_writes_a_fused_peft_adapter_that_peft_loads_with_our_logits(tmp_path, capsys):
    hf = family_tiny.make("phi3", tmp_path / "base", seed=51)
    ids = family_tiny.word_text(tmp_path / "text.txt", 300, seed=52)
    assert main(["finetune", "--model", str(tmp_path / "base"), "--data", str(tmp_path / "text.txt"), "--steps", "2",
                 "--seq-len", "32", "--out", str(tmp_path / "run"), "--device", "emulator"]) == 0
    capsys.readouterr()
    folder = tmp_path / "run" / "adapter"
    cfg = json.loads((folder / "adapter_config.json").read_text())
    assert set(cfg["target_modules"]) == set(TARGETS)  # the default: every linear, the fused modules as HF has them
    pm = peft.PeftModel.from_pretrained(hf, folder).eval()
    shapes = {n: tuple(p.shape) for n, p in pm.named_parameters() if "qkv_proj.lora_B" in n}
    assert set(shapes.values()) == {(64 + 2 * 32, 8)}  # B over the fused rows: q (4 heads) + k, v (2 each)
    config, weights, _ = load_model(tmp_path / "base")
    model = build_model(config, weights)
    model.set_adapter(load_peft(folder, config))
    for n in (12, 60):  # within and past the original context of 48
        assert rel_err(model.forward(ids[:n]), hf_tiny.hf_logits(pm, ids[:n])) < 1e-4
    with pm.disable_adapter():
        plain = hf_tiny.hf_logits(pm, ids[:60])
    assert rel_err(hf_tiny.hf_logits(pm, ids[:60]), plain) > 1e-4  # the adapter learned something
