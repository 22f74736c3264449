"""`load_tokenizer(path)`: a tokenizer file or folder, opened with its backend.

Files: `tokenizer.json` (HF `tokenizers`), GPT-2 `vocab.json` + `merges.txt`, SentencePiece
`.model` and llama2.c `tokenizer.bin` (`sentencepiece.py`); a folder is searched in that order.
A `tokenizer_config.json` (or `chat_template.jinja`) beside the file supplies the chat template
and the names of BOS/EOS.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..errors import TokenizerError
from .base import HFTokenizer, Tokenizer, gpt2_bpe
from .sentencepiece import Llama2cTokenizer, SentencePieceTokenizer

SEARCH = ("tokenizer.json", "tokenizer.model", "tokenizer.bin", "vocab.json")  # folder lookup order


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    p = Path(path)
    if p.is_dir():
        tok = find_tokenizer(p)
        if tok is None:
            raise TokenizerError(f"no tokenizer in {p}: expected tokenizer.json, tokenizer.model, "
                                 "tokenizer.bin or vocab.json + merges.txt")
        return tok
    if not p.is_file():
        raise TokenizerError(f"tokenizer not found: {p}")
    extras = read_extras(p.parent)
    try:
        return _open(p, extras)
    except (OSError, ValueError, RuntimeError) as e:
        raise _unreadable(p, e) from None


def _unreadable(p: Path, e: Exception) -> TokenizerError:
    msg = str(e).splitlines()[0] if str(e) else type(e).__name__
    return TokenizerError(f"cannot read tokenizer {p}: {msg}")


def _hf_file(p: Path, build: Any, *args: Any) -> Any:
    try:
        return build(*args)
    except Exception as e:  # noqa: BLE001 - `tokenizers` reports a bad file as a plain Exception
        raise _unreadable(p, e) from None


def find_tokenizer(folder: str | os.PathLike) -> Tokenizer | None:
    for name in SEARCH:
        f = Path(folder) / name
        if f.is_file():
            return load_tokenizer(f)
    return None


def _open(p: Path, extras: dict[str, Any]) -> Tokenizer:
    name = p.name
    if name.endswith("vocab.json") or name.endswith("merges.txt"):
        vocab = p.with_name(name.replace("merges.txt", "vocab.json"))
        merges = p.with_name(name.replace("vocab.json", "merges.txt"))
        if not (vocab.is_file() and merges.is_file()):
            raise TokenizerError(f"GPT-2 BPE needs both {vocab.name} and {merges.name} in {p.parent}")
        return _hf(_hf_file(p, gpt2_bpe, vocab, merges), extras, default_specials=("<|endoftext|>",))
    if p.suffix == ".json":
        from tokenizers import Tokenizer as HFTok

        return _hf(_hf_file(p, HFTok.from_file, str(p)), extras)
    if p.suffix == ".model":
        return SentencePieceTokenizer(p, **extras)
    if p.suffix == ".bin":
        return Llama2cTokenizer.from_file(p, **extras)
    raise TokenizerError(f"unknown tokenizer file {p}: expected tokenizer.json, a SentencePiece .model, "
                         "a llama2.c tokenizer.bin or vocab.json + merges.txt")


def _hf(tok: Any, extras: dict[str, Any], default_specials: tuple[str, ...] = ()) -> HFTokenizer:
    specials = extras.get("special_tokens", {})

    def find(key: str, names: tuple[str, ...]) -> int | None:
        for name in ((specials[key],) if key in specials else ()) + names + default_specials:
            if tok.token_to_id(name) is not None:
                return tok.token_to_id(name)
        return None

    bos, eos = find("bos_token", ("<s>", "<|begin_of_text|>")), find("eos_token", ("</s>", "<|endoftext|>"))
    named = {k: tok.id_to_token(i) for k, i in (("bos_token", bos), ("eos_token", eos)) if i is not None}
    return HFTokenizer(tok, bos_id=bos, eos_id=eos, chat_template=extras.get("chat_template"),
                       special_tokens={**named, **specials})  # templates may print them


def read_extras(folder: Path) -> dict[str, Any]:
    """chat_template, special token names and add_bos_token from tokenizer_config.json."""
    cfg: dict[str, Any] = {}
    f = folder / "tokenizer_config.json"
    if f.is_file():
        try:
            cfg = json.loads(f.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise TokenizerError(f"{f}: not valid JSON ({e})") from None
    specials = {}
    for k, v in cfg.items():
        if k.endswith("_token") and isinstance(v, dict):
            v = v.get("content")  # older files store AddedToken objects
        if k.endswith("_token") and isinstance(v, str):
            specials[k] = v
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        template = jinja_file.read_text()
    extras: dict[str, Any] = {"special_tokens": specials, "chat_template": template or None}
    if isinstance(cfg.get("add_bos_token"), bool):
        extras["add_bos"] = cfg["add_bos_token"]
    return extras
