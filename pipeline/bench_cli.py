"""`pipeline bench` command."""

from __future__ import annotations

from pathlib import Path

import click

from pipeline.bench import format_table, run_bench, write_json
from pipeline.cli_options import decoding_options
from pipeline.parity_cli import parse_backends
from pipeline.textio import check_output_file, refuse_overwriting_inputs
from runtime.decoding import DecodingOptions
from runtime.loader import backend_names


@click.command("bench")
@click.argument("model_dir", type=click.Path(path_type=Path))
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
@click.option("--device", default=None, help="cpu or cuda (default: best available).")
@click.option("--threads", default=None, type=click.IntRange(1), help="CPU threads per backend.")
@click.option("--json", "json_out", default=None, type=click.Path(path_type=Path), help="Write results as JSON.")
def bench(model_dir: Path, backends: str, batch_sizes: tuple[int, ...], decoding: DecodingOptions,
          fixed_length: int | None, src: Path | None, sentences: int, src_len: int, device: str | None,
          threads: int | None, json_out: Path | None) -> None:
    """Measure target tokens/s, sentences/s, latency per batch and peak memory per backend."""
    if json_out:
        refuse_overwriting_inputs([src] if src else [], [json_out], "--json file")
        check_output_file(json_out, "--json")
    report = run_bench(model_dir, parse_backends(backends), list(batch_sizes), decoding=decoding,
                       fixed_length=fixed_length, src=src, sentences=sentences, src_len=src_len,
                       device=device, threads=threads)
    click.echo(format_table(report))
    if json_out:
        write_json(report, json_out)
