"""`pipeline serve-batch`: the click command; the work is in pipeline/serve_batch/files.py."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import click

from model.atomic import restore_replaced_dir
from model.errors import UserError
from model.manifest import refuse_unless_model_dir
from pipeline.cli_options import MODEL_DIR_KIND, GivenPath, decoding_options, options_from, pick
from pipeline.distributed import dist_context, rank_device
from pipeline.serve_batch.files import ServeBatchOptions, check_outputs, output_paths, serve_files, target_suffix
from pipeline.textio import check_input
from runtime.decoding import DecodingOptions
from runtime.languages import own_languages
from runtime.model_dir import LoadOptions, load

log = logging.getLogger(__name__)

@click.command("serve-batch")
@click.argument("model_dir", type=GivenPath(file_okay=False, kind=MODEL_DIR_KIND))
@click.argument("inputs", metavar="INPUT...", nargs=-1, required=True, type=GivenPath())
@click.option("-o", "--output", metavar="FILE",
              help="Write the translation of the single INPUT here ('-' = stdout).")
@click.option("--output-dir", metavar="DIR", type=GivenPath(file_okay=False),
              help="Write each INPUT's translation to DIR/<input file name> (a .gz suffix is dropped).")
@options_from(LoadOptions, notes={"device": "Under torchrun each rank takes cuda:LOCAL_RANK."})
@decoding_options(notes={"nbest": "With N > 1 each output line holds the N best as 'text ||| score' "
                                    "joined by ' ||| ', best first (still one line per input line)."})
@options_from(ServeBatchOptions)
@click.option("--suffix", metavar="SUFFIX", default=None,
              help="With --output-dir: the outputs' language suffix (.en: part-000.de -> part-000.en; added where "
                   "the input has none) [default: the target language, --tgt-lang or the one the model dir "
                   "records; else the input's name is kept].")
@click.option("--progress/--no-progress", default=True, show_default=True,
              help="Show a progress bar on stderr (only on a terminal).")
def serve_batch(model_dir: str, inputs: tuple[str, ...], output: str | None, output_dir: str | None,
                suffix: str | None, decoding: DecodingOptions, progress: bool, **fields: Any) -> None:
    """Translate INPUT files ('-' = stdin) with the model in MODEL_DIR, line-aligned.

    Streams windows of lines, sorts them by length into dense batches, and writes each
    output atomically. Launch under `torchrun --nproc-per-node N -m pipeline serve-batch ...`
    to split the work over N processes / GPUs; the output stays complete and in order.
    Ends with a summary line on stderr.
    """
    if suffix is not None and output is not None:
        raise UserError("--suffix names the outputs of --output-dir; --output names its file itself")
    options: LoadOptions = pick(LoadOptions, fields)
    opts = dataclasses.replace(pick(ServeBatchOptions, fields), decoding=decoding).validate()
    restore_replaced_dir(model_dir)  # as ModelDir.open does: a dir an interrupted `export --force` left swapped
    refuse_unless_model_dir(Path(model_dir))  # before the outputs are checked against it (an "input directory")
    outputs = output_paths(list(inputs), output, output_dir, target_suffix(suffix, model_dir, opts.tgt_lang)
                           if output_dir is not None else None)
    for inp in inputs:  # a missing input (or a closed stdin) is one line before the model is loaded, not after
        check_input(inp)
    # the glossary files are inputs too: an output naming one would replace it with translations
    check_outputs([*inputs, *opts.glossary], outputs, "--output" if output is not None else "--output-dir", model_dir)
    # SIGTERM (kill, torchrun stopping the other ranks) unwinds like Ctrl-C (pipeline.cli),
    # so temp outputs are removed instead of being left behind by an abrupt exit.
    with dist_context(None, backend="gloo") as ctx:
        # the decoding: an imported model's own defaults (num_beams, max_length, ...) for the options not
        # given, and on a GPU no cap on a batch's sentences unless given (runtime/model_dir.py load)
        # and files of many batches: two side by side on a CPU of 2 or more threads (--parallel-batches)
        loaded = load(model_dir, dataclasses.replace(options, device=rank_device(ctx, options.device),
                                                     many_batches=True), decoding)
        impl, tokenizer = loaded.backend, loaded.tokenizer
        manifest = loaded.manifest  # a one-pair model's own --src-lang/--tgt-lang name the outputs, nothing more
        source, target = own_languages(manifest.model_config, manifest.language_pair, opts.src_lang, opts.tgt_lang)
        # the sentence rules of the source as the model spells it (a one-pair model's own when dropped: the same)
        opts = dataclasses.replace(opts, decoding=loaded.decoding, src_lang=source, tgt_lang=target).validate()
        opts = opts.sentence_rules(manifest.language_pair)
        if opts.decoding.batch_sentences != decoding.batch_sentences:
            log.info("batches of up to %d tokens, no sentence cap on %s (--batch-sentences sets one)",
                     opts.decoding.batch_tokens, impl.device)
        stats = serve_files(impl, tokenizer, list(inputs), outputs, opts, ctx, progress)
    if ctx.is_main:
        where = str(impl.device) if ctx.world_size == 1 else f"{ctx.world_size} ranks, rank 0 on {impl.device}"
        where += f", up to {impl.parallel_batches} batches at once" if impl.parallel_batches > 1 else ""
        shortlisted = " with shortlist" if getattr(impl, "shortlist", None) is not None else ""
        click.echo(stats.summary(impl.name + shortlisted, where), err=True)
