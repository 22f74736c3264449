"""load_engine: a model, its runner and its prompts for a server; the model folder's
generation_config.json as the sampling defaults."""

import json
import shutil
import sys

import pytest

from anelm.generate.engine import generation_defaults, load_engine
from anelm.generate.generate import generate
from anelm.generate.sampling import SamplingError, SamplingOptions
from anelm.models.errors import InputError, LoadError

hf_tiny = pytest.importorskip("hf_tiny")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("engine") / "tiny-llama"
    hf_tiny.make_word_model(d)
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"  # words only: ids are the words
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "</s>"}))
    return d


def test_an_engine_on_the_emulator_answers_as_anelm_generate(model_dir, capsys):
    from anelm.cli.main import main

    said = []
    engine = load_engine(model_dir, max_context=64, notice=said.append)
    assert engine.model_id == "tiny-llama" and engine.runner.device == "emulator" and engine.context == 64
    assert said == ["model: llama, 0.08M parameters, context 64"]
    prompt = engine.completion_prompt("w5 w9 w22 w40")
    assert prompt == [5, 9, 22, 40]
    deltas = list(engine.stream(prompt, engine.options(temperature=0, max_tokens=12)))
    assert main(["generate", "--model", str(model_dir), "--prompt", "w5 w9 w22 w40", "--max-tokens", "12",
                 "--temperature", "0", "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)
    assert [d.token for d in deltas[:-1]] == cli["ids"] and "".join(d.text for d in deltas) == cli["text"]
    assert engine.chat_prompt([{"role": "user", "content": "w7 w8"}]) == [7, 8]


def test_an_engine_on_the_cpu_says_so_and_takes_a_model_id(model_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "anelm.generate.pipeline", None)  # a build without the device pipeline
    said = []
    engine = load_engine(str(model_dir) + "/", model_id="tiny", notice=said.append)
    assert engine.model_id == "tiny" and engine.runner.device == "cpu" and engine.context == 64
    assert engine.constraint(None) is None and engine.constraint({"type": "text"}) is None
    assert said[-1] == "device: cpu (numpy reference; no device pipeline in this build for --device auto)"
    assert engine.completion_prompt("") == [engine.tokenizer.bos_id] and engine.tokenizer.bos_id is not None
    res = generate(engine.runner, engine.tokenizer, [5, 9], max_tokens=4)
    assert [d.token for d in engine.stream([5, 9], engine.options(temperature=0, max_tokens=4))][:-1] == res.ids
    with pytest.raises(SamplingError, match="top_p must be in"):
        engine.options(top_p=2.0)
    engine.tokenizer.bos_id = None
    with pytest.raises(InputError, match="the prompt is empty and the tokenizer has no BOS token"):
        engine.completion_prompt("")


def test_generation_config_gives_the_defaults(model_dir, tmp_path):
    assert generation_defaults(model_dir) == SamplingOptions()  # HF's file with ids only
    assert generation_defaults(tmp_path / "model.gguf") == SamplingOptions()  # a file has no folder's config
    d = tmp_path / "m"
    d.mkdir()
    gen = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1,
           "max_new_tokens": 50, "eos_token_id": [2, 3]}
    (d / "generation_config.json").write_text(json.dumps(gen))
    assert generation_defaults(d) == SamplingOptions(max_tokens=50, temperature=0.6, top_p=0.9, top_k=20,
                                                     repetition_penalty=1.1)
    (d / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.6}))
    assert generation_defaults(d) == SamplingOptions(temperature=0.0)  # HF samples only with do_sample
    (d / "generation_config.json").write_text("{not json")
    with pytest.raises(LoadError, match="generation_config.json: expected a JSON object of HF generation settings"):
        generation_defaults(d)
    (d / "generation_config.json").write_text(json.dumps({"top_p": 7}))
    with pytest.raises(LoadError, match=r"top_p must be in \(0, 1\]"):
        generation_defaults(d)


def test_the_engine_takes_its_defaults_from_the_folder(model_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "anelm.generate.pipeline", None)
    d = tmp_path / "with-defaults"
    shutil.copytree(model_dir, d)
    (d / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_k": 5}))
    engine = load_engine(d, notice=lambda msg: None)
    assert (engine.defaults.temperature, engine.defaults.top_k) == (0.7, 5)
    assert engine.options(top_k=0) == SamplingOptions(temperature=0.7)
