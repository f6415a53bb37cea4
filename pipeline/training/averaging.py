"""Averaging a save dir's checkpoints (section 6.1: the last 5 for base, 20 for big; or the window ending at the
best validation BLEU): `pipeline average`, and `pipeline demo`'s step before its exports."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from model.atomic import remove_stale_temps
from model.checkpoint import (
    AVERAGED,
    AVERAGED_AT,
    BEST,
    CheckpointError,
    average_mark,
    checkpoint_step,
    read_checkpoint,
    save_checkpoint,
    step_checkpoints,
)
from model.config import ModelConfig
from model.errors import UserError
from model.manifest import MANIFEST
from model.transformer import Transformer
from pipeline.textio import check_output_file, refuse_overwriting_inputs, within
from pipeline.training.checkpointing import (
    best_window,
    interrupted_steps,
    no_best,
    run_corpus,
    scheduled_checkpoints,
    writer_of,
)

log = logging.getLogger(__name__)


def average_checkpoints(save_dir: Path, last: int = 5, out: Path | None = None, best: int | None = None,
                        force: bool = False) -> Path:
    """Average the weights of the last `last` step checkpoints (section 6.1: the last 5 for base, 20 for big) into
    `out` (default save_dir/averaged.pt, replaced; another file only with `force`), atomically. With `best`,
    average instead the `best` step checkpoints ending at the best validation BLEU's step (checkpoint_best.pt's).
    Its extra records the files averaged (`averaged`), their step numbers ascending (`steps`), and the newest
    (`step`). No file of the run is written through a link (averaged.pt -> checkpoint_best.pt), nor a model dir's."""
    save_dir = Path(save_dir)
    if (count := last if best is None else best) < 1:
        raise UserError(f"{'--last' if best is None else '--best'} must be at least 1 (got {count})")
    if not save_dir.is_dir():
        raise UserError(f"{save_dir}: no such save directory")
    if (save_dir / MANIFEST).is_file():  # (it said --out lay in a model dir: the default --out does)
        raise UserError(f"{save_dir}: is an exported model dir, not a `pipeline train` --save-dir; average the save "
                        "dir it was exported from")
    option = "--out" if out is not None else f"{AVERAGED} (the default --out)"  # what a refusal names
    out = Path(out) if out is not None else save_dir / AVERAGED
    if within(out, save_dir) and out.name != AVERAGED and (out.is_file() or checkpoint_step(out) is not None):
        raise UserError(f"{out}: --out would replace a file of the run in {save_dir}, or be taken for one of its "
                        f"checkpoints; choose a new file name (the default is {save_dir / AVERAGED})")
    made = [d for d in out.parents if within(d, save_dir) and d != save_dir and not d.exists()]
    if any(d.suffix == ".pt" for d in made):  # (averaged.pt/x made a directory averaged.pt: plain average failed)
        raise UserError(f"{out}: --out would make a directory {made[-1]} named like a checkpoint in the run; "
                        f"choose a file there (the default is {save_dir / AVERAGED})")
    if checkpoint_step(out) is not None or out.name == BEST:  # in any run's dir: resume and export would read it
        raise UserError(f"{out}: --out is named as a training run's own checkpoint, which resuming and exporting "
                        f"that dir would take for one of its steps; choose another name (the default is {AVERAGED})")
    if out.is_file() and not force and out.resolve() != (save_dir / AVERAGED).resolve():  # another run's
        raise UserError(f"{out}: exists; pass --force to replace it, or choose another --out")
    run_files = [p for p in save_dir.iterdir() if p.name != AVERAGED]  # and the run's corpus, wherever it lies
    refuse_overwriting_inputs([*run_corpus(save_dir), *run_files], [out], "--out")
    if (out.parent / MANIFEST).is_file():
        raise UserError(f"{out}: --out lies in a model dir, whose files its manifest checks; choose another path")
    check_output_file(out, option, "a checkpoint")
    remove_stale_temps(save_dir)
    remove_stale_temps(out.parent)
    paths = scheduled_checkpoints(save_dir)[-last:]  # a stop signal's checkpoint is a resume point, not one of them
    best_step = None
    if best is not None:
        if not (save_dir / BEST).is_file():
            raise UserError(f"{save_dir / BEST}: not found; " + no_best(save_dir))
        best_step = read_checkpoint(save_dir / BEST)["extra"].get("step")
        paths, last = best_window(scheduled_checkpoints(save_dir), best_step, best), best
        if best_step is not None and not any(checkpoint_step(p) == best_step for p in paths):
            # validated between two saves (--valid-every apart from --save-every): the best weights are only in
            # checkpoint_best.pt, which ends the window, after the step checkpoints before it
            before = [p for p in scheduled_checkpoints(save_dir) if (checkpoint_step(p) or 0) < best_step]
            paths = [*(before[-(best - 1):] if best > 1 else []), save_dir / BEST]
    if not paths and interrupted_steps(save_dir) & set(map(checkpoint_step, step_checkpoints(save_dir))):
        points = ", ".join(p.name for p in step_checkpoints(save_dir))
        raise UserError(f"{save_dir}: its only checkpoints were written at a stop signal or before the first update "
                        f"({points}): resume points, not averaged; rerun the training command to go on, or export "
                        "that file itself")
    if not paths:
        raise UserError(f"{save_dir}: no checkpoint_<step>.pt files to average; is it a `pipeline train` --save-dir?")
    if len(paths) < last:
        log.warning("only %d checkpoint(s) in %s%s, averaging those (asked for %d)", len(paths), save_dir,
                    f" up to the best (step {best_step})" if best is not None else "", last)
    first = _read(paths[0], save_dir)
    last_payload = first
    # float64 sums: averaging 20 float32 checkpoints in float32 would round each addition.
    total = {k: v.double() if v.is_floating_point() else v for k, v in first["model"].items()}
    for path in paths[1:]:
        payload = last_payload = _read(path, save_dir)
        if payload["model_config"] != first["model_config"]:
            raise UserError(f"{path}: its model config differs from {paths[0]}'s; cannot average them")
        if payload["spm_model"] != first["spm_model"]:  # same shapes, another vocabulary: ids mean other pieces
            raise UserError(f"{path}: its SentencePiece model differs from {paths[0]}'s (another run's checkpoint?); "
                            "cannot average them")
        for k, v in payload["model"].items():
            if v.is_floating_point():
                total[k] += v.double()
    model = Transformer(ModelConfig.from_dict(first["model_config"]))
    state = {k: (v / len(paths)).to(first["model"][k].dtype) if v.is_floating_point() else v
             for k, v in total.items()}
    model.load_state_dict(state)
    steps = [s for s in (checkpoint_step(p) if p.name != BEST else best_step for p in paths) if s is not None]
    save_checkpoint(out, model, first["spm_model"],
                    extra={"averaged": [p.name for p in paths], "steps": steps,
                           "step": last_payload["extra"].get("step"),
                           # the run's newest step checkpoint then: a save dir resolves to this average until a
                           # newer one is written (model.checkpoint.resolve_checkpoint), whatever the files' times
                           AVERAGED_AT: average_mark(newest[-1]) if (newest := step_checkpoints(save_dir)) else None})
    log.info("averaged %d checkpoints (%s .. %s) into %s", len(paths), paths[0].name, paths[-1].name, out)
    return out


def _read(path: Path, save_dir: Path) -> dict[str, Any]:
    """A checkpoint to average; one removed meanwhile by the training run writing the save dir (it keeps only its
    --keep-last newest) is said so, not "no such checkpoint file" of a file the user just saw listed."""
    try:
        return read_checkpoint(path)
    except CheckpointError:
        if path.exists():
            raise
        writer = writer_of(save_dir)
        if writer is None:
            raise
        raise UserError(f"{path}: removed while it was averaged, by the training run writing {save_dir} (pid "
                        f"{writer}), which keeps only its newest checkpoints; rerun `pipeline average` (it takes the "
                        "newest then), or average once the run ends") from None
