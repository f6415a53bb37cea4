"""`pipeline tune-decoding`: parse options, delegate to pipeline.evaluation.tuning."""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict
from pathlib import Path
from typing import Any

import click

from model.errors import UserError
from model.manifest import MANIFEST
from pipeline.cli_options import GivenPath, decoding_options, options_from, pick
from pipeline.evaluation.tuning import TuneOptions, tune_decoding
from pipeline.serve_batch.translation import ServeBatchOptions
from pipeline.textio import atomic_output, check_output_file, refuse_overwriting_inputs, within
from runtime.decoding import DecodingOptions
from runtime.model_dir import LoadOptions


@click.command("tune-decoding")
@click.argument("model", type=GivenPath(path_type=Path))
@options_from(TuneOptions, only=("src", "ref", "beams", "alphas"))
@decoding_options("max_len_a", "max_len_b", "batch_tokens", "batch_sentences")
@options_from(LoadOptions, only=("device", "threads"))
@options_from(ServeBatchOptions, only=("src_lang", "tgt_lang"))
@options_from(TuneOptions, only=("json_out",))
def tune_decoding_cmd(model: Path, decoding: DecodingOptions, device: str | None, threads: int | None = None,
                      src_lang: str | None = None, tgt_lang: str | None = None, **values: Any) -> None:
    """Pick --beam-size and --alpha for serve-batch on a validation set: MODEL is an exported
    model dir, a checkpoint, or a training save dir (its averaged or latest checkpoint)."""
    opts: TuneOptions = pick(TuneOptions, values).validate()
    if opts.json_out:
        check_json_out(opts.json_out, [opts.src, opts.ref], model)
    trials = tune_decoding(model, opts.src, opts.ref, opts.beam_sizes(), opts.alpha_values(), decoding, device,
                           src_lang, tgt_lang, threads)
    aside = str(opts.json_out) == "-"  # the table on standard error: standard output holds the JSON alone
    click.echo("beam  alpha   BLEU   chrF", err=aside)
    for t in trials:
        click.echo(f"{t.beam_size:4d}  {t.alpha:5.2f}  {t.bleu:5.2f}  {t.chrf:5.2f}", err=aside)
    best = trials[0]
    flags = best.export_flags()  # with the other search settings it ran under, unlike the paper's
    given = " ".join(f"--{side}-lang {code}" for side, code in (("src", src_lang), ("tgt", tgt_lang)) if code)
    pair = f" ({given})" if given else ""
    click.echo(f"best on {opts.src.name}{pair}: {flags} (BLEU {best.bleu:.2f})", err=aside)
    checkpoint = "CHECKPOINT" if (model / MANIFEST).is_file() else shlex.quote(str(model))
    click.echo(f"pass them to serve-batch, serve, parity or ray-translate, or record them as a model dir's defaults: "
               f"pipeline export {checkpoint} --out NEW_DIR {flags}", err=aside)
    if opts.json_out:
        with atomic_output(opts.json_out) as f:  # '-': standard output, the table on standard error
            f.write(json.dumps([asdict(t) for t in trials], indent=2) + "\n")


def check_json_out(json_out: Path, inputs: list[Path], model: Path) -> None:
    """Before any decoding: --json may not be --src, --ref or the checkpoint, nor a file a model dir or save dir
    already holds (a new file there is fine), and must be writable."""
    model_dir = model.is_dir() and (model / MANIFEST).is_file()
    refuse_overwriting_inputs([*inputs, *([] if model.is_dir() else [model])], [json_out], "--json file",
                              input_dirs=[model] if model_dir else [])
    if model.is_dir() and json_out.is_file() and within(json_out, model):
        raise UserError(f"{json_out}: this --json file is one {model} already holds; writing it would replace it, "
                        "choose a new file name")
    check_output_file(json_out, "--json")
