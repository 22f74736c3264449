"""PEFT adapters on the tiny HF models of `hf_tiny`: the oracles of the LoRA tests (`import
lora_tiny` from any test folder). B is redrawn non-zero (PEFT starts it at zero, where an
adapter changes nothing), so every tensor of the adapter matters to the logits."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

TARGETS = {"gpt2": ["c_attn", "c_proj"], "llama-gqa": ["q_proj", "v_proj", "down_proj"],
           "qwen3-untied": ["q_proj", "k_proj", "o_proj", "up_proj"]}


def make_peft(hf_model, kind: str, folder: Path | None = None, rank: int = 4, alpha: float = 8.0,
              seed: int = 0, targets=None):
    """`hf_model` wrapped by PEFT LoRA (random A and B), saved to `folder` when given; returns
    the PeftModel. It wraps the very model passed: build a fresh base for each adapter."""
    cfg = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets or TARGETS[kind],
                          task_type="CAUSAL_LM", lora_dropout=0.0)
    model = peft.get_peft_model(hf_model, cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_A" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    if folder is not None:
        model.save_pretrained(folder)
    return model


def peft_tensors(model) -> dict[str, tuple]:
    """{module path: (A, B)} of a PeftModel, as numpy."""
    out: dict[str, dict] = {}
    for name, p in model.named_parameters():
        for ab in ("A", "B"):
            tag = f".lora_{ab}.default.weight"
            if name.endswith(tag):
                out.setdefault(name.removeprefix("base_model.model.").removesuffix(tag), {})[ab] = p.detach().numpy()
    return {k: (v["A"], v["B"]) for k, v in out.items()}
