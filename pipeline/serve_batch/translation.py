"""Input lines to output lines, the way serve-batch does it (and so parity, which must
measure exactly what is served).

Reading: a window of lines at a time, split on b'\\n' only, strict UTF-8 (refused with
file:line) or replaced (counted). Everything between reading and writing is the text service's
(runtime/texts.py): encode_texts applies the line policy (blank lines -> no tokens -> "", long lines
truncated or refused as file:line, --split sentences, --format html) and finish_texts gives each line's
output (n-best, documents and HTML rebuilt). pipeline/serve_batch/files.py runs the windows through the
backend (split over torchrun ranks) and yields a `TranslatedWindow` per window.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO

from model.errors import UserError
from model.manifest import Languages
from pipeline.cli_options import opt
from pipeline.textio import SERVED_LINE_BYTES, NotUtf8, decode_line, open_binary
from runtime.decoding import PAPER, DecodingOptions
from runtime.errors import RuntimeUserError
from runtime.glossary import Glossary
from runtime.languages import LANG_CODE, ONE_PAIR, Direction
from runtime.sentences import DEFAULT_LANG, SPLIT_MODES
from runtime.texts import FORMATS, EncodedTexts, Lines, TextPolicy, encode_texts, finish_texts, term_counts
from runtime.tokenizer import AnyTokenizer
from runtime.translate import LONG_LINE_POLICIES, NBest

log = logging.getLogger(__name__)

INVALID_UTF8_POLICIES = ("error", "replace")
WINDOW_BYTES = 16 << 20  # a window also ends past this much text: memory is a few times a window's bytes, and
# --window 10000 of 30 KB lines held 1.5 GB (each line up to MAX_LINE_BYTES still makes a window alone)
WINDOW_SENTENCES = 20_000  # with split or html, past about this many sentences (each holds ~2 KB until written:
# 400 lines of "da. da. ..." held 329 MB, 160,000 sentences in 640 KB), counted as their ends are (". ", "? ", "。")
SENTENCE_ENDS = tuple(end.encode() for end in (". ", "! ", "? ", "\u3002", "\uff01", "\uff1f"))


@dataclass(frozen=True)
class ServeBatchOptions:
    """How serve-batch (and parity) read, encode, decode and write; serve-batch's options are generated
    from these fields (pipeline/cli_options.py), the decoding options from DecodingOptions."""

    window: int = opt(10000, "Lines read, sorted by length and translated at a time (bounds memory; a window "
                             "also ends past 16 MiB of text, and with --split sentences or --format html past "
                             "about 20,000 sentences).", min=1)
    long_lines: str = opt("truncate", "Lines longer than the model's source limit: truncate them (counted warning; "
                                      "with --split sentences or --format html a long sentence is cut into "
                                      "sentences that fit) or stop with an error naming the line.",
                          choices=LONG_LINE_POLICIES)
    invalid_utf8: str = opt("error", "Invalid UTF-8: stop with an error naming file and line, or replace the bad "
                                     "bytes with U+FFFD (counted warning).", choices=INVALID_UTF8_POLICIES)
    decoding: DecodingOptions = PAPER
    split: str = opt("none", "sentences: each line is a document, translated sentence by sentence and rebuilt "
                             "with the whitespace it had between them (as `pipeline serve` does for \"split\": "
                             "\"sentences\").", choices=SPLIT_MODES)
    lang: str | None = opt(None, "The input's language (ISO 639, e.g. de), for the sentence rules of --split "
                                 "sentences and --format html [default: --src-lang's, else the model dir's source "
                                 "language, else en].", metavar="CODE")
    src_lang: str | None = opt(None, "A multilingual model's source language, as its model dir lists it (M2M-100: "
                                     "en; NLLB: eng_Latn). manifest.json lists them.", metavar="CODE")
    tgt_lang: str | None = opt(None, "A multilingual model's target language (its forced first token).",
                               metavar="CODE")
    format: str = opt("text", "html: each line is an HTML document whose text is translated (each text node as "
                              "with --split sentences) and whose markup is kept byte for byte, as `pipeline serve` "
                              "does for \"format\": \"html\" (docs/serving.md).", choices=FORMATS)
    glossary: tuple[str, ...] = opt((), "A glossary (TSV: source term, target term; an empty target: do not "
                                         "translate): its terms found in a line are kept in its translation "
                                         "(docs/glossary.md). Repeatable: the files are used as one, a term two "
                                         "of them translate differently refused.", multiple=True, metavar="FILE")

    def validate(self) -> ServeBatchOptions:
        problems = [] if self.window >= 1 else [f"--window must be at least 1 (got {self.window})"]
        if self.long_lines not in LONG_LINE_POLICIES:
            problems.append(f"--long-lines must be one of {', '.join(LONG_LINE_POLICIES)}")
        if self.invalid_utf8 not in INVALID_UTF8_POLICIES:
            problems.append(f"--invalid-utf8 must be one of {', '.join(INVALID_UTF8_POLICIES)}")
        if self.split not in SPLIT_MODES:
            problems.append(f"--split must be one of {', '.join(SPLIT_MODES)}")
        elif self.split == "sentences" and self.decoding.nbest > 1:
            problems.append("--split sentences writes one translation per line; it takes no --nbest above 1")
        if self.lang is not None and not LANG_CODE.fullmatch(self.lang):
            problems.append(f"--lang must be a language code like de (got {self.lang[:40]!r})")
        if self.format not in FORMATS:
            problems.append(f"--format must be one of {', '.join(FORMATS)}")
        elif self.format == "html" and self.decoding.nbest > 1:
            problems.append("--format html writes one translation per line; it takes no --nbest above 1")
        if problems:
            raise UserError("; ".join(problems))
        self.decoding.validate()
        return self

    def policy(self, way: Direction = ONE_PAIR) -> TextPolicy:
        """The text service's policy for these options in direction `way` (runtime/languages.py: its prefix starts
        each source; the source language as the target, each text is answered as it came)."""
        return TextPolicy(self.long_lines, self.split, self.format, self.lang or DEFAULT_LANG, way.prefix, way.same)

    def sentence_rules(self, pair: Languages | None) -> ServeBatchOptions:
        """These options with --lang decided as the HTTP API decides "lang" from "source": as given, else the
        source language (--src-lang's, else a one-pair model's own, as its model dir records it), else en."""
        own = pair.source[0] if pair is not None and len(pair.source) == 1 else None
        return dataclasses.replace(self, lang=self.lang or self.src_lang or own or DEFAULT_LANG)


@dataclass
class Window:
    """One window of an input: its lines as the text service encoded them, and how many had bytes replaced."""

    encoded: EncodedTexts
    replaced: int = 0

    @property
    def ids(self) -> list[list[int]]:
        """Source ids per line ([] for blank lines), or per sentence (--split sentences, --format html)."""
        return self.encoded.ids

    @property
    def empty(self) -> int:
        return sum(self.encoded.empty)

    @property
    def truncated(self) -> int:
        """Lines with text cut to the source limit (a line of several sentences counts once)."""
        return self.encoded.texts_cut

    @property
    def pieced(self) -> int:
        """Lines with a sentence over the source limit, translated in pieces that fit (--split, --format html)."""
        return self.encoded.pieced


@dataclass
class TranslatedWindow:
    """One window translated: what was written, what the backend saw and produced."""

    lines: list[str]          # output lines, without newlines, line-aligned with the input
    sources: list[list[int]]  # source ids the backend saw ([] for blank lines)
    nbest: list[NBest]
    empty: int = 0
    truncated: int = 0
    pieced: int = 0
    replaced: int = 0
    min_len_over: int = 0  # lines whose maximum output length is below --min-len
    stopped_at_limit: int = 0  # lines whose translation ran to the model's target limit (export --max-tgt-len)
    terms: int = 0  # with --glossary: the terms found in the window's lines, and those their translations hold
    terms_applied: int = 0
    best: list[list[int]] = field(init=False)  # best hypothesis' tokens per line ([] for blank)

    def __post_init__(self) -> None:
        self.best = [n[0][0] if n else [] for n in self.nbest]

    @property
    def src_tokens(self) -> int:
        return sum(len(s) for s in self.sources)

    @property
    def tgt_tokens(self) -> int:
        """Generated tokens of the best hypotheses, EOS included."""
        return sum(len(n[0][0]) + 1 for n in self.nbest if n)


def read_windows(path: str, tokenizer: AnyTokenizer, max_src_len: int, opts: ServeBatchOptions,
                 way: Direction = ONE_PAIR, glossary: Glossary | None = None) -> Iterator[Window]:
    """Windows of `opts.window` lines, tokenized (in direction `way`: runtime/languages.py), with the
    bad-input policy applied and the glossary's terms found (runtime/glossary.py)."""
    f = open_binary(path)
    try:
        texts: list[str] = []
        replaced = size = ends = 0
        first_line = 1
        unclosed = 0  # lines of the file that leave a construct open (--format html)
        splits = opts.split != "none" or opts.format == "html"
        for lineno, raw in enumerate(_raw_lines(f, path), start=1):
            text, bad = decode_row(raw, path, lineno, opts.invalid_utf8)
            replaced, size = replaced + bad, size + len(raw)
            ends += 1 + sum(raw.count(end) for end in SENTENCE_ENDS) if splits else 0
            texts.append(text)
            if len(texts) == opts.window or size >= WINDOW_BYTES or ends >= WINDOW_SENTENCES:
                window = encode_window(texts, first_line, path, tokenizer, max_src_len, opts, replaced, way,
                                       glossary)
                unclosed += _unclosed(window, path, first_line, unclosed)
                yield window
                texts, replaced, size, ends, first_line = [], 0, 0, 0, lineno + 1
        if texts:
            window = encode_window(texts, first_line, path, tokenizer, max_src_len, opts, replaced, way, glossary)
            unclosed += _unclosed(window, path, first_line, unclosed)
            yield window
        if unclosed > 1:  # the first was named: the count, so no repair goes uncounted
            log.warning("%s: %d lines in all leave a tag, comment or <script>/<pre> open; the rest of each was copied "
                        "untranslated", path, unclosed)
    finally:
        if f is not sys.stdin.buffer:
            f.close()


def _unclosed(window: Window, path: str, first_line: int, before: int) -> int:
    """How many --format html lines of the window leave <script>, <pre>, a comment, ... open, the first of the
    file named (`before`: how many earlier windows had): the rest of such a line is copied untranslated, as a
    browser would, but a whole HTML file split into lines (its script's code, <pre>'s lines) is read so,
    translating what it should keep and keeping what it should not."""
    found = [(k, m.unclosed) for k, m in enumerate(window.encoded.markups) if m is not None and m.unclosed]
    if found and not before:
        log.warning("%s:%d: the line leaves %s open, so the rest of it is copied untranslated: --format html reads "
                    "each line as an HTML document; a multi-line HTML file is one document (translate it with "
                    "`pipeline serve`'s POST /translate_file, or put each document on one line)", path,
                    first_line + found[0][0], found[0][1])
    return len(found)


MAX_LINE_BYTES = SERVED_LINE_BYTES  # a longer line has no line breaks to speak of: not a text file (/dev/zero)


def line_too_long(path: str, lineno: int) -> UserError:
    """The refusal of a line over MAX_LINE_BYTES (serve-batch's windows, ray-translate's rows)."""
    return UserError(f"{path}:{lineno}: a line of more than {MAX_LINE_BYTES >> 20} MiB with no line break; is it "
                     "a text file? Put one sentence or paragraph per line")


def _raw_lines(f: IO[bytes], path: str) -> Iterator[bytes]:
    """The input's lines as bytes, each read with a bound (an input without line breaks was read whole:
    /dev/zero took all memory)."""
    lineno = 0
    try:
        while raw := f.readline(MAX_LINE_BYTES + 2):
            lineno += 1
            if len(raw) - raw.endswith(b"\n") > MAX_LINE_BYTES:  # its line break not counted, as ray-translate's
                raise line_too_long(path, lineno)
            yield raw
    except (OSError, EOFError) as e:
        raise UserError(f"{path}: cannot read ({e})") from None


def decode_row(raw: bytes, path: str, lineno: int, policy: str) -> tuple[str, int]:
    """One line's bytes as text under --invalid-utf8 `policy`, and 1 if bytes were replaced (serve-batch's
    windows, ray-translate's rows)."""
    try:
        return decode_line(raw, path, lineno), 0
    except NotUtf8:
        raise
    except UserError as e:
        if policy != "replace":
            raise UserError(f"{e}, or pass --invalid-utf8 replace") from None
        return decode_line(raw, path, lineno, errors="replace"), 1


def encode_window(texts: list[str], first_line: int, path: str, tokenizer: AnyTokenizer, max_src_len: int,
                  opts: ServeBatchOptions, replaced: int = 0, way: Direction = ONE_PAIR,
                  glossary: Glossary | None = None) -> Window:
    """The lines encoded by the text service under the options' policy, refusals named `path:line`."""
    try:
        encoded = encode_texts(tokenizer, texts, max_src_len, opts.policy(way), Lines(path, first_line),
                               glossary=glossary)
    except RuntimeUserError as e:  # a refused long line: a UserError, so every rank hears of it
        raise UserError(str(e)) from None
    return Window(encoded, replaced)


def finish_window(tokenizer: AnyTokenizer, window: Window, nbest: list[NBest], n: int) -> TranslatedWindow:
    """The window's output lines from its hypotheses (in input order), as the text service writes them."""
    results = finish_texts(tokenizer, window.encoded, nbest, n)
    found, applied = term_counts(results)
    return TranslatedWindow([result.text for result in results], window.ids, nbest, empty=window.empty,
                            truncated=window.truncated, pieced=window.pieced, replaced=window.replaced, terms=found,
                            terms_applied=applied)
