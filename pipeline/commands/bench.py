"""`pipeline bench` command."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import click

from model.errors import UserError
from pipeline.cli_options import GivenPath, decoding_options, installed_backends, options_from, parse_backends, pick
from pipeline.evaluation.bench import BenchOptions, format_table, run_bench, write_json
from pipeline.evaluation.bench_compare import format_comparison, run_comparison
from pipeline.evaluation.serve_bench import ServeBenchOptions, format_serve_bench, run_serve_bench
from pipeline.evaluation.whole_process import format_whole_process, run_whole_process
from pipeline.serve_batch.translation import ServeBatchOptions
from pipeline.textio import check_output_file, refuse_overwriting_inputs
from runtime.decoding import DecodingOptions
from runtime.machine import default_parallel_batches
from runtime.model_dir import LoadOptions, ModelDir


@click.command("bench")
@click.argument("model_dirs", nargs=-1, required=True, type=GivenPath(path_type=Path))
@options_from(BenchOptions, only=("backends", "batch_sizes"))
@decoding_options("beam_size", "rules", notes={"rules": (
    "Here: ours in-process and with --whole-process (CTranslate2 has one rule: top-beam, its early exit).")})
@options_from(BenchOptions, only=("fixed_length", "src", "sentences", "src_len"))
@options_from(LoadOptions, skip=("backend", "precision"), notes={"shortlist": (
    "Here: every engine of ours, in every mode but --serve (CTranslate2 is unchanged); its rows record "
    "\"shortlist\": true and show vocab 'shortlist'."), "parallel_batches": (
    "Here: 1 unless given, but with --whole-process serve-batch's default; CTranslate2 runs as many inter_threads.")})
@options_from(BenchOptions, only=("compare", "min_agreement"))
@options_from(ServeBatchOptions, only=("src_lang", "tgt_lang"))
@options_from(BenchOptions, only=("rounds", "serve_input"))
@options_from(ServeBenchOptions)
@options_from(BenchOptions, only=("whole_process", "json_out"))
@click.pass_context
def bench(ctx: click.Context, model_dirs: tuple[Path, ...], decoding: DecodingOptions, device: str | None,
          threads: int | None, shortlist: bool = False, src_lang: str | None = None, tgt_lang: str | None = None,
          step: str | None = None, steps_per_replay: int | None = None, parallel_batches: int | None = None,
          **values: Any) -> None:
    """Measure target tokens/s, sentences/s, latency and peak memory per backend of MODEL_DIRS.

    One MODEL_DIR without --compare: in-process, backend after backend. Several (e.g. the
    fp32 and int8 exports of one checkpoint) or --compare: one table over every engine and
    precision, measured alternately in fresh subprocesses, plus batch-1 latency (ms/sentence).
    """
    o: BenchOptions = pick(BenchOptions, values).validate()
    if o.json_out:
        refuse_overwriting_inputs([p for p in (o.src, o.serve_input, *o.whole_process) if p], [o.json_out],
                                  "--json file", input_dirs=list(model_dirs))
        check_output_file(o.json_out, "--json")
    LoadOptions(threads=threads, parallel_batches=parallel_batches).validate()  # before anything is measured
    _one_mode(ctx, o)
    o = _used(ctx, o, len(model_dirs), step is not None or steps_per_replay is not None)
    aside = str(o.json_out) == "-"  # the table on standard error: standard output holds the JSON alone
    for name, value in (("--step", step), ("--steps-per-replay", steps_per_replay)):
        if value is not None and (o.whole_process or o.serve_input is not None or len(model_dirs) > 1 or o.compare):
            raise UserError(f"{name} {value} is measured in-process, with one MODEL_DIR and --backends torch; leave "
                            "out --whole-process, --serve, --compare and other MODEL_DIRs")
    rules = decoding.rules if "rules" in decoding.given() else None
    if rules and not o.whole_process and (o.serve_input is not None or len(model_dirs) > 1 or o.compare):
        raise UserError("--rules is measured in-process (one MODEL_DIR) and with --whole-process; leave it out of "
                        "runs of several MODEL_DIRs, --serve and --compare")
    # one batch at a time in-process unless told; with --whole-process, what serve-batch does by default
    batches = parallel_batches or (default_parallel_batches(threads or 2) if o.whole_process else 1)
    if o.whole_process:
        report = run_whole_process(list(model_dirs), list(o.whole_process), compare=list(o.compare),
                                   threads=threads or 2, beam_size=_beam(decoding, model_dirs[0]),
                                   fixed_length=o.fixed_length, rounds=o.rounds, shortlist=shortlist,
                                   src_lang=src_lang, tgt_lang=tgt_lang, min_agreement=o.min_agreement,
                                   parallel_batches=batches, rules=rules)
        click.echo(format_whole_process(report), err=aside)
    elif o.serve_input is not None:
        serve_bench = pick(ServeBenchOptions, values)
        default_backends = ctx.get_parameter_source("backends") is click.core.ParameterSource.DEFAULT
        chosen = ["auto"] if default_backends else parse_backends(o.backends)
        if len(chosen) != 1 or len(model_dirs) != 1 or o.compare:
            raise UserError("--serve measures one MODEL_DIR on one backend (e.g. --backends onnxruntime), "
                            "without --compare")
        if src_lang or tgt_lang:
            raise UserError("--serve does not take --src-lang/--tgt-lang yet; bench a multilingual model in-process "
                            "(leave out --serve) or with --whole-process")
        if shortlist or batches > 1:
            raise UserError("--serve does not measure --shortlist or --parallel-batches yet; bench them in-process "
                            "(leave out --serve)")
        report = run_serve_bench(str(model_dirs[0]), str(o.serve_input), chosen[0], threads,
                                 _beam(decoding, model_dirs[0]), serve_bench)
        click.echo(format_serve_bench(report), err=aside)
    elif len(model_dirs) == 1 and not o.compare:
        names = installed_backends(ctx, parse_backends(o.backends))  # a deploy install: the exported graphs
        report = run_bench(model_dirs[0], names, list(o.batch_sizes), decoding=decoding,
                           fixed_length=o.fixed_length, src=o.src, sentences=o.sentences, src_len=o.src_len,
                           device=device, threads=threads, shortlist=shortlist, src_lang=src_lang,
                           tgt_lang=tgt_lang, step=step, steps_per_replay=steps_per_replay,
                           parallel_batches=batches)
        click.echo(format_table(report), err=aside)
    else:
        report = run_comparison(list(model_dirs), parse_backends(o.backends), list(o.batch_sizes),
                                compare=list(o.compare), beam_size=_beam(decoding, model_dirs[0]),
                                fixed_length=o.fixed_length,
                                src=o.src, sentences=o.sentences, src_len=o.src_len, device=device, threads=threads,
                                rounds=o.rounds, shortlist=shortlist, src_lang=src_lang, tgt_lang=tgt_lang,
                                min_agreement=o.min_agreement, parallel_batches=batches)
        click.echo(format_comparison(report), err=aside)
    if o.json_out:
        write_json(report, o.json_out)


def _beam(decoding: DecodingOptions, model_dir: Path) -> int:
    """--beam-size where given, else the model dir's default (an export's --beam-size 2): the subprocess modes ran
    the paper's 4 while the report recorded the model's decoding."""
    if "beam_size" in decoding.given():
        return decoding.beam_size
    opened = ModelDir.open(model_dir, verify=False)  # each measured process verifies it
    return decoding.for_model(opened.decoding_defaults, str(opened.path / "manifest.json")).beam_size


def _one_mode(ctx: click.Context, o: BenchOptions) -> None:
    """Options a mode would leave out in silence are refused: --serve with --whole-process (two measurements),
    --fixed-length with --serve (it translates the file's lines as given), --serve's own options without it."""
    if o.whole_process and o.serve_input is not None:
        raise UserError("--whole-process and --serve are two measurements; run them apart")
    if o.serve_input is not None and o.fixed_length is not None:
        raise UserError("--fixed-length is measured in-process and with --whole-process; --serve translates INPUT's "
                        "lines as they are")
    given = [f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(ServeBenchOptions)
             if ctx.get_parameter_source(f.name) in (click.core.ParameterSource.COMMANDLINE,
                                                     click.core.ParameterSource.ENVIRONMENT)]
    if o.serve_input is None and given:
        raise UserError(f"{', '.join(given)}: only with --serve INPUT (the HTTP server's benchmark)")
    flags = {p.name: p.opts[0] for p in ctx.command.params}  # what the other modes take and these do not use
    for mode, on, unused in (("--whole-process", bool(o.whole_process), IN_PROCESS + ("backends",)),
                             ("--serve", o.serve_input is not None, IN_PROCESS + ("rounds",))):
        named = [flags[n] for n in unused if ctx.get_parameter_source(n) in (
            click.core.ParameterSource.COMMANDLINE, click.core.ParameterSource.ENVIRONMENT)]
        if on and named:  # --device cuda was ignored: the measured processes chose their own device
            raise UserError(f"{', '.join(named)}: not used by {mode}, which runs `pipeline "
                            f"{'serve-batch' if mode == '--whole-process' else 'serve'}` on its file as a user would "
                            "(on the device it picks itself); leave them out")


def _used(ctx: click.Context, o: BenchOptions, dirs: int, step: bool) -> BenchOptions:
    """Options the chosen measurement would ignore in silence, refused: --rounds and --min-agreement in-process
    (one run, no CTranslate2), --min-agreement without --compare, --step for no torch row, and a --batch-size
    above --sentences (the row said the batch it ran, 4, beside another of the same). The default batch is
    --sentences where they are fewer."""
    def given(name: str) -> bool:
        return ctx.get_parameter_source(name) in (click.core.ParameterSource.COMMANDLINE,
                                                  click.core.ParameterSource.ENVIRONMENT)
    in_process = dirs == 1 and not o.compare and not o.whole_process and o.serve_input is None
    if in_process and given("rounds"):
        raise UserError(f"--rounds {o.rounds}: one MODEL_DIR without --compare is measured once, in-process; give "
                        "several MODEL_DIRs or --compare for alternating rounds")
    if not o.compare and given("min_agreement"):
        raise UserError("--min-agreement checks CTranslate2's output against ours: only with --compare ctranslate2")
    if in_process and step and "torch" not in parse_backends(o.backends):
        raise UserError("--step and --steps-per-replay choose the torch backend's decoder step: add torch to "
                        "--backends")
    over = [b for b in o.batch_sizes if b > o.sentences]
    if over and o.serve_input is None and not o.whole_process:
        if not given("batch_sizes"):
            return dataclasses.replace(o, batch_sizes=tuple(sorted({min(b, o.sentences) for b in o.batch_sizes})))
        raise UserError(f"--batch-size {over[0]} is more than the {o.sentences} sentences measured: the row would be "
                        f"of batch {o.sentences}; give --sentences {over[0]} or more")
    return o


# the in-process measurement's own options: its sources, batches and device
IN_PROCESS = ("device", "batch_sizes", "src", "sentences", "src_len")
