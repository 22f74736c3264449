"""Models named by their Hugging Face repo id: `owner/name` (an HF folder) or `owner/name:FILE.gguf`
(one GGUF file of the repo), resolved to a local path through the standard HF cache by
huggingface_hub, as transformers resolves them: downloaded when the network allows, taken from
the cache when it does not (HF_HUB_OFFLINE=1, or no network). A folder brings only what
`load_model` reads (configs, safetensors, tokenizer files), not the repo's other formats.

The cache and the switches are read when a model is resolved, not when huggingface_hub is
imported: HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub; HF_HUB_OFFLINE;
HF_ENDPOINT.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from .errors import LoadError

REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9]")  # huggingface_hub's rule, with the owner
FOLDER_FILES = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja", "*.txt"]  # what loading reads
TRUE = ("1", "on", "yes", "true")


def parse(spec: object) -> tuple[str, str | None] | None:
    """(repo id, GGUF file name or None) of a `REPO` or `REPO:FILE.gguf` spec, or None."""
    repo, colon, file = str(spec).partition(":")
    if not REPO_ID.fullmatch(repo) or ".." in repo or (colon and not (file.endswith(".gguf") and ".." not in file)):
        return None
    return repo, file or None


def cache_dir() -> Path:
    """The standard HF hub cache, as huggingface_hub finds it."""
    env = os.environ
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in TRUE


def resolve(spec: object) -> Path | None:
    """The local path of repo-id `spec` (module doc), None when `spec` is not a repo id; a
    LoadError names the cache folder it looked in when the repo is neither there nor reachable."""
    parsed = parse(spec)
    if parsed is None:
        return None
    repo, file = parsed
    try:
        import huggingface_hub as hub
    except ImportError:  # a dependency, but an environment may lack it
        raise LoadError(f"model not found: {spec}: resolving an HF repo id needs huggingface_hub: "
                        "pip install 'huggingface_hub>=0.25'") from None
    # one snapshot call for a file too: it asks the Hub once and falls back to the cache at once
    # without a network (hf_hub_download retries for half a minute, logging each retry)
    kw = {"cache_dir": cache_dir(), "local_files_only": offline(), "endpoint": os.environ.get("HF_ENDPOINT") or None,
          "allow_patterns": [file] if file else FOLDER_FILES}
    why = "HF_HUB_OFFLINE is set" if offline() else "the repo holds no such file"
    try:
        found = Path(hub.snapshot_download(repo, **kw))
    except Exception as e:  # noqa: BLE001 - whatever the hub says (offline, not found, no network) is this one line
        found = None
        if not offline():
            why = (str(e).strip().splitlines() or [type(e).__name__])[0].removeprefix("Got: ")
    if found is not None and (file is None or (found / file).is_file()):
        return found / file if file else found
    where = kw["cache_dir"] / f"models--{repo.replace('/', '--')}"
    what = f"{file} of the HF repo {repo}" if file else f"the HF repo {repo}"
    raise LoadError(f"model not found: {spec} is no local path, and {what} is not in the HF cache (looked in "
                    f"{where}) nor could it be downloaded ({why})")
