"""`pipeline train` and `pipeline average`: parse options, delegate to pipeline.training."""

from __future__ import annotations

import shlex
import signal
import sys
from pathlib import Path

import click

from pipeline.cli_options import GivenPath, options_from, pick
from pipeline.distributed import env_ranks
from pipeline.training import AverageOptions, TrainingInterrupted, TrainOptions, average_checkpoints, describe_defaults
from pipeline.training import train as run_training
from pipeline.training.budget import process_start_time
from pipeline.training.checkpointing import scheduled_checkpoints


@click.command(epilog="Per-preset defaults for unset options: " + describe_defaults())
@options_from(TrainOptions)
def train(**kwargs: object) -> None:
    """Train the Transformer on a parallel corpus (or the built-in one) into --save-dir.

    One process: `pipeline train ...`. Several (DDP, gloo on CPU, NCCL on GPU):
    `torchrun --standalone --nproc-per-node N -m pipeline train ...`. SIGINT/SIGTERM
    write a checkpoint and exit with status 130/143; rerun the same command to resume.
    Validation keeps the best-BLEU weights as SAVE_DIR/checkpoint_best.pt.
    """
    opts = TrainOptions(**kwargs)  # type: ignore[arg-type]
    main = env_ranks()[0] == 0  # under torchrun the first process speaks for all (the others saved nothing)
    try:
        save_dir = run_training(opts, process_start_time())  # --max-time counts this process's imports too
    except TrainingInterrupted as e:
        for sig in (signal.SIGINT, signal.SIGTERM):  # the checkpoint is written: another Ctrl-C while Python exits
            signal.signal(sig, signal.SIG_IGN)  # printed a KeyboardInterrupt traceback from an atexit hook
        if main:
            click.echo(str(e), err=True)
        sys.exit(128 + e.signum)
    if main and scheduled_checkpoints(save_dir):
        click.echo(f"checkpoints in {save_dir}; average them with `pipeline average {shlex.quote(str(save_dir))}`")
    elif main:  # --max-time spent before the first update: its checkpoint is a resume point, which average refuses
        click.echo(f"no update finished within the run's time: {save_dir} holds a resume point only; rerun the "
                   "command (with a larger --max-time) to train")


@click.command()
@click.argument("save_dir", type=GivenPath(file_okay=False, path_type=Path))
@options_from(AverageOptions)
def average(save_dir: Path, **values: object) -> None:
    """Average the weights of the last K checkpoints of a save dir (section 6.1)."""
    opts: AverageOptions = pick(AverageOptions, values).validate()
    path = average_checkpoints(save_dir, last=opts.count, out=opts.out, best=opts.best, force=opts.force)
    click.echo(f"wrote {path}")
