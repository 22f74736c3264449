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


def test_a_notice_during_a_progress_bar_prints_above_it(capsys):
    """The SRAM notice (a program built in perplexity's first window) landed inside the
    bar's line; it goes above the bar, which is drawn again below it."""
    import sys

    from tqdm import tqdm

    from anelm.cli import main as cli_main

    cli_main._shown.clear()
    with tqdm(total=4, file=sys.stderr, disable=False, desc="perplexity") as bar:
        bar.update(1)
        cli_main._show_warning(UserWarning("a program's SRAM working set exceeds"), UserWarning, cli_main.__file__, 1)
        bar.update(1)
    err = capsys.readouterr().err
    line, = [line for line in err.split("\n") if "anelm: warning" in line]
    assert line.split("\r")[-1] == "anelm: warning: a program's SRAM working set exceeds", repr(err)


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


ANE_OFF_A_MAC = "--device ane requested but the Apple Neural Engine is unavailable: not macOS"


@pytest.mark.parametrize("argv, says", [
    (["generate", "--model", "M", "--device", "ane"], ANE_OFF_A_MAC),
    (["generate", "--model", "M", "--adapter", "NOPE"], "--adapter NOPE does not exist: expected a PEFT LoRA folder"),
    (["chat", "--model", "M", "--device", "ane"], ANE_OFF_A_MAC),
    (["chat", "--model", "M", "--adapter", "M"], "no adapter_config.json in M"),
    (["perplexity", "--model", "M", "--data", "TEXT", "--seq-len", "1"], "--seq-len 1 is too short"),
    (["perplexity", "--model", "M", "--data", "EMPTY"], "data file EMPTY is empty: expected UTF-8 text"),
    (["perplexity", "--model", "M", "--data", "TEXT", "--adapter", "NOPE"], "--adapter NOPE does not exist"),
    (["perplexity", "--model", "M", "--data", "TEXT", "--device", "ane"], ANE_OFF_A_MAC),
    (["finetune", "--model", "M", "--data", "EMPTY"], "data file EMPTY is empty"),
    (["finetune", "--model", "M", "--data", "NOPE"], "data path NOPE does not exist"),
    (["finetune", "--model", "M", "--data", "TEXT", "--seq-len", "1"], "--seq-len: expected at least 2, got 1"),
    (["finetune", "--model", "M", "--data", "TEXT", "--device", "ane"], ANE_OFF_A_MAC),
    (["train", "--init-from", "M", "--data", "EMPTY"], "data file EMPTY is empty"),
    (["train", "--init-from", "M", "--data", "TEXT", "--seq-len", "1"], "--seq-len: expected at least 2, got 1"),
    (["train", "--init-from", "M", "--data", "TEXT", "--device", "ane"], ANE_OFF_A_MAC),
])
def test_flags_that_need_no_model_fail_before_it_loads(argv, says, tmp_path, monkeypatch, capsys):
    """Each of these used to wait for the model to load (6-13 s on a real one) to fail."""
    import sys

    from anelm.models import loading

    if "ane" in argv and sys.platform == "darwin":
        pytest.skip("a Mac may have the ANE")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "M").mkdir()
    (tmp_path / "TEXT").write_text("some text to score\n")
    (tmp_path / "EMPTY").write_text("")
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("the model loaded first"))
    rc = main(argv + (["--out", "RUN"] if argv[0] in ("train", "finetune") else []))
    err = capsys.readouterr().err
    assert rc in (1, 2) and err.count("\n") == 1 and err.startswith("anelm: error: ") and says in err, err
    assert not (tmp_path / "RUN").exists()


def test_a_missing_adapter_fails_at_once_in_a_fresh_process(tmp_path):
    """The check imports the adapter module first thing in a process (where nothing else has)."""
    import subprocess
    import sys

    (tmp_path / "M").mkdir()
    r = subprocess.run([sys.executable, "-m", "anelm", "generate", "--model", str(tmp_path / "M"), "--adapter",
                        str(tmp_path / "NOPE")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr == (f"anelm: error: --adapter {tmp_path / 'NOPE'} does not exist: expected a "
                                              "PEFT LoRA folder or a finetune RUN folder (RUN/adapter/)\n"), r.stderr
