"""`pipeline parity` command."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from model.manifest import PRECISIONS
from pipeline.cli_options import decoding_options, options_from, parse_backends
from pipeline.evaluation.parity import (
    DEFAULT_GATES,
    REFERENCE,
    REFERENCES,
    SHORTLISTED,
    Gate,
    format_table,
    run_parity,
    write_json,
)
from pipeline.serve_batch.translation import ServeBatchOptions
from pipeline.textio import check_output_file, refuse_overwriting_inputs
from runtime.decoding import DecodingOptions
from runtime.model_dir import LoadOptions
from runtime.registry import backend_names, installed


@click.command("parity")
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.option("--src", default=None, type=click.Path(path_type=Path),
              help="Source sentences, one per line; the PyTorch model translates them live. Without --src and "
                   "--ref: the held-out lines recorded in MODEL_DIR at export, with their decoding options "
                   "(needs no PyTorch).")
@click.option("--ref", default=None, type=click.Path(path_type=Path), help="Reference translations of --src, "
              "line-aligned.")
@click.option("--backends", default="torch,onnxruntime", show_default=True,
              help="Comma-separated backends to compare against the PyTorch model (" + ",".join(backend_names()) + ").")
@decoding_options("beam_size", "alpha", "max_len_a", "max_len_b", "min_len", "batch_tokens", "rules")
@click.option("--reference", "reference_engine", type=click.Choice(REFERENCES), default=REFERENCE, show_default=True,
              help="What the backends are compared with: our fp32 PyTorch model, or, for a model made by `pipeline "
                   "import`, transformers' own generate on the directory it was imported from (all backends, "
                   "torch included, gated token for token; needs --src and --ref).")
@click.option("--hf-dir", default=None, type=click.Path(file_okay=False, path_type=Path),
              help="With --reference transformers: the Hugging Face directory (default: the one the import recorded).")
@options_from(LoadOptions, skip=("backend", "precision", "step", "parallel_batches"), notes={"shortlist": (
    "Here: every listed backend, torch included, decodes so against the full-vocabulary reference; labelled e.g. "
    f"fp32+shortlist, gated by |dBLEU| <= {DEFAULT_GATES['shortlist'].max_bleu_delta} (fp16/int8: the larger of "
    "it and their own), with the shortlist's coverage of the reference's tokens.")})
@options_from(ServeBatchOptions, only=("src_lang", "tgt_lang"))
@click.option("--min-identical", default=DEFAULT_GATES["fp32"].min_identical, show_default=True, type=float,
              help="fp32 gate: least share of sentences token-identical to PyTorch.")
@click.option("--max-bleu-delta", default=DEFAULT_GATES["fp32"].max_bleu_delta, show_default=True, type=float,
              help="fp32 gate: largest |BLEU(backend) - BLEU(torch)|.")
@click.option("--fp16-max-bleu-delta", default=DEFAULT_GATES["fp16"].max_bleu_delta, show_default=True,
              type=float, help="fp16 gate: largest |BLEU(backend) - BLEU(torch)|.")
@click.option("--fp16-min-identical", default=None, type=float,
              help="fp16 gate: least share of token-identical sentences (default: not gated).")
@click.option("--int8-max-bleu-delta", default=DEFAULT_GATES["int8"].max_bleu_delta, show_default=True,
              type=float, help="int8 gate: largest |BLEU(backend) - BLEU(torch fp32)|.")
@click.option("--int8-min-identical", default=None, type=float,
              help="int8 gate: least share of token-identical sentences (default: not gated).")
@click.option("--json", "json_out", default=None, type=click.Path(path_type=Path), help="Write the report as JSON.")
@click.option("--save-hyps", default=None, type=click.Path(file_okay=False, path_type=Path), metavar="DIR",
              help="Write each backend's translation of SRC, line-aligned, to DIR/<backend>.<precision>.txt "
                   "(what serve-batch writes with the same options).")
@click.pass_context
def parity(ctx: click.Context, model_dir: Path, src: Path | None, ref: Path | None, backends: str,
           decoding: DecodingOptions, device: str | None,
           threads: int | None, min_identical: float, max_bleu_delta: float, fp16_max_bleu_delta: float,
           fp16_min_identical: float | None, json_out: Path | None, save_hyps: Path | None,
           int8_max_bleu_delta: float = DEFAULT_GATES["int8"].max_bleu_delta,
           int8_min_identical: float | None = None, reference_engine: str = REFERENCE,
           hf_dir: Path | None = None, shortlist: bool = False, src_lang: str | None = None,
           tgt_lang: str | None = None) -> None:
    """Translate SRC with each backend of MODEL_DIR and compare with the PyTorch model:
    BLEU and chrF against REF, BLEU against PyTorch, share of token-identical sentences,
    first divergence step and log-prob gap. Each backend translates SRC exactly as
    serve-batch does (blank lines stay blank, long lines are truncated). Without --src/--ref
    the comparison is with the fp32 PyTorch translations recorded at export, so it runs where
    PyTorch is not installed. Exits 1 when a backend misses its gate."""
    gates = {"fp32": Gate(min_identical, max_bleu_delta), "fp16": Gate(fp16_min_identical, fp16_max_bleu_delta),
             "int8": Gate(int8_min_identical, int8_max_bleu_delta), "shortlist": DEFAULT_GATES["shortlist"]}
    names = parse_backends(backends)
    recorded = src is None and ref is None and reference_engine == REFERENCE
    if recorded:
        given = [f"--{p.replace('_', '-')}" for p in ("beam_size", "alpha", "max_len_a", "max_len_b", "min_len",
                                                      "rules")
                 if ctx.get_parameter_source(p) is not click.core.ParameterSource.DEFAULT]
        if given:
            raise click.UsageError(f"{', '.join(given)}: parity against the recorded references uses the decoding "
                                   "they were recorded with; pass --src and --ref to choose other options")
        if ctx.get_parameter_source("backends") is click.core.ParameterSource.DEFAULT and not installed("torch"):
            names = [n for n in names if n != "torch"]  # no PyTorch here: gate the exported graphs
    labels = [p + (SHORTLISTED if shortlist else "") for p in PRECISIONS]
    hyp_files = [save_hyps / f"{b}.{p}.txt" for b in names for p in labels] if save_hyps else []
    inputs = [p for p in (src, ref) if p is not None]
    refuse_overwriting_inputs(inputs, hyp_files, "--save-hyps file")
    if json_out:
        refuse_overwriting_inputs(inputs, [json_out], "--json file")
        check_output_file(json_out, "--json")
    report = run_parity(model_dir, src, ref, names, opts=ServeBatchOptions(decoding=decoding, src_lang=src_lang,
                                                                              tgt_lang=tgt_lang),
                        device=device, gates=gates, threads=threads, save_hyps=save_hyps,
                        reference_engine=reference_engine, hf_dir=hf_dir, shortlist=shortlist)
    click.echo(format_table(report))
    if json_out:
        write_json(report, json_out)
    if not report.passed:
        click.echo("parity: FAILED", err=True)
        sys.exit(1)
    click.echo("parity: passed")
