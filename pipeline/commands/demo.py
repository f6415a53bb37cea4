"""`pipeline demo` command."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import click

from pipeline.cli_options import decoding_options, options_from, pick
from pipeline.demo.run import DemoOptions, format_result, run_demo
from pipeline.training import TrainingInterrupted
from runtime.decoding import DecodingOptions
from runtime.model_dir import LoadOptions


@click.command("demo")
@options_from(DemoOptions, skip=("progress",))
@decoding_options("beam_size", defaults_from=None)
@options_from(LoadOptions, only=("threads",))
@options_from(DemoOptions, only=("progress",))
def demo(decoding: DecodingOptions, threads: int | None, **values: Any) -> None:
    """Train on the built-in made-up language pair, export fp32, fp16 and int8, translate the test
    file with serve-batch and print the parity table of each backend against PyTorch.
    Needs no data and no network; a few minutes on 2 CPU cores. Exits 1 if parity fails.
    SIGINT/SIGTERM during training write a checkpoint and exit with status 130/143, as `pipeline
    train` does; rerun the same command to resume."""
    opts: DemoOptions = pick(DemoOptions, values)  # --backends a,b checked as before: one click error
    try:
        result = run_demo(dataclasses.replace(opts, decoding=decoding, threads=threads).validate())
    except TrainingInterrupted as e:  # the stop train's command reports: one line, 128 + signum
        click.echo(str(e), err=True)
        sys.exit(128 + e.signum)
    click.echo(format_result(result))
    if not result.passed:
        sys.exit(1)
