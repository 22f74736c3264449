"""`anelm train --init-from` a real pretrained model (SmolLM2-135M-Instruct, Q4_1 GGUF in
../shared) on the emulator under `strict`: the first step's loss is HF transformers' float32
loss on the same batch, and fine-tuning lowers the held-out loss.

The training step keeps the residual stream, the norms and the loss on the CPU in float32; the
device runs the projections and attention in fp16 on normalised inputs. This model's down
projection writes 27,030 into the stream, inside the accumulator limit of 32768 (docs/chip-profiles.md).
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from anelm.device.emulator import Emulator  # noqa: E402
from anelm.chip.profile import STRICT  # noqa: E402
from anelm.train.loop import Trainer  # noqa: E402
from anelm.train.run import prepare  # noqa: E402

LOSS_TOL = 0.01  # the first-step loss within 1 % of HF's


def inventory(lines: int = 240) -> str:
    """A text the model has never seen, in one repeated form: fine-tuning on its first part
    should make the held-out end likelier within a few steps."""
    rng = np.random.default_rng(0)
    colours, things = ["red", "blue", "green", "amber"], ["crate", "barrel", "sack", "drum"]
    return "".join(f"Shelf {rng.integers(1, 99)} holds {rng.integers(2, 20)} {rng.choice(colours)} "
                   f"{rng.choice(things)}s.\n" for _ in range(lines))


def test_init_from_gguf_starts_at_hf_loss_and_fine_tuning_lowers_eval_loss(smollm_gguf, smollm_hf, tmp_path):
    model, _ = smollm_hf
    text = tmp_path / "inventory.txt"
    text.write_text(inventory(), encoding="utf-8")
    setup = prepare({"init_from": str(smollm_gguf), "data": str(text), "steps": 4, "batch_size": 2,
                     "seq_len": 64, "lr": 1e-4, "warmup": 0, "eval_every": 4, "eval_batches": 2,
                     "sample_tokens": 0, "save_every": 4, "keep_last": 1}, tmp_path / "run", resume=False)
    trainer = Trainer(setup, Emulator(STRICT), progress=False)
    try:
        state = trainer.batcher.state_dict()
        x, y = trainer.batcher.next()  # the first step's batch
        trainer.batcher.load_state_dict(state)
        with torch.no_grad():
            logits = model(torch.from_numpy(np.asarray(x))).logits
            hf_loss = float(torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), torch.from_numpy(np.asarray(y)).reshape(-1)))
        eval_before = trainer.validation.evaluate(trainer.dev)
        outcome = trainer.train()
    finally:
        trainer.close()
    first = outcome.records[0]
    assert abs(first["loss"] / hf_loss - 1) <= LOSS_TOL, (first["loss"], hf_loss)
    assert not any(r["skipped"] for r in outcome.records)
    assert outcome.final_eval_loss < eval_before, (outcome.final_eval_loss, eval_before)


def test_init_from_gguf_with_the_head_on_a_torch_device_logs_the_all_device_losses(smollm_gguf, tmp_path,
                                                                                    monkeypatch):
    """`--head-on gpu` (here torch's CPU device, `ANELM_GPU=cpu`: the path a Mac's mps runs)
    against the classifier in vocabulary tiles on the device, on the real model for a few steps:
    the same losses within the training tolerance (the tiles' fp16 logits against float32)."""
    monkeypatch.setenv("ANELM_GPU", "cpu")
    text = tmp_path / "inventory.txt"
    text.write_text(inventory(60), encoding="utf-8")
    losses = {}
    for place in ("ane", "gpu"):
        setup = prepare({"init_from": str(smollm_gguf), "data": str(text), "steps": 3, "batch_size": 1,
                         "seq_len": 32, "lr": 1e-4, "warmup": 0, "eval_every": 3, "eval_batches": 1,
                         "sample_tokens": 0, "head_on": place,
                         "save_every": 3, "keep_last": 1}, tmp_path / place, resume=False)
        trainer = Trainer(setup, Emulator(STRICT), progress=False)
        try:
            losses[place] = [r["loss"] for r in trainer.train().records]
            assert trainer.head_on == place
        finally:
            trainer.close()
        shutil.rmtree(tmp_path / place)  # a 1.6 GB checkpoint the comparison does not read
    print(f"\nlosses, head on the ANE: {losses['ane']}; on the torch device: {losses['gpu']}")
    assert len(losses["gpu"]) == 3
    for a, g in zip(losses["ane"], losses["gpu"]):
        assert abs(g - a) <= 2e-2 * a, losses
