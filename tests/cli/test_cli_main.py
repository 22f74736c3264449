"""The CLI's own conventions, across every subcommand: help text, error and warning lines."""

import argparse
import json
import warnings

import pytest

from anelm.cli.main import build_parser, main


def subparsers(parser):
    """(name, parser) of the top level and of every subcommand."""
    yield "anelm", parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.items()


def test_every_option_of_every_subcommand_has_help():
    missing = [f"{name} {'/'.join(a.option_strings) or a.dest}"
               for name, p in subparsers(build_parser()) for a in p._actions
               if not isinstance(a, argparse._SubParsersAction) and not (a.help or "").strip()]
    assert missing == []


def test_a_usage_error_names_the_program_once(capsys):
    assert main(["train", "--steps", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("anelm: error: train: argument --steps"), err
    assert err.count("anelm") == 1


def test_anelm_warnings_print_as_notice_lines(tmp_path, capsys, monkeypatch):
    from anelm.compiler.passes import validate

    monkeypatch.setattr(validate, "SRAM_BYTES", 1024)  # every program is "large"
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        assert main(["compile", "--dim", "32", "--heads", "2", "--seq", "16", "--out", str(tmp_path / "k")]) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "SRAM" in line]
    assert lines and all(line.startswith("anelm: warning: a program") for line in lines), err
    assert "UserWarning" not in err and "warnings.warn" not in err


def test_one_notice_prints_once_per_command_even_when_the_filters_are_reset(tmp_path, capsys, monkeypatch):
    import types

    from anelm.compiler.passes import validate

    monkeypatch.setattr(validate, "SRAM_BYTES", 1024)  # every program is "large"

    def warn(*a, **k):  # a library touching the filters between programs forgets Python's once-rule
        warnings.filterwarnings("ignore", message="an unrelated library's notice")
        warnings.warn(*a, **{**k, "stacklevel": k.get("stacklevel", 1) + 1})

    monkeypatch.setattr(validate, "warnings", types.SimpleNamespace(warn=warn))
    assert main(["compile", "--dim", "32", "--heads", "2", "--seq", "16", "--layers", "3", "--out", str(tmp_path / "k")]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if "SRAM" in line]
    assert len(lines) == 1, lines


@pytest.mark.parametrize("argv, imported", [(["--help"], set()), (["generate", "--help"], {"generate"})])
def test_the_cli_imports_only_the_command_it_runs(argv, imported):
    """Building every subcommand imported all of anelm (~1.8 s before `anelm --help` printed)."""
    import subprocess
    import sys

    from anelm.cli.main import SUBCOMMANDS

    code = (f"import sys\nfrom anelm.cli.main import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in sys.modules if m.startswith('anelm.cli.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = set(json.loads(out.strip().splitlines()[-1].replace("'", '"')))
    commands = {f"anelm.cli.{module}" for module, _ in SUBCOMMANDS.values()}
    assert loaded & commands == {f"anelm.cli.{SUBCOMMANDS[c][0]}" for c in imported}
