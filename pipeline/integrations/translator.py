"""`Translator`: a model dir loaded once per worker, translating batches of rows as serve-batch does.

    ds = ray.data.read_parquet("corpus/")
    ds = ds.map_batches(Translator, fn_constructor_kwargs={"model_dir": "models/en-de"},
                        concurrency=4, num_cpus=1, batch_size=1000)

Each call takes a column of source strings and adds `translation` (serve-batch's output line, n-best
included), `score` (the best hypothesis' score), `empty` (a blank row: no translation) and `truncated`
(sentences cut at the model's source limit) to the batch. The translations are serve-batch's, byte for byte:
the rows go through its own encoding, search and formatting (pipeline/serve_batch/rows.py). Nothing here
imports torch or Ray: the deploy install plus Ray Data (or Spark) runs it."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from model.errors import UserError
from pipeline.serve_batch.rows import direction_of, encode_rows, translate_rows
from pipeline.serve_batch.translation import ServeBatchOptions, TranslatedWindow, Window
from runtime.decoding import PAPER, DecodingOptions
from runtime.model_dir import LoadOptions, ModelDir, load

log = logging.getLogger(__name__)

OUTPUT_COLUMNS = ("translation", "score", "empty", "truncated")


@dataclass
class Translated:
    """One batch's results, row-aligned with its sources."""

    translation: list[str]
    score: list[float]     # the best hypothesis' score; NaN for a blank row, --split sentences, --format html
    empty: list[bool]      # blank (or null) rows: the translation is ""
    truncated: list[int]   # lines (or sentences) cut to the model's source limit
    min_len_over: int = 0  # rows whose maximum output length is below --min-len

    def columns(self) -> dict[str, np.ndarray]:
        return {"translation": np.array(self.translation, dtype=object),
                "score": np.array(self.score, dtype=np.float64),
                "empty": np.array(self.empty, dtype=bool),
                "truncated": np.array(self.truncated, dtype=np.int32)}


class Translator:
    """A model dir loaded once (ONNX Runtime unless `load_options` say otherwise, `threads` intra-op threads:
    1 unless given, since a cluster runs one such worker per core), called on batches of rows.

    `decoding` are the options the user gave (the model's own defaults fill the others, as in serve-batch);
    `options` serve-batch's line policy (`--long-lines`, `--split`, ...; `decoding` replaces its own).
    `origin_columns` (path, line): columns naming each row's file and line number, for the one-line error of
    a refused row; without them a row is named by its place in the batch."""

    def __init__(self, model_dir: str | Path, *, column: str = "text", load_options: LoadOptions | None = None,
                 decoding: DecodingOptions = PAPER, options: ServeBatchOptions | None = None,
                 origin_columns: tuple[str, str] | None = None):
        load_options = load_options or LoadOptions()
        if load_options.threads is None:
            load_options = dataclasses.replace(load_options, threads=1)
        self.column = column
        self.origin_columns = origin_columns
        self.loaded = load(ModelDir.open(model_dir), load_options, decoding)
        self.options = dataclasses.replace(options or ServeBatchOptions(), decoding=self.loaded.decoding).validate()
        self.direction = direction_of(self.loaded.backend, self.options)  # a multilingual model's pair

    def __call__(self, batch: Any) -> Any:
        """The batch (a dict of numpy arrays, Ray Data's default, or a pandas DataFrame) with the output
        columns added."""
        try:
            sources = batch[self.column]
        except KeyError:
            names = ", ".join(map(str, batch.keys())) or "none"
            raise UserError(f"no column {self.column!r} in the rows (they have: {names}); name the column of "
                            "source text") from None
        origins = None
        if self.origin_columns is not None:
            origins = [list(batch[name]) for name in self.origin_columns]
        for name, values in self.translate(list(sources), origins).columns().items():
            batch[name] = values
        return batch

    def translate(self, sources: Sequence[Any], origins: list[list[Any]] | None = None) -> Translated:
        """Row-aligned results for source strings (None: a blank row)."""
        texts = [_text(s) for s in sources]
        loaded = self.loaded
        window = self._encode(texts, origins)
        done = translate_rows(loaded.backend, loaded.tokenizer, window, self.options, self.direction)
        if done.min_len_over:
            log.warning("%d row(s) have a maximum output length below --min-len %d; they stop at that maximum",
                        done.min_len_over, self.options.decoding.min_len)
        return Translated(done.lines, _scores(done, window), _empty(texts, window),
                          self._truncated(texts, window), done.min_len_over)

    def _encode(self, texts: list[str], origins: list[list[Any]] | None) -> Window:
        tokenizer, limit = self.loaded.tokenizer, self.loaded.backend.max_src_len
        try:
            return encode_rows(texts, tokenizer, limit, self.options, self.direction, "row")
        except UserError:
            # a refused row (--long-lines error): find it again, one row at a time, to name its file and line
            for k, text in enumerate(texts):
                origin, line = (str(origins[0][k]), int(origins[1][k])) if origins else ("row", k + 1)
                encode_rows([text], tokenizer, limit, self.options, self.direction, origin, line)
            raise

    def _truncated(self, texts: list[str], window: Window) -> list[int]:
        """Per row, its sources the line policy cut: only a source exactly at the limit can have been cut, and
        encoding that one again says whether it was."""
        limit, prefix = self.loaded.backend.max_src_len, len(self.direction.prefix)
        owners = _owners(texts, window)
        units = _units(texts, window)
        out = [0] * len(texts)
        for j, ids in enumerate(window.ids):
            if len(ids) == limit and prefix + len(self.loaded.tokenizer.encode_source([units[j]])[0]) > limit:
                out[owners[j]] += 1
        return out


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, float) and math.isnan(value):  # pandas' null
        return ""
    return str(value)


def _units(texts: list[str], window: Window) -> list[str]:
    """The texts that were encoded, one per source of the window: the rows, or their sentences."""
    if window.splits is None:
        return texts
    return [sentence for split in window.splits for sentence in split.sentences]


def _split_rows(window: Window) -> list[int]:
    """For each split of the window (a row's, or under --format html a text node's), its row."""
    assert window.splits is not None
    if window.markups is None:
        return list(range(len(window.splits)))
    return [row for row, markup in enumerate(window.markups) for _ in markup.sources]


def _owners(texts: list[str], window: Window) -> list[int]:
    """For each source of the window, the row it belongs to."""
    if window.splits is None:
        return list(range(len(texts)))
    rows = _split_rows(window)
    return [rows[k] for k, split in enumerate(window.splits) for _ in split.sentences]


def _empty(texts: list[str], window: Window) -> list[bool]:
    """The rows with nothing to translate, as serve-batch counts them."""
    if window.markups is not None:
        return [not markup.sources for markup in window.markups]
    if window.splits is not None:
        return [not split.sentences for split in window.splits]
    return [not ids for ids in window.ids]


def _scores(done: TranslatedWindow, window: Window) -> list[float]:
    if window.splits is not None:  # a document's sentences each have a score; serve gives none for documents
        return [math.nan] * len(done.lines)
    return [nbest[0][1] if nbest else math.nan for nbest in done.nbest]
