"""The tokenizer a GGUF file describes, rebuilt as an HF `tokenizers.Tokenizer` from its metadata.

`tokenizer.ggml.model` names the kind, with llama.cpp's meaning:
- `gpt2`: byte-level BPE. `tokens` are already spelled in GPT-2's byte alphabet and `merges`
  are "left right" lines; `tokenizer.ggml.pre` names how text is split into words before BPE,
  one regex (or several, applied in turn) per family, as llama.cpp's pre-tokenizer table has them.
- `llama`: SentencePiece BPE. There are no merges, only a score per piece: SentencePiece joins
  the adjacent pair whose union has the highest score, which is BPE with merges ranked by that
  score. Text gets the "▁" word marker (and a leading one unless `add_space_prefix` is false);
  characters without a piece fall back to <0xNN> byte pieces.
Token types (llama.cpp's): 3 control tokens are special (never split, dropped by decode),
4 user-defined ones are matched whole. BOS/EOS are added as `add_bos_token`/`add_eos_token`
say, with llama.cpp's defaults (BOS for SentencePiece vocabularies, none for byte-level).
"""

from __future__ import annotations

from typing import Any

from ..errors import TokenizerError
from .base import HFTokenizer

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types
META = "\u2581"  # SentencePiece's visible space

# GPT-2's word split (its tokenizer's regex): contractions, letters, digits, other symbols, spaces.
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# Llama 3 and Qwen2 differ in how digits group: up to three per word, or one.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
# GPT-4o's (o200k; Phi-4-mini's tokenizer.json): a word's capitals split from the next word's,
# contractions kept on the word, digits in threes
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
GPT4O_SPLIT = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTION}|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTION}"
               r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_SPLITS = {
    "gpt-2": (GPT2_SPLIT,),
    "smollm": (r"\p{N}", GPT2_SPLIT),  # every digit its own word, then GPT-2's split
    "llama-bpe": (LLAMA3_SPLIT,),
    "qwen2": (QWEN2_SPLIT,),
    "gpt-4o": (GPT4O_SPLIT,),
    # llama.cpp's fallback for files that name no family
    "default": (r"[\p{P}\$\+<=>\^~\|]+", GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]"),
}
IGNORE_MERGES = {"llama-bpe"}  # Llama 3 takes a word that is a whole token as it is, before merging


def tokenizer_from_gguf(meta: dict[str, Any], source: str) -> HFTokenizer:
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if kind not in ("gpt2", "llama"):
        raise TokenizerError(f"{source}: unsupported tokenizer.ggml.model {kind!r}: expected gpt2 or llama")
    if not tokens:
        raise TokenizerError(f"{source}: GGUF metadata tokenizer.ggml.tokens is missing")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    tok = _byte_level(meta, tokens, source) if kind == "gpt2" else _sentencepiece(meta, tokens, types)
    _add_special(tok, tokens, types)
    ids = {k: meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos")}
    add = {"bos": meta.get("tokenizer.ggml.add_bos_token", kind == "llama"),
           "eos": meta.get("tokenizer.ggml.add_eos_token", False)}
    _post_process(tok, tokens, ids, add)
    named = {f"{k}_token": tokens[i] for k, i in ids.items() if i is not None and 0 <= i < len(tokens)}
    return HFTokenizer(tok, bos_id=ids["bos"], eos_id=ids["eos"], chat_template=meta.get("tokenizer.chat_template"),
                       special_tokens=named)


def _byte_level(meta: dict[str, Any], tokens: list[str], source: str) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_SPLITS:
        raise TokenizerError(f"{source}: unsupported tokenizer.ggml.pre {pre!r}: expected one of "
                             f"{', '.join(PRE_SPLITS)}")
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=pre in IGNORE_MERGES))
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_SPLITS[pre]]
    # the words are already split: ByteLevel only maps bytes to GPT-2's alphabet
    tok.pre_tokenizer = pre_tokenizers.Sequence(splits + [pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                  use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(meta: dict[str, Any], tokens: list[str], types: list[int]) -> Any:
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(models.BPE(vocab, _merges_from_scores(tokens, scores, types, vocab),
                               unk_token=tokens[unk] if unk is not None else None,
                               byte_fallback=True, fuse_unk=True))
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    # A normalizer, not Metaspace: SentencePiece (and llama.cpp, after each special token too)
    # adds "▁" even to text that starts with a space, which Metaspace would not. The text stays
    # one word, so merges may cross spaces as SentencePiece's do.
    tok.normalizer = normalizers.Sequence(([normalizers.Prepend(META)] if prefix else [])
                                          + [normalizers.Replace(" ", META)])
    steps = [decoders.Replace(META, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))  # the added space
    return tok


def _merges_from_scores(tokens: list[str], scores: list[float], types: list[int],
                        vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a normal piece into two pieces, best-scored union first (ties: lower id)."""
    found = []
    for i, t in enumerate(tokens):
        if types[i] != 1:  # control, byte and unknown pieces never come out of a merge
            continue
        for cut in range(1, len(t)):
            left, right = t[:cut], t[cut:]
            if left in vocab and right in vocab:
                found.append((-scores[i], i, vocab[left], (left, right)))
    return [m for *_, m in sorted(found)]


def _add_special(tok: Any, tokens: list[str], types: list[int]) -> None:
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED])


def _post_process(tok: Any, tokens: list[str], ids: dict[str, int | None], add: dict[str, bool]) -> None:
    from tokenizers import processors

    for k in ("bos", "eos"):
        if add[k] and ids[k] is None:
            raise TokenizerError(f"GGUF metadata says add_{k}_token but has no tokenizer.ggml.{k}_token_id")
    pre = [tokens[ids["bos"]]] if add["bos"] else []
    post = [tokens[ids["eos"]]] if add["eos"] else []
    if pre or post:
        single = " ".join(pre + ["$A"] + post)
        tok.post_processor = processors.TemplateProcessing(
            single=single, pair=single + " " + " ".join(pre + ["$B:1"] + post),
            special_tokens=[(tokens[ids[k]], ids[k]) for k in ("bos", "eos") if add[k]])
