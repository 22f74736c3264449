"""One `Tokenizer` interface over four file formats, and chat templates.

Backends: `tokenizer.json` (HF `tokenizers`), GPT-2 `vocab.json` + `merges.txt` (built as an
HF byte-level BPE from the files), SentencePiece `.model` and llama2.c `tokenizer.bin`
(`tokenizer_sp.py`). `load_tokenizer(path)` picks by file name and searches a folder.
A `tokenizer_config.json` (or `chat_template.jinja`) beside the file supplies the chat
template and the names of BOS/EOS.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
from datetime import datetime
from pathlib import Path
from typing import Any

from .errors import TokenizerError

PLAIN_STOP = "\nUser:"  # the plain chat format's next turn: where an assistant reply ends
SEARCH = ("tokenizer.json", "tokenizer.model", "tokenizer.bin", "vocab.json")  # folder lookup order


class Tokenizer:
    """encode/decode, special ids and the chat template; backends fill in the first three."""

    vocab_size: int = 0

    def __init__(self, bos_id: int | None = None, eos_id: int | None = None,
                 chat_template: str | None = None, special_tokens: dict[str, str] | None = None):
        self.bos_id, self.eos_id, self.chat_template = bos_id, eos_id, chat_template
        self.special_tokens = dict(special_tokens or {})  # e.g. {"bos_token": "<s>"} for templates

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def save(self, folder: str | os.PathLike) -> None:
        """Write the tokenizer file and, when there is one, a tokenizer_config.json with the template."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self._save_file(folder)
        cfg = dict(self.special_tokens)
        if self.chat_template:
            cfg["chat_template"] = self.chat_template
        if cfg:
            (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")

    def _save_file(self, folder: Path) -> None:
        raise NotImplementedError

    def chat_format(self) -> str:
        """"template" when the chat template can be rendered, else "plain" (User:/Assistant:)."""
        return "template" if self.chat_template and importlib.util.find_spec("jinja2") else "plain"

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Prompt ids for a conversation: the template's rendering, or the plain format."""
        if self.chat_format() == "template":
            text = render_template(self.chat_template, messages, add_generation_prompt, self.special_tokens)
            return self.encode(text, add_special_tokens=False)  # the template wrote any BOS
        return self.encode(render_plain(messages, add_generation_prompt), add_special_tokens=True)


class HFTokenizer(Tokenizer):
    """An HF `tokenizers.Tokenizer`; its post-processor decides BOS/EOS."""

    def __init__(self, tok: Any, **kw: Any):
        self.tok = tok
        super().__init__(**kw)
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def _save_file(self, folder: Path) -> None:
        self.tok.save(str(folder / "tokenizer.json"))


def gpt2_bpe(vocab: Path, merges: Path) -> Any:
    """GPT-2's byte-level BPE as an HF `tokenizers.Tokenizer`, from vocab.json + merges.txt."""
    from tokenizers import Tokenizer as HFTok, decoders, models, pre_tokenizers

    tok = HFTok(models.BPE.from_file(str(vocab), str(merges)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2's regex split
    tok.decoder = decoders.ByteLevel()
    if tok.token_to_id("<|endoftext|>") is not None:
        tok.add_special_tokens(["<|endoftext|>"])  # never split by BPE; dropped by decode
    return tok


# --- loading ----------------------------------------------------------------------------------

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
    from .tokenizer_sp import Llama2cTokenizer, SentencePieceTokenizer

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


def copy_file(src: Path, dst: Path) -> None:
    if src.resolve() != dst.resolve():
        shutil.copyfile(src, dst)


# --- chat ------------------------------------------------------------------------------------

def render_plain(messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """`User:`/`Assistant:` lines, for models without a template (or without jinja2)."""
    names = {"system": "System", "user": "User", "assistant": "Assistant"}
    lines = [f"{names.get(m['role'], m['role'].title())}: {m['content']}" for m in messages]
    return "\n".join(lines + (["Assistant:"] if add_generation_prompt else []))


def render_template(template: str, messages: list[dict[str, str]], add_generation_prompt: bool,
                    special_tokens: dict[str, str]) -> str:
    """Render an HF chat template with jinja2 the way transformers does."""
    import jinja2

    try:
        return compiled_template(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                  **special_tokens)
    except jinja2.TemplateError as e:
        raise TokenizerError(f"chat template does not render: {e}") from None


@functools.lru_cache(maxsize=8)
def compiled_template(template: str) -> Any:
    # compiling costs ~3 ms, rendering ~0.1: a JSONL file of thousands of conversations renders
    # the same template twice per record
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TokenizerError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(template)
