"""Translate many sentences: sort by length, batch by a token budget, search, restore order.

Sorting by length makes batches dense (little padding, similar stopping times), and the
budget keeps each batch's work roughly constant whatever the sentence lengths.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch

from model.config import PAD_ID
from runtime.backend import Backend
from runtime.search import Hypothesis, SearchError, beam_search, greedy_search
from runtime.tokenizer import Tokenizer

log = logging.getLogger(__name__)

DEFAULT_BATCH_TOKENS = 4096


def pad_batch(sources: list[list[int]]) -> torch.Tensor:
    """(B, S) int64 right-padded with PAD_ID."""
    width = max(len(s) for s in sources)
    out = torch.full((len(sources), width), PAD_ID, dtype=torch.long)
    for i, s in enumerate(sources):
        out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
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


def translate_ids(backend: Backend, sources: list[list[int]], *, beam_size: int = 4, alpha: float = 0.6,
                  max_len_a: float = 1.0, max_len_b: int = 50, min_len: int = 0, nbest: int = 1,
                  batch_tokens: int = DEFAULT_BATCH_TOKENS) -> list[list[Hypothesis]]:
    """Hypotheses (nbest, best first) for each source, in input order.

    Each source is pieces + EOS, at most backend.max_src_len tokens. An empty source
    (no tokens at all) gets [] without touching the model. beam_size 1 runs greedy search.
    batch_tokens bounds n_sentences x longest source x beam per batch (see length_batches).
    """
    if nbest > beam_size:
        raise SearchError(f"nbest ({nbest}) must not exceed the beam size ({beam_size})")
    results: list[list[Hypothesis]] = [[] for _ in sources]
    todo = [i for i, s in enumerate(sources) if s]
    max_batch = getattr(backend, "max_batch", None)
    for batch in length_batches([len(sources[i]) for i in todo], batch_tokens, beam_size, max_batch):
        idx = [todo[j] for j in batch]
        src = pad_batch([sources[i] for i in idx])
        if beam_size == 1:
            hyps = greedy_search(backend, src, max_len_a=max_len_a, max_len_b=max_len_b,
                                 min_len=min_len, alpha=alpha)
        else:
            hyps = beam_search(backend, src, beam_size=beam_size, alpha=alpha, max_len_a=max_len_a,
                               max_len_b=max_len_b, min_len=min_len, nbest=nbest)
        for i, h in zip(idx, hyps):
            results[i] = h
    return results


def encode_lines(tokenizer: Tokenizer, lines: list[str], max_src_len: int) -> tuple[list[list[int]], int]:
    """Source ids per line ([] for empty / whitespace-only lines) and how many lines were
    cut to max_src_len tokens (EOS included)."""
    ids: list[list[int]] = [[] for _ in lines]
    live = [i for i, line in enumerate(lines) if line.strip()]
    truncated = 0
    if live:
        full = tokenizer.encode_source([lines[i] for i in live])
        for i, seq in zip(live, full):
            if len(seq) > max_src_len:
                truncated += 1
                seq = seq[: max_src_len - 1] + seq[-1:]
            ids[i] = seq
    return ids, truncated


def translate_lines(backend: Backend, tokenizer: Tokenizer, lines: list[str], **options: Any) -> list[str]:
    """Text in, text out, line-aligned: the best hypothesis of each line; empty or
    whitespace-only lines give "" without touching the model; lines longer than the
    backend's source limit are truncated (logged). Options as translate_ids."""
    ids, truncated = encode_lines(tokenizer, lines, backend.max_src_len)
    if truncated:
        log.warning("%d line(s) longer than %d source tokens were truncated", truncated,
                    backend.max_src_len)
    hyps = translate_ids(backend, ids, **options)
    best = [h[0].tokens if h else [] for h in hyps]
    texts = tokenizer.decode(best)
    return [text if src else "" for text, src in zip(texts, ids)]
