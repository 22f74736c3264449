"""Instruction fine-tuning throughput of SmolLM2-135M on examples/facts, counted over the answer
tokens (what the loss is over): anelm's LoRA step with packing on and off, against PEFT on
PyTorch (CPU, float32) doing the same LoRA step on the same padded batches.

Each variant runs in its own process (so each peak RSS is its own), `--steps` optimizer steps
after a first one that carries the compiles; the variants take turns for `--rounds` rounds (a
shared machine drifts by tens of percent within a minute):

    pack   anelm finetune's loop (loop.Trainer + train/lora.py) on examples/facts: several examples
           per sequence, attention kept inside each (the default)
    pad    the same with --no-pack: one example per sequence, padded to --seq-len
    peft   transformers + peft.get_peft_model, float32 on the CPU, on pad's batches (the same
           seeded sampler: the same sequences, step by step): forward, the mean cross-entropy
           over the counted targets, backward, clip, AdamW. (HF has no packed path on the CPU
           short of a 4D mask per batch, so the baseline is the padded batches.)

Printed per variant: the padding fraction (slots of the epoch's sequences that hold no example
token) and the counted fraction (slots whose target is an answer token), the step time (best,
median), counted tokens per second over the timed steps (sum of the steps' counted targets over
the sum of their times; the best round and the median round), the cold start (process start to
the first update done: model load, tokenizing, the step-0 eval over valid.jsonl, the compiles,
the first step; anelm's kernel cache is off, ANELM_KERNEL_CACHE_MB=0, so every process compiles),
and peak RSS. Then the padding fraction of both at other sequence lengths (no training).

    python benchmarks/bench_instruct.py                      # batch 2 x 128, all-linear rank 16, ~4 min
    python benchmarks/bench_instruct.py --batch-size 4 --seq-len 64     # the README's fine-tune shape
    python benchmarks/bench_instruct.py --steps 10 --rounds 3 --data DIR  # longer; another chat set
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

from timing import finetune_flags, rounds  # benchmarks/timing.py, beside this script

T_START = time.perf_counter()
ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT.parent / "shared" / "data" / "models" / "smollm2-135m-instruct-q4_1.gguf"
FACTS = ROOT / "examples" / "facts"
VARIANTS = ("pack", "pad", "peft")
NAMES = {"pack": "anelm finetune, packed (emulator)", "pad": "anelm finetune --no-pack (emulator)",
         "peft": "PEFT LoRA, PyTorch CPU float32, padded"}
LR = 1e-3


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def fractions(examples, seq_len: int, pack: bool) -> dict:
    """Padding and counted fractions of the slots of the examples' sequences (one epoch)."""
    from anelm.train.steps.cpu_ops import IGNORE
    from anelm.train.data.packing import fit, sequences

    x, y, _ = sequences(examples, seq_len, pack)
    held = sum(len(e.ids) - 1 for e in fit(examples, seq_len)[0] if len(e.ids) >= 2)
    return {"rows": len(x), "padding": 1 - held / x.size, "counted_share": float((y != IGNORE).mean())}


# ----------------------------------------------------------------------- one variant

def run_anelm(pack: bool, a, out: Path) -> dict:
    from anelm.chip.profile import STRICT
    from anelm.device.emulator import Emulator
    from anelm.train.loop import Trainer
    from anelm.train.lora import adapter_writer, best_writer, prepare_finetune, step_factory

    n = a.steps + 1
    explicit = {"init_from": str(a.model), "data": str(a.data), "steps": n, "batch_size": a.batch_size,
                "seq_len": a.seq_len, "lr": LR, "warmup": 0, "eval_every": n, "save_every": n,
                "sample_tokens": 0, "pack": pack}
    setup = prepare_finetune(explicit, {"rank": a.rank, "alpha": a.alpha, "targets": a.targets}, out, False)
    trainer = Trainer(setup, Emulator(STRICT), progress=False, step_factory=step_factory(setup),
                      after_save=adapter_writer(setup), write_best=best_writer(setup))
    counted, first_done = [], []
    draw, update = trainer.batcher.draw, trainer._update

    def drawn():  # each step's counted targets, for the per-second figure
        b = draw()
        counted.append(b.counted)
        return b

    def updated():  # the end of the first update: the cold start
        rec = update()
        if not first_done:
            first_done.append(time.perf_counter() - T_START)
        return rec

    trainer.batcher.draw, trainer._update = drawn, updated
    try:
        recs = trainer.train().records
    finally:
        trainer.close()
    return {"steps": [r["t_step"] for r in recs[1:]], "counted": counted[1:], "cold_s": first_done[0],
            "compiles": recs[-1]["compiles"], "trainable": sum(int(p.size) for p in setup.params.values()),
            **fractions(setup.data.train, a.seq_len, pack)}


def run_peft(a) -> dict:
    import peft
    import torch
    import torch.nn.functional as F
    import transformers

    from anelm.models.adapters import resolve_targets
    from anelm.models.loading import load_model
    from anelm.train.data.examples import load_data
    from anelm.train.data.packing import ExampleBatcher

    torch.set_num_threads(a.torch_threads)
    config, _, tok = load_model(a.model)  # our tokenizer and template: the ids anelm trains on
    data = load_data(str(a.data), a.seq_len, tokenizer=tok)
    batcher = ExampleBatcher(data.train, a.batch_size, a.seq_len, seed=0, pack=False)  # pad's batches
    model = transformers.AutoModelForCausalLM.from_pretrained(str(a.model.parent), gguf_file=a.model.name,
                                                              dtype=torch.float32)
    model = peft.get_peft_model(model, peft.LoraConfig(r=a.rank, lora_alpha=a.alpha, lora_dropout=0.0,
                                                       target_modules=list(resolve_targets(config, a.targets))))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    times, counted, cold = [], [], None
    for _ in range(a.steps + 1):
        b = batcher.draw()
        x, y = torch.from_numpy(b.x), torch.from_numpy(b.y)
        t0 = time.perf_counter()
        # padding follows each example and a causal mask keeps it out of the example's queries
        logits = model(x).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100,
                               reduction="sum") / b.counted
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        counted.append(b.counted)
        cold = cold or time.perf_counter() - T_START
    return {"steps": times[1:], "counted": counted[1:], "cold_s": cold, "compiles": None,
            "trainable": sum(p.numel() for p in params), **fractions(data.train, a.seq_len, False)}


def worker(a) -> None:
    with tempfile.TemporaryDirectory(prefix="anelm-bench-instruct-") as tmp:
        res = run_peft(a) if a.worker == "peft" else run_anelm(a.worker == "pack", a, Path(tmp) / "run")
    res["peak_rss_mb"] = peak_rss_mb()
    print(json.dumps(res))


# ----------------------------------------------------------------------- the driver

def padding_table(a) -> None:
    from anelm.models.loading import load_model
    from anelm.train.data.examples import load_data

    tok = load_model(a.model)[2]
    lengths = sorted({64, 96, 128, 256, a.seq_len})
    print(f"\npadding fraction of {a.data.name}/train.jsonl's sequences (one epoch; rows in brackets):")
    print("| seq-len | " + " | ".join(str(s) for s in lengths) + " |\n|---|" + "---|" * len(lengths))
    for pack in (True, False):
        cells = []
        for s in lengths:
            f = fractions(load_data(str(a.data), s, tokenizer=tok, notice=lambda m: None).train, s, pack)
            cells.append(f"{f['padding']:.0%} ({f['rows']})")
        print(f"| {'packed' if pack else '--no-pack'} | " + " | ".join(cells) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=MODEL)
    p.add_argument("--data", type=Path, default=FACTS, help="a folder with train.jsonl and valid.jsonl")
    finetune_flags(p, steps=4, batch_size=2, seq_len=128, rank=16, targets="all-linear", variants=VARIANTS)
    a = p.parse_args()
    if a.worker:
        return worker(a)
    got = rounds(__file__, VARIANTS, a, ("model", "data", "steps", "batch_size", "seq_len", "rank", "alpha",
                                         "targets", "torch_threads"),
                 env={"ANELM_KERNEL_CACHE_MB": "0"})  # every process compiles
    load = os.getloadavg()[0]
    print(f"SmolLM2-135M on {a.data.name}, batch {a.batch_size} x {a.seq_len}, rank {a.rank}, alpha {a.alpha:g}, "
          f"targets {a.targets}; {a.rounds} rounds x {a.steps} timed steps each; load average {load:.1f}")
    print("| | padding | counted / slot | step, best | step, median | counted tokens/s, best round | "
          "median round | cold start to first update | compiles | peak RSS | trainable |\n" + "|---" * 11 + "|")
    rate = {}
    for kind in VARIANTS:
        runs = got[kind]
        rates = [sum(run["counted"]) / sum(run["steps"]) for run in runs]
        rate[kind] = (max(rates), statistics.median(rates))
        steps = [t for run in runs for t in run["steps"]]
        r0 = runs[0]
        compiles = "-" if r0["compiles"] is None else str(r0["compiles"])
        print(f"| {NAMES[kind]} | {r0['padding']:.0%} | {r0['counted_share']:.0%} | {min(steps):.2f} s | "
              f"{statistics.median(steps):.2f} s | {max(rates):.1f} | {statistics.median(rates):.1f} | "
              f"{min(run['cold_s'] for run in runs):.1f} s | {compiles} | "
              f"{max(run['peak_rss_mb'] for run in runs):,.0f} MB | {r0['trainable']:,} |")
    pk, pd, hf = rate["pack"], rate["pad"], rate["peft"]
    print(f"counted tokens/s, best rounds (median rounds): packed / padded {pk[0] / pd[0]:.2f}x "
          f"({pk[1] / pd[1]:.2f}x); padded / PEFT on the same batches {pd[0] / hf[0]:.2f}x ({pd[1] / hf[1]:.2f}x); "
          f"packed / PEFT {pk[0] / hf[0]:.2f}x ({pk[1] / hf[1]:.2f}x)")
    padding_table(a)


if __name__ == "__main__":
    main()
