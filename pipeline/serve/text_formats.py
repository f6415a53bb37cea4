"""The plain document formats of POST /translate_file (.txt, .html, .srt), and what every format's reader gives:
a `Document` (its texts and how to rebuild it) or a `DocumentError`. The rules are documents.py's."""

from __future__ import annotations

import codecs
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from runtime.markup import parse_html


class DocumentError(ValueError):
    """The file cannot be read as its format (400), or is over a limit (413 when `too_large`)."""

    def __init__(self, message: str, too_large: bool = False):
        super().__init__(message)
        self.too_large = too_large


@dataclass
class Document:
    """A file's texts to translate, in order; `rebuild(translations)` is the file with texts[k] replaced by
    translations[k] (once: it writes into the parsed document)."""

    texts: list[str]
    _rebuild: Callable[[list[str]], bytes]

    def rebuild(self, translations: list[str]) -> bytes:
        if len(translations) != len(self.texts):
            raise ValueError(f"{len(translations)} translations for {len(self.texts)} texts")
        return self._rebuild(translations)


def extension(filename: str) -> str:
    """The name's extension, lower case, with its dot ("" without one)."""
    name = re.split(r"[/\\]", filename)[-1]
    dot = name.rfind(".")
    return name[dot:].lower() if dot > 0 else ""


def has_letters(text: str) -> bool:
    return any(c.isalpha() for c in text)


# -- text formats: .txt, .html, .srt ------------------------------------------------------------------------

BOMS = ((codecs.BOM_UTF8, "utf-8"), (codecs.BOM_UTF32_LE, "utf-32-le"), (codecs.BOM_UTF32_BE, "utf-32-be"),
        (codecs.BOM_UTF16_LE, "utf-16-le"), (codecs.BOM_UTF16_BE, "utf-16-be"))


def _decode(data: bytes, what: str) -> tuple[str, Callable[[str], bytes]]:
    """UTF-8, or the Unicode encoding its byte-order mark names; and how to encode the rebuilt text as it was."""
    bom, encoding = next(((b, e) for b, e in BOMS if data.startswith(b)), (b"", "utf-8"))
    try:
        text = data[len(bom):].decode(encoding)
    except UnicodeDecodeError as e:
        raise DocumentError(f"the {what} is not {encoding.upper()} text (byte {e.start + len(bom)}); save it as "
                            "UTF-8") from None
    return text, lambda out: bom + out.encode(encoding, "surrogatepass")


LINE = re.compile(r"([^\r\n]*)(\r\n|\r|\n|$)")


def _lines(text: str) -> Iterator[tuple[str, str]]:
    """(line, its end) for each line; the last one's end is ""."""
    for m in LINE.finditer(text):
        if m.start() == len(text) and m.start() > 0:
            return
        yield m.group(1), m.group(2)


def read_txt(data: bytes) -> Document:
    text, encode = _decode(data, ".txt file")
    lines = list(_lines(text))
    places = [i for i, (line, _) in enumerate(lines) if has_letters(line)]

    def rebuild(translations: list[str]) -> bytes:
        out = [line for line, _ in lines]
        for i, t in zip(places, translations):
            out[i] = t
        return encode("".join(line + end for line, (_, end) in zip(out, lines)))

    return Document([lines[i][0] for i in places], rebuild)


def read_html(data: bytes) -> Document:
    text, encode = _decode(data, "HTML file")
    markup = parse_html(text)
    return Document(list(markup.sources), lambda translations: encode(markup.rebuild(translations)))


TIMING = re.compile(r"\s*\d+:\d{1,2}:\d{1,2}[,.]\d{1,3}\s*-->\s*\d+:\d{1,2}:\d{1,2}[,.]\d{1,3}.*")
TAG = re.compile(r"(<[^<>]*>|\{\\[^{}]*\})")  # <i>, </font>, {\an8}: copied, never translated


def read_srt(data: bytes) -> Document:
    text, encode = _decode(data, ".srt file")
    lines = list(_lines(text))
    cues: list[tuple[int, int]] = []  # [first, last) text lines of each cue
    i = 0
    while i < len(lines):
        if TIMING.fullmatch(lines[i][0]):
            j = i + 1
            while j < len(lines) and lines[j][0].strip():
                j += 1
            if j > i + 1:
                cues.append((i + 1, j))
            i = j
        else:
            i += 1
    texts: list[str] = []
    pieces: list[list[str]] = []  # per cue: its joined text cut at tags
    for first, last in cues:
        cut = TAG.split(" ".join(line.strip() for line, _ in lines[first:last]))
        pieces.append(cut)
        texts.extend(p for k, p in enumerate(cut) if k % 2 == 0 and has_letters(p))

    def rebuild(translations: list[str]) -> bytes:
        out: list[str | None] = [line for line, _ in lines]
        given = iter(translations)
        for (first, last), cut in zip(cues, pieces):
            cue = "".join(next(given) if k % 2 == 0 and has_letters(p) else p for k, p in enumerate(cut))
            wrapped = _wrap(cue, last - first)
            for k in range(first, last):
                out[k] = wrapped[k - first] if k - first < len(wrapped) else None  # fewer words than lines
        kept = [(line, end) for line, (_, end) in zip(out, lines) if line is not None]
        return encode("".join(line + end for line, end in kept))

    return Document(texts, rebuild)


def _wrap(text: str, n: int) -> list[str]:
    """The text broken at spaces outside tags into at most n lines of about equal length."""
    words: list[str] = []
    for k, part in enumerate(TAG.split(text.strip())):
        if k % 2:  # a tag sticks to the word it touches
            words[-1:] = [(words[-1] if words else "") + part]
            continue
        chunks = part.split(" ")
        if words and chunks:
            words[-1] += chunks.pop(0)
        words.extend(chunks)
    words = [w for w in words if w]
    if n <= 1 or len(words) <= 1:
        return [" ".join(words)]
    n = min(n, len(words))
    total = sum(len(w) for w in words) + len(words) - 1
    lines: list[list[str]] = [[]]
    done = 0
    for k, word in enumerate(words):
        left = len(words) - k  # words still to place, this one included
        if lines[-1] and len(lines) < n and (done + len(word) / 2 > total * len(lines) / n
                                             or left == n - len(lines)):
            lines.append([])
        lines[-1].append(word)
        done += len(word) + 1
    return [" ".join(line) for line in lines]
