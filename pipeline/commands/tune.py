"""`pipeline tune-decoding`: parse options, delegate to pipeline.evaluation.tuning."""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict
from pathlib import Path
from typing import Any

import click

from model.digests import file_digest
from model.errors import UserError
from model.manifest import DEFAULT_LIMITS, DEFAULT_TOPK, MANIFEST, Manifest
from pipeline.cli_options import GivenPath, decoding_options, options_from, pick
from pipeline.evaluation.bench import host_facts
from pipeline.evaluation.tuning import TuneOptions, tune_decoding
from pipeline.invocation import command_line
from pipeline.serve_batch.translation import ServeBatchOptions
from pipeline.textio import atomic_output, check_output_file, refuse_overwriting_inputs, within
from runtime.decoding import DecodingOptions
from runtime.model_dir import LoadOptions, ModelDir
from runtime.shortlist import DEFAULT_PER_SOURCE


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
    if str(opts.src) == "-" and str(opts.ref) == "-":  # the references read an exhausted stdin ("- has 0 lines")
        raise UserError("--src and --ref are both standard input; give at least one of them as a file")
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
    export = f"pipeline export {_export_as(model)} --out NEW_DIR {flags}"
    click.echo(f"pass them to serve-batch, serve, parity or ray-translate, or record them as a model dir's defaults: "
               f"{export}", err=aside)
    if opts.json_out:  # what was tuned, where and on what, as bench and parity record it
        report = {"command": command_line(), "model": str(model), "src": str(opts.src), "ref": str(opts.ref),
                  "src_lang": src_lang, "tgt_lang": tgt_lang, "device": device, "threads": threads,
                  "host": host_facts(threads), "best": asdict(best), "export": export,
                  "trials": [asdict(t) for t in trials]}
        with atomic_output(opts.json_out) as f:  # '-': standard output, the table on standard error
            f.write(json.dumps(report, indent=2) + "\n")


def _export_as(model: Path) -> str:
    """The export that makes a model dir of the tuned settings: a model dir's own checkpoint (where its file still
    holds what was exported: a later `average` replaces averaged.pt), precision and language pair (an int8 dir's
    suggestion made an fp32 one), or the checkpoint / save dir tuned."""
    if not (model / MANIFEST).is_file():
        return shlex.quote(str(model))
    manifest = ModelDir.open(model, verify=False).manifest
    source = manifest.source_checkpoint
    same = source.path and Path(source.path).is_file() and file_digest(Path(source.path)) == source.sha256
    checkpoint = shlex.quote(source.path) if same else "CHECKPOINT"
    precision = {"fp16": " --fp16", "int8": " --int8"}.get(manifest.precision, "")
    flavour = f" --int8-flavour {manifest.quantization}" if manifest.precision == "int8" and manifest.quantization \
        else ""
    pair = manifest.language_pair  # a one-pair model's languages: without them LibreTranslate's API has no route
    given = f" --src-lang {pair.source[0]} --tgt-lang {pair.target[0]}" if pair is not None and len(pair.source) == 1 \
        and len(pair.target) == 1 else ""
    return checkpoint + precision + flavour + given + "".join(f" {flag}" for flag in _settings(manifest))


def _settings(manifest: Manifest) -> list[str]:
    """The export options a model dir was made with that its export command must give again: shapes and topk
    other than the defaults (a dir exported with --max-beam 12, tuned at beam 12, was suggested an export that
    refused "--beam-size 12 is above --max-beam 8"), int8's activation scales where not the default's, and the
    shortlist's corpus."""
    limits, flags = manifest.limits, []
    for name in ("max_batch", "max_src_len", "max_tgt_len", "max_beam"):
        if getattr(limits, name) != getattr(DEFAULT_LIMITS, name):
            flags.append(f"--{name.replace('_', '-')} {getattr(limits, name)}")
    if manifest.topk != DEFAULT_TOPK:
        flags.append(f"--topk {manifest.topk}")
    scales = manifest.verification.get("int8_activation_scales") or {}
    if scales.get("chosen") == "given" and scales.get("calibrated_on"):
        flags.append(f"--int8-calibrate {shlex.quote(str(scales['calibrated_on']))}")
    elif scales.get("kind") == "per-row" and "sample_gate" not in scales:  # (a missed gate: the default again)
        flags.append("--no-int8-calibrate")
    if manifest.shortlist is not None:
        src, tgt = manifest.shortlist.corpus
        flags.append(f"--shortlist-src {shlex.quote(src)} --shortlist-tgt {shlex.quote(tgt)}")
        if manifest.shortlist.per_source != DEFAULT_PER_SOURCE:
            flags.append(f"--shortlist-per-source {manifest.shortlist.per_source}")
    return flags


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
