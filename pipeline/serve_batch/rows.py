"""serve-batch's path for lines that come from somewhere other than a file it reads: a batch of rows of a
Ray Data or Spark job (pipeline/integrations/). The same steps `files.translate_windows` runs on each window
in one process (encode with the line policy, translate, format, count), so the rows' translations are
serve-batch's, byte for byte."""

from __future__ import annotations

from pipeline.serve_batch.files import ONE_PROCESS, _translate_share, min_len_over
from pipeline.serve_batch.translation import (
    ServeBatchOptions,
    TranslatedWindow,
    Window,
    _decode,
    _encode,
    finish_window,
)
from runtime import languages
from runtime.backend import Backend
from runtime.languages import ONE_PAIR, Direction
from runtime.tokenizer import AnyTokenizer


def direction_of(backend: Backend, opts: ServeBatchOptions) -> Direction:
    """The language pair --src-lang / --tgt-lang name for a multilingual model (ONE_PAIR for others)."""
    return languages.direction(backend.cfg, opts.src_lang, opts.tgt_lang)


def encode_rows(texts: list[str], tokenizer: AnyTokenizer, max_src_len: int, opts: ServeBatchOptions,
                direction: Direction = ONE_PAIR, origin: str = "input", first_line: int = 1) -> Window:
    """The rows as one window of source ids, with serve-batch's line policy (blank rows, long rows, --split);
    a refused row is a UserError naming `origin:line` (lines counted from first_line)."""
    return _encode(texts, first_line, origin, tokenizer, max_src_len, opts, 0, direction.prefix)


def translate_rows(backend: Backend, tokenizer: AnyTokenizer, window: Window, opts: ServeBatchOptions,
                   direction: Direction = ONE_PAIR) -> TranslatedWindow:
    """The window translated and formatted in input order, as serve-batch writes it."""
    nbest = _translate_share(backend, window.ids, ONE_PROCESS, opts.decoding, direction)
    done = finish_window(tokenizer, window, nbest, opts.decoding.nbest)
    done.min_len_over = min_len_over(window.ids, opts.decoding, backend.max_tgt_len)
    return done


def decode_row(raw: bytes, path: str, lineno: int, invalid_utf8: str) -> tuple[str, int]:
    """One line's bytes as text under serve-batch's --invalid-utf8 policy, and 1 if bytes were replaced."""
    return _decode(raw, path, lineno, invalid_utf8)
