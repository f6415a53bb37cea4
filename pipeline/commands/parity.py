"""`pipeline parity` command."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import click

from model.manifest import PRECISIONS
from pipeline.cli_options import GivenPath, decoding_options, installed_backends, options_from, parse_backends, pick
from pipeline.evaluation.parity import format_table, run_parity, write_json
from pipeline.evaluation.parity_options import DEFAULT_GATES, REFERENCE, SHORTLISTED, ParityOptions
from pipeline.serve_batch.translation import ServeBatchOptions
from pipeline.textio import check_output_file, refuse_overwriting_inputs
from runtime.decoding import DecodingOptions
from runtime.model_dir import LoadOptions


@click.command("parity")
@click.argument("model_dir", type=GivenPath(path_type=Path))
@options_from(ParityOptions, only=("src", "ref", "backends"))
@decoding_options("beam_size", "alpha", "max_len_a", "max_len_b", "min_len", "batch_tokens", "batch_sentences", "rules")
@options_from(ParityOptions, only=("reference_engine", "hf_dir"))
@options_from(LoadOptions, skip=("backend", "precision", "step", "steps_per_replay", "parallel_batches"), notes={
    "shortlist": (
    "Here: every listed backend, torch included, decodes so against the full-vocabulary reference; labelled e.g. "
    f"fp32+shortlist, gated by |dBLEU| <= {DEFAULT_GATES['shortlist'].max_bleu_delta} (fp16/int8: the larger of "
    "it and their own), with the shortlist's coverage of the reference's tokens.")})
@options_from(ServeBatchOptions, only=("src_lang", "tgt_lang"))
@options_from(ParityOptions, skip=("src", "ref", "backends", "reference_engine", "hf_dir"))
@click.pass_context
def parity(ctx: click.Context, model_dir: Path, decoding: DecodingOptions, device: str | None, threads: int | None,
           shortlist: bool = False, src_lang: str | None = None, tgt_lang: str | None = None, **values: Any) -> None:
    """Translate SRC with each backend of MODEL_DIR and compare with the PyTorch model:
    BLEU and chrF against REF, BLEU against PyTorch, share of token-identical sentences,
    first divergence step and log-prob gap. Each backend translates SRC exactly as
    serve-batch does (blank lines stay blank, long lines are truncated). Without --src/--ref
    the comparison is with the fp32 PyTorch translations recorded at export, so it runs where
    PyTorch is not installed. Exits 1 when a backend misses its gate."""
    opts: ParityOptions = pick(ParityOptions, values).validate()
    src, ref, save_hyps, json_out = opts.src, opts.ref, opts.save_hyps, opts.json_out
    names = parse_backends(opts.backends)
    recorded = src is None and ref is None and opts.reference_engine == REFERENCE
    if recorded:
        given = [f"--{p.replace('_', '-')}" for p in ("beam_size", "alpha", "max_len_a", "max_len_b", "min_len",
                                                      "rules", "src_lang", "tgt_lang")
                 if ctx.get_parameter_source(p) is not click.core.ParameterSource.DEFAULT]
        if given:  # (the languages were ignored: the references' own direction is translated)
            raise click.UsageError(f"{', '.join(given)}: parity against the recorded references uses the decoding "
                                   "and languages they were recorded with; pass --src and --ref to choose other "
                                   "options")
        names = installed_backends(ctx, names)  # no PyTorch here: gate the exported graphs
    labels = [p + (SHORTLISTED if shortlist else "") for p in PRECISIONS]
    hyp_files = [save_hyps / f"{b}.{p}.txt" for b in names for p in labels] if save_hyps else []
    inputs = [p for p in (src, ref) if p is not None]
    model_files = [model_dir, *([opts.hf_dir] if opts.hf_dir else [])]  # read whole: nothing may be written there
    refuse_overwriting_inputs(inputs, hyp_files, "--save-hyps file", input_dirs=model_files)
    for hyp_file in hyp_files[:1]:  # one dir for all: checked before minutes of translating, not after
        check_output_file(hyp_file, "--save-hyps")
    if json_out:
        refuse_overwriting_inputs(inputs, [json_out], "--json file", input_dirs=model_files)
        if os.path.realpath(json_out) in {os.path.realpath(h) for h in hyp_files}:  # one would replace the other
            raise click.UsageError(f"--json {json_out} is a file --save-hyps writes (BACKEND.PRECISION.txt); give "
                                   "the report another name")
        check_output_file(json_out, "--json")
    report = run_parity(model_dir, src, ref, names, opts=ServeBatchOptions(decoding=decoding, src_lang=src_lang,
                                                                              tgt_lang=tgt_lang),
                        device=device, gates=opts.gates(), threads=threads, save_hyps=save_hyps,
                        reference_engine=opts.reference_engine, hf_dir=opts.hf_dir, shortlist=shortlist)
    aside = str(json_out) == "-"  # the table on standard error: standard output holds the JSON alone
    click.echo(format_table(report), err=aside)
    if json_out:
        write_json(report, json_out)
    if not report.passed:
        click.echo("parity: FAILED", err=True)
        sys.exit(1)
    click.echo("parity: passed", err=aside)
