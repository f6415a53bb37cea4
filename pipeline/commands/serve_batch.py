"""`pipeline serve-batch`: the click command; the work is in pipeline/serve_batch/files.py."""

from __future__ import annotations

import dataclasses
import logging

import click

from pipeline.cli_options import decoding_options
from pipeline.distributed import dist_context, rank_device
from pipeline.serve_batch.files import ServeOptions, check_outputs, output_paths, serve_files
from runtime.decoding import DecodingOptions
from runtime.model_dir import LoadOptions, load
from runtime.registry import BACKENDS
from runtime.sentences import DEFAULT_LANG, SPLIT_MODES

log = logging.getLogger(__name__)

# the help of every command's --shortlist (serve, bench and parity add what it means for them)
SHORTLIST_HELP = ("Decode over the model dir's vocabulary shortlist (export --shortlist-src/--shortlist-tgt): "
                  "faster on large vocabularies, but a sentence's output may depend on the sentences batched "
                  "with it. On torch and onnxruntime only; see docs/shortlist.md.")


@click.command("serve-batch")
@click.argument("model_dir", type=click.Path(file_okay=False))
@click.argument("inputs", metavar="INPUT...", nargs=-1, required=True)
@click.option("-o", "--output", metavar="FILE",
              help="Write the translation of the single INPUT here ('-' = stdout).")
@click.option("--output-dir", metavar="DIR",
              help="Write each INPUT's translation to DIR/<input file name> (a .gz suffix is dropped).")
@click.option("--backend", type=click.Choice(BACKENDS), default="auto", show_default=True,
              help="auto: tensorrt if the engines, TensorRT and a GPU are present, else onnxruntime "
                   "if installed, else torch.")
@click.option("--device", default=None, metavar="DEV",
              help="cpu, cuda or cuda:N [default: cuda when available, else cpu; under torchrun "
                   "each rank takes cuda:LOCAL_RANK].")
@click.option("--dtype", type=click.Choice(["fp32", "fp16"]), default=None,
              help="Torch backend precision [default: the model dir's; fp16 only on GPU].")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="Intra-op threads of torch / onnxruntime [default: all cores].")
@click.option("--shortlist", is_flag=True, default=False, help=SHORTLIST_HELP)
@decoding_options(notes={"nbest": "With N > 1 each output line holds the N best as 'text ||| score' "
                                    "joined by ' ||| ', best first (still one line per input line)."})
@click.option("--window", type=click.IntRange(min=1), default=10000, show_default=True,
              help="Lines read, sorted by length and translated at a time (bounds memory).")
@click.option("--long-lines", type=click.Choice(["truncate", "error"]), default="truncate",
              show_default=True,
              help="Lines longer than the model's source limit: truncate them (counted warning) or stop "
                   "with an error naming the line.")
@click.option("--invalid-utf8", type=click.Choice(["error", "replace"]), default="error",
              show_default=True,
              help="Invalid UTF-8: stop with an error naming file and line, or replace the bad bytes "
                   "with U+FFFD (counted warning).")
@click.option("--split", type=click.Choice(SPLIT_MODES), default="none", show_default=True,
              help="sentences: each line is a document, translated sentence by sentence and rebuilt with the "
                   "whitespace it had between them (as `pipeline serve` does for \"split\": \"sentences\").")
@click.option("--lang", default=DEFAULT_LANG, show_default=True, metavar="CODE",
              help="The input's language (ISO 639, e.g. de), for --split sentences' rules.")
@click.option("--progress/--no-progress", default=True, show_default=True,
              help="Show a progress bar on stderr (only on a terminal).")
def serve_batch(model_dir: str, inputs: tuple[str, ...], output: str | None, output_dir: str | None,
                backend: str, device: str | None, dtype: str | None, threads: int | None, shortlist: bool,
                decoding: DecodingOptions, window: int, long_lines: str, invalid_utf8: str, split: str, lang: str,
                progress: bool) -> None:
    """Translate INPUT files ('-' = stdin) with the model in MODEL_DIR, line-aligned.

    Streams windows of lines, sorts them by length into dense batches, and writes each
    output atomically. Launch under `torchrun --nproc-per-node N -m pipeline serve-batch ...`
    to split the work over N processes / GPUs; the output stays complete and in order.
    Ends with a summary line on stderr.
    """
    opts = ServeOptions(window=window, long_lines=long_lines, invalid_utf8=invalid_utf8, decoding=decoding,
                        split=split, lang=lang).validate()
    outputs = output_paths(list(inputs), output, output_dir)
    check_outputs(list(inputs), outputs, "--output" if output is not None else "--output-dir")
    # SIGTERM (kill, torchrun stopping the other ranks) unwinds like Ctrl-C (pipeline.cli),
    # so temp outputs are removed instead of being left behind by an abrupt exit.
    with dist_context(None, backend="gloo") as ctx:
        # the decoding: an imported model's own defaults (num_beams, max_length, ...) for the options not
        # given, and on a GPU a larger batch budget unless given (runtime/model_dir.py load)
        loaded = load(model_dir, LoadOptions(backend=backend, device=rank_device(ctx, device), threads=threads,
                                             precision=dtype, shortlist=shortlist), decoding)
        impl, tokenizer = loaded.backend, loaded.tokenizer
        opts = dataclasses.replace(opts, decoding=loaded.decoding).validate()
        if opts.decoding.batch_tokens != decoding.batch_tokens:
            log.info("batch budget %d on %s (--batch-tokens sets another)", opts.decoding.batch_tokens, impl.device)
        stats = serve_files(impl, tokenizer, list(inputs), outputs, opts, ctx, progress)
    if ctx.is_main:
        where = str(impl.device) if ctx.world_size == 1 else f"{ctx.world_size} ranks, rank 0 on {impl.device}"
        shortlisted = " with shortlist" if getattr(impl, "shortlist", None) is not None else ""
        click.echo(stats.summary(impl.name + shortlisted, where), err=True)
