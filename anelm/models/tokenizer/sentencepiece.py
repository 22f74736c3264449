"""SentencePiece-family tokenizers: a `.model` through the sentencepiece library, and
llama2.c's `tokenizer.bin` with llama2.c's own encoder.

`tokenizer.bin`: uint32 max piece length, then per piece an f32 score, an int32 byte length
and the UTF-8 bytes, until the end of the file. Word boundaries are marked "▁" (U+2581) in
SentencePiece exports and " " in llama2.c's own export; both are read.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path
from typing import Any

from ..errors import TokenizerError
from .base import Tokenizer, copy_file

BYTE_PIECE = re.compile(rb"<0x([0-9A-Fa-f]{2})>")
META = "\u2581"  # SentencePiece's visible space


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece `.model`; BOS is added unless tokenizer_config.json says otherwise."""

    def __init__(self, path: Path, add_bos: bool = True, special_tokens: dict[str, str] | None = None,
                 chat_template: str | None = None):
        try:
            import sentencepiece as spm
        except ImportError:
            raise TokenizerError(f"reading {path} needs the optional package sentencepiece: "
                                 "pip install 'anelm[sentencepiece]'") from None
        self.path = Path(path)
        try:
            self.sp = spm.SentencePieceProcessor(model_file=str(path))
        except (OSError, RuntimeError) as e:
            raise TokenizerError(f"{path}: not a SentencePiece model ({str(e).splitlines()[0]})") from None
        bos, eos = self.sp.bos_id(), self.sp.eos_id()
        names = {k: self.sp.id_to_piece(i) for k, i in (("bos_token", bos), ("eos_token", eos)) if i >= 0}
        super().__init__(bos if bos >= 0 else None, eos if eos >= 0 else None, chat_template,
                         {**names, **(special_tokens or {})})
        self.vocab_size, self.add_bos = self.sp.vocab_size(), add_bos

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.sp.encode(text)
        return ([self.bos_id] if add_special_tokens and self.add_bos and self.bos_id is not None else []) + ids

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode([int(i) for i in ids])

    def _save_file(self, folder: Path) -> None:
        copy_file(self.path, folder / "tokenizer.model")


class Llama2cTokenizer(Tokenizer):
    """llama2.c's encoder: "▁" + text with spaces as "▁", one piece per character (or
    <0xNN> byte pieces when the character has none), then repeatedly merge the adjacent pair
    whose concatenation is a piece with the highest score (leftmost on ties)."""

    def __init__(self, pieces: list[bytes], scores: list[float], max_len: int, add_bos: bool = True,
                 special_tokens: dict[str, str] | None = None, chat_template: str | None = None):
        self.pieces, self.scores, self.max_len = pieces, scores, max_len
        find = lambda *names: next((i for i, p in enumerate(pieces) if p in names), None)  # noqa: E731
        bos, eos, unk = find(b"<s>", b"\n<s>\n"), find(b"</s>", b"\n</s>\n"), find(b"<unk>")
        self.control = {i for i in (bos, eos, unk) if i is not None}
        self.bytes = {int(m.group(1), 16): i for i, p in enumerate(pieces) if (m := BYTE_PIECE.fullmatch(p))}
        # Control and byte pieces are never merge results: SentencePiece never forms them from text.
        self.ids: dict[bytes, int] = {}
        for i, p in enumerate(pieces):
            if i not in self.control and not BYTE_PIECE.fullmatch(p):
                self.ids.setdefault(p, i)
        self.space = META if META.encode() in b"".join(pieces) else " "
        names = {"bos_token": "<s>", "eos_token": "</s>"}
        super().__init__(bos, eos, chat_template, {**names, **(special_tokens or {})})
        self.vocab_size, self.add_bos, self.unk = len(pieces), add_bos, unk

    @classmethod
    def from_file(cls, path: Path, **kw: Any) -> "Llama2cTokenizer":
        data = Path(path).read_bytes()
        if len(data) < 4:
            raise TokenizerError(f"{path}: truncated tokenizer.bin: expected a 4-byte header, found {len(data)} bytes")
        (max_len,), off, pieces, scores = struct.unpack_from("<I", data), 4, [], []
        while off < len(data):
            if off + 8 > len(data):
                raise TokenizerError(f"{path}: truncated tokenizer.bin at piece {len(pieces)}")
            score, n = struct.unpack_from("<fi", data, off)
            if n < 0 or off + 8 + n > len(data):
                raise TokenizerError(f"{path}: truncated tokenizer.bin at piece {len(pieces)}: "
                                     f"expected {n} bytes, found {len(data) - off - 8}")
            pieces.append(data[off + 8: off + 8 + n])
            scores.append(score)
            off += 8 + n
        return cls(pieces, scores, max_len, **kw)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._merge(self._chars(self.space + text.replace(" ", self.space))) if text else []
        return ([self.bos_id] if add_special_tokens and self.add_bos and self.bos_id is not None else []) + ids

    def _chars(self, text: str) -> list[int]:
        ids = []
        for ch in text:
            b = ch.encode("utf-8")
            if b in self.ids:
                ids.append(self.ids[b])
            else:  # byte fallback; a model without byte pieces gets <unk>
                ids.extend(self.bytes.get(x, self.unk if self.unk is not None else 0) for x in b)
        return ids

    def _pair(self, ids: list[int], i: int) -> tuple[float, int]:
        j = self.ids.get(self.pieces[ids[i]] + self.pieces[ids[i + 1]])
        return (float("-inf"), -1) if j is None else (self.scores[j], j)

    def _merge(self, ids: list[int]) -> list[int]:
        pairs = [self._pair(ids, i) for i in range(len(ids) - 1)]  # (score, merged id) of (i, i+1)
        while pairs:
            best = max(range(len(pairs)), key=lambda i: pairs[i][0])  # first maximum: leftmost
            if pairs[best][1] < 0:
                break
            ids[best: best + 2] = [pairs[best][1]]
            del pairs[best]
            for i in (best - 1, best):  # only the pairs touching the merged piece change
                if 0 <= i < len(pairs):
                    pairs[i] = self._pair(ids, i)
        return ids

    def decode(self, ids: list[int]) -> str:
        out = bytearray()
        for i in ids:
            if i in self.control:
                continue
            p = self.pieces[i]
            m = BYTE_PIECE.fullmatch(p)
            out += bytes([int(m.group(1), 16)]) if m else p
        text = out.decode("utf-8", errors="replace").replace(META, " ")
        return text[1:] if text.startswith(" ") else text  # the prefix space the encoder added

    def _save_file(self, folder: Path) -> None:
        parts = [struct.pack("<I", self.max_len)]
        for p, s in zip(self.pieces, self.scores):
            parts.append(struct.pack("<fi", s, len(p)) + p)
        (folder / "tokenizer.bin").write_bytes(b"".join(parts))
