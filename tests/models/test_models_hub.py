"""Models named by their HF repo id (`anelm.models.hub`): a temporary HF_HOME holds a snapshot of
a tiny model laid out as huggingface_hub lays out its cache (refs/main -> a commit, the
snapshot's files linking to content-addressed blobs); offline (HF_HUB_OFFLINE=1, or a Hub that
cannot be reached) it loads from there, as a folder and as one GGUF file of the repo; a repo
absent from the cache is one line naming the cache folder looked in."""

import hashlib
import json
import shutil

import pytest

import family_tiny
import hf_tiny
from helpers import rel_err

from anelm.cli.main import _from_hub, main
from anelm.models.hub import parse
from anelm.models.loading import build_model, load_model

REPO, COMMIT = "anelm-tests/tiny-qwen2", "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub_home(tmp_path_factory):
    """(HF_HOME holding REPO's snapshot with tiny.gguf beside the folder's files, the HF model)."""
    root = tmp_path_factory.mktemp("hub")
    hf = family_tiny.make("qwen2", root / "src", seed=51)
    yarn = {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 16}
    family_tiny.write_gguf(hf, root / "src" / "tiny.gguf", "qwen2", "qwen2", yarn)
    repo = root / "home" / "hub" / f"models--{REPO.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snap, blobs = repo / "snapshots" / COMMIT, repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for f in sorted((root / "src").iterdir()):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, blobs / digest)
        (snap / f.name).symlink_to(f"../../blobs/{digest}")
    return root / "home", hf


@pytest.fixture
def offline(hub_home, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(hub_home[0]))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub_home


def test_repo_ids_and_paths_apart():
    assert parse("HuggingFaceTB/SmolLM2-135M-Instruct") == ("HuggingFaceTB/SmolLM2-135M-Instruct", None)
    assert parse("bartowski/Llama-3.2-1B-Instruct-GGUF:Llama-3.2-1B-Instruct-Q4_K_M.gguf")[1].endswith(".gguf")
    for path in ("/abs/model", "./rel/model", "model", "a/b/c", "../x/y", "a/b:weights.bin", "a/b:../c.gguf"):
        assert parse(path) is None, path


@pytest.mark.parametrize("spec", [REPO, f"{REPO}:tiny.gguf"])
def test_a_cached_repo_loads_offline(offline, spec):
    _, hf = offline
    config, weights, tok = load_model(spec)
    assert config.model_type == "qwen2" and tok is not None
    ids = [1, 5, 9, 22, 40, 41]
    assert rel_err(build_model(config, weights).forward(ids), hf_tiny.hf_logits(hf, ids)) < 1e-4


def test_generate_takes_a_repo_id_offline(offline, capsys):
    assert main(["generate", "--model", REPO, "--prompt", "w5 w9 w12", "--max-tokens", "3", "--temperature", "0",
                 "--json", "--device", "emulator"]) == 0
    assert len(json.loads(capsys.readouterr().out)["ids"]) == 3


@pytest.mark.parametrize("spec", ["anelm-tests/absent", f"{REPO}:absent.gguf"])
def test_a_repo_absent_from_the_cache_is_one_line_naming_it(offline, capsys, spec):
    home, _ = offline
    assert main(["generate", "--model", spec, "--prompt", "hi", "--device", "emulator"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith(f"anelm: error: model not found: {spec}"), err
    folder = home / "hub" / f"models--{spec.split(':')[0].replace('/', '--')}"
    assert f"looked in {folder})" in err and "HF_HUB_OFFLINE is set" in err


def test_without_a_network_the_cache_serves_and_absence_is_one_line(offline, monkeypatch, capsys):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: the Hub is unreachable
    assert load_model(REPO)[0].model_type == "qwen2"
    assert main(["generate", "--model", "anelm-tests/absent", "--prompt", "hi", "--device", "emulator"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not in the HF cache (looked in" in err, err


def test_a_served_repo_keeps_its_id_as_the_model_name(offline):
    import argparse

    args = argparse.Namespace(model=REPO, model_id=None)
    _from_hub(args)
    assert args.model_id == REPO and args.model.endswith(COMMIT)
