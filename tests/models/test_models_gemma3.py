"""Gemma 3 from the folders users have: a text-only `gemma3_text` folder, and the text model of a
multimodal `gemma3` folder (its config's `text_config`, its weights under `model.language_model.`
as transformers 5 saves them or `language_model.model.` as 4.x did, a vision tower beside them),
which must load to the same config and weights; and the CPU reference against HF float32."""

import json

import numpy as np
import pytest

import hf_tiny
from helpers import rel_err

from anelm.models.loading import build_model, load_model
from anelm.models.formats.safetensors_io import read_safetensors, save_safetensors


@pytest.fixture(scope="module")
def text_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3") / "text"
    return folder, hf_tiny.make_hf("gemma3", folder, seed=2)


@pytest.mark.parametrize("prefix", ["model.language_model.", "language_model.model."])
def test_a_multimodal_folder_loads_its_text_model(text_folder, tmp_path, prefix):
    folder, _ = text_folder
    text_cfg = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": text_cfg, "vision_config": {"model_type": "siglip_vision_model"}}))
    _, tensors = read_safetensors(folder / "model.safetensors")
    moved = {(prefix + k.removeprefix("model.")) if k.startswith("model.") else k: v for k, v in tensors.items()}
    moved["model.vision_tower.vision_model.post_layernorm.weight"] = np.ones(8, np.float32)
    moved["model.multi_modal_projector.mm_soft_emb_norm.weight"] = np.ones(8, np.float32)
    save_safetensors(tmp_path / "model.safetensors", moved)
    config, weights, _ = load_model(tmp_path)
    ref_config, ref_weights, _ = load_model(folder)
    assert config == ref_config and config.model_type == "gemma3_text"
    assert set(weights) == set(ref_weights)
    assert all(np.array_equal(weights[k], ref_weights[k]) for k in weights)


def test_cpu_reference_matches_hf(text_folder):
    folder, hf = text_folder
    config, weights, _ = load_model(folder)
    ids = np.random.default_rng(0).integers(0, config.vocab_size, 40).tolist()  # past the window of 8
    assert rel_err(build_model(config, weights).forward(ids), hf_tiny.hf_logits(hf, ids)) <= 1e-4
