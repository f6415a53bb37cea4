"""`pipeline bench` command."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from model.errors import UserError
from pipeline.cli_options import decoding_options, options_from, parse_backends, pick
from pipeline.evaluation.bench import format_table, run_bench, write_json
from pipeline.evaluation.bench_compare import format_comparison, run_comparison
from pipeline.evaluation.serve_bench import ServeBenchOptions, format_serve_bench, run_serve_bench
from pipeline.evaluation.whole_process import format_whole_process, run_whole_process
from pipeline.serve_batch.translation import ServeBatchOptions
from pipeline.textio import check_output_file, refuse_overwriting_inputs
from runtime.decoding import DecodingOptions
from runtime.model_dir import LoadOptions
from runtime.registry import backend_names


@click.command("bench")
@click.argument("model_dirs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--backends", default="torch,onnxruntime", show_default=True,
              help="Comma-separated backends to measure (" + ",".join(backend_names()) + ").")
@click.option("--batch-size", "batch_sizes", multiple=True, type=click.IntRange(1), default=(32,),
              show_default=True, help="Sentences per batch; repeat the option to measure several.")
@decoding_options("beam_size")
@click.option("--fixed-length", default=None, type=click.IntRange(1),
              help="Force exactly N output tokens per sentence, for fair comparisons across models.")
@click.option("--src", default=None, type=click.Path(path_type=Path),
              help="Source sentences to translate (cycled); default: random pieces of --src-len tokens.")
@click.option("--sentences", default=256, show_default=True, type=click.IntRange(1),
              help="Sentences per measurement.")
@click.option("--src-len", default=20, show_default=True, type=click.IntRange(2),
              help="Length of generated source sentences (tokens, EOS included) when --src is not given.")
@options_from(LoadOptions, skip=("backend", "precision"), notes={"shortlist": (
    "Here: every engine of ours, in every mode but --serve (CTranslate2 is unchanged); its rows record "
    "\"shortlist\": true and show vocab 'shortlist'.")})
@click.option("--compare", "compare", multiple=True, type=click.Choice(["ctranslate2"]),
              help="Also map the first MODEL_DIR's weights into this engine (after checking its greedy "
                   "output is token-identical to ours) and time it in float32 and int8, with ratio "
                   "columns. Needs the bench extra: pip install -e .[bench].")
@click.option("--min-agreement", default=1.0, show_default=True, type=click.FloatRange(0.0, 1.0),
              help="With --compare ctranslate2: least share of check sentences whose greedy output must be "
                   "token-identical in both engines before anything is timed (the share is reported either way). "
                   "Lower it only for random weights, whose near-ties the two engines' arithmetic may break apart.")
@options_from(ServeBatchOptions, only=("src_lang", "tgt_lang"))
@click.option("--rounds", default=3, show_default=True, type=click.IntRange(1),
              help="With several MODEL_DIRs or --compare: alternating rounds, each measurement in a fresh "
                   "subprocess (honest peak RSS per engine); rows report medians.")
@click.option("--serve", "serve_input", default=None, metavar="INPUT",
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Instead: load `pipeline serve` (started on a free 127.0.0.1 port with the first MODEL_DIR "
                   "and backend) with INPUT's lines from --concurrency clients, and compare sentences/s and "
                   "p50/p99 latency with serve-batch on the same lines. Bounded in requests and seconds.")
@options_from(ServeBenchOptions)
@click.option("--whole-process", "whole_process", multiple=True, metavar="FILE",
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Instead: time what a user waits for, translating FILE (repeatable) start to exit in a fresh "
                   "process per run: `pipeline serve-batch --backend onnxruntime` for each MODEL_DIR and, with "
                   "--compare ctranslate2, a CTranslate2 script on the same weights; wall time and peak RSS, "
                   "--rounds alternating rounds, --threads threads (default 2).")
@click.option("--json", "json_out", default=None, type=click.Path(path_type=Path), help="Write results as JSON.")
@click.pass_context
def bench(ctx: click.Context, model_dirs: tuple[Path, ...], backends: str, batch_sizes: tuple[int, ...],
          decoding: DecodingOptions, fixed_length: int | None, src: Path | None, sentences: int, src_len: int,
          device: str | None, threads: int | None, json_out: Path | None, shortlist: bool = False,
          compare: tuple[str, ...] = (), rounds: int = 3, serve_input: Path | None = None,
          whole_process: tuple[Path, ...] = (), min_agreement: float = 1.0, src_lang: str | None = None,
          tgt_lang: str | None = None, step: str | None = None, parallel_batches: int = 1,
          **serve_options: Any) -> None:
    """Measure target tokens/s, sentences/s, latency and peak memory per backend of MODEL_DIRS.

    One MODEL_DIR without --compare: in-process, backend after backend. Several (e.g. the
    fp32 and int8 exports of one checkpoint) or --compare: one table over every engine and
    precision, measured alternately in fresh subprocesses, plus batch-1 latency (ms/sentence).
    """
    if json_out:
        refuse_overwriting_inputs([p for p in (src, serve_input, *whole_process) if p], [json_out], "--json file")
        check_output_file(json_out, "--json")
    LoadOptions(threads=threads, parallel_batches=parallel_batches).validate()  # before anything is measured
    if step is not None and (whole_process or serve_input is not None or len(model_dirs) > 1 or compare):
        raise UserError(f"--step {step} is measured in-process, with one MODEL_DIR and --backends torch; leave out "
                        "--whole-process, --serve and --compare")
    if whole_process:
        report = run_whole_process(list(model_dirs), list(whole_process), compare=list(compare),
                                   threads=threads or 2, beam_size=decoding.beam_size, fixed_length=fixed_length,
                                   rounds=rounds, shortlist=shortlist, src_lang=src_lang, tgt_lang=tgt_lang,
                                   min_agreement=min_agreement, parallel_batches=parallel_batches)
        click.echo(format_whole_process(report))
    elif serve_input is not None:
        serve_bench = pick(ServeBenchOptions, serve_options)
        default_backends = ctx.get_parameter_source("backends") is click.core.ParameterSource.DEFAULT
        chosen = ["auto"] if default_backends else parse_backends(backends)
        if len(chosen) != 1 or len(model_dirs) != 1 or compare:
            raise UserError("--serve measures one MODEL_DIR on one backend (e.g. --backends onnxruntime), "
                            "without --compare")
        if src_lang or tgt_lang:
            raise UserError("--serve does not take --src-lang/--tgt-lang yet; bench a multilingual model in-process "
                            "(leave out --serve) or with --whole-process")
        if shortlist or parallel_batches > 1:
            raise UserError("--serve does not measure --shortlist or --parallel-batches yet; bench them in-process "
                            "(leave out --serve)")
        report = run_serve_bench(str(model_dirs[0]), str(serve_input), chosen[0], threads, decoding.beam_size,
                                 serve_bench)
        click.echo(format_serve_bench(report))
    elif len(model_dirs) == 1 and not compare:
        report = run_bench(model_dirs[0], parse_backends(backends), list(batch_sizes), decoding=decoding,
                           fixed_length=fixed_length, src=src, sentences=sentences, src_len=src_len,
                           device=device, threads=threads, shortlist=shortlist, src_lang=src_lang,
                           tgt_lang=tgt_lang, step=step, parallel_batches=parallel_batches)
        click.echo(format_table(report))
    else:
        report = run_comparison(list(model_dirs), parse_backends(backends), list(batch_sizes),
                                compare=list(compare), beam_size=decoding.beam_size, fixed_length=fixed_length,
                                src=src, sentences=sentences, src_len=src_len, device=device, threads=threads,
                                rounds=rounds, shortlist=shortlist, src_lang=src_lang, tgt_lang=tgt_lang,
                                min_agreement=min_agreement, parallel_batches=parallel_batches)
        click.echo(format_comparison(report))
    if json_out:
        write_json(report, json_out)
