"""The Python API at the top of the package (`anelm.load`, `generate`, `stream_generate`,
`finetune`): the same text as the commands for the same model and settings, on the emulator
over a tiny HF Llama (GQA) with a word tokenizer (`hf_tiny.make_word_model`); `import anelm`
imports none of it."""

import json
import random
import subprocess
import sys

import pytest

import anelm
from anelm.cli.main import main
from anelm.errors import UsageError

import hf_tiny

PROMPT = "w5 w9 w14 w3"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("api")
    hf_tiny.make_word_model(folder / "base")
    rng = random.Random(0)
    (folder / "words.txt").write_text(" ".join(f"w{rng.randint(3, 40)}" for _ in range(1800)))
    return folder


def cli_text(capsys, *flags) -> str:
    capsys.readouterr()
    assert main(["generate", "--temperature", "0", "--json", "--device", "emulator", *map(str, flags)]) == 0
    return json.loads(capsys.readouterr().out)["text"]


def test_import_anelm_is_light():
    # anelm.generate is the package (its __init__ a docstring) and, called, the API's generate
    code = ("import sys, anelm; heavy = [m for m in ('numpy', 'anelm.api', 'anelm.generate.engine', 'anelm.models') "
            "if m in sys.modules]; assert not heavy, heavy; assert callable(anelm.load) and callable(anelm.generate); "
            "assert {'load', 'generate', 'stream_generate', 'finetune'} <= set(dir(anelm)); "
            "import anelm.generate.engine; from anelm import generate; assert callable(generate)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_generate_equals_the_cli_and_the_stream(base, capsys):
    model = anelm.load(base / "base", device="emulator")
    assert model.runner.device == "emulator"
    from anelm import generate

    text = generate(model, PROMPT, max_tokens=12)
    assert text and text == cli_text(capsys, "--model", base / "base", "--prompt", PROMPT, "--max-tokens", 12)
    assert "".join(anelm.stream_generate(model, PROMPT, max_tokens=12)) == text
    ids = model.tokenizer.encode(PROMPT)
    assert anelm.generate(model, ids, max_tokens=12) == text  # token ids: the same prompt
    stop = text.split()[1]
    assert anelm.generate(model, PROMPT, max_tokens=12, stop=[stop]) == text[:text.find(stop)]
    with pytest.raises(UsageError):
        anelm.generate(model, PROMPT, top_p=0)  # checked before any work
    with pytest.raises(UsageError):
        anelm.generate(model, [1.5])


def test_finetune_then_load_the_adapter(base, capsys):
    run = anelm.finetune(base / "base", base / "words.txt", out=base / "run", steps=2, batch_size=2, seq_len=16,
                         lr=1e-2, rank=4, eval_batches=1, sample_tokens=0, device="emulator")
    assert run == base / "run" and (run / "adapter" / "adapter_config.json").is_file()
    assert json.loads((run / "adapter" / "adapter_config.json").read_text())["r"] == 4
    tuned = anelm.load(base / "base", adapter=run / "adapter", device="emulator")
    text = anelm.generate(tuned, PROMPT, max_tokens=12)
    assert text == cli_text(capsys, "--model", base / "base", "--adapter", run / "adapter", "--prompt", PROMPT,
                            "--max-tokens", 12)
    # a flag setting is its flag: resume=True continues the run towards the new steps, from its own model
    assert anelm.finetune(None, out=run, resume=True, steps=3, device="emulator") == run
    steps = [json.loads(line).get("step") for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(s for s in steps if s is not None) == 3


def test_finetune_refuses_bad_settings_before_loading(base):
    with pytest.raises(UsageError, match="unknown setting 'stepz'"):
        anelm.finetune(base / "base", base / "words.txt", out=base / "bad", stepz=3)
    with pytest.raises(UsageError, match="rank"):
        anelm.finetune(base / "base", base / "words.txt", out=base / "bad", rank=0)
    assert not (base / "bad").exists()
