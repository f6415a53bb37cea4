"""`pipeline demo` command."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from model.config import PRESETS
from pipeline.cli_options import decoding_options, options_from, parse_backends
from pipeline.demo.run import DEMO_MAX_TIME, DemoOptions, format_result, run_demo
from pipeline.training import TrainingInterrupted
from runtime.decoding import DecodingOptions
from runtime.model_dir import LoadOptions
from runtime.registry import backend_names


@click.command("demo")
@click.option("--out", default=Path("runs/demo"), show_default=True, type=click.Path(file_okay=False, path_type=Path),
              help="Working directory: train/ (save dir), model-fp32/, model-fp16/, model-int8/, test.hyp, "
                   "parity-*.json.")
@click.option("--preset", type=click.Choice(list(PRESETS)), default=None,
              help="Model size [default: the built-in default, demo].")
@click.option("--max-steps", type=click.IntRange(1), default=None,
              help="Training updates [default: the built-in default, 1200].")
@click.option("--max-time", default=DEMO_MAX_TIME, show_default=True,
              help="Training's wall-clock budget (90s, 10m, 1h): it stops at this or --max-steps, whichever comes "
                   "first, and the result says which.")
@click.option("--builtin-pairs", type=click.IntRange(10), default=None,
              help="Training pairs of the built-in corpus [default: 30000].")
@click.option("--average-last", type=click.IntRange(1), default=3, show_default=True,
              help="Average this many last checkpoints before export.")
@click.option("--backends", default=None,
              help="Backends whose parity with PyTorch is checked (" + ",".join(backend_names()) + ") "
                   "[default: every one this machine can run; see `pipeline doctor`].")
@decoding_options("beam_size", model_dir=False)
@options_from(LoadOptions, only=("threads",))
@click.option("--progress/--no-progress", default=True, show_default=True, help="Show progress bars.")
def demo(out: Path, preset: str | None, max_steps: int | None, max_time: str, builtin_pairs: int | None,
         average_last: int,
         backends: str | None, decoding: DecodingOptions, threads: int | None, progress: bool) -> None:
    """Train on the built-in made-up language pair, export fp32, fp16 and int8, translate the test
    file with serve-batch and print the parity table of each backend against PyTorch.
    Needs no data and no network; a few minutes on 2 CPU cores. Exits 1 if parity fails.
    SIGINT/SIGTERM during training write a checkpoint and exit with status 130/143, as `pipeline
    train` does; rerun the same command to resume."""
    wanted = tuple(parse_backends(backends)) if backends else None
    try:
        result = run_demo(DemoOptions(out=out, preset=preset, max_steps=max_steps, max_time=max_time,
                                      builtin_pairs=builtin_pairs,
                                      average_last=average_last, backends=wanted,
                                      decoding=decoding, threads=threads, progress=progress))
    except TrainingInterrupted as e:  # the stop train's command reports: one line, 128 + signum
        click.echo(str(e), err=True)
        sys.exit(128 + e.signum)
    click.echo(format_result(result))
    if not result.passed:
        sys.exit(1)
