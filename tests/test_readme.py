"""README.md says what the code does: its supported-models tables are the registry's (regenerated
here), its commands table lists every `anelm` command, its quick-start commands are the two the
project runs, and its Python example runs as written (on the real SmolLM2 GGUF in ../shared)
and prints the answer its comment gives."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
TRAIN = "python3 -m venv .venv && . .venv/bin/activate && pip install . && anelm train"
TEST = "python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[test]' && python -m pytest -q"


def section(title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README, re.S | re.M)
    assert match, f"README.md has no '## {title}' section"
    return match.group(1)


def test_the_supported_models_tables_are_the_registrys():
    from anelm.api import supported_models

    match = re.search(r"<!-- supported-models: begin -->\n(.*?)\n<!-- supported-models: end -->", README, re.S)
    assert match, "README.md lost its supported-models markers"
    assert match.group(1).strip() == supported_models().strip(), (
        "README.md's supported-models tables differ from the registry's: paste "
        "`python -c 'import anelm.api as a; print(a.supported_models())'` between the markers")


def test_every_model_type_has_a_row():
    from anelm.models.registry import MODEL_TYPES

    table = section("Supported models")
    assert all(f"| `{t}`" in table for t in MODEL_TYPES)


def test_the_commands_table_lists_every_command():
    from anelm.cli.main import SUBCOMMANDS

    listed = re.findall(r"^\| `anelm ([a-z-]+)` \|", section("Commands"), re.M)
    assert sorted(listed) == sorted(SUBCOMMANDS)


def test_the_quick_start_commands_are_the_projects():
    quick = section("Quick start")
    assert f"```sh\n{TRAIN}\n```" in quick and f"```sh\n{TEST}\n```" in quick
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "pip install -q -e '.[test]' && python -m pytest -q" in ci


def python_example() -> str:
    blocks = re.findall(r"^```python\n(.*?)^```", section("Python API"), re.S | re.M)
    assert len(blocks) == 1, "the Python API section holds one python block"
    return blocks[0]


@pytest.mark.slow
def test_the_python_example_runs_as_written(smollm_gguf):
    """Run from the repository's root, as a reader would: the example names the GGUF by its path
    relative to it (skipped with the fixture's reason where ../shared is absent)."""
    code = python_example()
    expected = re.search(r"print\(anelm\.generate\(.*\)\)\s*# (.+)", code)
    assert expected, "the example's generate line says what it prints"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert lines[0] == expected.group(1).strip()
    assert len(lines) >= 2 and lines[1].strip(), "the streamed continuation printed nothing"


def test_the_format_table_says_what_the_code_refuses():
    """The quantized folder's "no"s are the commands that call `refuse_quantized`, and the
    llama2.c row's finetune "no" is the base check of finetune and --init-from (a folder or a
    .gguf): a command that starts or stops refusing changes the table."""
    from anelm.models.support import formats

    package = ROOT / "anelm"
    refusing = {m for p in package.rglob("*.py")
                for m in re.findall(r'refuse_quantized\([^,]+, "([^"]+)"\)', p.read_text(encoding="utf-8"))}
    assert refusing == {"finetune", "train --init-from", "export", "--adapter", "quantize"}
    quantized = next(f for f in formats() if "anelm quantize" in f.name)
    assert quantized.run and not (quantized.adapter or quantized.finetune or quantized.quantize)
    for module in ("train/lora.py", "train/init.py"):  # a base is a folder or a .gguf file
        assert 'p.is_dir() or (p.is_file() and p.suffix == ".gguf")' in (package / module).read_text(encoding="utf-8")
    llama2c = next(f for f in formats() if "llama2.c" in f.name)
    assert llama2c.run and not llama2c.finetune
