"""Training data: `--data` to a flat token array, then seeded random batches.

Inputs (`load_dataset`):
- a UTF-8 text file, or a folder of `.txt` files (recursively, in sorted order), tokenized once
  into a raw uint16 (uint32 above 65536 ids) file in a cache folder, named by a hash of the
  content and of the tokenizer, then memory-mapped;
- a pretokenized llama2.c/TinyStories `.bin`: flat little-endian uint16 ids, no header;
- nothing: the built-in story corpus (`corpus.py`).

Without a tokenizer, a byte-level BPE is trained on the text with HF `tokenizers` and saved
as `tokenizer.json` in the run folder; a run that already has one (a resume) reuses it, so
the ids never change under a checkpoint.

The last `val_fraction` of the tokens is held out for eval loss. Batches are `[B, S]` int64
inputs and the same windows shifted by one as targets.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from ... import caches
from ...atomic import atomic_open
from .corpus import EOT, generate_corpus
from ..errors import DataError

_CHUNK_CHARS = 1 << 20  # tokenize in ~1 MB pieces cut at line ends (bounded memory, batched)
_EXPECTED = "expected a UTF-8 text file, a folder of .txt files, or a llama2.c .bin of uint16 ids"


# ---------------------------------------------------------------------- reading input

def text_files(path: Path) -> list[Path]:
    """The text files behind `--data`: the file itself, or a folder's `.txt` files, sorted."""
    if not path.exists():
        raise DataError(f"data path {path} does not exist; {_EXPECTED}")
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*.txt") if p.is_file() and not p.name.startswith("."))
    if not files:
        raise DataError(f"data folder {path} holds no .txt files; {_EXPECTED}")
    return files


def read_text(path: Path, allow_empty: bool = False) -> str:
    """The file as text, refusing binary files (and empty ones, unless one of a folder's)."""
    raw = path.read_bytes()
    if not raw and not allow_empty:
        raise DataError(f"data file {path} is empty; {_EXPECTED}")
    nul = raw.find(b"\x00")
    if nul >= 0:
        raise DataError(f"data file {path} looks binary (NUL byte at offset {nul}); {_EXPECTED}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"data file {path} is not UTF-8 (byte 0x{raw[e.start]:02x} at offset "
                        f"{e.start}); {_EXPECTED}") from None


def load_bin(path: Path) -> np.ndarray:
    """A llama2.c `.bin`: flat little-endian uint16 token ids, memory-mapped."""
    size = path.stat().st_size
    if size == 0:
        raise DataError(f"token file {path} is empty; {_EXPECTED}")
    if size % 2:
        raise DataError(f"token file {path} has {size} bytes; expected an even count "
                        "(flat little-endian uint16 ids)")
    return np.memmap(path, dtype="<u2", mode="r")


def check_data_path(data: str | Path | None) -> None:
    """What `load_dataset` refuses about `--data` before reading it: a path that is not there,
    a folder without .txt files, an empty file. Cheap, so a run checks it before its model loads."""
    if data is None:
        return
    path = Path(data)
    if path.is_file() and path.suffix == ".bin":
        load_bin(path)
    elif len(files := text_files(path)) == 1 and files[0].stat().st_size == 0:
        raise DataError(f"data file {path} is empty; {_EXPECTED}")


# ------------------------------------------------------------------------- tokenizers

def train_bpe(files: list[Path], vocab_size: int, out_path: Path):
    """Train a byte-level BPE (every byte is a token, so any text encodes) and save it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(f) for f in files], trainer)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_path))
    return tok


def load_tokenizer(spec):
    """A tokenizer object: `spec` itself, or loaded from a file by `anelm.models.tokenizer`
    (tokenizer.json, SentencePiece .model, llama2.c tokenizer.bin, GPT-2 vocab.json)."""
    if not isinstance(spec, (str, Path)):
        return spec
    if not Path(spec).exists():
        raise DataError(f"tokenizer {spec} does not exist; expected a tokenizer.json, "
                        "tokenizer.model or tokenizer.bin file")
    from ...models.tokenizer import load_tokenizer as load_model_tokenizer

    return load_model_tokenizer(spec)


def vocab_size_of(tok) -> int:
    """Number of ids the tokenizer can produce (HF `get_vocab_size`, else `vocab_size`/len)."""
    if hasattr(tok, "get_vocab_size"):
        return int(tok.get_vocab_size(with_added_tokens=True))
    if hasattr(tok, "vocab_size"):
        return int(tok.vocab_size)
    return len(tok)


def _hf_backend(tok):
    # the raw HF `tokenizers.Tokenizer`, given directly or inside anelm's HFTokenizer
    inner = getattr(tok, "tok", tok)
    return inner if hasattr(inner, "encode_batch") and hasattr(inner, "to_str") else None


def _fingerprint(tok) -> bytes:
    # what identifies a tokenizer for the cache key: its whole definition when we can see it
    hf = _hf_backend(tok)
    if hf is not None:
        return hf.to_str().encode()
    probe = "Once upon a time, 12 émigrés said: \"ok!\"\n\tThe end."
    return repr((type(tok).__qualname__, vocab_size_of(tok), list(_encode(tok, [probe])[0]))).encode()


def _encode(tok, texts: list[str]) -> list:
    """Ids of each text without BOS/EOS: chunks are not documents, the text marks those."""
    hf = _hf_backend(tok)
    if hf is not None:  # batched, in parallel in Rust
        return [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)]
    out = []
    for t in texts:
        try:
            ids = tok.encode(t, add_special_tokens=False)
        except TypeError:  # an encode(text) without the keyword
            ids = tok.encode(t)
        out.append(getattr(ids, "ids", ids))
    return out


def _chunks(text: str) -> list[str]:
    pieces, start = [], 0
    while start < len(text):
        end = text.find("\n", start + _CHUNK_CHARS)
        end = len(text) if end < 0 else end + 1
        pieces.append(text[start:end])
        start = end
    return pieces


# --------------------------------------------------------------------- the token cache

def default_cache_dir() -> Path:
    return caches.cache_dir("tokens")


def _write_atomic(path: Path, arr: np.ndarray) -> None:
    with atomic_open(path, durable=True) as f:
        f.write(arr.tobytes())


def tokenize_files(files: list[Path], tok, cache_dir: Path) -> tuple[np.ndarray, Path]:
    """Tokens of all files in order, from the cache when this content and tokenizer were
    seen before; otherwise tokenized now and cached. Returns (memmap, cache file)."""
    h = hashlib.sha256(_fingerprint(tok))
    texts = []
    for f in files:
        text = read_text(f, allow_empty=len(files) > 1)
        texts.append(text)
        h.update(f.name.encode() + b"\0" + hashlib.sha256(text.encode()).digest())
    if not any(texts):
        raise DataError(f"data folder {files[0].parent} holds only empty files; {_EXPECTED}")
    vocab = vocab_size_of(tok)
    dtype = np.dtype("<u2") if vocab <= 1 << 16 else np.dtype("<u4")
    path = cache_dir / f"{h.hexdigest()[:32]}.{'u16' if dtype.itemsize == 2 else 'u32'}"
    if not path.exists():
        ids = [np.asarray(i, dtype=np.int64) for t in texts for i in _encode(tok, _chunks(t))]
        flat = np.concatenate(ids) if ids else np.zeros(0, np.int64)
        if flat.size and (flat.min() < 0 or flat.max() >= 1 << (8 * dtype.itemsize)):
            raise DataError(f"tokenizer produced id {flat.max()} outside {dtype.name}")
        cache_dir.mkdir(parents=True, exist_ok=True)
        _write_atomic(path, flat.astype(dtype))
    if path.stat().st_size == 0:
        return np.zeros(0, dtype), path
    return np.memmap(path, dtype=dtype, mode="r"), path


# -------------------------------------------------------------------------- the dataset

@dataclass
class Dataset:
    """All tokens (train then validation), where they came from, and their tokenizer."""

    tokens: np.ndarray            # 1-D ids, memmap (uint16 or uint32)
    n_val: int                    # the last n_val tokens are the validation split
    source: str                   # what --data named, for messages and config.json
    tokenizer: object = None      # None for a .bin given without one
    tokenizer_path: Path | None = None  # tokenizer.json written into the run, if trained

    @cached_property
    def entropy(self) -> float:
        """The unigram entropy of all its tokens, in nats: the bar a model must beat, which the
        run's last line and loss.png compare the loss against."""
        return unigram_entropy(self.tokens)

    @property
    def train(self) -> np.ndarray:
        return self.tokens[: len(self.tokens) - self.n_val]

    @property
    def val(self) -> np.ndarray:
        return self.tokens[len(self.tokens) - self.n_val:]

    def describe(self) -> str:
        return f"{len(self.train):,} train / {len(self.val):,} held-out tokens"

    def batches(self, args, shard: tuple[int, int] = (0, 1)) -> tuple["Batcher", list["Batch"]]:
        """The trainer's batches (`args`: TrainSettings): random windows, and the fixed eval ones."""
        evals = eval_batches(self.val, args.batch_size, args.seq_len, args.eval_batches, shard)
        return (Batcher(self.train, args.batch_size, args.seq_len, args.seed, shard=shard),
                [Batch(x, y, None, x.size * shard[1]) for x, y in evals])

    def check_vocab(self, model_vocab: int) -> None:
        """Refuse a tokenizer or token file with ids the model's embedding has no row for."""
        if self.tokenizer is not None and vocab_size_of(self.tokenizer) > model_vocab:
            raise DataError(f"tokenizer has {vocab_size_of(self.tokenizer)} ids but the model's "
                            f"vocab_size is {model_vocab}; expected at most {model_vocab}")
        top = int(self.tokens.max())
        if top >= model_vocab:
            raise DataError(f"{self.source} holds token id {top} but the model's vocab_size is "
                            f"{model_vocab}; expected ids below {model_vocab}")


def load_dataset(data: str | Path | None, seq_len: int, *, run_dir: str | Path | None = None,
                 tokenizer=None, bpe_vocab_size: int = 1024, cache_dir: str | Path | None = None,
                 val_fraction: float = 0.05) -> Dataset:
    """Tokens for `--data` (None: the built-in corpus), split into train and validation.

    `tokenizer`: a tokenizer.json path or a loaded tokenizer object; None trains a BPE of
    `bpe_vocab_size` ids into `run_dir/tokenizer.json` (or reuses the one already there).
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if data is None:
        path, source = _builtin_corpus(cache), "the built-in corpus"
    else:
        path, source = Path(data), str(data)
    tok, tok_path = (load_tokenizer(tokenizer) if tokenizer is not None else None), None
    if path.is_file() and path.suffix == ".bin":
        tokens = load_bin(path)
    else:
        files = text_files(path)
        if tok is None:
            if run_dir is None:
                raise DataError("training a tokenizer needs a run folder to save tokenizer.json in")
            tok_path = Path(run_dir) / "tokenizer.json"
            if tok_path.exists():
                tok = load_tokenizer(tok_path)
            else:
                for f in files:  # refuse bad files before BPE training sees them
                    read_text(f, allow_empty=len(files) > 1)
                train_bpe(files, bpe_vocab_size, tok_path)
                tok = load_tokenizer(tok_path)
        tokens, _ = tokenize_files(files, tok, cache)
    return Dataset(tokens, _val_size(len(tokens), seq_len, val_fraction, source),
                   source, tok, tok_path)


def _builtin_corpus(cache: Path) -> Path:
    # named by its content, so a change to the grammar can never reuse stale tokens
    text = generate_corpus()
    path = cache / f"builtin-stories-{hashlib.sha256(text.encode()).hexdigest()[:16]}.txt"
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        _write_atomic(path, np.frombuffer(text.encode(), np.uint8))
    return path


def _val_size(n: int, seq_len: int, val_fraction: float, source: str) -> int:
    # each split needs one full window of seq_len inputs plus the shifted target
    n_val = max(int(round(n * val_fraction)), seq_len + 1)
    if n - n_val < seq_len + 1:
        raise DataError(f"{source} has {n} tokens; expected at least {2 * (seq_len + 1)} "
                        f"(seq_len + 1 = {seq_len + 1} each for training and validation)")
    return n_val


def unigram_entropy(tokens: np.ndarray) -> float:
    """Entropy in nats of the token frequency distribution (the bar a model must beat)."""
    counts = np.bincount(np.asarray(tokens, dtype=np.int64))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


# ------------------------------------------------------------------------------ batches

@dataclass
class Batch:
    """What one micro-batch gives the step (token windows here, packed examples in `packing`)."""

    x: np.ndarray                 # int64 [N, S] inputs
    y: np.ndarray                 # int64 [N, S] targets, IGNORE where not counted (and in padding)
    positions: np.ndarray | None  # int64 [N, S]: each example's restart at 0; None: every row is 0..S-1
    counted: int                  # counted targets in the GLOBAL batch (all ranks' rows): the loss denominator


class Batcher:
    """Random windows from the training split, from a seeded generator whose state is saved
    in checkpoints, so a resumed run draws exactly the batches the straight run would.

    `shard=(rank, world)` (data-parallel training): every rank draws the same global batch of
    world × batch_size windows and keeps rows rank·B .. rank·B + B, so the ranks together see
    exactly what one process with batch world × B sees, and their generators stay equal."""

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int,
                 shard: tuple[int, int] = (0, 1)):
        if len(tokens) < seq_len + 1:
            raise DataError(f"training split has {len(tokens)} tokens; expected at least {seq_len + 1}")
        self.tokens, self.batch_size, self.seq_len, self.shard = tokens, batch_size, seq_len, shard
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.drawn = 0  # batches drawn so far: the data position

    def draw(self) -> Batch:
        """`next()` as a Batch: every target counts, world × B × S in the global batch."""
        x, y = self.next()
        return Batch(x, y, None, x.size * self.shard[1])

    def next(self) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets), each int64 `[B, S]`; targets are the inputs shifted by one."""
        offsets = self.rng.integers(0, len(self.tokens) - self.seq_len,
                                    size=self.batch_size * self.shard[1])
        windows = _windows(self.tokens, _my_rows(offsets, self.shard), self.seq_len)
        self.drawn += 1
        return windows[:, :-1], windows[:, 1:]

    def state_dict(self) -> dict:
        """JSON-able: the generator state (arbitrary-size ints) and the batch count."""
        return {"rng": self.rng.bit_generator.state, "drawn": self.drawn}

    def load_state_dict(self, d: dict) -> None:
        self.rng.bit_generator.state = d["rng"]
        self.drawn = int(d["drawn"])


def _my_rows(global_batch: np.ndarray, shard: tuple[int, int]) -> np.ndarray:
    """This rank's equal slice of a global batch (rows rank·n/world .. (rank+1)·n/world)."""
    rank, world = shard
    per = len(global_batch) // world
    return global_batch[rank * per:(rank + 1) * per]


def _windows(tokens: np.ndarray, offsets: np.ndarray, seq_len: int) -> np.ndarray:
    idx = offsets[:, None] + np.arange(seq_len + 1)  # (B, S+1)
    return np.asarray(tokens[idx], dtype=np.int64)


def eval_batches(val: np.ndarray, batch_size: int, seq_len: int, max_batches: int = 8,
                 shard: tuple[int, int] = (0, 1)) -> list[tuple[np.ndarray, np.ndarray]]:
    """A fixed set of validation batches: evenly spaced windows over the split, the same on
    every call, so eval losses are comparable across steps and runs. With `shard`, the
    batches are the global ones of world × batch_size windows and this rank gets its slice of
    each (as `Batcher`), so the mean over the ranks is the one-process eval loss."""
    batch_size *= shard[1]
    if len(val) < seq_len + 1:
        raise DataError(f"validation split has {len(val)} tokens; expected at least {seq_len + 1}")
    count = min(max_batches * batch_size, (len(val) - 1) // seq_len)
    offsets = np.linspace(0, len(val) - seq_len - 1, count).round().astype(np.int64)
    groups = [offsets[i:i + batch_size] for i in range(0, count, batch_size)]
    if len(groups) > 1 and len(groups[-1]) < batch_size:
        groups.pop()  # equal batch shapes, so one compiled kernel shape serves all
    if len(groups[0]) < shard[1]:
        raise DataError(f"validation split has {len(val)} tokens, {len(groups[0])} windows of "
                        f"{seq_len}; expected at least one per rank ({shard[1]})")
    return [(w[:, :-1], w[:, 1:]) for w in (_windows(val, _my_rows(g, shard), seq_len) for g in groups)]
