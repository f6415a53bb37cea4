"""`pipeline random-checkpoint`: a random-weight checkpoint of a preset shape, for benchmarks."""

from __future__ import annotations

from pathlib import Path

import click

from model.config import PRESETS
from pipeline.evaluation.random_model import make_random_checkpoint
from pipeline.textio import check_output_file


@click.command("random-checkpoint")
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--preset", type=click.Choice(list(PRESETS)), default="base", show_default=True,
              help="Model shape (model/config.py's preset table).")
@click.option("--vocab-size", type=click.IntRange(min=16), default=32000, show_default=True,
              help="Vocabulary of the SentencePiece model trained on made-up text (a soft limit).")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seed of the made-up text and of the weights (the same seed and shape give the same weights).")
@click.option("--decoder-layers", type=click.IntRange(min=1), default=None,
              help="Decoder layers instead of the preset's (e.g. a 1-layer student's shape).")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
def random_checkpoint(out: Path, preset: str, vocab_size: int, seed: int, force: bool,
                      decoder_layers: int | None = None) -> None:
    """Write OUT, a checkpoint with random weights of a preset's shape and a real tokenizer, to
    measure a shape's speed and memory without training it:

        pipeline random-checkpoint base.pt --preset base --vocab-size 32000
        pipeline export base.pt --out models/base-fp32 --no-tensorrt
        pipeline bench models/base-fp32 --backends onnxruntime --compare ctranslate2
    """
    if out.exists() and not force:
        raise click.UsageError(f"{out} exists; pass --force to replace it")
    check_output_file(out, "OUT")
    vocab = make_random_checkpoint(out, preset, vocab_size, seed, decoder_layers)
    shape = f", {decoder_layers} decoder layer(s)" if decoder_layers else ""
    click.echo(f"{out}: random {preset} model{shape}, vocab {vocab}")
