"""The training loop: take the next global batch, update, then log, validate and save on
their schedules, until --max-steps, --max-time or a signal (the last two write a checkpoint
first).

Under --max-time the run also validates its last update when it has validated before in this
process: the budget keeps back as long as the last validation took, so the final validation fits
in it, and the updates after the last scheduled validation can be the best (checkpoint_best.pt)
and end the window that `average --best` takes. Without it, a 60-minute Multi30k run that
validated every 400 updates left its last 327 updates in no averaging window."""

from __future__ import annotations

import logging
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from model.checkpoint import step_checkpoints
from model.errors import UserError
from pipeline.corpus.data import PreparedData, ShardedBatches
from pipeline.training.budget import TimeBudget, steps_within
from pipeline.training.checkpointing import Checkpointer, Progress
from pipeline.training.metrics import MetricsLog, StopFlag, TrainingInterrupted
from pipeline.training.options import TrainOptions, parse_duration
from pipeline.training.step import Stepper, UpdateStats, learning_rate
from pipeline.training.tensorboard import TensorBoardLog
from pipeline.training.validation import validate

log = logging.getLogger(__name__)

_SPEED_STEPS = 20  # updates this process trains before --lr-schedule linear estimates a horizon


@dataclass
class _Throughput:
    """Tokens (source + target, all ranks) since the run started and since the last log line."""

    start: float = field(default_factory=time.time)
    run_tokens: int = 0
    window_start: float = field(default_factory=time.time)
    window_tokens: int = 0

    def add(self, n: int) -> None:
        self.run_tokens += n
        self.window_tokens += n

    def window_rate(self) -> float:
        """Tokens/s since the last call, and start a new window."""
        now = time.time()
        rate = self.window_tokens / max(now - self.window_start, 1e-9)
        self.window_start, self.window_tokens = now, 0
        return rate


@dataclass
class _Heartbeat:
    """One log line every `every_s` seconds (--log-seconds) where no bar is drawn: step, loss, tokens/s,
    elapsed, and the time left to whichever comes first, --max-steps or --max-time."""

    first_step: int
    started: float
    every_s: float
    last: float = 0.0

    def maybe_log(self, step: int, max_steps: int, loss: float, speed: _Throughput, budget: TimeBudget) -> None:
        now = time.time()
        if now - max(self.last, self.started) < self.every_s:
            return
        self.last = now
        done, spent = step - self.first_step, now - self.started
        per_step = spent / max(done, 1)
        eta, by = (max_steps - step) * per_step, "--max-steps"
        if budget.limit_s is not None and budget.limit_s - budget.elapsed() < eta:
            eta, by = max(0.0, budget.limit_s - budget.elapsed()), "--max-time"
        log.info("step %d/%d, loss %.3f, %.0f tokens/s, %s elapsed, about %s left (%s)", step, max_steps, loss,
                 speed.run_tokens / max(spent, 1e-9), _clock(budget.elapsed()), _clock(eta), by)


def _clock(seconds: float) -> str:
    minutes, s = divmod(int(seconds), 60)
    return f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m{s:02d}s"


@dataclass
class TrainLoop:
    """The loop's parts; `run` is the loop, each scheduled task a small method."""

    opts: TrainOptions
    stepper: Stepper
    batches: ShardedBatches
    data: PreparedData
    metrics: MetricsLog
    checkpointer: Checkpointer
    budget: TimeBudget
    tensorboard: TensorBoardLog
    last_valid: dict[str, Any] = field(default_factory=dict)
    validated_step: int | None = None  # the step of this process's last validation (every rank)
    valid_seconds: float = 0.0  # how long it took (the main rank): what --max-time keeps back

    def run(self, progress: Progress) -> Progress:
        """Train from `progress` to --max-steps, or until --max-time is spent (a checkpoint, then
        a normal return); raises TrainingInterrupted on SIGINT/SIGTERM."""
        opts, ctx, model = self.opts, self.stepper.ctx, self.stepper.model
        start_step, speed, nonfinite = progress.step, _Throughput(), 0
        decay_text = opts.decay_time or opts.max_time  # the budget --lr-schedule linear decays over
        decay_s = parse_duration(decay_text) if decay_text else None
        if opts.lr_schedule == "linear" and decay_s is None:  # it decays over --max-steps: recorded, and a resume
            was = progress.decay_steps if progress.decay_time_s is None else None  # with another is said
            if was is not None and was != opts.max_steps and progress.step and ctx.is_main:
                log.warning("--lr-schedule linear decayed to zero at --max-steps %d when this run started; it now "
                            "decays to step %d: the learning rate moves from %.3g to %.3g at step %d", was,
                            opts.max_steps, learning_rate(progress.step, model.cfg.d_model, opts.warmup,
                                                          opts.lr_scale, "linear", was),
                            learning_rate(progress.step + 1, model.cfg.d_model, opts.warmup, opts.lr_scale, "linear",
                                          opts.max_steps), progress.step + 1)
            progress.decay_steps, progress.decay_time_s = opts.max_steps, None
        bar = tqdm(total=opts.max_steps, initial=progress.step, unit="step", dynamic_ncols=True,
                   disable=not (ctx.is_main and opts.progress and sys.stderr.isatty()))  # a log gets no redraws
        # a log gets a line every --log-seconds instead, so a run logged to a file is not silent until validation
        heartbeat = _Heartbeat(progress.step, time.time(), opts.log_seconds) \
            if ctx.is_main and opts.log_seconds > 0 and bar.disable else None
        model.train()
        with StopFlag() as stop, bar:
            while progress.step < opts.max_steps:
                position = self.batches.state_dict()
                group = self.batches.next_group()
                lr = learning_rate(progress.step + 1, model.cfg.d_model, opts.warmup, opts.lr_scale,
                                   opts.lr_schedule, self._decay_steps(progress, start_step, speed, decay_s))
                stats = self.stepper.update(group, lr, stop.signum is not None,
                                            self.budget.exhausted(self.valid_seconds))
                if stats.stop or stats.out_of_time:
                    self.batches.load_state_dict(position)  # this group was not trained on
                if stats.stop:
                    path = self._save(progress, interrupted=True)
                    signum = stop.signum if stop.signum is not None else signal.SIGTERM
                    raise TrainingInterrupted(signum, progress.step, path)
                if stats.out_of_time:
                    self._out_of_time(progress, start_step, bar)
                    break
                if not stats.finite:
                    nonfinite += 1
                    self._check_nonfinite(progress.step + 1, nonfinite)
                    continue
                nonfinite = 0
                progress.step += 1
                n_tok = stats.tgt_tokens + stats.src_tokens
                progress.tokens += n_tok
                speed.add(n_tok)
                bar.update(1)
                if heartbeat is not None:
                    heartbeat.maybe_log(progress.step, opts.max_steps, stats.loss, speed, self.budget)
                self._on_schedule(progress, stats, lr, speed, bar)
        self.checkpointer.finish(progress)
        self._summary(progress, start_step, speed)
        return progress

    def _decay_steps(self, progress: Progress, start_step: int, speed: _Throughput,
                     budget_s: float | None) -> int | None:
        """Where --lr-schedule linear reaches zero: --max-steps without a time budget; with one
        (--decay-time, else --max-time), the step the budget is estimated to end at, from this
        process's speed once warmup is over and 20 updates are measured. It is then recorded
        in the checkpoints, so a resumed run keeps it and replays bit-exactly; only a different
        budget makes a new estimate."""
        opts = self.opts
        if opts.lr_schedule != "linear":
            return None
        if budget_s is None:
            return opts.max_steps
        if progress.decay_steps is not None and progress.decay_time_s == budget_s:
            return progress.decay_steps
        done_here = progress.step - start_step
        if progress.step < opts.warmup or done_here < _SPEED_STEPS:
            # Until this process has measured its speed (validation and saving included; start-up
            # would make it look slow), the peak holds, or a horizon made for another budget.
            return progress.decay_steps
        per_step = (time.time() - speed.start) / done_here
        horizon = min(opts.max_steps, steps_within(progress.step, self.budget.elapsed(), budget_s, per_step))
        progress.decay_steps, progress.decay_time_s = self.stepper.ctx.broadcast((horizon, budget_s))
        if self.stepper.ctx.is_main:
            log.info("--lr-schedule linear: at %.2f s per step, the %.0f s budget ends near step %d; the "
                     "learning rate falls to zero there", per_step, budget_s, progress.decay_steps)
            if progress.decay_steps < opts.max_steps and opts.max_time is None:  # --decay-time alone: no stop there
                log.warning("--decay-time %s ends near step %d but the run goes on to --max-steps %d at a learning "
                            "rate of zero: give --max-time, or a --decay-time as long as the run", opts.decay_time,
                            progress.decay_steps, opts.max_steps)
        return progress.decay_steps

    def _save(self, progress: Progress, interrupted: bool = False) -> Any:
        progress.elapsed_s = self.budget.elapsed()
        return self.checkpointer.save(progress, self.last_valid, interrupted)

    def _out_of_time(self, progress: Progress, start_step: int, bar: tqdm) -> None:
        """--max-time is spent (but for the time the last validation took): validate the last
        update if this process validated before and not at this step, checkpoint what this run
        trained (a resume that finds the budget already spent has nothing new to save), then stop
        like --max-steps does. Every rank takes the same branches (validated_step is common)."""
        if progress.step > start_step and self.validated_step not in (None, progress.step):
            self._validate(progress, bar)
        if progress.step > start_step or not step_checkpoints(self.checkpointer.save_dir):
            self._save(progress, interrupted=progress.step == 0)  # untrained weights (the budget went before the
            # first update): a resume point, gone once a later checkpoint is written, never kept nor averaged
        if self.stepper.ctx.is_main:
            log.info("time budget reached: --max-time %s spent (%.0f s in all runs) at step %d; a "
                     "checkpoint of step %d is in %s", self.opts.max_time, self.budget.elapsed(),
                     progress.step, progress.step, self.checkpointer.save_dir)

    def _check_nonfinite(self, step: int, in_a_row: int) -> None:
        log.warning("step %d: non-finite loss or gradient (%d in a row); update skipped", step, in_a_row)
        if in_a_row >= self.opts.max_nonfinite:
            raise UserError(f"the loss was not finite for {in_a_row} updates in a row at step "
                            f"{step}; nothing was saved from them. Lower --lr-scale, raise "
                            "--warmup, set --clip-norm, or use --precision fp32")

    def _on_schedule(self, progress: Progress, stats: UpdateStats, lr: float, speed: _Throughput,
                     bar: tqdm) -> None:
        """Log, validate and save when their --*-every comes round (and at the last step)."""
        opts, step = self.opts, progress.step
        final = step == opts.max_steps
        if step % opts.log_every == 0 or final:
            tps = speed.window_rate()
            bar.set_postfix(loss=f"{stats.loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tps:.0f}")
            fields = dict(loss=stats.loss, nll=stats.nll, lr=lr, tokens=progress.tokens,
                          tokens_per_s=round(tps, 1), grad_norm=round(stats.grad_norm, 4),
                          epoch=self.batches.epoch)
            self.metrics.write("train", step=step, **fields)
            self.tensorboard.write("train", step, fields)
        if self.data.valid is not None and (step % opts.valid_every == 0 or final):
            self._validate(progress, bar)
        if step % opts.save_every == 0 or final:
            self._save(progress)

    def _validate(self, progress: Progress, bar: tqdm) -> None:
        """Rank 0 validates; every rank learns the best BLEU (it goes into checkpoints)."""
        ctx = self.stepper.ctx
        self.validated_step = progress.step
        if ctx.is_main:
            started = time.time()
            result = validate(self.stepper.model, self.data, self.opts, ctx.device, self.stepper.precision)
            self.valid_seconds = time.time() - started
            # a tie goes to the later step, trained longer (as fairseq's checkpoint_best): BLEU 0.00 at every early
            # validation kept the first, and `average --best` averaged that one alone
            if progress.best_bleu is None or result["bleu"] >= progress.best_bleu:
                progress.best_bleu, progress.best_step = result["bleu"], progress.step
                self.checkpointer.save_best(progress, result)
            self.last_valid = result
            self.metrics.write("valid", step=progress.step, **result)
            self.tensorboard.write("valid", progress.step, result)
            total = len(self.data.valid_src_lines)  # BLEU of the first --valid-max-sentences, said so
            scored = "" if result["sentences"] == total else f" of the first {result['sentences']} of {total} lines"
            bar.write(f"step {progress.step}: valid loss {result['loss']:.3f} ppl {result['ppl']:.2f} "
                      f"BLEU {result['bleu']:.2f}{scored} ({result['bleu_signature']})",
                      file=sys.stderr)  # (tqdm's default is stdout: a script's own output got it)
        progress.best_bleu, progress.best_step = ctx.broadcast((progress.best_bleu, progress.best_step))

    def _summary(self, progress: Progress, start_step: int, speed: _Throughput) -> None:
        seconds = time.time() - speed.start
        summary = dict(steps=progress.step - start_step, step=progress.step, tokens=speed.run_tokens,
                       seconds=round(seconds, 1), tokens_per_s=round(speed.run_tokens / max(seconds, 1e-9), 1),
                       best_bleu=progress.best_bleu)
        self.metrics.write("summary", **summary)
        if self.stepper.ctx.is_main:
            log.info("trained %d steps (to step %d): %d tokens in %.1f s, %.0f tokens/s (source + target, "
                     "all processes); best valid BLEU %s", summary["steps"], progress.step, speed.run_tokens,
                     seconds, summary["tokens_per_s"],
                     progress.best_bleu if progress.best_bleu is not None else "n/a")
