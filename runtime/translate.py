"""Translate many sentences: sort by length, batch by a token budget, search, restore order.

Sorting by length makes batches dense (little padding, similar stopping times), and the
budget keeps each batch's work roughly constant whatever the sentence lengths.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from model.config import PAD_ID
from runtime.backend import Backend
from runtime.decoding import PAPER, DecodingOptions
from runtime.errors import RuntimeUserError
from runtime.search import Hypothesis, search
from runtime.tokenizer import AnyTokenizer

log = logging.getLogger(__name__)

LONG_LINE_POLICIES = ("truncate", "error")
NBEST_SEP = " ||| "

NBest = list[tuple[list[int], float]]  # one line's hypotheses as (tokens, score), best first; [] for blank


def pad_batch(sources: list[list[int]], pad_id: int = PAD_ID) -> np.ndarray:
    """(B, S) int64 right-padded with pad_id (the model's: backend.cfg.pad_id)."""
    width = max(len(s) for s in sources)
    out = np.full((len(sources), width), pad_id, dtype=np.int64)
    for i, s in enumerate(sources):
        out[i, : len(s)] = s
    return out


def length_batches(lengths: list[int], batch_tokens: int, beam_size: int,
                   max_batch: int | None = None) -> Iterator[list[int]]:
    """Indices of `lengths`, longest first, cut into batches whose padded source tokens
    times beam size (n_sentences x longest source x beam) stay within batch_tokens.

    That product is the size of the beam's cross-attention state, which is what the
    budget bounds; a single sentence always forms a batch even when it alone exceeds it.
    `max_batch` caps the number of sentences (engines built for a maximum batch)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batch: list[int] = []
    width = 0
    for i in order:
        new_width = max(width, lengths[i])
        too_big = batch and (len(batch) + 1) * new_width * beam_size > batch_tokens
        too_many = max_batch is not None and len(batch) >= max_batch
        if too_big or too_many:
            yield batch
            batch, new_width = [], lengths[i]
        batch.append(i)
        width = new_width
    if batch:
        yield batch


def translate_ids(backend: Backend, sources: list[list[int]], options: DecodingOptions = PAPER,
                  first_tokens: list[int] | None = None, on_batch: Callable[[int], None] | None = None,
                  constraints: list[list[list[int]]] | None = None, joins: np.ndarray | None = None,
                  workers: int | None = None, **changes: Any) -> list[list[Hypothesis]]:
    """Hypotheses (options.nbest, best first) for each source, in input order.
    first_tokens: per source, the token forced first (a multilingual model's target language; sources of
    different targets may share a batch). constraints: per source, the target token phrases its output must
    hold (a glossary's terms: runtime/glossary.py), [] for none; joins: each target piece's kind, which says
    what may not follow a completed phrase or precede its start (runtime/tokenizer.py word_continuations).

    `changes` override single fields of `options` (translate_ids(b, s, beam_size=2)). `on_batch(n)` is told
    each time n more sources are done (the empty ones at once, then each batch): a progress bar's steps.
    Each source is pieces + EOS, at most backend.max_src_len tokens (encode_sources). An
    empty source (a blank line) gets [] without touching the model. options.batch_tokens
    bounds n_sentences x longest source x beam per batch (see length_batches), options.batch_sentences
    (when not 0) the sentences a batch holds, as does the backend's max_batch.

    Sources with constraints are batched apart, decoded by constrained beam search (runtime/constrained.py)
    with its wider beam; the others are batched among themselves and decoded as without constraints.
    `workers`: batches decoded at once (decode_batches), the backend's parallel_batches unless given (1 where the
    caller runs several of these calls at once itself, as the HTTP server's batcher does).
    """
    options = options.replace(**changes) if changes else options
    options.validate()
    results: list[list[Hypothesis]] = [[] for _ in sources]
    todo = [i for i, s in enumerate(sources) if s]
    if constraints is not None and len(constraints) != len(sources):
        raise RuntimeUserError(f"constraints are given for {len(constraints)} sources, not {len(sources)}")
    forced = [i for i in todo if constraints and constraints[i]]
    plain = [i for i in todo if not (constraints and constraints[i])] if forced else todo
    caps = [n for n in (backend.max_batch, options.batch_sentences) if n]
    max_batch = min(caps) if caps else None

    def decode(batch: tuple[bool, list[int]]) -> list[list[Hypothesis]]:
        constrained, idx = batch
        first = None if first_tokens is None else [first_tokens[i] for i in idx]
        src = pad_batch([sources[i] for i in idx], backend.cfg.pad_id)
        if not constrained:
            return search(backend, src, options, first)
        from runtime.constrained import constrained_beam_search

        assert constraints is not None
        return constrained_beam_search(backend, src, [constraints[i] for i in idx], **wide.search_kwargs(),
                                       first_tokens=first, joins=joins)

    wide = options
    if forced:
        from runtime.constrained import constrained_beam

        wide = options.replace(beam_size=constrained_beam(options.beam_size, backend.topk))

    def batches_of(group: list[int], opts: DecodingOptions, constrained: bool) -> Iterator[tuple[bool, list[int]]]:
        for batch in length_batches([len(sources[i]) for i in group], opts.batch_tokens, opts.beam_size, max_batch):
            yield constrained, [group[j] for j in batch]

    batches = itertools.chain(batches_of(plain, options, False), batches_of(forced, wide, True))
    if on_batch is not None and len(todo) < len(sources):
        on_batch(len(sources) - len(todo))
    for (_, idx), hyps in decode_batches(backend, batches, decode, workers):
        for i, h in zip(idx, hyps):
            results[i] = h
        if on_batch is not None:
            on_batch(len(idx))
    return results


B = TypeVar("B")
R = TypeVar("R")


def decode_batches(backend: Backend, batches: Iterable[B], decode: Callable[[B], R],
                   workers: int | None = None) -> Iterator[tuple[B, R]]:
    """(batch, decode(batch)) for each batch, in the batches' order.

    A backend that can decode several batches at once (`parallel_batches`, the onnxruntime backend on
    the CPU: runtime/ort_backend.py) gets that many on threads, each run on its share of the cores, so
    the operators of two batches run side by side instead of each operator split over the cores. At
    most that many batches are decoded at once and as many more wait their turn, so memory holds
    `parallel_batches` batches' caches. An error in one batch, or Ctrl-C, cancels the batches not yet
    started and is raised once the running ones have ended. `workers` given: that many at once instead."""
    workers = int(workers or backend.parallel_batches or 1)
    if workers <= 1:
        for batch in batches:
            yield batch, decode(batch)
        return
    pool = ThreadPoolExecutor(workers, thread_name_prefix="batch")
    pending: deque[tuple[B, Future[R]]] = deque()
    try:
        for batch in batches:
            pending.append((batch, pool.submit(decode, batch)))
            if len(pending) >= 2 * workers:  # the oldest's result, while the others run and wait
                done, future = pending.popleft()
                yield done, future.result()
        while pending:
            done, future = pending.popleft()
            yield done, future.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


@dataclass
class Sources:
    """Source ids per line ([] for a blank line) and what the line policy did."""

    ids: list[list[int]]
    empty: int = 0
    truncated: int = 0


class SourceTooLong(RuntimeUserError):
    """A source over the model's limit under long_lines "error". `what` names it and its length; the
    message adds the command-line fix, which the HTTP layer leaves out (it has no such option)."""

    def __init__(self, what: str):
        super().__init__(f"{what}; pass --long-lines truncate or split the line")
        self.what = what


def not_text(text: str) -> str | None:
    """Why a str given as text (a request's, a data frame row's) is none: a NUL character, or a lone surrogate
    (U+D800-U+DFFF: JSON's "\\ud800", a file read with surrogateescape), which no tokenizer takes; None for text.
    serve-batch refuses the same in a file's bytes (pipeline/textio.py decode_line)."""
    if "\x00" in text:
        return f"a NUL character (U+0000, character {text.index(chr(0))}), which no text holds"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"a lone surrogate (\\ud800-\\udfff, character {e.start}), not text"
    return None


def encode_sources(tokenizer: AnyTokenizer, lines: list[str], max_src_len: int, *, long_lines: str = "truncate",
                   origin: str = "input", first_line: int | None = 1, prefix: tuple[int, ...] = ()) -> Sources:
    """The one way text lines become source ids (serve-batch, parity, bench, validation).

    Blank or whitespace-only lines get [] (they are never translated: the output line is
    empty), and so do lines of characters the tokenizer keeps nothing of (U+200B, a BOM mid-file: the model,
    given EOS alone, invented a sentence); others are pieces + EOS. A line over max_src_len tokens (EOS included) is cut
    to its first max_src_len - 1 pieces + EOS (long_lines "truncate", counted) or refused
    as `origin:line` (long_lines "error"; line numbers start at first_line; with first_line None, one line
    named `origin` alone). `prefix` starts every
    non-blank source (a multilingual model's source language token: runtime/languages.py).
    """
    if long_lines not in LONG_LINE_POLICIES:
        raise RuntimeUserError(f"--long-lines {long_lines!r}: choose one of {', '.join(LONG_LINE_POLICIES)}")
    live = [i for i, line in enumerate(lines) if line.strip()]
    out = Sources([[] for _ in lines], empty=len(lines) - len(live))
    if not live:
        return out
    for i, seq in zip(live, tokenizer.encode_source([lines[i] for i in live])):
        if len(seq) <= 1:  # EOS alone: nothing of the line is left to translate
            out.empty += 1
            continue
        seq = list(prefix) + seq if prefix else seq
        if len(seq) > max_src_len:
            if long_lines == "error":
                where = origin if first_line is None else f"{origin}:{first_line + i}"
                raise SourceTooLong(f"{where}: {len(seq)} tokens, more than the model's limit of {max_src_len}")
            out.truncated += 1
            seq = seq[: max_src_len - 1] + seq[-1:]
        out.ids[i] = seq
    return out


def translate_lines(backend: Backend, tokenizer: AnyTokenizer, lines: list[str], options: DecodingOptions = PAPER,
                    *, prefix: tuple[int, ...] = (), first: int | None = None, **changes: Any) -> list[str]:
    """Text in, text out, line-aligned: the best hypothesis of each line; blank lines give
    "" without touching the model; lines longer than the backend's source limit are
    truncated (logged). Options as translate_ids; a multilingual model's direction (runtime/languages.py
    Direction) as its `prefix` (each source's language token) and `first` (the target's, forced first)."""
    sources = encode_sources(tokenizer, lines, backend.max_src_len, prefix=prefix)
    if sources.truncated:
        log.warning("%d line(s) longer than %d source tokens were truncated", sources.truncated,
                    backend.max_src_len)
    hyps = translate_ids(backend, sources.ids, options, None if first is None else [first] * len(lines), **changes)
    texts = tokenizer.decode([h[0].tokens if h else [] for h in hyps])
    return [text if src else "" for text, src in zip(texts, sources.ids)]


def format_line(tokenizer: AnyTokenizer, nbest: NBest, n: int) -> str:
    """One output line: the best translation, or with n > 1 the n best as
    `text ||| score` joined by ' ||| ' (line-aligned with the input whatever n is)."""
    texts = tokenizer.decode([tokens for tokens, _ in nbest]) if nbest else []
    return format_hypotheses([(text, score) for text, (_, score) in zip(texts, nbest)], n)


def format_hypotheses(hyps: list[tuple[str, float]], n: int) -> str:
    """format_line's line from hypotheses as (text, score), best first."""
    if not hyps:  # a blank line: one empty hypothesis, as the HTTP API answers it ({"text": "", "score": 0})
        return "" if n == 1 else f"{NBEST_SEP}{0.0:.4f}"
    if n == 1:
        return hyps[0][0]
    return NBEST_SEP.join(f"{text}{NBEST_SEP}{score:.4f}" for text, score in hyps)
