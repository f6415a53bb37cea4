"""`pipeline serve-batch`: translate text files, streaming, line-aligned, atomically.

Each input is read a window of lines at a time (memory stays bounded on any file size);
the window is tokenized, sorted by length into dense batches (runtime.translate),
translated, put back in input order and written. Output goes to a temp file renamed
into place at the end, so an interrupted run never leaves a truncated translation.

Bad input never shifts lines: empty or whitespace-only lines give empty lines; lines
longer than the model's source limit are truncated (counted) or refused; invalid UTF-8
is refused with file:line or replaced (counted).

`translate_windows` is the serving path itself (pipeline/serve_batch/translation.py reads and formats);
parity runs every backend through it, so it measures exactly what serve-batch writes.

Under torchrun (WORLD_SIZE > 1) rank 0 reads and tokenizes each window, every rank
translates lines i % world == rank on its own device, and rank 0 gathers the results
and writes them in input order.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from model.atomic import remove_stale_temps
from model.errors import UserError
from pipeline.distributed import DistContext, on_main
from pipeline.serve_batch.translation import (
    ServeBatchOptions,
    TranslatedWindow,
    finish_window,
    read_windows,
)
from pipeline.textio import atomic_output, check_input, check_output_file, open_binary, refuse_overwriting_inputs
from runtime import languages
from runtime.backend import Backend
from runtime.decoding import DecodingOptions
from runtime.glossary import Glossary
from runtime.glossary_file import open_glossary
from runtime.languages import ONE_PAIR, Direction, folded_spellings, language_suffix, spelled
from runtime.model_dir import ModelDir
from runtime.tokenizer import AnyTokenizer, word_continuations
from runtime.translate import NBest, translate_ids

log = logging.getLogger(__name__)

ONE_PROCESS = DistContext()  # the default: no torchrun

@dataclass
class ServeStats:
    sentences: int = 0
    empty: int = 0
    truncated: int = 0
    pieced: int = 0
    replaced: int = 0
    min_len_over: int = 0
    stopped_at_limit: int = 0
    terms: int = 0  # --glossary: terms found in the input, and those the translations hold
    terms_applied: int = 0
    src_tokens: int = 0
    tgt_tokens: int = 0
    seconds: float = 0.0

    def add(self, other: ServeStats) -> None:
        for name in ("sentences", "empty", "truncated", "pieced", "replaced", "min_len_over", "stopped_at_limit",
                     "terms", "terms_applied", "src_tokens", "tgt_tokens", "seconds"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def count(self, window: TranslatedWindow) -> None:
        self.sentences += sum(1 for s in window.sources if s)  # sent to the model: not blank lines or copied ones
        self.empty += window.empty
        self.truncated += window.truncated
        self.pieced += window.pieced
        self.replaced += window.replaced
        self.min_len_over += window.min_len_over
        self.stopped_at_limit += window.stopped_at_limit
        self.terms += window.terms
        self.terms_applied += window.terms_applied
        self.src_tokens += window.src_tokens
        self.tgt_tokens += window.tgt_tokens

    def summary(self, backend: str, device: str) -> str:
        rate = self.tgt_tokens / self.seconds if self.seconds > 0 else 0.0
        return (f"translated {self.sentences} sentences ({self.src_tokens} source tokens, "
                f"{self.tgt_tokens} target tokens) in {self.seconds:.3f} s: {rate:.1f} target tokens/s; "
                f"backend {backend}, device {device}")


# -- translating --------------------------------------------------------------------------


def _translate_share(backend: Backend, ids: list[list[int]], ctx: DistContext, decoding: DecodingOptions,
                     direction: Direction = ONE_PAIR, on_batch: Callable[[int], None] | None = None,
                     constraints: list[list[list[int]]] | None = None, joins: Any = None) -> list[NBest]:
    """This rank's lines of the window (i % size == rank), as (tokens, score) per hypothesis; constraints (a
    glossary's terms) per line of the window, joins as runtime.translate's translate_ids."""
    share = ids[ctx.rank::ctx.world_size]
    mine = None if constraints is None else constraints[ctx.rank::ctx.world_size]
    hyps = translate_ids(backend, share, decoding, direction.first_tokens(len(share)), on_batch, mine, joins)
    return [[(h.tokens, h.score) for h in nbest] for nbest in hyps]


def _gather(share: list[Any], ctx: DistContext, n_lines: int) -> list[Any] | None:
    """All ranks' shares interleaved back into input order, on rank 0 (None elsewhere)."""
    shares = ctx.gather(share)
    if shares is None:
        return None
    merged: list[Any] = [None] * n_lines
    for rank, part in enumerate(shares):
        merged[rank::ctx.world_size] = part
    return merged


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(desc: str, enabled: bool, total: int | None = None) -> Any:
    """A tqdm bar of translated lines (with a total and an ETA when it is known), only on a terminal: a log
    or a pipe gets no carriage-return redraws, and tqdm (30 ms of start-up) is imported only when a bar is
    shown."""
    if not (enabled and sys.stderr.isatty()):
        return _NoBar()
    from tqdm import tqdm

    return tqdm(desc=desc, unit=" lines", leave=False, total=total)


def count_lines(path: str) -> int | None:
    """The lines of a plain file (a fast count of its line breaks, before the bar starts), for the bar's total
    and ETA; None for stdin and .gz (counting would decompress it all), a file that cannot be read, and anything
    but a regular file (a pipe, <(...), /dev/stdin: counting would read away what is to be translated)."""
    if path == "-" or path.endswith(".gz") or not os.path.isfile(path):
        return None
    lines, last = 0, b"\n"
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                lines += chunk.count(b"\n")
                last = chunk[-1:]
    except OSError:
        return None
    return lines + (last != b"\n")


class _Advance:
    """The bar, in input lines, moved batch by batch through a window of `units` (its lines, or with --split or
    --format html its sentences): this rank's batches stand for every rank's (about the same share), and the
    window's end brings it to the window's lines whatever the batches said."""

    def __init__(self, bar: Any, lines: int, units: int, world_size: int):
        self.bar, self.lines, self.units, self.world_size = bar, lines, max(units, 1), world_size
        self.counted = self.done = 0

    def __call__(self, n: int) -> None:
        self.done += n * self.world_size
        step = min(self.lines, self.done * self.lines // self.units) - self.counted
        self.counted += step
        self.bar.update(step)

    def finish(self) -> None:
        self.bar.update(self.lines - self.counted)
        self.counted = self.lines


def translate_windows(backend: Backend, tokenizer: AnyTokenizer, input_path: str, opts: ServeBatchOptions,
                      ctx: DistContext = ONE_PROCESS, progress: bool = False, glossary: Glossary | None = None
                      ) -> Iterator[TranslatedWindow]:
    """The serving path: each window of `input_path` read, encoded (with `glossary`: opts.glossary opened once
    per run, on rank 0, by open_glossary), translated (split over the ranks) and formatted, in input order.
    Rank 0 gets every window; other ranks only do their share and get nothing. serve-batch writes these;
    parity measures them."""
    direction = languages.direction(backend.cfg, opts.src_lang, opts.tgt_lang)
    if direction.same and ctx.is_main:
        log.info("%s: %s", input_path, languages.same_language_notice(str(direction.source)))
    windows = read_windows(input_path, tokenizer, backend.max_src_len, opts, direction,
                           glossary) if ctx.is_main else None
    shown = progress and ctx.is_main and sys.stderr.isatty()
    bar = progress_bar(Path(input_path).name if input_path != "-" else "stdin", shown,
                       count_lines(input_path) if shown else None)
    try:
        while True:
            window = on_main(ctx, lambda: next(windows, None))  # type: ignore[arg-type]
            if window is None:
                return
            advance = _Advance(bar, len(window.encoded.spans), len(window.ids), ctx.world_size)
            share = _translate_share(backend, window.ids, ctx, opts.decoding, direction, advance if shown else None,
                                     window.encoded.constraints,
                                     None if window.encoded.constraints is None else word_continuations(tokenizer))
            merged = _gather(share, ctx, len(window.ids))
            if merged is None:
                continue
            done = finish_window(tokenizer, window, merged, opts.decoding.nbest)
            done.min_len_over = window.encoded.min_len_over(opts.decoding, backend.max_tgt_len)
            done.stopped_at_limit = window.encoded.stopped_at_limit(merged, opts.decoding, backend.max_tgt_len)
            yield done
            advance.finish()
    finally:
        bar.close()


def translate_stream(backend: Backend, tokenizer: AnyTokenizer, input_path: str, out: IO[str] | None,
                     opts: ServeBatchOptions, ctx: DistContext = ONE_PROCESS, progress: bool = True,
                     glossary: Glossary | None = None) -> ServeStats:
    """Translate one input into `out` (rank 0; None on other ranks), window by window."""
    stats = ServeStats()
    started = time.perf_counter()
    progress = progress and not (out is not None and out.isatty())  # the bar drew over the lines on a terminal
    for window in translate_windows(backend, tokenizer, input_path, opts, ctx, progress, glossary):
        out.write("".join(line + "\n" for line in window.lines))  # type: ignore[union-attr]
        stats.count(window)
    stats.seconds = time.perf_counter() - started
    return stats


# -- files ----------------------------------------------------------------------------------



def output_name(name: str, suffix: str | None = None) -> str:
    """An input's output name in --output-dir: a trailing .gz dropped (the output is plain text), and with
    `suffix` (".en") the input's language suffix replaced by it (part-000.de -> part-000.en), or added where
    it has none (part-000 -> part-000.en)."""
    name = name[:-3] if name.endswith(".gz") and name != ".gz" else name  # a file named .gz keeps its name
    if not suffix:
        return name
    stem, dot, last = name.rpartition(".")
    language = language_suffix(last)
    return stem + suffix if dot and stem and language else name + suffix


def target_suffix(given: str | None, model_dir: str, tgt_lang: str | None) -> str | None:
    """--suffix, else "." + the target language when it is known (--tgt-lang, or the pair the model dir's
    manifest records), else None (outputs keep the input's name)."""
    if given is not None:
        if "/" in given or os.sep in given or ".." in given.strip("."):
            raise UserError(f"--suffix {given!r}: a file name ending like .en, without a path (it would write "
                            "outside --output-dir)")
        body = given.removeprefix(".")
        if given and (not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_+-]*(\.[A-Za-z0-9][A-Za-z0-9_+-]*)*", body)):
            raise UserError(f"--suffix {given!r}: an ending like .en, .de.txt or .pt-BR (letters, digits, '_', '-' "
                            "between dots); '..', a space or a lone '-' named files 'x..' or 'x. '")
        return given if given.startswith(".") or not given else "." + given
    try:
        languages = ModelDir.open(model_dir, verify=False).manifest.languages
    except (UserError, OSError, ValueError):  # loading the model dir says what is wrong with it, in one line
        languages = None
    if tgt_lang:  # as the model spells it, in any case it is given (EN: .en, as ray-translate names it)
        return "." + spelled(tgt_lang, folded_spellings(languages.target if languages is not None else ()))
    return "." + languages.target[0] if languages is not None and len(languages.target) == 1 else None


def output_paths(inputs: list[str], output: str | None, output_dir: str | None, suffix: str | None = None
                 ) -> list[str]:
    """Where each input's translation goes: --output FILE for one input, or
    DIR/<input name> (output_name: .gz dropped, the language suffix made the target's)."""
    if (output is None) == (output_dir is None):
        raise UserError("give exactly one of --output FILE or --output-dir DIR")
    if output is not None:
        if len(inputs) != 1:
            raise UserError(f"--output takes one input, got {len(inputs)}; use --output-dir DIR")
        return [output]
    assert output_dir is not None
    paths = []
    for inp in inputs:
        if inp == "-":
            raise UserError("input '-' (stdin) has no name for --output-dir; use --output FILE or '-'")
        if str(Path(inp).parent) in ("/dev/fd", "/proc/self/fd"):  # <(...): its translation was written as "62"
            raise UserError(f"input {inp} (a pipe: `<(...)`) has no name for --output-dir; translate it with "
                            "--output FILE")
        paths.append(str(Path(output_dir) / output_name(Path(inp).name, suffix)))
    seen: dict[str, str] = {}
    for inp, path in zip(inputs, paths):
        if path in seen:  # the same name, or names the suffix makes one (y and y.en with --suffix .en)
            raise UserError(f"{seen[path]} and {inp} would both be written to {path}, one over the other; "
                            "translate them in separate runs")
        seen[path] = inp
    return paths


def check_outputs(inputs: list[str], outputs: list[str], option: str = "--output", model_dir: str | None = None
                  ) -> None:
    """Everything that would make writing the outputs fail or destroy data (an input, a file of the model dir),
    checked before the model is loaded or a line is read; then the temps a killed run left beside the outputs
    are removed."""
    refuse_overwriting_inputs(list(inputs), list(outputs), input_dirs=[model_dir] if model_dir else [])
    probed: set[Path] = set()
    for out in outputs:
        check_output_file(out, option, probed=probed)
    for parent in dict.fromkeys(Path(out).parent for out in outputs if out != "-"):  # each dir once (per output:
        remove_stale_temps(parent)  # 6,000 outputs into a dir of 6,000 files scanned it 6,000 times, a minute)


def serve_files(backend: Backend, tokenizer: AnyTokenizer, inputs: list[str], outputs: list[str],
                opts: ServeBatchOptions, ctx: DistContext = ONE_PROCESS, progress: bool = True) -> ServeStats:
    """Translate every input to its output; each output appears complete or not at all. The glossary is read
    once, before any input (a pipe given as --glossary serves every input)."""
    total = ServeStats()
    # rank 0 reads it (and says a bad one on every rank: under torchrun the others' traceback buried its line)
    glossary = on_main(ctx, lambda: open_glossary(opts.glossary, tokenizer, backend), share=False)
    for done, (inp, outp) in enumerate(zip(inputs, outputs)):
        try:
            if inp != "-" and os.path.isfile(inp):  # a pipe is opened once, by its reader (its writer could fail)
                open_binary(inp).close()  # a missing or unreadable input fails on every rank, before any output
            elif inp != "-":
                check_input(inp)
            if ctx.is_main:
                with atomic_output(outp, "w") as out:
                    stats = translate_stream(backend, tokenizer, inp, out, opts, ctx, progress, glossary)
            else:
                stats = translate_stream(backend, tokenizer, inp, None, opts, ctx, progress)
        except BaseException:  # which outputs are whole: the error (or Ctrl-C) alone said nothing of them
            if done and ctx.is_main:
                log.warning("%d of %d inputs were translated, their outputs complete (the last: %s); %s and the "
                            "rest were not", done, len(inputs), outputs[done - 1], inp)
            raise
        total.add(stats)
        _warn(stats, inp, opts.decoding, bool(opts.glossary) and ctx.is_main)  # (rank 0 counts the terms)
    return total


def _warn(stats: ServeStats, path: str, decoding: DecodingOptions, glossary: bool = False) -> None:
    if stats.truncated:
        log.warning("%s: %d line(s) longer than the model's source limit were truncated "
                    "(--long-lines error refuses them)", path, stats.truncated)
    if stats.pieced:  # every word translated, but a sentence in pieces: said, as a truncation is
        log.warning("%s: %d line(s) held a sentence longer than the model's source limit, translated in pieces that "
                    "fit (--long-lines error refuses them)", path, stats.pieced)
    if stats.replaced:
        log.warning("%s: %d line(s) had invalid UTF-8 or a NUL byte, replaced by U+FFFD", path, stats.replaced)
    if stats.terms or glossary:  # none found is said too: a glossary of another language, a mistyped term
        (log.info if stats.terms_applied == stats.terms and stats.terms else log.warning)(
            "%s: the glossary's terms: %d found in the input, %d of them in the translations", path, stats.terms,
            stats.terms_applied)
    warn_min_len(stats.min_len_over, path, decoding)
    warn_stopped_at_limit(stats.stopped_at_limit, path)


def warn_stopped_at_limit(lines: int, path: str) -> None:
    """Say how many lines' translations the model's target positions cut (export --max-tgt-len)."""
    if lines:
        log.warning("%s: %d line(s) were translated up to the model's target limit (export --max-tgt-len) and "
                    "stopped there: their translations may be cut", path, lines)


def warn_min_len(lines: int, path: str, decoding: DecodingOptions) -> None:
    """Say how many lines --min-len cannot hold for (min_len_over), as serve-batch and parity translate them."""
    if lines:
        log.warning("%s: %d line(s) have a maximum output length (%g x source tokens + %d, and at most the model's "
                    "target limit) below --min-len %d; they stop at that maximum", path, lines, decoding.max_len_a,
                    decoding.max_len_b, decoding.min_len)
