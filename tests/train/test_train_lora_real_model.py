"""LoRA fine-tuning of the real SmolLM2-135M-Instruct (Q4_1 GGUF in ../shared) on the emulator
under `strict`: a short text of invented facts it has never seen, 12 steps at sequence length
64, batch 1 (a fine-tune of tens of steps, trimmed to keep the suite fast: ~50 s of CPU time,
100 s wall on a lightly loaded 2-core machine). The held-out eval loss falls below 80 % of its start (measured 58 %),
the adapter written to RUN/adapter/ lowers the held-out perplexity by more than 10 % on the CPU
float32 reference (an independent path: PEFT files, `load_peft`, the reference forward), and
the compile count does not grow after the kernels are built: every step is data only.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from anelm.chip.profile import STRICT
from anelm.device.base import compile_count
from anelm.device.emulator import Emulator
from anelm.generate.perplexity import perplexity
from anelm.models.formats.peft import load_peft
from anelm.models.loading import build_model
from anelm.train.loop import Trainer
from anelm.train.lora import ADAPTER_DIR, prepare_finetune, step_factory, adapter_writer

STEPS = 12


def lore() -> str:
    """~4 KB of invented towns, trades and mayors, each fact told five times in shuffled order:
    the held-out end restates facts the training part holds, in words no corpus has."""
    rng = random.Random(7)
    names = ["Quorvath", "Ilsmere", "Tandrel", "Vopplin", "Marzeka", "Oskavune", "Brelloth", "Zintaro"]
    trades = ["glass kites", "salt violins", "copper lanterns", "moss rope", "ink bells", "reed maps"]
    rivers = ["the Ulmer", "the Kessa", "the Drovn", "the Phael"]
    facts = [f"In the town of {n}, the people make {rng.choice(trades)} beside {rng.choice(rivers)}, "
             f"and the mayor is called {rng.choice(names)}-{rng.randint(10, 99)}.\n" for n in names]
    return "".join(f for _ in range(5) for f in rng.sample(facts, len(facts)))


def test_lora_on_smollm2_learns_an_unseen_text_without_compiling(smollm_gguf, tmp_path):
    text = tmp_path / "lore.txt"
    text.write_text(lore(), encoding="utf-8")
    explicit = {"init_from": str(smollm_gguf), "data": str(text), "steps": STEPS, "batch_size": 1,
                "seq_len": 64, "lr": 4e-3, "warmup": 0, "eval_every": STEPS, "eval_batches": 2,
                "sample_tokens": 0}
    setup = prepare_finetune(explicit, {"rank": 8}, tmp_path / "run", resume=False)
    trainer = Trainer(setup, Emulator(STRICT), step_factory=step_factory(setup),
                      after_save=adapter_writer(setup), progress=False)
    try:
        built = compile_count()
        start = trainer.validation.evaluate(trainer.dev)
        outcome = trainer.train()
    finally:
        trainer.close()
    assert outcome.steps_done == STEPS and not any(r["skipped"] for r in outcome.records)
    assert outcome.final_eval_loss < 0.8 * start, (outcome.final_eval_loss, start)
    assert [r["compiles"] for r in outcome.records] == [built] * STEPS

    model = build_model(setup.model_config, setup.frozen)  # the CPU float32 reference
    held_out = [int(t) for t in setup.data.val]
    before = perplexity(model, held_out, 64, progress=False).ppl
    model.set_adapter(load_peft(setup.run / ADAPTER_DIR, setup.model_config))
    after = perplexity(model, held_out, 64, progress=False).ppl
    assert after < 0.9 * before, (after, before)
