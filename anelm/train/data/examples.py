"""The training data of a run: instruction examples from JSONL, or token windows from text
(docs/fine-tuning.md).

    data = load_data(args.data, args.seq_len, valid_data=..., train_on_prompt=..., tokenizer=tok, ...)
    batcher, evals = data.batches(args, shard)      # both kinds answer the trainer alike

`--data` naming a `.jsonl` file or a folder with `train.jsonl` gives an `ExampleSet`: the
records tokenized with the model's tokenizer and chat template (`instruct`), fitted to
`--seq-len` (a notice says how many were cut), split into train and valid (`valid.jsonl`,
`--valid-data`, or else the last 5 % of the records, at least one), batched by `packing`.
Anything else is `data.load_dataset`'s, as before.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from . import check_data_path, load_dataset, load_tokenizer, vocab_size_of
from ..errors import DataError
from .instruct import Example, encode_records, is_jsonl, jsonl_splits, read_records
from .packing import ExampleBatcher, counted_entropy, counted_total, eval_batches, fit

_NAMES = {"messages": "chat", "prompt": "prompt/completion", "text": "text"}


@dataclass
class ExampleSet:
    train: list[Example]
    val: list[Example]
    source: str           # what --data named
    tokenizer: object
    shape: str            # the records' shape: "messages", "prompt" or "text"
    held_out: bool        # val is the train file's last records (no valid set was given)
    tokenizer_path: Path | None = None  # never trained for instruction data: the model's own

    @cached_property
    def tokens(self) -> np.ndarray:
        """Every example's ids end to end (what ranks compare to be sure they read the same data)."""
        return np.concatenate([e.ids for e in self.train + self.val])

    @cached_property
    def entropy(self) -> float:
        """The unigram entropy of the counted tokens: the loss plot's reference line."""
        return counted_entropy(self.train + self.val)

    def examples_to_prompt(self) -> list[list[int]]:
        """Each valid example's prompt: its ids before the first counted one (the generation
        prompt of a chat, a completion's prompt), for the run's end sample."""
        return [e.ids[:int(np.argmax(e.counted))].tolist() for e in self.val if e.counted.any() and e.counted.argmax() > 0]

    def describe(self) -> str:
        valid = "held out from train" if self.held_out else "valid"
        return (f"{len(self.train):,} train / {len(self.val):,} {valid} {_NAMES[self.shape]} examples, "
                f"{counted_total(self.train):,} / {counted_total(self.val):,} counted tokens")

    def batches(self, args, shard: tuple[int, int] = (0, 1)):
        """(ExampleBatcher, the whole valid set's batches) for TrainSettings `args`."""
        return (ExampleBatcher(self.train, args.batch_size, args.seq_len, args.seed, shard, args.pack),
                eval_batches(self.val, args.batch_size, args.seq_len, shard, args.pack))

    def check_vocab(self, model_vocab: int) -> None:
        if vocab_size_of(self.tokenizer) > model_vocab:
            raise DataError(f"tokenizer has {vocab_size_of(self.tokenizer)} ids but the model's vocab_size "
                            f"is {model_vocab}; expected at most {model_vocab}")


def check_data(data, valid_data=None) -> None:
    """What loading would refuse, before a model loads: every JSONL record's shape and fields
    (no tokenizer needed), or `data.check_data_path`'s checks."""
    if valid_data is not None and (data is None or not is_jsonl(data)):
        raise DataError(f"--valid-data {valid_data}: expected --data to be JSONL too (a .jsonl file or a "
                        "folder with train.jsonl)")
    if data is None or not is_jsonl(data):
        check_data_path(data)
        return
    for path in [*jsonl_splits(data).values(), *([Path(valid_data)] if valid_data else [])]:
        read_records(path)


def load_data(data, seq_len: int, *, valid_data=None, train_on_prompt: bool = False, tokenizer=None,
              notice=None, **token_kw):
    """An ExampleSet for JSONL `data`, else `load_dataset(data, seq_len, tokenizer=, **token_kw)`."""
    if data is None or not is_jsonl(data):
        check_data(data, valid_data)
        return load_dataset(data, seq_len, tokenizer=tokenizer, **token_kw)
    if tokenizer is None:
        raise DataError(f"--data {data} is JSONL: expected the model's tokenizer (its chat template) "
                        "from --init-from/--model, or --tokenizer")
    tok = load_tokenizer(tokenizer)
    splits = jsonl_splits(data)
    if valid_data is not None:
        splits["valid"] = Path(valid_data)
    shape, train = _examples(splits["train"], tok, train_on_prompt)
    held_out = "valid" not in splits
    if held_out:
        n_val = max(1, round(0.05 * len(train)))
        if len(train) - n_val < 1:
            raise DataError(f"{splits['train']} has {len(train)} record(s) and no valid set; expected at least 2 "
                            "(one held out for eval loss), or a valid.jsonl")
        train, val = train[:-n_val], train[-n_val:]
    else:
        vshape, val = _examples(splits["valid"], tok, train_on_prompt)
        if vshape != shape:
            raise DataError(f"{splits['valid']}: records are {vshape} but {splits['train']}'s are {shape}; "
                            "expected one shape for the train and valid sets")
    (train, cut_t), (val, cut_v) = fit(train, seq_len), fit(val, seq_len)
    if cut_t or cut_v:
        (notice or _notice)(f"anelm: note: {cut_t + cut_v} of {len(train) + len(val)} examples are longer than "
                            f"--seq-len {seq_len} (+1) tokens and were cut to it")
    return ExampleSet(train, val, str(data), tok, shape, held_out)


def _examples(path: Path, tok, train_on_prompt: bool) -> tuple[str, list[Example]]:
    shape, records = read_records(path)
    return shape, encode_records(path, shape, records, tok, train_on_prompt)


def _notice(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
