"""The training loop: device step → loss scaling → clip → AdamW → weights back to the device.

One optimizer step (`Trainer._update`):

    for each of --grad-accum micro-batches:     x, y ← Batcher (seeded; state in checkpoints)
        loss, grads ← step.loss_and_grads(x, y, scale)   forward + dx on the device, dW on CPU
        a non-finite loss stops the run (TrainError), the last checkpoint untouched
    any inf/NaN in the grads → skip the update, the scaler halves (logged as skipped)
    otherwise: AdamW at the cosine lr on grads/(scale·accum) clipped to --clip (one factor,
    optim.update_scale), then step.set_weights

then a metrics record, an eval every --eval-every steps, a checkpoint every --save-every.
Data-parallel (`sync`, a `distributed.Group`): each rank runs this same loop on its slice of
every batch; the last micro-batch's gradients come back summed over the ranks (distributed.grads),
the loss is the mean over the ranks, and rank 0 alone writes metrics and checkpoints.
Everything that decides a later loss (weights, AdamW moments, scaler, batch RNG, step) is
in the checkpoint, so a run killed at any moment and resumed logs the same losses.

Static pipeline: every update recompiles the kernels, and a process may compile only
`profile.compile_budget` times. Before an update that would cross it the trainer saves a
checkpoint and re-executes itself with `--resume` (`restart`), and carries on.
"""

from __future__ import annotations

import math
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..device.base import compile_count
from ..errors import CompileBudgetExceeded
from .checkpoint import Checkpoint, latest_checkpoint, save_checkpoint
from .data import Batcher
from .errors import CheckpointError, TrainError
from .distributed import SOLO, check_world
from .metrics import MetricsLog, NullLog, Progress, plot_loss
from .optim import AdamW, accumulate_, adamw_flops, update_scale, zero_, zeros_like
from .steps.placement import resolve_head
from .run import RunSetup
from .scaler import make_scaler, scaler_from_state
from .schedule import CosineSchedule
from .validation import Validation, weights_writer

StepFactory = Callable[..., object]  # (config, weights, device, *, seq_len, pipeline) -> step


def device_step_factory(config, weights, device, *, seq_len: int, pipeline: str, **packed):
    from .steps import step_class  # the device half; imported late, it compiles kernels

    return step_class(config)(config, weights, device, seq_len=seq_len, pipeline=pipeline, **packed)


@dataclass
class Outcome:
    steps_done: int                   # optimizer steps completed in the whole run
    final_eval_loss: float | None
    wall_s: float                     # this process
    records: list[dict] = field(default_factory=list)  # step records of this process
    best: tuple[int, float] | None = None  # (step, eval loss) of RUN/best, with a valid set


# Without a live bar (stderr not a terminal) a line per eval, every 10 % of the steps by default,
# could leave a long run silent for hours: a progress line at least this often as well.
PROGRESS_EVERY_S = 60.0


class Trainer:
    """Runs `setup` to `--steps` on `device`. `restart()` replaces the process (os.execv with
    `--resume` in the CLI); `budget` is the per-process compile budget (None: unlimited)."""

    def __init__(self, setup: RunSetup, device, *, step_factory: StepFactory = device_step_factory,
                 budget: int | None = None, restart: Callable[[], None] | None = None,
                 progress: bool | None = None, sync=None, after_save: Callable[[int, dict], None] | None = None,
                 write_best: Callable | None = None):
        self.s, self.a, self.device = setup, setup.args, device
        self.sync = sync = sync or SOLO
        self.params, self.budget, self.restart = setup.params, budget, restart
        self.after_save = after_save  # (step, params) once a checkpoint is written (finetune: RUN/adapter)
        a = self.a
        self.opt = AdamW(self.params, lr=a.lr, weight_decay=a.weight_decay)
        self.scaler = make_scaler(a.loss_scale)
        self.schedule = CosineSchedule(a.lr, a.steps, a.warmup)
        # instruction data (`packing`) or token windows (`data`); `write_best`: how RUN/best/ is
        # written (default: the weights as an HF folder), with a valid set of examples only
        self.batcher, evals = setup.data.batches(a, sync.shard)
        self.examples = not isinstance(self.batcher, Batcher)
        self.validation = Validation(evals, sync, patience=a.patience, run=setup.run,
                                     write_best=(write_best or weights_writer(setup)) if self.examples else None)
        self.step, self.pending_eval = 0, False
        if setup.checkpoint is not None:
            self._restore(setup.checkpoint)
        self.acc = zeros_like(self.params) if a.grad_accum > 1 else None
        # drops records past the checkpoint: the killed run logged them, this one logs them again
        self.log = MetricsLog(setup.run, resume_step=self.step) if sync.is_main else NullLog()
        self.progress_enabled = progress if sync.is_main else False
        self.packed = self.examples and a.pack  # several examples per sequence: per-example attention
        cfg = setup.model_config  # the classifier's place: `auto` resolved for this device (placement.py)
        self.head_on = resolve_head(a.head_on, device, cfg.vocab_size, cfg.hidden_size, a.seq_len, a.batch_size,
                                    a.grad_accum)
        self.dev = step_factory(cfg, self.params, device, seq_len=a.seq_len, pipeline=a.pipeline,
                                **({"packed": True} if self.packed else {}),
                                **({"head_on": self.head_on} if self.head_on != "cpu" else {}),
                                **({"embed_on": a.embed_on} if a.embed_on != "cpu" else {}))
        self.device_name = getattr(device, "name", str(device))
        self.last_eval: float | None = None
        self.weights_stale = False  # set_weights hit the compile budget: the device is behind
        self._say = lambda m: print(m, file=sys.stderr, flush=True)  # train() routes it past its bar
        self._recent: list[dict] = []
        self.n_params = sum(int(p.size) for p in self.params.values())

    # ---------------------------------------------------------------- state

    def _restore(self, ck: Checkpoint) -> None:
        check_world(ck, self.sync.world)
        try:
            self.opt.load_state_dict(ck.optimizer, ck.optimizer_state)
            self.scaler = scaler_from_state(ck.scaler)
            self.batcher.load_state_dict({**ck.data, **({"rng": ck.rng["data"]} if "data" in ck.rng else {})})
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"checkpoint at step {ck.step} in {self.s.run} lacks training state "
                                  f"({type(e).__name__}: {e}); expected one written by anelm train") from None
        self.step = ck.step
        self.pending_eval = bool(ck.extra.get("pending_eval", False))
        self.validation.load_state_dict(ck.extra.get("validation"))

    def save(self, pending_eval: bool = False) -> None:
        self.sync.check_same(self.step, self.params)  # every rank, before rank 0 writes
        if not self.sync.is_main:
            return
        tensors, opt_meta = self.opt.state_dict()
        b = self.batcher.state_dict()  # token windows: a generator's state; examples: epoch and cursor
        ck = Checkpoint(step=self.step, config=self.s.config, weights=self.params, optimizer=tensors,
                        optimizer_state=opt_meta, scaler=self.scaler.state_dict(),
                        rng={"data": b.pop("rng")} if "rng" in b else {}, data=b,
                        extra={"pending_eval": pending_eval, "world_size": self.sync.world,
                               "validation": self.validation.state_dict()})
        save_checkpoint(self.s.run, ck, keep_last=self.a.keep_last or None)
        if self.after_save is not None:
            self.after_save(self.step, self.params)

    # ----------------------------------------------------------------- the loop

    def train(self) -> Outcome:
        a, t_start, records = self.a, time.perf_counter(), []
        bar = Progress(a.steps, initial=self.step, disable=self._bar_disabled())
        self._say = bar.write if self.sync.is_main else (lambda m: None)
        self._last_line = time.monotonic()
        try:
            with self._stop_on_interrupt():
                self._loop(bar, records)
        finally:
            bar.close()
            self.log.close()
        v = self.validation
        best = (v.best_step, v.best_loss) if v.write_best is not None and v.best_step is not None else None
        return Outcome(self.step, self.last_eval, time.perf_counter() - t_start, records, best)

    @contextmanager
    def _stop_on_interrupt(self):
        """Ctrl-C (SIGINT) ends the run after the step in progress, with a checkpoint of the step
        reached, so `--resume` goes on from it; a second Ctrl-C interrupts at once. Only a
        single process in its main thread: ranks of a distributed run would stop at different
        steps and wait on each other's all-reduce (torchrun stops them all)."""
        self._stop = False
        if self.sync.world > 1 or threading.current_thread() is not threading.main_thread():
            yield
            return

        def stop(signum, frame):
            if self._stop:
                raise KeyboardInterrupt
            self._stop = True
            self._say("anelm: interrupted: stopping after this step with a checkpoint (Ctrl-C again stops at once)")

        previous = signal.signal(signal.SIGINT, stop)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    def _loop(self, bar, records: list) -> None:
        """Steps to --steps, each with its record, eval and checkpoint as due (module doc)."""
        a = self.a
        if self.pending_eval:  # a restart interrupted this step's eval: do it first
            self._eval(bar)
            self.save()  # now without the flag, so a later resume does not eval again
        if self.examples and self.step == 0:  # with a valid set: where the run starts from
            self._eval(bar)
        while self.step < a.steps and not self._patience_spent():
            if self._budget_would_overflow():
                self._restart_now(len(records))
            data_state = self.batcher.state_dict()
            try:
                rec = self._update()
            except CompileBudgetExceeded:  # an uncounted compile before any state changed
                self.batcher.load_state_dict(data_state)
                self._restart_now(len(records))
            records.append(rec)
            self._recent = records
            bar.update(self.step, rec["loss"], rec["tokens_per_s"])
            if self._stop:  # the step is done: keep it, its eval left to the resumed run
                self.save(pending_eval=self.step % a.eval_every == 0 or self.step == a.steps)
                self._say(f"anelm: saved the checkpoint of step {self.step} in {self.s.run}; "
                          "--resume continues from it")
                raise KeyboardInterrupt
            self._after_step(bar, rec)
            if bar.bar.disable and time.monotonic() - self._last_line >= PROGRESS_EVERY_S:
                self._line(f"anelm: step {self.step}/{a.steps}{self._pace()}")

    def _bar_disabled(self) -> bool | None:
        if self.progress_enabled is None:
            return None  # tqdm: off when stderr is not a terminal
        return not self.progress_enabled

    def _after_step(self, bar, rec: dict) -> None:
        a = self.a
        if rec.get("skipped"):
            self._say(f"anelm: step {self.step}: gradients overflowed; update skipped, "
                      f"loss scale now {self.scaler.scale:g}")
        eval_due = self.step % a.eval_every == 0 or self.step == a.steps
        if self.weights_stale:  # the device cannot run the new weights in this process
            self._restart_now(1, pending_eval=eval_due)
        if eval_due:
            try:
                self._eval(bar)
            except CompileBudgetExceeded:
                self._restart_now(1, pending_eval=True)
        if self.step % a.save_every == 0 or self.step == a.steps:
            self.save()

    def _update(self) -> dict:
        """One optimizer step; returns its metrics record (already logged)."""
        a, t0, sync = self.a, time.perf_counter(), self.sync
        lr, scale = self.schedule(self.step), self.scaler.scale
        loss_sum, stats_sum, grads, sink = 0.0, {}, None, None
        fused = getattr(self.dev, "accumulates_in_place", False)  # else: zeroed, then one add per micro-batch
        if self.acc is not None and not fused:
            zero_(self.acc)
        batches = [self.batcher.draw() for _ in range(a.grad_accum)]
        # each micro-batch's loss sums its counted targets over the step's share per micro-batch
        # and rank, so the trainer's mean over them (and the all-reduce) is the step's token mean
        count = sum(b.counted for b in batches) / (a.grad_accum * sync.world)
        begin = getattr(self.dev, "begin_micro_batch", None)  # a step that draws (LoRA dropout) keys
        for k in range(a.grad_accum):                        # its draws by where it is in the run
            if begin is not None:
                begin(self.step, k, sync.rank)
            batch = batches[k]
            # the ranks' gradients are summed once per step, on the last micro-batch
            sink = sync.reducer(self.acc) if k == a.grad_accum - 1 else None
            # accumulated by the dW GEMMs themselves: the first micro-batch writes the buffers
            # (and, but for the last, left running beside the next micro-batch's forward)
            into = ({"into": self.acc, "add": k > 0, "defer": k < a.grad_accum - 1}
                    if self.acc is not None and sink is None and fused else {})
            if k < a.grad_accum - 1 and getattr(self.dev, "head_runs_ahead", False):  # the next forward
                nxt = batches[k + 1]                                                  # beside the GPU's head
                into["ahead"] = (nxt.x, nxt.y, nxt.positions if self.packed else None)
            loss, grads, stats = self.dev.loss_and_grads(
                batch.x, batch.y, loss_scale=scale, **({"sink": sink} if sink is not None else {}),
                **self._counting(batch, count), **into)
            if not math.isfinite(loss) and sync.world == 1:
                raise self._diverged(loss, "training", self.step + 1)
            loss_sum += loss
            for key, v in stats.items():
                stats_sum[key] = stats_sum.get(key, 0) + v
            if self.acc is not None and sink is None and not fused:
                accumulate_(self.acc, grads)
        if self.acc is not None and sink is None and not fused:
            grads = self.acc
        loss = sync.mean(loss_sum / a.grad_accum)  # every rank decides divergence alike
        if not math.isfinite(loss):
            raise self._diverged(loss, "training", self.step + 1)
        rec = self._apply(grads, scale, lr)
        self.step += 1
        dt = time.perf_counter() - t0
        tokens = a.batch_size * a.seq_len * a.grad_accum * sync.world
        if self.examples:  # what the loss is over: the counted (answer) tokens
            rec["counted_tokens_per_s"] = round(count * a.grad_accum * sync.world / dt, 1)
        return self.log.log_step(
            self.step, loss, lr, scale, tokens / dt, self.device_name,
            int(stats_sum.get("device_flops", 0)),
            int(stats_sum.get("cpu_flops", 0)) + adamw_flops(self.n_params), **rec,
            **{k: round(float(stats_sum[k]), 6) for k in ("t_device", "t_cpu", "t_dw") if k in stats_sum},
            **{k: stats_sum[k] for k in ("allreduce_ms", "allreduce_wait_ms", "allreduce_bytes")
               if k in stats_sum},
            t_step=round(dt, 6), compiles=compile_count(), head_on=self.head_on,
            embed_on=a.embed_on)

    def _apply(self, grads: dict, scale: float, lr: float) -> dict:
        """Scaler decision, unscale, clip, AdamW, weights to the device. Returns record extras."""
        # the sum over the ranks: 1/world joins 1/(scale·accum) in the one factor
        norm, factor = update_scale(grads, scale, self.a.grad_accum * self.sync.world, self.a.clip)
        if not self.scaler.update(math.isfinite(norm)):
            return {"skipped": True, "grad_norm": None}
        t0 = time.perf_counter()
        self.opt.step(grads, lr=lr, grad_scale=factor)  # unscaled and clipped inside the update
        t_opt = time.perf_counter() - t0
        try:
            self.dev.set_weights(self.params)  # restage (dynamic) or recompile (static)
        except CompileBudgetExceeded:
            self.weights_stale = True  # the update stands; a fresh process compiles it
        return {"skipped": False, "grad_norm": norm if self.a.clip > 0 else None, "t_adamw": round(t_opt, 6)}

    def _counting(self, batch, count: float) -> dict:
        """The step keywords of instruction data: the step's count, each example's positions."""
        if not self.examples:
            return {}  # token windows: every target counts, the mean of each micro-batch is the step's
        return {"count": count, **({"positions": batch.positions} if self.packed else {})}

    def _patience_spent(self) -> bool:
        if not self.validation.exhausted:
            return False
        v = self.validation
        self.save()  # the step stopped at, whatever --save-every says
        self._say(f"anelm: early stop at step {self.step}: {v.since_best} evals without a lower eval loss "
                  f"than {v.best_loss:.4f} (step {v.best_step}, in {self.s.run / 'best'})")
        return True

    def _eval(self, bar) -> float:
        value = self.validation.evaluate(self.dev)
        if not math.isfinite(value):
            raise self._diverged(value, "eval", self.step)
        self.log.log_eval(self.step, value)
        if self.validation.write_best is not None:
            self.validation.record(self.step, value, self.params)
        self.last_eval, self.pending_eval = value, False
        self._plot()
        if bar.bar.disable:  # no live bar (not a terminal): a line per eval instead
            self._line(f"anelm: step {self.step}/{self.a.steps}: eval loss {value:.4f}{self._pace()}")
        return value

    def _line(self, msg: str) -> None:
        """A progress line in place of the bar; the next periodic one is due PROGRESS_EVERY_S later."""
        self._say(msg)
        self._last_line = time.monotonic()

    def _pace(self) -> str:
        """", train loss L, N tok/s, ETA" from this process's records so far."""
        if not self._recent:
            return ""
        rec, rate = self._recent[-1], float(np.mean([r["t_step"] for r in self._recent[-20:]]))
        eta = rate * (self.a.steps - self.step)
        return (f", train loss {rec['loss']:.4f}, {rec['tokens_per_s']:,.0f} tok/s, "
                f"ETA {int(eta // 60)}m{int(eta % 60):02d}s")

    def _plot(self) -> None:
        if not self.sync.is_main:
            return
        try:
            plot_loss(self.s.run, reference=self.s.data.entropy)
        except Exception as e:  # noqa: BLE001 - a plotting failure must not end a training run
            self._say(f"anelm: warning: could not draw loss.png ({type(e).__name__}: {e})")

    def _diverged(self, value: float, what: str, step: int) -> TrainError:
        ck = latest_checkpoint(self.s.run)
        keep = f"the last good checkpoint is {ck}" if ck else "no checkpoint had been written yet"
        return TrainError(f"non-finite {what} loss ({value}) at step {step}; stopped, {keep}; "
                          "try a lower --lr or a fixed --loss-scale")

    # ------------------------------------------------------- compile budget restart

    def _budget_would_overflow(self) -> bool:
        need = int(getattr(self.dev, "compiles_per_update", 0) or 0)
        return bool(self.budget and need and compile_count() + need > self.budget)

    def _restart_now(self, done_here: int, pending_eval: bool = False) -> None:
        """Checkpoint, then hand over to a fresh process (its compile budget is whole again)."""
        if done_here == 0:
            need = getattr(self.dev, "compiles_per_update", "?")
            raise TrainError(f"the compile budget of {self.budget} per process cannot fit one weight "
                             f"update ({need} compiles after {compile_count()} to start); expected a "
                             "larger compile_budget in the profile, or --pipeline dynamic")
        if self.restart is None:
            raise TrainError(f"compile budget of {self.budget} spent at step {self.step} and this "
                             "trainer cannot restart its process; use --pipeline dynamic")
        self.save(pending_eval=pending_eval)
        self._say(f"anelm: compile budget: {compile_count()} of {self.budget} compiles used; "
                  f"restarting the process from the checkpoint at step {self.step}")
        self.log.close()
        self.close()
        self.restart()
        raise TrainError("the process restart returned; expected it to replace this process")

    def close(self) -> None:
        close = getattr(self.dev, "close", None)
        if close is not None:
            close()
