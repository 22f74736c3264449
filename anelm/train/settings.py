"""The training settings: one dataclass, whose field metadata is the `anelm train` help.

A value comes from, in order: the command line, the run's saved `config.json` (on
`--resume`), the preset's `TRAIN_DEFAULTS`, the field default. The command line leaves
every setting at None unless the user typed it, which is how the others can fill in.
Settings derived from `--steps` (warmup, eval and checkpoint intervals) stay None until
`resolved()`, so a resumed run with a new `--steps` rescales them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace

from ..errors import UsageError

PIPELINES = ("dynamic", "static")
HEAD_PLACES = ("auto", "ane", "cpu", "gpu")  # train/steps/placement.py
EMBED_PLACES = ("cpu", "gpu")


def _f(default, help_: str, **kw):
    return field(default=default, metadata={"help": help_, **kw})


@dataclass(frozen=True)
class TrainSettings:
    preset: str = _f("tiny", "model preset: tiny, stories15m, stories42m, stories110m, qwen3-0.6b")
    data: str | None = _f(None, "UTF-8 text file, folder of .txt files, llama2.c .bin, or JSONL records (a .jsonl "
                                "file, or a folder with train.jsonl and valid.jsonl) (default: the built-in story corpus)")
    valid_data: str | None = _f(None, "validation JSONL (default: valid.jsonl beside a --data folder's train.jsonl, "
                                      "else a held-out part of the data)", metavar="FILE")
    train_on_prompt: bool = _f(False, "JSONL data: count every token in the loss, not only the answers'", kind="flag")
    pack: bool = _f(True, "JSONL data: one example per sequence, padded, instead of several packed with "
                          "attention kept inside each", kind="flag", flag="--no-pack")
    patience: int | None = _f(None, "stop after N evals without a lower eval loss (JSONL data; RUN/best keeps "
                                    "the lowest)", kind="positive")
    tokenizer: str | None = _f(None, "tokenizer.json / .model / tokenizer.bin (default: a byte-level "
                                     "BPE trained on the data, or the --init-from model's)")
    init_from: str | None = _f(None, "start from the weights (and tokenizer) of this HF folder, RUN or .gguf file",
                               metavar="HF_DIR")
    steps: int = _f(1000, "optimizer steps in the whole run", kind="positive")
    batch_size: int = _f(8, "sequences per micro-batch", kind="positive")
    seq_len: int = _f(256, "tokens per sequence (at most the model's context)", kind="positive")
    lr: float = _f(3e-4, "peak learning rate (cosine decay to 10 %%)", kind="positive")
    grad_accum: int = _f(1, "micro-batches per optimizer step", kind="positive")
    warmup: int | None = _f(None, "linear warmup steps (default: 5 %% of --steps)", kind="nonneg")
    weight_decay: float = _f(0.1, "AdamW weight decay (not on norms)", kind="nonneg")
    clip: float = _f(1.0, "clip the global gradient norm to this (0: off)", kind="nonneg")
    loss_scale: str = _f("dynamic", "'dynamic' (halve on overflow, double when clean) or a fixed number")
    eval_every: int | None = _f(None, "eval loss every N steps (default: 10 %% of --steps)", kind="positive")
    eval_batches: int = _f(4, "held-out batches per eval (text data; JSONL evaluates its whole valid set)",
                           kind="positive")
    save_every: int | None = _f(None, "checkpoint every N steps (default: 10 %% of --steps)",
                                kind="positive")
    keep_last: int = _f(3, "checkpoints to keep (0: all)", kind="nonneg")
    seed: int = _f(0, "seed of the weight init and the batch order", kind="int")
    pipeline: str = _f("dynamic", "dynamic: weights as kernel inputs, compiled once; static: weights "
                                  "baked into the kernels, recompiled per update", choices=PIPELINES)
    head_on: str = _f("auto", "where the classifier and its loss run: ane (vocabulary tiles on the device), cpu, "
                              "gpu (torch's mps on a Mac, or cuda), or auto, the one the cost model predicts "
                              "fastest on the chip (the CPU on the emulator)", choices=HEAD_PLACES)
    embed_on: str = _f("cpu", "where the embedding's gather and its gradient run: cpu, or gpu (as --head-on gpu)",
                       choices=EMBED_PLACES)
    sample_tokens: int = _f(64, "tokens of the sample printed at the end (0: none)", kind="nonneg")
    bpe_vocab_size: int | None = _f(None, "vocabulary of the BPE trained when no tokenizer is given "
                                          "(default: the preset's)", kind="positive")

    # ------------------------------------------------------------------ resolution

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def merge(cls, explicit: dict, saved: dict | None = None, defaults: dict | None = None
              ) -> "TrainSettings":
        """Command line over saved over preset defaults over field defaults."""
        values = {}
        for name in cls.names():
            for source in (explicit, saved or {}, defaults or {}):
                if source.get(name) is not None:
                    values[name] = source[name]
                    break
        return cls(**values)

    def resolved(self) -> "TrainSettings":
        """Fill the intervals that scale with --steps; refuse impossible combinations."""
        tenth = max(1, round(self.steps / 10))
        s = replace(self, eval_every=self.eval_every or tenth, save_every=self.save_every or tenth,
                    warmup=self.warmup if self.warmup is not None else int(round(0.05 * self.steps)))
        s.check()
        return s

    def check(self) -> None:
        if not math.isfinite(self.lr) or self.lr <= 0:
            raise UsageError(f"--lr: expected a positive finite number, got {self.lr}")
        if self.warmup is not None and self.warmup > self.steps:
            raise UsageError(f"--warmup {self.warmup}: expected at most --steps ({self.steps})")
        for name in ("weight_decay", "clip"):
            v = getattr(self, name)
            if not math.isfinite(v) or v < 0:
                raise UsageError(f"--{name.replace('_', '-')}: expected a finite number >= 0, got {v}")
        if self.loss_scale != "dynamic":
            try:
                ok = math.isfinite(float(self.loss_scale)) and float(self.loss_scale) > 0
            except ValueError:
                ok = False
            if not ok:
                raise UsageError(f"--loss-scale: expected 'dynamic' or a positive number, "
                                 f"got {self.loss_scale!r}")
        if self.pipeline not in PIPELINES:
            raise UsageError(f"--pipeline: expected one of {', '.join(PIPELINES)}, got {self.pipeline!r}")
        if self.seq_len < 2:
            raise UsageError(f"--seq-len: expected at least 2, got {self.seq_len}")

    def to_dict(self) -> dict:
        return asdict(self)

    def argv(self) -> list[str]:
        """The settings as `--key=value` flags (for the restart's command line); a flag setting
        as its flag, when it is not the default."""
        out, flags = [], {f.name: f for f in fields(self) if f.metadata.get("kind") == "flag"}
        for name, v in self.to_dict().items():
            if name in flags:
                if v != flags[name].default:
                    out.append(flags[name].metadata.get("flag") or f"--{name.replace('_', '-')}")
            elif v is not None:
                out.append(f"--{name.replace('_', '-')}={v}")
        return out
