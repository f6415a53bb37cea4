"""Step checkpoints of a save dir: what one holds, writing and pruning them, resuming from the latest (exactly:
the RNG states of every rank and the data position are in it), and averaging the last few (section 6.1).

A step checkpoint holds the model config, SentencePiece model and weights (model/checkpoint.py) plus
`train_state`: optimizer, loss scaler, schedule step, data position, RNG states of every rank, tokens seen,
best BLEU, the comparable config, the resolved options and the corpus files' fingerprints (size + SHA-256:
resuming on changed data is refused, on moved data not)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from model.atomic import atomic_write_text
from model.checkpoint import (
    BEST,
    CheckpointWriteError,
    checkpoint_step,
    read_checkpoint,
    save_checkpoint,
    step_checkpoint_path,
    step_checkpoints,
)
from model.config import ModelConfig
from model.errors import UserError
from model.signals import signals_deferred
from model.transformer import Transformer
from pipeline.corpus.data import ShardedBatches, file_fingerprint
from pipeline.distributed import DistContext, on_main
from pipeline.training.options import CORPUS_PATHS, TrainOptions, config_differences

log = logging.getLogger(__name__)


# -- RNG states ---------------------------------------------------------------------------

def rng_state(device: torch.device) -> dict[str, Any]:
    """Every generator that dropout or data order may draw from, on this process."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def gather_rng(ctx: DistContext) -> list[dict[str, Any]]:
    """Every rank's RNG state, in rank order (a collective: every rank calls it)."""
    mine = rng_state(ctx.device)
    if not ctx.distributed:
        return [mine]
    everyone: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    return everyone


# -- resume ---------------------------------------------------------------------------------

def check_resume(save_dir: Path, wanted: dict[str, Any]) -> dict[str, Any] | None:
    """The latest checkpoint's payload when resuming (after checking its config), else None."""
    steps = step_checkpoints(save_dir)
    if not steps:
        return None
    payload = read_checkpoint(steps[-1])
    state = payload.get("train_state") or {}
    old = state.get("config")
    if old is None:
        raise UserError(f"{steps[-1]}: has no training state to resume from; use a new --save-dir")
    diffs = config_differences(old, wanted, fingerprinted=bool(state.get("data_files")))
    if diffs:
        preset = _recorded(save_dir, "preset")  # the option left out: the diffs were only the fields it sets
        given = f" (its run's --preset: {preset})" if isinstance(preset, str) else ""
        raise UserError(f"{save_dir} holds a run with a different config ({'; '.join(diffs)}); rerun with "
                        f"the original options{given} or choose a new --save-dir (`pipeline demo`: a new --out)")
    return payload


def _recorded(save_dir: Path, option: str) -> Any:
    """An option of the run in `save_dir` as its config.json resolved it; None when unknown."""
    with contextlib.suppress(OSError, ValueError, AttributeError, TypeError):
        return json.loads((Path(save_dir) / CONFIG_FILE).read_text()).get("resolved_options", {}).get(option)
    return None


CONFIG_FILE = "config.json"  # a save dir's options and corpus fingerprints (pipeline/training/trainer.py writes it)
LOCK_FILE = ".run.lock"  # held by the process that writes a save dir (torchrun's rank 0) while it runs


def writer_of(save_dir: Path) -> str | None:
    """The pid of the training run writing `save_dir` now (it holds LOCK_FILE: trainer.py), else None."""
    try:
        with open(Path(save_dir) / LOCK_FILE) as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return handle.read().strip()[:20] or "unknown"
    except OSError:
        pass
    return None


def run_corpus(save_dir: Path) -> list[Path]:
    """The corpus files a save dir's run trains on, as its config.json records them: their absolute paths (the
    fingerprints'; the options hold them as typed, maybe relative to where training ran); [] when unknown."""
    try:
        files = json.loads((Path(save_dir) / CONFIG_FILE).read_text()).get("data_files") or {}
        return [Path(entry["path"]) for entry in files.values() if isinstance(entry, dict) and "path" in entry]
    except (OSError, ValueError, AttributeError, TypeError):
        return []


def no_best(save_dir: Path) -> str:
    """Why a run has no checkpoint_best.pt: it has no validation set, or stopped before its first validation."""
    with contextlib.suppress(OSError, ValueError, KeyError, AttributeError, TypeError):
        config = json.loads((save_dir / CONFIG_FILE).read_text())
        if config["training"].get("valid_src"):
            return (f"the run stopped before its first validation (every {config['resolved_options']['valid_every']}"
                    " updates), so none is best yet; average the --last checkpoints, or train on past it")
    return "--best needs a run with validation (--valid-src/--valid-tgt)"


def data_fingerprint(opts: TrainOptions) -> dict[str, dict[str, Any]] | None:
    """Size and SHA-256 of each corpus file given (pipeline.corpus.data.file_fingerprint), by option;
    None for the built-in corpus, whose contents --seed and --builtin-pairs already pin."""
    if opts.builtin_pairs is not None:
        return None
    found = {}
    for name in CORPUS_PATHS:
        path = getattr(opts, name)
        if path is None:
            continue
        if not Path(path).is_file():
            option = "--" + name.replace("_", "-")
            if not Path(path).exists():
                raise UserError(f"{option} {path}: no such file")
            what = "is a directory" if Path(path).is_dir() else "is not a regular file (a device or pipe)"
            raise UserError(f"{option} {path}: {what}; training reads its corpus more than once: give a text file")
        found[name] = file_fingerprint([Path(path)])[0]
    return found


def check_data(save_dir: Path, recorded: dict[str, Any] | None, current: dict[str, Any] | None,
               allow_changed: bool) -> list[str]:
    """Compare the corpus files with the fingerprints the resumed checkpoint recorded: a change is refused (it
    would resume the old tokenizer and data position on other text) unless --allow-changed-data; returns what
    changed. A file moved, same contents, is said. Checkpoints of earlier versions recorded none."""
    if not recorded or current is None:
        return []
    changed = []
    for name in CORPUS_PATHS:
        old, new = recorded.get(name), current.get(name)
        if old is None or new is None:  # a file added or dropped is a config difference, checked before
            continue
        if (old["size"], old["sha256"]) == (new["size"], new["sha256"]) and old["path"] != new["path"]:
            log.info("--%s %s: the same contents as %s, where this run read it before", name.replace("_", "-"),
                     new["path"], old["path"])
        elif (old["size"], old["sha256"]) != (new["size"], new["sha256"]):
            changed.append(f"--{name.replace('_', '-')} {new['path']} ({old['size']} -> {new['size']} bytes, "
                           f"sha256 {old['sha256'][:12]} -> {new['sha256'][:12]})")
    if changed and not allow_changed:
        raise UserError(f"{save_dir}: the corpus changed since this run wrote its checkpoints: "
                        f"{'; '.join(changed)}. Resuming would apply the old tokenizer and data position to "
                        "other text: start fresh with a new --save-dir, or rerun with --allow-changed-data "
                        "to continue on the new contents knowingly")
    if changed:
        log.warning("the corpus changed since the last checkpoint (%s); continuing on the new contents as "
                    "--allow-changed-data asks, with the run's tokenizer and data position", "; ".join(changed))
    return changed


VALIDATION_MEASURE = ("valid_beam", "valid_max_sentences")  # options whose change makes BLEUs incomparable


@dataclass
class Progress:
    """Where a run stands: what a checkpoint restores besides weights and optimizer."""

    step: int = 0
    tokens: int = 0
    best_bleu: float | None = None
    best_step: int | None = None  # the step of best_bleu (and of checkpoint_best.pt)
    elapsed_s: float = 0.0  # wall clock of this run and the runs it resumed (--max-time)
    # --lr-schedule linear under a time budget: the step where the learning rate reaches zero,
    # estimated once (after warmup, from measured speed) for a budget of decay_time_s seconds, then kept.
    decay_steps: int | None = None
    decay_time_s: float | None = None


@dataclass
class Checkpointer:
    """Writes and restores the step checkpoints of one run (every rank holds one)."""

    save_dir: Path
    ctx: DistContext
    model: Transformer
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    batches: ShardedBatches
    spm_bytes: bytes
    config: dict[str, Any]  # comparable_config, checked on resume
    options: dict[str, Any]  # the resolved options, for the record
    keep_last: int
    data_files: dict[str, Any] | None = None  # data_fingerprint, checked on resume

    def save(self, progress: Progress, last_valid: dict[str, Any], interrupted: bool = False) -> Path | None:
        """Every rank calls this (RNG states are gathered); rank 0 writes, then prunes. A
        failed write (full disk...) stops every rank with one line; earlier checkpoints stay. `interrupted`: a
        checkpoint written at a stop signal, off the --save-every schedule: a resume point only, recorded as such
        and removed once a later checkpoint supersedes it, so the run ends with the checkpoints of an
        uninterrupted one (what --keep-last keeps and `average --last` averages do not depend on Ctrl-C)."""
        rng = gather_rng(self.ctx)
        path = step_checkpoint_path(self.save_dir, progress.step)
        scheduled = path.is_file() and progress.step not in interrupted_steps(self.save_dir)
        state = {"step": progress.step, "optimizer": self.optimizer.state_dict(),
                 "scaler": self.scaler.state_dict() if self.scaler else None,
                 "data": self.batches.state_dict(), "rng": rng, "world_size": self.ctx.world_size,
                 "tokens": progress.tokens, "best_bleu": progress.best_bleu, "config": self.config,
                 "options": self.options, "data_files": self.data_files,
                 "best_step": progress.best_step, "elapsed_s": progress.elapsed_s,
                 "decay_steps": progress.decay_steps, "decay_time_s": progress.decay_time_s}

        def write() -> None:
            with signals_deferred():  # the checkpoint and its record as one: a second Ctrl-C between them left a
                try:  # stop signal's checkpoint counted as a scheduled one (kept, averaged)
                    save_checkpoint(path, self.model, self.spm_bytes, train_state=state,
                                    extra={"step": progress.step, "valid": last_valid})
                except CheckpointWriteError as e:
                    latest = step_checkpoints(self.save_dir)
                    resume = f"from {latest[-1].name}" if latest else "from the start"
                    raise UserError(f"{e}; fix that and rerun the same command to resume {resume}") from None
                supersede_interrupted(self.save_dir, progress.step)  # the stop-signal checkpoints before it go
                if interrupted and not scheduled:  # a scheduled save of this very step stays one
                    mark_interrupted(self.save_dir, progress.step)
                prune(self.save_dir, self.keep_last, progress.best_step)

        on_main(self.ctx, write, share=False)
        if not self.ctx.is_main:
            return None
        log.debug("wrote %s", path)
        return path

    def finish(self, progress: Progress) -> None:
        """The run ended (--max-steps or --max-time, not a signal): its last checkpoint is the run's, even when a
        stop signal wrote it and the rerun found nothing left to train."""
        if self.ctx.is_main and progress.step > 0:  # untrained weights are a resume point, never the run's
            supersede_interrupted(self.save_dir, progress.step)

    def save_best(self, progress: Progress, valid: dict[str, Any]) -> Path:
        """checkpoint_best.pt: the weights of the best validation BLEU so far, with its step and
        BLEU (rank 0; a model checkpoint without training state, like averaged.pt)."""
        path = self.save_dir / BEST
        save_checkpoint(path, self.model, self.spm_bytes,
                        extra={"step": progress.step, "bleu": progress.best_bleu, "valid": valid})
        log.info("step %d: best validation BLEU so far (%.2f), kept as %s", progress.step,
                 progress.best_bleu or 0.0, path)
        return path

    def restore(self, payload: dict[str, Any]) -> Progress:
        """Load weights, optimizer, scaler, data position and this rank's RNG state."""
        state = payload["train_state"]
        saved_cfg = ModelConfig.from_dict(payload["model_config"])
        if saved_cfg != self.model.cfg:
            raise UserError(f"the checkpoint's model config differs from this run's: {saved_cfg} vs "
                            f"{self.model.cfg}")
        self.model.load_state_dict(payload["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.batches.load_state_dict(state["data"])
        rngs = state["rng"]
        if len(rngs) == self.ctx.world_size:
            set_rng_state(rngs[self.ctx.rank], self.ctx.device)
        elif self.model.cfg.dropout > 0:  # the RNG draws dropout masks alone (sampling is keyed by batch)
            log.warning("the checkpoint holds RNG states of %d process(es), this run has %d: dropout "
                        "masks will not replay exactly", len(rngs), self.ctx.world_size)
        best_bleu, best_step = state.get("best_bleu"), state.get("best_step")
        old = state.get("options") or {}
        remeasured = [f"--{k.replace('_', '-')} {old[k]} -> {self.options.get(k)}" for k in VALIDATION_MEASURE
                      if k in old and old[k] != self.options.get(k)]
        if remeasured and best_bleu is not None:  # a BLEU on 1 line beat one on 40 and took checkpoint_best.pt
            log.warning("validation BLEU is measured otherwise now (%s): the best so far, %.2f at step %s, is not "
                        "compared with it; the next validation starts a new best (and replaces %s)",
                        ", ".join(remeasured), best_bleu, best_step, BEST)
            best_bleu, best_step = None, None
        return Progress(state["step"], state.get("tokens", 0), best_bleu, best_step,
                        state.get("elapsed_s", 0.0), state.get("decay_steps"), state.get("decay_time_s"))


INTERRUPTED = "interrupted.json"  # the steps whose checkpoints were written at a stop signal (resume points)


def interrupted_steps(save_dir: Path) -> set[int]:
    """The steps of a save dir's checkpoints written at a stop signal, off the schedule (none recorded: none)."""
    try:
        steps = json.loads((Path(save_dir) / INTERRUPTED).read_text())["steps"]
        return {s for s in steps if isinstance(s, int)}
    except (OSError, ValueError, KeyError, TypeError):
        return set()


def _record_interrupted(save_dir: Path, steps: set[int]) -> None:
    path = Path(save_dir) / INTERRUPTED
    if steps:
        atomic_write_text(path, json.dumps({"steps": sorted(steps)}) + "\n")
    else:
        path.unlink(missing_ok=True)


def mark_interrupted(save_dir: Path, step: int) -> None:
    _record_interrupted(save_dir, interrupted_steps(save_dir) | {step})


def supersede_interrupted(save_dir: Path, step: int) -> None:
    """A checkpoint of `step` is written (or the run ended there): the stop-signal checkpoints before it are
    resume points no more, and go; one of `step` itself is no longer marked (the caller marks it again when a
    stop signal wrote it)."""
    marked = interrupted_steps(save_dir)
    done = {s for s in marked if s <= step}
    for s in done:
        if s != step:
            step_checkpoint_path(save_dir, s).unlink(missing_ok=True)
    if done:
        _record_interrupted(save_dir, marked - done)


def scheduled_checkpoints(save_dir: Path) -> list[Path]:
    """The step checkpoints of the --save-every schedule (and a run's last), ascending: not those written at a
    stop signal."""
    marked = interrupted_steps(save_dir)
    return [p for p in step_checkpoints(save_dir) if checkpoint_step(p) not in marked]


def prune(save_dir: Path, keep_last: int, best_step: int | None = None) -> None:
    """Delete all but the newest `keep_last` scheduled step checkpoints and the `keep_last` ending at the
    best validation step (the window `pipeline average --best K` averages, for K <= keep_last); a stop
    signal's checkpoint stays until a later one supersedes it."""
    paths = scheduled_checkpoints(save_dir)
    keep = set(paths[-keep_last:]) | set(best_window(paths, best_step, keep_last))
    for old in paths:
        if old not in keep:
            old.unlink(missing_ok=True)


def best_window(paths: list[Path], best_step: int | None, k: int) -> list[Path]:
    """The k newest of `paths` (step checkpoints, ascending) at or before best_step."""
    if best_step is None:
        return []
    return [p for p in paths if (checkpoint_step(p) or 0) <= best_step][-k:]
