"""The one cache folder (docs/caching.md): where it is, and that numba's compiled loops go there
and never into the installed package."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from anelm.caches import cache_dir
from anelm.train.data import default_cache_dir

REPO = Path(__file__).resolve().parents[1]


def test_anelm_cache_dir_then_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("ANELM_CACHE_DIR", str(tmp_path / "own"))
    assert cache_dir() == tmp_path / "own"
    monkeypatch.delenv("ANELM_CACHE_DIR")
    assert cache_dir("numba") == tmp_path / "xdg" / "anelm" / "numba"
    assert default_cache_dir() == tmp_path / "xdg" / "anelm" / "tokens"  # the token caches too
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/xdg")  # not absolute: ignored, as XDG says
    assert cache_dir() == tmp_path / "home" / ".cache" / "anelm"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("ANELM_CACHE_DIR", "")  # empty is unset
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "anelm" / "tokens"


def test_numba_caches_go_to_the_cache_dir_not_the_package(tmp_path):
    # a copy of the package as pip installs it, imported after numba (the harder order: numba
    # has read its config already) and made to compile its fp16 loop; run from tmp_path, so
    # `-c` (which puts the working directory first on sys.path) imports the copy
    site = tmp_path / "site"
    shutil.copytree(REPO / "anelm", site / "anelm", ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if k not in ("ANELM_CACHE_DIR", "NUMBA_CACHE_DIR")}
    env.update(PYTHONPATH=str(site), XDG_CACHE_HOME=str(tmp_path / "xdg"), PYTHONDONTWRITEBYTECODE="1")
    code = ("import numba, numpy as np\nfrom anelm.fp16.grid import round_fp16\n"
            "assert round_fp16(np.float32([1e5, 0.1]))[0] == np.inf\n")
    subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, check=True, timeout=300)
    inside = [p for p in site.rglob("*") if p.suffix in (".nbi", ".nbc")]
    cached = [p for p in (tmp_path / "xdg" / "anelm" / "numba").rglob("*") if p.suffix in (".nbi", ".nbc")]
    assert inside == [] and {p.suffix for p in cached} == {".nbi", ".nbc"}


def test_the_cache_folder_follows_the_environment_and_survives_a_removed_working_folder(tmp_path, monkeypatch):
    import os

    from anelm.caches import cache_dir

    monkeypatch.setenv("ANELM_CACHE_DIR", str(tmp_path / "a"))
    assert cache_dir("kernels") == tmp_path / "a" / "kernels"
    monkeypatch.setenv("ANELM_CACHE_DIR", str(tmp_path / "b"))
    assert cache_dir("kernels") == tmp_path / "b" / "kernels"  # remembered, but by what it is made from
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    assert cache_dir("kernels") == tmp_path / "b" / "kernels"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ANELM_CACHE_DIR", "rel")
    assert cache_dir() == tmp_path / "rel" and os.path.isabs(cache_dir())


def test_an_unwritable_cache_folder_is_said_once(tmp_path, monkeypatch, capsys):
    """The stores used to fail quietly where the folder cannot be written (every run then
    compiles from scratch, ~3x slower): a command says so, once per process."""
    from anelm.cli.main import main

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("ANELM_CACHE_DIR", str(blocker / "cache"))  # under a file: never creatable
    assert main(["bench", "--chips"]) == 0
    assert main(["bench", "--chips"]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "cache folder" in line]
    assert warned == [f"anelm: warning: cache folder {blocker / 'cache'} is not writable: Not a directory; runs "
                      "compile from scratch (set ANELM_CACHE_DIR to a writable folder)"]
    monkeypatch.setenv("ANELM_CACHE_DIR", str(tmp_path / "fine"))
    assert main(["bench", "--chips"]) == 0
    assert "cache folder" not in capsys.readouterr().err and (tmp_path / "fine").is_dir()
