"""load_model: HF folders (single, sharded, bf16, OpenAI-style GPT-2 keys), RUN folders, and
each bad input as a one-line error naming what was expected and what was found."""

import json
import shutil

import numpy as np
import pytest
from hf_tiny import hf_logits, make_hf, torch
from helpers import rel_err
from safetensors.numpy import load_file, save_file

from anelm.models.errors import ConfigError, LoadError
from anelm.models.loading import build_model, load_model
from anelm.models.tokenizer.base import HFTokenizer


def one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    make_hf("llama-gqa", d, seed=11)
    return d


def copy_folder(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_nonexistent_path(tmp_path):
    expected = "model not found: .*nope: expected an HF folder, a RUN folder, a quantized folder, a llama2.c .bin or a .gguf file"
    with pytest.raises(LoadError, match=expected):
        load_model(tmp_path / "nope")


def test_folder_without_config_or_weights(tmp_path, llama_dir):
    with pytest.raises(LoadError, match="no config.json in"):
        load_model(tmp_path)
    shutil.copy(llama_dir / "config.json", tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(LoadError, match=r"no weights in .*: expected model.safetensors.*found pytorch_model.bin") as e:
        load_model(tmp_path)
    one_line(e)


def test_unsupported_model_type(tmp_path, llama_dir):
    d = copy_folder(llama_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "mamba"}))
    expected = r"unsupported model_type 'mamba' in .*config.json: expected one of gemma3_text, gpt2, llama, mistral, phi3, qwen2, qwen3, smollm3"
    with pytest.raises(ConfigError, match=expected):
        load_model(d)


def test_missing_keys_and_shape_mismatch_are_named(tmp_path, llama_dir):
    d = copy_folder(llama_dir, tmp_path / "m")
    w = load_file(d / "model.safetensors")
    del w["model.layers.1.mlp.up_proj.weight"], w["model.norm.weight"]
    save_file(w, d / "model.safetensors")
    with pytest.raises(LoadError, match=r"missing weights model.layers.1.mlp.up_proj.weight, model.norm.weight"):
        load_model(d)
    w = load_file(llama_dir / "model.safetensors")
    w["model.layers.0.self_attn.k_proj.weight"] = np.zeros((64, 64), np.float32)
    save_file(w, d / "model.safetensors")
    expected = r"weight model.layers.0.self_attn.k_proj.weight has shape \(64, 64\), expected \(16, 64\)"
    with pytest.raises(LoadError, match=expected):
        load_model(d)


def test_truncated_safetensors(tmp_path, llama_dir):
    d = copy_folder(llama_dir, tmp_path / "m")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(LoadError, match="model.safetensors: not a readable safetensors file") as e:
        load_model(d)
    one_line(e)


def test_sharded_and_bf16_folders(tmp_path):
    hf = make_hf("qwen3-untied", tmp_path / "sharded", seed=12)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    config, weights, _ = load_model(tmp_path / "sharded")
    ids = list(range(20))
    assert rel_err(build_model(config, weights).forward(ids), hf_logits(hf, ids)) < 1e-4
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    _, weights, _ = load_model(tmp_path / "bf16")
    for name, p in hf.state_dict().items():
        assert np.array_equal(weights[name], p.float().numpy()), name


def test_openai_style_gpt2_keys(tmp_path):
    hf = make_hf("gpt2", tmp_path / "g", seed=13)
    w = load_file(tmp_path / "g" / "model.safetensors")
    w = {k.removeprefix("transformer."): v for k, v in w.items()}  # OpenAI's files have no prefix...
    w["h.0.attn.bias"] = np.tril(np.ones((1, 1, 64, 64), np.float32))  # ...and carry the mask buffer
    save_file(w, tmp_path / "g" / "model.safetensors")
    config, weights, _ = load_model(tmp_path / "g")
    ids = list(range(30))
    assert rel_err(build_model(config, weights).forward(ids), hf_logits(hf, ids)) < 1e-4


def test_run_folder_loads_latest_checkpoint_and_tokenizer(tmp_path, llama_dir):
    from tokenizers import Tokenizer, models

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    cfg = json.loads((llama_dir / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**cfg, "lr": 3e-4, "steps": 100, "batch_size": 4}))
    w = load_file(llama_dir / "model.safetensors")
    for step, scale in ((9, 1.0), (20, 2.0), (100, 3.0)):
        ckpt = {k: v * scale for k, v in w.items()}
        ckpt["optimizer.m.model.norm.weight"] = np.zeros(64, np.float32)  # state beside the weights
        name = f"step-{step:06d}.safetensors" + (".tmp" if step == 100 else "")  # 100: still being written
        save_file(ckpt, run / "checkpoints" / name, metadata={"step": str(step)})
    Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]")).save(str(run / "tokenizer.json"))
    config, weights, tok = load_model(run)
    assert "optimizer.m.model.norm.weight" not in weights
    assert np.array_equal(weights["model.norm.weight"], w["model.norm.weight"] * 2.0)
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == 3
    config, weights, tok = load_model(run / "checkpoints" / "step-000009.safetensors", tokenizer=run)
    assert np.array_equal(weights["model.norm.weight"], w["model.norm.weight"])
    assert isinstance(tok, HFTokenizer)
    assert load_model(llama_dir)[2] is None  # an HF folder without tokenizer files


def test_other_files_are_rejected(tmp_path):
    f = tmp_path / "weights.pt"
    f.write_bytes(b"x")
    with pytest.raises(LoadError, match=r"cannot read model file .*weights.pt: expected an HF folder"):
        load_model(f)
