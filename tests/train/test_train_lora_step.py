"""The LoRA step (base frozen on the emulator, adapters as kernel inputs) against PEFT autograd.

For Llama (GQA, every target), Qwen3 and GPT-2 (one adapter over the fused c_attn, c_proj on
attention and MLP, c_fc) and both pipelines, the loss and the gradient of every lora_A and
lora_B tensor must match `peft.get_peft_model` on the same HF float32 model (eager attention),
the same adapter and batch. B is drawn non-zero (PEFT initializes it to zero, which would make
dA vanish), so both gradients are exercised. Tolerances (docs/testing.md): max|got − ref| /
max|ref| ≤ 5e-2 and cosine ≥ 0.999 per tensor (measured ≤ 5.6e-3, ≥ 0.99999; without the
device's adapter term the gradients are off by > 100 %); the loss 1e-2 relative (forward only).

LoRA dropout: PEFT's `lora_dropout[name]` module of every adapted layer is replaced by one that
multiplies by the step's own draw d = mask/(1-p), so autograd through PEFT with
`lora_dropout=p` sees the masks our step trains with; dA, dB (and, through the layers behind,
dx through the masked adapter branch) then meet the same tolerances, in both pipelines. The
masks change the reference gradients by far more than the tolerance, so the test is decisive
(measured: ≤ 6.7e-3 and cosine ≥ 0.99998 with dropout; without the mask on the dx kernels'
adapter term, up to 0.70 and 0.80).
"""

import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from anelm.chip.profile import STRICT
from anelm.device import base
from anelm.device.base import compile_count
from anelm.device.emulator import Emulator
from anelm.models.adapters import LoraSpec
from anelm.models.config import config_from_dict
from anelm.models.loading import architecture
from anelm.train.steps import lora_train_step

from helpers import GRAD_COSINE, GRAD_TOL, rel_err

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

S, B, RANK, ALPHA, SCALE = 16, 2, 4, 8.0, 1024.0
PROFILE = STRICT.replace(compile_budget=10**9)  # the process-wide count spans every test
COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              rms_norm_eps=1e-5, max_position_embeddings=64, attn_implementation="eager")
ARCHS = {  # name: (HF config class, model class, extra config, targets)
    "llama-gqa": ("LlamaConfig", "LlamaForCausalLM",
                  dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
                  ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(num_attention_heads=4, num_key_value_heads=2, head_dim=12, tie_word_embeddings=True),
              ("q_proj", "v_proj", "down_proj")),
    # c_attn: one adapter over the fused q, k, v (fan_in_fan_out); c_proj names attn's and mlp's
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_positions=64, n_embd=32, n_layer=2, n_head=4),
             ("c_attn", "c_proj", "c_fc")),
}
GPT2_DROP = ("hidden_size", "intermediate_size", "num_hidden_layers", "rms_norm_eps", "max_position_embeddings")


@pytest.fixture(autouse=True, scope="module")
def _compile_count_as_found():
    yield
    base.reset_compile_count()


@functools.lru_cache(maxsize=None)
def reference(arch):
    """(our config, base weights, adapter, targets, x, y, PEFT loss, PEFT adapter grads)."""
    cfg, weights, targets, pm, x, y = peft_model(arch)
    loss, grads = peft_loss_and_grads(pm, x, y)
    ours = lambda n: n.replace("base_model.model.", "", 1).replace(".default", "")  # noqa: E731
    adapter = {ours(n): p.detach().numpy().copy() for n, p in pm.named_parameters() if "lora_" in n}
    return cfg, weights, adapter, targets, x, y, loss, grads


class FixedDropout(torch.nn.Module):
    """PEFT's dropout with a given draw: x·d, d = mask/(1-p) laid out as x, [B, S, in]."""

    def __init__(self, d):
        super().__init__()
        self.d = d

    def forward(self, x):
        return x * self.d


def peft_loss_and_grads(pm, x, y, masks=None, p=0.0):
    """PEFT's loss and adapter gradients, by our names; `masks`: module path -> d `[in, B·S]`
    (our columns, the sequences side by side), each installed as that layer's dropout."""
    layers = {n: pm.get_submodule("base_model.model." + n) for n in masks or {}}
    for n, layer in layers.items():
        assert isinstance(layer.lora_dropout["default"], torch.nn.Dropout), n  # lora_dropout=p made one
        assert layer.lora_dropout["default"].p == p
        d = masks[n].T.reshape(B, S, -1)  # [in, B·S] -> [B, S, in]
        layer.lora_dropout["default"] = FixedDropout(torch.tensor(d))
    pm.zero_grad()
    logits = pm(torch.tensor(x)).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.tensor(y).reshape(-1))
    loss.backward()
    for layer in layers.values():  # the cached model gets its own dropout back
        layer.lora_dropout["default"] = torch.nn.Dropout(p)
    ours = lambda n: n.replace("base_model.model.", "", 1).replace(".default", "")  # noqa: E731
    return loss.item(), {ours(n): q.grad.numpy().copy() for n, q in pm.named_parameters() if "lora_" in n}


@functools.lru_cache(maxsize=None)
def peft_model(arch, dropout=0.0):
    """(our config, base weights, targets, the PEFT model with a non-zero B, x, y)."""
    cfg_name, model_name, extra, targets = ARCHS[arch]
    common = {k: v for k, v in COMMON.items() if arch != "gpt2" or k not in GPT2_DROP}
    hf_cfg = getattr(transformers, cfg_name)(**common, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(hf_cfg).float().eval()  # eval: GPT-2 has dropout
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(0.1 * torch.randn_like(p) if n.endswith("bias") else
                    torch.empty_like(p).uniform_(0.5, 1.5) if p.ndim == 1 else
                    torch.randn_like(p) * (0.3 if "embed" in n else min(p.shape) ** -0.5))
    cfg = config_from_dict(hf_cfg.to_dict())
    weights = {n: t.detach().numpy().copy() for n, t in model.state_dict().items()}
    weights = architecture(cfg.model_type).sanitize(weights, cfg)  # GPT-2's Conv1D as [out, in]
    if hf_cfg.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    lora = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=dropout, target_modules=list(targets),
                           fan_in_fan_out=arch == "gpt2")
    pm = peft.get_peft_model(model, lora)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.2)  # non-zero B, or dA is zero
    rng = np.random.default_rng(1)
    x, y = rng.integers(0, COMMON["vocab_size"], (B, S)), rng.integers(0, COMMON["vocab_size"], (B, S))
    return cfg, weights, targets, pm, x, y


def make_step(arch, pipeline="dynamic", adapter=None, dropout=0.0):
    cfg, w, ad, targets, *_ = reference(arch)
    return lora_train_step(cfg, w, Emulator(PROFILE), seq_len=S, spec=LoraSpec(RANK, ALPHA, dropout, targets),
                           adapter=adapter or ad, pipeline=pipeline, seed=5)


def assert_grads_match(grads, ref_grads):
    assert set(grads) == set(ref_grads)  # the adapters' and nothing of the base
    for name, want in ref_grads.items():
        got = grads[name] / SCALE
        cos = np.dot(got.ravel(), want.ravel()) / (np.linalg.norm(got) * np.linalg.norm(want))
        assert got.dtype == np.float32 and got.shape == want.shape, name
        assert rel_err(got, want) <= GRAD_TOL and cos >= GRAD_COSINE, (name, rel_err(got, want), cos)


@pytest.mark.parametrize("pipeline", ["dynamic", "static"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_loss_and_adapter_gradients_match_peft(arch, pipeline):
    *_, x, y, ref_loss, ref_grads = reference(arch)
    with make_step(arch, pipeline) as step:
        loss, grads, stats = step.loss_and_grads(x, y, loss_scale=SCALE)
    assert abs(loss - ref_loss) / ref_loss <= 1e-2
    assert_grads_match(grads, ref_grads)
    assert stats["device_flops"] > 0 and stats["cpu_flops"] > 0


P = 0.3  # 1/(1-p) is not exact in fp16: the scaled masks are rounded on the device as PEFT's are not


@pytest.mark.parametrize("pipeline", ["dynamic", "static"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_adapter_gradients_with_dropout_match_peft_given_the_same_masks(arch, pipeline):
    *_, pm, x, y = peft_model(arch, P)
    with make_step(arch, pipeline, dropout=P) as step:
        masks = step.dropout_masks(x.size, at=(7, 1, 0))
        step.begin_micro_batch(7, 1, 0)
        loss, grads, _ = step.loss_and_grads(x, y, loss_scale=SCALE)
    ref_loss, ref_grads = peft_loss_and_grads(pm, x, y, masks, P)
    assert abs(loss - ref_loss) / ref_loss <= 1e-2
    assert_grads_match(grads, ref_grads)
    undropped = reference(arch)[-1]
    assert max(rel_err(ref_grads[n], undropped[n]) for n in ref_grads) > 5 * GRAD_TOL  # decisive


def test_dropout_masks_are_inverted_seeded_and_independent():
    cfg, *_ = reference("llama-gqa")
    with make_step("llama-gqa", dropout=P) as step:
        a, again, later = (step.dropout_masks(4096, at=at) for at in ((3, 0, 0), (3, 0, 0), (3, 1, 0)))
    assert set(a) == {n[: -len(".lora_A.weight")] for n in reference("llama-gqa")[2] if "lora_A" in n}
    every = np.concatenate([d.ravel() for d in a.values()])
    assert set(np.unique(every)) == {0.0, np.float32(1 / (1 - P))}  # PEFT's inverted dropout
    assert abs((every == 0).mean() - P) < 0.01                      # 1.2 M draws: the rate is p
    assert all(np.array_equal(a[n], again[n]) for n in a)           # the same place, the same masks
    assert all(not np.array_equal(a[n], later[n]) for n in a)       # another micro-batch, others
    q, v = (a[n] for n in ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"))
    assert not np.array_equal(q, v)  # one mask per module, as PEFT's one dropout per layer


def test_eval_loss_runs_without_dropout():
    *_, x, y, _, _ = reference("qwen3")
    with make_step("qwen3", dropout=0.5) as dropped, make_step("qwen3") as plain:
        assert dropped.loss(x, y) == plain.loss(x, y)
        assert dropped.loss_and_grads(x, y, SCALE)[0] != plain.loss_and_grads(x, y, SCALE)[0]


def test_adapter_update_compiles_nothing_and_takes_effect(fresh_compile_count):
    *_, x, y, _, _ = reference("llama-gqa")
    ad = reference("llama-gqa")[2]
    new = {n: (a + 0.1 * np.random.default_rng(3).standard_normal(a.shape)).astype(np.float32)
           for n, a in ad.items()}
    with make_step("llama-gqa") as step, make_step("llama-gqa", adapter=new) as fresh:
        before = step.loss(x, y)
        n = compile_count()
        step.set_weights(new)
        assert compile_count() == n
        assert step.loss(x, y) == fresh.loss(x, y) != before


def test_untargeted_kernels_stay_as_full_training_builds_them():
    from anelm.kernels.training import Dims
    from anelm.train.steps.lora import lora_layout

    cfg = reference("qwen3")[0]
    for dropout in (0.0, P):  # dropout adds blocks to the adapted kernels only
        check_untargeted_kernels(Dims.from_config(cfg, S), lora_layout(cfg, LoraSpec(RANK, ALPHA, dropout, ("q_proj",))))


def check_untargeted_kernels(dims, lay):
    from anelm.kernels.training import build_graph, layouts

    assert lay.kinds() == ("qkv", "qkv_dx")
    for kind in ("wo", "ffn_up", "ffn_down", "wo_dx", "ffn_up_dx", "ffn_down_dx"):
        assert layouts(dims, lay)[kind] == layouts(dims)[kind]
        got, want = build_graph(kind, dims, lora=lay), build_graph(kind, dims)
        assert [(n.op, n.name) for n in got.nodes] == [(n.op, n.name) for n in want.nodes]
        assert [v.shape for v in got.inputs] == [v.shape for v in want.inputs]
