"""`pipeline tune-decoding`: parse options, delegate to pipeline.evaluation.tuning."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import click

from pipeline.cli_options import decoding_options, options_from
from pipeline.evaluation.tuning import parse_list, tune_decoding
from runtime.decoding import DecodingOptions
from runtime.model_dir import LoadOptions

_PATH = click.Path(path_type=Path)


@click.command("tune-decoding")
@click.argument("model", type=_PATH)
@click.option("--src", required=True, type=_PATH, help="Validation sources (never a test set).")
@click.option("--ref", required=True, type=_PATH, help="Validation references, line-aligned with --src.")
@click.option("--beams", default="1,4,6", show_default=True, help="Beam widths to try, comma-separated.")
@click.option("--alphas", default="0.6,1.0", show_default=True, help="Length penalties to try, comma-separated.")
@decoding_options("max_len_a", "max_len_b", "batch_tokens")
@options_from(LoadOptions, only=("device",))
@click.option("--json", "json_out", type=_PATH, help="Also write every trial as JSON to this file.")
def tune_decoding_cmd(model: Path, src: Path, ref: Path, beams: str, alphas: str, decoding: DecodingOptions,
                      device: str | None, json_out: Path | None) -> None:
    """Pick --beam-size and --alpha for serve-batch on a validation set: MODEL is an exported
    model dir, a checkpoint, or a training save dir (its averaged or latest checkpoint)."""
    trials = tune_decoding(model, src, ref, parse_list(beams, int, "--beams"),
                           parse_list(alphas, float, "--alphas"), decoding, device)
    click.echo("beam  alpha   BLEU   chrF")
    for t in trials:
        click.echo(f"{t.beam_size:4d}  {t.alpha:5.2f}  {t.bleu:5.2f}  {t.chrf:5.2f}")
    best = trials[0]
    click.echo(f"best on {src.name}: --beam-size {best.beam_size} --alpha {best.alpha:g} (BLEU {best.bleu:.2f})")
    if json_out:
        json_out.write_text(json.dumps([asdict(t) for t in trials], indent=2) + "\n")
