"""`pipeline random-checkpoint`: a random-weight checkpoint of a preset shape, for benchmarks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from model.checkpoint import AVERAGED, BEST, checkpoint_step
from pipeline.cli_options import GivenPath, options_from, pick
from pipeline.evaluation.random_model import RandomCheckpointOptions, make_random_checkpoint
from pipeline.textio import check_output_file


@click.command("random-checkpoint")
@click.argument("out", type=GivenPath(dir_okay=False, path_type=Path))
@options_from(RandomCheckpointOptions)
def random_checkpoint(out: Path, **values: Any) -> None:
    """Write OUT, a checkpoint with random weights of a preset's shape and a real tokenizer, to
    measure a shape's speed and memory without training it:

    \b
        pipeline random-checkpoint base.pt --preset base --vocab-size 32000
        pipeline export base.pt --out models/base-fp32 --no-tensorrt
        pipeline bench models/base-fp32 --backends onnxruntime --compare ctranslate2
    """
    opts: RandomCheckpointOptions = pick(RandomCheckpointOptions, values).validate()
    if checkpoint_step(out) is not None or out.name in (BEST, AVERAGED):  # export of its dir took it for the run's
        raise click.UsageError(f"{out.name} is how a training run names its checkpoints: export, tune-decoding and "
                               "resume of that dir would take these random weights for the run's; choose another name")
    if out.exists() and not opts.force:
        raise click.UsageError(f"{out} exists; pass --force to replace it")
    check_output_file(out, "OUT", "a checkpoint")
    vocab = make_random_checkpoint(out, opts.preset, opts.vocab_size, opts.seed, opts.decoder_layers)
    shape = f", {opts.decoder_layers} decoder layer(s)" if opts.decoder_layers else ""
    click.echo(f"{out}: random {opts.preset} model{shape}, vocab {vocab}")
