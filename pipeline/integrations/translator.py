"""`Translator`: a model dir loaded once per worker, translating batches of rows as serve-batch does.

    ds = ray.data.read_parquet("corpus/")
    ds = ds.map_batches(Translator, fn_constructor_kwargs={"model_dir": "models/en-de"},
                        concurrency=4, num_cpus=1, batch_size=1000)

Each call takes a column of source strings and adds `translation` (serve-batch's output line, n-best
included), `score` (the best hypothesis' score), `empty` (a blank row: no translation) and `truncated`
(sentences cut at the model's source limit) to the batch; with a glossary (`glossary="terms.tsv"`, or
serve-batch's --glossary in `options`), also `terms`: per row, JSON of the terms found and whether each was
applied (docs/glossary.md). The translations are serve-batch's, byte for byte:
the rows go through the same text service (runtime/texts.py: encode_texts, the search, finish_texts) under
serve-batch's options. Nothing here imports torch or Ray: the deploy install plus Ray Data (or Spark) runs it."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from model.errors import UserError
from pipeline.serve_batch.translation import ServeBatchOptions
from runtime import languages
from runtime.decoding import PAPER, DecodingOptions
from runtime.errors import RuntimeUserError
from runtime.glossary import Glossary
from runtime.glossary_file import check_glossary, open_glossary
from runtime.model_dir import LoadOptions, ModelDir, load
from runtime.texts import Lines, Located, Origin, encode_texts, finish_texts, term_counts
from runtime.translate import SourceTooLong, not_text

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
    rows_terms: list[str] | None = None  # with a glossary: per row, JSON of its terms ({"source", "applied"...})
    terms: int = 0  # the terms found in the batch's rows, and those their translations hold
    terms_applied: int = 0
    pieced: int = 0  # rows with a sentence over the source limit, translated in pieces that fit (split sentences)
    unclosed: int = 0  # format html rows that leave a tag, comment or <script> open: its rest copied untranslated

    def columns(self) -> dict[str, np.ndarray]:
        columns = {"translation": np.array(self.translation, dtype=object),
                   "score": np.array(self.score, dtype=np.float64),
                   "empty": np.array(self.empty, dtype=bool),
                   "truncated": np.array(self.truncated, dtype=np.int32)}
        if self.rows_terms is not None:
            columns["terms"] = np.array(self.rows_terms, dtype=object)
        return columns


class Translator:
    """A model dir loaded once (ONNX Runtime unless `load_options` say otherwise, `threads` intra-op threads:
    1 unless given, since a cluster runs one such worker per core), called on batches of rows.

    `decoding` are the options the user gave (the model's own defaults fill the others, as in serve-batch), else
    `options.decoding`; `options` serve-batch's line policy (`--long-lines`, `--split`, ...). Search options given
    twice and different are refused (options.decoding was dropped in silence: beam_size=1 ran the model's 4).
    `origin_columns` (path, line): columns naming each row's file and line number, for the one-line error of
    a refused row; without them a row is named by its place in the batch. `glossary`: a glossary file or several
    (used as one; it replaces options.glossary), read and checked once per worker, or a Glossary already read
    (runtime.glossary_file.load_glossaries: a driver reads the files once, its workers check it)."""

    API = True  # refusals name the Python options beside the command's (ray-translate's own Translator: False)

    def _fix(self, name: str, value: str) -> str:
        """How a refusal names the fix: the command line's flag, and the Translator's option where it is the API."""
        flag = f"--{name.replace('_', '-')} {value}"
        return f"{flag} (options with {name}={value!r})" if self.API else flag

    def __init__(self, model_dir: str | Path, *, column: str = "text", load_options: LoadOptions | None = None,
                 decoding: DecodingOptions | None = None, options: ServeBatchOptions | None = None,
                 origin_columns: tuple[str, str] | None = None,
                 glossary: str | Path | Sequence[str | Path] | Glossary | None = None):
        load_options = load_options or LoadOptions()
        if load_options.threads is None:
            load_options = dataclasses.replace(load_options, threads=1)
        self.column = column
        self.origin_columns = origin_columns
        within = options.decoding if options is not None else PAPER
        if decoding is not None and within not in (PAPER, decoding):
            raise UserError("the search options are given twice, as decoding= and as options.decoding, and differ; "
                            "give them once (decoding=DecodingOptions(...))")
        self.loaded = load(ModelDir.open(model_dir), load_options, decoding if decoding is not None else within)
        self.options = dataclasses.replace(options or ServeBatchOptions(), decoding=self.loaded.decoding).validate()
        if glossary is not None and not isinstance(glossary, Glossary):
            given = [glossary] if isinstance(glossary, (str, Path)) else glossary
            self.options = dataclasses.replace(self.options, glossary=tuple(str(g) for g in given))
        try:
            if isinstance(glossary, Glossary):
                check_glossary(glossary, self.loaded.tokenizer, self.loaded.backend)
                self.glossary: Glossary | None = glossary
            else:
                self.glossary = open_glossary(self.options.glossary, self.loaded.tokenizer, self.loaded.backend)
        except RuntimeUserError as e:
            raise UserError(str(e)) from None
        # a multilingual model's pair (src_lang / tgt_lang, in any case), nothing for others (a one-pair model: its
        # own only); the options then hold the codes as the model spells them (EN: en), as the sentence rules take them
        self.direction = languages.direction(self.loaded.backend.cfg, self.options.src_lang, self.options.tgt_lang,
                                             source_name="src_lang", target_name="tgt_lang",
                                             pair=self.loaded.manifest.language_pair)
        if self.direction is not languages.ONE_PAIR:
            self.options = dataclasses.replace(self.options, src_lang=self.direction.source,
                                               tgt_lang=self.direction.target)
        self.options = self.options.sentence_rules(self.loaded.manifest.language_pair)
        self.policy = self.options.policy(self.direction)

    def __call__(self, batch: Any) -> Any:
        """The batch (a dict of numpy arrays, Ray Data's default, or a pandas DataFrame) with the output
        columns added."""
        names = list(batch.column_names if hasattr(batch, "column_names") else batch.keys())  # Arrow's, or keys
        for wanted in (self.column, *(self.origin_columns or ())):
            if wanted not in names:
                what = "source text" if wanted == self.column else "each row's file and line (origin_columns)"
                raise UserError(f"no column {wanted!r} in the rows (they have: {', '.join(map(str, names)) or 'none'})"
                                f"; name the column of {what}")
        added = (*OUTPUT_COLUMNS, *(("terms",) if self.glossary is not None else ()))
        if taken := [name for name in added if name in names]:  # a QA score, a reference, replaced unseen
            raise UserError(f"the rows already have {', '.join(map(repr, taken))}, a column the Translator adds "
                            f"({', '.join(added)}); rename or drop it first")
        sources = batch[self.column]
        if isinstance(sources, (str, bytes)):  # {"text": "a line"}: each character was a row, beside the scalar
            raise TypeError(f"the column {self.column!r} is one string; a batch holds a list (or array) of rows")
        origins = None
        if self.origin_columns is not None:
            origins = [list(batch[name]) for name in self.origin_columns]
        columns = self.translate(list(sources), origins).columns()
        if hasattr(batch, "append_column"):  # a pyarrow Table (batch_format="pyarrow"): columns are added, not set
            for name, values in columns.items():
                batch = batch.append_column(name, _arrow(values))
            return batch
        for name, values in columns.items():
            batch[name] = values
        return batch

    def translate(self, sources: Sequence[Any], origins: list[list[Any]] | None = None) -> Translated:
        """Row-aligned results for source strings (None: a blank row); a refused row is named by `origins`
        (each row's file and line) or by its place in the batch and its start (row:N of this batch of M ('...'):
        Spark's and Ray's batches are slices of the data, so a place alone does not find the row)."""
        if isinstance(sources, (str, bytes)):  # translate("a line") translated each character as a row
            raise TypeError("Translator.translate takes a list of texts, not one string: translate([text])")
        def where(row: int) -> str:  # a refused row named as a refused line is: its file and line, else its place
            if origins is not None:
                return f"{origins[0][row]}:{origins[1][row]}"
            return f"row:{row + 1} of this batch of {len(sources)}{_start(sources[row])}"

        replace = self._fix("invalid_utf8", "replace")
        texts = [self._checked(_text(s, row, where, self.options.invalid_utf8, replace), row, where)
                 for row, s in enumerate(sources)]
        loaded, decoding = self.loaded, self.options.decoding
        origin: Origin = Located(origins[0], origins[1]) if origins is not None else Lines("row")
        try:
            encoded = encode_texts(loaded.tokenizer, texts, loaded.backend.max_src_len, self.policy, origin,
                                   glossary=self.glossary)
        except SourceTooLong as e:  # a refused row (long_lines "error"): one line naming it, and the option
            raise UserError(f"{e.what}; pass {self._fix('long_lines', 'truncate')}"
                            " or split the line") from None
        except RuntimeUserError as e:
            raise UserError(str(e)) from None
        nbest = loaded.translate(encoded.ids, decoding, self.direction.first_tokens(len(encoded.ids)),
                                 constraints=encoded.constraints)
        results = finish_texts(loaded.tokenizer, encoded, nbest, decoding.nbest)
        over = encoded.min_len_over(decoding, loaded.backend.max_tgt_len)
        if over:
            log.warning("%d row(s) have a maximum output length below --min-len %d; they stop at that maximum",
                        over, decoding.min_len)
        cut = encoded.stopped_at_limit(nbest, decoding, loaded.backend.max_tgt_len)
        if cut:
            log.warning("%d row(s) were translated up to the model's target limit (export --max-tgt-len) and "
                        "stopped there: their translations may be cut", cut)
        out = Translated([], [], [], [], over, None if self.glossary is None else [], pieced=encoded.pieced,
                         unclosed=sum(1 for m in encoded.markups if m is not None and m.unclosed))
        if out.pieced:  # as serve-batch says them: every word translated, a sentence in pieces
            log.warning("%d row(s) held a sentence longer than the model's source limit, translated in pieces that "
                        "fit (%s refuses them)", out.pieced, self._fix("long_lines", "error"))
        if out.unclosed:
            log.warning("%d row(s) leave a tag, a comment or a <script> open, so the rest of each is copied "
                        "untranslated (format html reads each row as one HTML document)", out.unclosed)
        for r in results:  # the columns in one pass
            out.translation.append(r.text)
            # a document's sentences each have a score; a row gives one only for a plain text
            out.score.append(math.nan if self.policy.documents or r.score is None else r.score)
            out.empty.append(r.empty)
            out.truncated.append(r.truncated)
            if out.rows_terms is not None:
                out.rows_terms.append(json.dumps(r.terms or [], ensure_ascii=False))
        out.terms, out.terms_applied = term_counts(results)
        return out


    def _checked(self, text: str, row: int, where: Callable[[int], str]) -> str:
        """A row's text as serve-batch reads a line and the HTTP APIs a text: a NUL or a lone surrogate refused
        (U+FFFD with invalid_utf8='replace', as serve-batch repairs a file's bytes); a newline
        only in a document (split 'sentences', format 'html'), where it is whitespace between sentences."""
        if why := not_text(text):
            if self.options.invalid_utf8 != "replace":
                raise UserError(f"{where(row)}: holds {why}; pass "
                                f"{self._fix('invalid_utf8', 'replace')} to "
                                "replace it with U+FFFD")
            text = "".join("\ufffd" if c == "\x00" or "\ud800" <= c <= "\udfff" else c for c in text)
        if "\n" in text and not self.policy.documents:  # one line to the model: its lines ran together
            raise UserError(f"{where(row)}: holds a newline; give one line per row, or pass "
                            f"{self._fix('split', 'sentences')}: its lines then "
                            "translate apart")
        return text


def _start(value: Any) -> str:
    """How a refused text row begins, to find it by: ` ('its first 40 characters (or bytes), escaped')`; "" for
    another value (its refusal quotes it)."""
    if not isinstance(value, (str, bytes)):
        return ""
    return f" ({value[:40]!r}{'...' if len(value) > 40 else ''})"


def _arrow(values: np.ndarray) -> Any:
    import pyarrow as pa  # type: ignore[import-untyped]  # the batch is Arrow's: pyarrow is there

    return pa.array(values.tolist() if values.dtype == object else values)


_NULLS = ("NAType", "NaTType")  # pandas' pd.NA (a string column's null) and pd.NaT


def _text(value: Any, row: int, where: Callable[[int], str], invalid_utf8: str,
          replace: str = "options with invalid_utf8='replace'") -> str:
    """A row's source text: a null of any kind (None, NaN, pd.NA, a null Arrow scalar) a blank row; bytes as UTF-8
    under serve-batch's --invalid-utf8; anything else not text refused, naming the row (its str() would be
    translated: "nan", "<NA>", "[1, 2]")."""
    if isinstance(value, str):
        return value
    if value is None or type(value).__name__ in _NULLS or isinstance(value, (float, np.floating)) and math.isnan(
            value):
        return ""
    if hasattr(value, "as_py") and hasattr(value, "is_valid"):  # a pyarrow scalar
        return "" if not value.is_valid else _text(value.as_py(), row, where, invalid_utf8, replace)
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as e:
            if invalid_utf8 == "replace":
                return value.decode("utf-8", errors="replace")
            raise UserError(f"{where(row)}: invalid UTF-8 (byte {e.start}: {value[e.start:e.start + 1]!r}); pass "
                            f"{replace} to replace it with U+FFFD") from None
    raise UserError(f"{where(row)}: {type(value).__name__} {str(value)[:30]!r}, not text; the source column holds "
                    "strings (a null is a blank row)")
