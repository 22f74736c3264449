"""Helpers any test folder imports by name (`from helpers import ...`): pyproject puts tests/
on pytest's `pythonpath`, so they import the same way whichever folders a run collects.

`../shared` (beside the repo) holds external fixtures: MIL conformance programs and real
tokenizer files. It is not part of a user's clone, so tests that read it skip with a reason.
"""

import random
import signal
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"

# docs/testing.md's default tolerances, against an independent float32/float64 reference
ELEMENTWISE_TOL = 2e-3  # one elementwise op
REDUCTION_TOL = 1e-2    # matmul, conv, reductions, softmax
BLOCK_TOL = 2e-2        # a transformer block
LOGITS_TOL = 3e-2       # logits of a whole tiny model
GRAD_TOL = 5e-2         # gradients against PyTorch autograd in fp32 ...
GRAD_COSINE = 0.999     # ... with at least this cosine similarity


TIE_MARGIN = 0.05       # greedy choices may differ where HF's top-2 margin is under this x max|logit|


def decisive(logits) -> bool:
    """docs/testing.md's tie rule: HF's top-2 logit margin is at least TIE_MARGIN of max|logit|,
    so a different choice there is a real disagreement."""
    top2 = np.sort(np.asarray(logits, np.float64))[-2:]
    return bool(top2[1] - top2[0] >= TIE_MARGIN * np.abs(logits).max())


def rel_err(got, ref) -> float:
    """The error measure of docs/testing.md: max|got − ref| / max|ref|, in float64."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))


def shared_path(*parts: str) -> Path:
    p = SHARED.joinpath(*parts)
    if not p.exists():
        pytest.skip(f"{p} is absent: ../shared (external fixtures) is not part of a user's clone")
    return p


def rms_norm_graph(b, x, weight, eps: float = 1e-5, name: str = "rms"):
    """A small realistic graph for the compiler's tests: the unscaled RMSNorm of the reference
    programs (`anelm.kernels.norms.plain_rms`; the kernels' own norm first scales x for fp16)."""
    from anelm.kernels.norms import plain_rms

    return plain_rms(b, x, weight, eps, name)

def kill_after(procs, checkpoint: Path, wait_s: float, jitter_s: float, late=None) -> list[int]:
    """SIGKILL every process of `procs` (one job) at a random moment up to `jitter_s` after
    `checkpoint` appears ("at any moment" after the first checkpoint), or once one of them has
    ended or `wait_s` has passed; their return codes. `late()`: true once the run is so near its
    end that the kill must come now (on a fast machine the jitter could outlast the run)."""
    deadline = time.time() + wait_s
    while not checkpoint.exists() and all(p.poll() is None for p in procs) and time.time() < deadline:
        time.sleep(0.005)
    until = time.time() + random.uniform(0.0, jitter_s)
    while time.time() < until and not (late is not None and late()):
        time.sleep(0.002)
    for p in procs:
        p.send_signal(signal.SIGKILL)
    return [p.wait() for p in procs]


def steps_logged(run: Path) -> int:
    """The highest step of a run's metrics.jsonl so far (0 when none; a torn line is skipped)."""
    from anelm.train.metrics import read_metrics

    return max((int(r.get("step", 0)) for r in read_metrics(run)), default=0)


def byte_tokenizer(eos_id: int = 256):
    """A byte-level tokenizer whose token id is the byte's value (0-255), EOS `eos_id`: characters
    span tokens. The vocabulary is built in byte order, as GPT-2 maps bytes to characters, because
    `ByteLevel.alphabet()` lists its characters in a different order in every process."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from anelm.models.tokenizer.base import HFTokenizer

    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]  # bytes shown as themselves
    shifted = iter(range(256, 512))
    chars = [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]
    tok = Tokenizer(models.BPE({c: b for b, c in enumerate(chars)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    return HFTokenizer(tok, eos_id=eos_id)


def device_against_cpu(config, weights, ids=(5, 9, 17, 33, 2, 70, 41, 8), max_context: int = 32) -> float:
    """`rel_err` of a model's logits from the device pipeline on the emulator against its float32
    CPU reference on the same weights (a quantized folder's: the dequantized ones)."""
    from anelm.generate.pipeline import build_runner
    from anelm.models.loading import build_model

    cpu = build_model(config, dict(weights))
    ref = cpu.prefill(list(ids), cpu.new_cache())
    runner = build_runner(config, weights, "emulator", max_context=max_context)
    return rel_err(runner.prefill(list(ids), runner.new_cache()), ref)
