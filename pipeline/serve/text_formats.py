"""The plain document formats of POST /translate_file (.txt, .html, .srt), and what every format's reader gives:
a `Document` (its texts and how to rebuild it) or a `DocumentError`. The rules are documents.py's."""

from __future__ import annotations

import codecs
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from runtime.markup import TooManyTexts, parse_html
from runtime.sentences import has_letters

# the tags of a file's HTML or XHTML pages, together: runtime/markup.py's scanner takes its time per tag (~1.3 us
# on an EPYC core: 30 MiB of "<b/>" in a 30 KB .epub took 18 s of the one document thread), so they are counted
# before it runs
MAX_TAGS = 2_000_000


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
    soft_breaks: bool = False  # texts of markup (HTML, XML): a line break in one is a space, not a cut

    def rebuild(self, translations: list[str]) -> bytes:
        if len(translations) != len(self.texts):
            raise ValueError(f"{len(translations)} translations for {len(self.texts)} texts")
        return self._rebuild(translations)


def extension(filename: str) -> str:
    """The name's extension, lower case, with its dot ("" without one)."""
    name = re.split(r"[/\\]", filename)[-1]
    dot = name.rfind(".")
    return name[dot:].lower() if dot > 0 else ""


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
    if not bom and data.count(0) * 3 >= len(data) > 0:  # ASCII in UTF-16 or UTF-32 reads as UTF-8 with NULs
        raise DocumentError(f"the {what} is not UTF-8 text: a third or more of its bytes are 0, as in UTF-16 or "
                            "UTF-32 without a byte-order mark; save it as UTF-8")
    return text, lambda out: bom + out.encode(encoding, "surrogatepass")


DECLARED = re.compile(r"""<\?xml[^>]*?\bencoding\s*=\s*["']([\w.:-]+)|<meta\b[^>]*?\bcharset\s*=\s*["']?([\w.:-]+)""",
                      re.IGNORECASE)


def declared_encoding(page: str) -> str | None:
    """"ascii" for an ASCII page that declares an encoding other than UTF-8 in its first 1024 characters (an XML
    declaration's, a meta's): its rebuilt bytes stay ASCII, every other character a character reference, which
    reads right under any ASCII-compatible encoding, known here or not (in UTF-8 under `<meta
    charset="iso-8859-1">`, "Größe" showed as "GrÃ¶Ãe"). None: UTF-8 (or a UTF-16/32 label, which a page read
    as UTF-8 means as UTF-8), nothing declared, or a page that is not ASCII (UTF-8 whatever it says, as before)."""
    m = DECLARED.search(page[:1024])
    if m is None or not page.isascii():
        return None
    label = (m[1] or m[2]).lower().replace("_", "-")
    if label.startswith(("utf-8", "utf8", "utf-16", "utf-32", "unicode")) or label in ("x-unicode20utf8",
                                                                                     "ucs-2", "iso-10646-ucs-2"):
        return None
    return "ascii"


LINE = re.compile(r"([^\r\n]*)(\r\n|\r|\n|$)")


def _lines(text: str) -> Iterator[re.Match[str]]:
    """Each line as a match: group 1 the line, group 2 its end (the last line's is "")."""
    for m in LINE.finditer(text):
        if m.start() == len(text) and m.start() > 0:
            return
        yield m


def too_many_texts(max_texts: int) -> DocumentError:
    return DocumentError(f"the file has more than {max_texts} texts, this server's limit per request "
                         "(--max-sentences); split the file", too_large=True)


def _counted(texts: list[str], max_texts: int | None) -> None:
    """Refuse at once a file with more than `max_texts` texts (before the rest of it is read)."""
    if max_texts is not None and len(texts) > max_texts:
        raise too_many_texts(max_texts)


def _spliced(text: str, spans: list[tuple[int, int]], parts: Iterator[str]) -> str:
    """`text` with text[a:b] replaced by the next of `parts`, for each (a, b) of `spans` (in order)."""
    out, copied = [], 0
    for (a, b), part in zip(spans, parts):
        out += [text[copied:a], part]
        copied = b
    return "".join(out) + text[copied:]


def read_txt(data: bytes, max_texts: int | None = None) -> Document:
    """Each line with letters a text; the rest of the file (line ends, lines without letters) copied. Only the
    texts are kept apart, so a file of a million lines without letters costs no more than its string."""
    text, encode = _decode(data, ".txt file")
    spans: list[tuple[int, int]] = []
    texts: list[str] = []
    for m in _lines(text):
        if has_letters(m.group(1)):
            spans.append(m.span(1))
            texts.append(m.group(1))
            _counted(texts, max_texts)
    return Document(texts, lambda translations: encode(_spliced(text, spans, iter(translations))))


def read_html(data: bytes, max_texts: int | None = None) -> Document:
    text, encode = _decode(data, "HTML file")
    declared = None if data.startswith(tuple(bom for bom, _ in BOMS)) else declared_encoding(text)
    if declared is not None:
        encode = lambda out: out.encode(declared, "xmlcharrefreplace")  # noqa: E731
    if text.count("<") > MAX_TAGS:
        raise DocumentError(f"the HTML file holds more than this server's limit of {MAX_TAGS:,} tags; split the "
                            "file", too_large=True)
    try:
        markup = parse_html(text, max_texts)
    except TooManyTexts as e:
        raise too_many_texts(e.limit) from None
    return Document(list(markup.sources), lambda translations: encode(markup.rebuild(translations)), True)


TIMING = re.compile(r"\s*\d+:\d{1,2}:\d{1,2}[,.]\d{1,3}\s*-->\s*\d+:\d{1,2}:\d{1,2}[,.]\d{1,3}.*")
INDEX = re.compile(r"\s*\d+\s*")
TAG = re.compile(r"(<[^<>]*>|\{\\[^{}]*\})")  # <i>, </font>, {\an8}: copied, never translated
SPACES = re.compile(r"\s*")
DASHES = re.compile(r"[-\u2013\u2014]+\s*")  # after spaces and tags: "- ", "<i>–", a speaker's turn (_mark)


@dataclass
class _Turn:
    """A run of a cue's text lines translated as one text: where its text starts, each line's end (its line
    break), where the last one's end stops; and the joined text cut at tags."""

    start: int
    ends: list[str]
    stop: int
    cut: list[str]


def read_srt(data: bytes, max_texts: int | None = None) -> Document:
    """Each cue's text, or each speaker's turn in a dialogue (see `_turns`); only those with letters are kept
    apart, the rest is copied. A timing line starts a cue even without the blank line before it, as VLC and
    ffmpeg read it: the index line just before it is that cue's, not the previous cue's text."""
    text, encode = _decode(data, ".srt file")
    turns: list[_Turn] = []
    texts: list[str] = []
    lines = _lines(text)
    m = next(lines, None)
    cues = 0
    while m is not None:
        if not TIMING.fullmatch(m.group(1)):
            m = next(lines, None)
            continue
        cues += 1
        block: list[re.Match[str]] = []
        m = next(lines, None)
        while m is not None and m.group(1).strip() and not TIMING.fullmatch(m.group(1)):
            block.append(m)
            m = next(lines, None)
        if m is not None and m.group(1).strip() and block and INDEX.fullmatch(block[-1].group(1)):
            block.pop()  # ended by a timing line: the line before it is the next cue's index
        for start, run in _turns(block):
            joined = " ".join([text[start:run[0].end(1)].strip(), *(line.group(1).strip() for line in run[1:])])
            cut = TAG.split(joined.strip())
            said = [p for k, p in enumerate(cut) if k % 2 == 0 and has_letters(p)]
            if said:
                turns.append(_Turn(start, [line.group(2) for line in run], run[-1].end(), cut))
                texts.extend(said)
                _counted(texts, max_texts)
    if not cues and has_letters(text):  # it came back unchanged, as if translated
        raise DocumentError("the .srt file has no subtitle cue: each is an index line, a timing line "
                            "(00:00:01,000 --> 00:00:02,500, hours included), then its text; for plain text, "
                            "send a .txt file")

    def turn_text(turn: _Turn, given: Iterator[str]) -> str:
        joined = "".join(next(given) if k % 2 == 0 and has_letters(p) else p for k, p in enumerate(turn.cut))
        # fewer words than lines: the last lines go, each line kept with its own line end
        return "".join(line + end for line, end in zip(_wrap(joined, len(turn.ends)), turn.ends))

    def rebuild(translations: list[str]) -> bytes:
        given = iter(translations)
        return encode(_spliced(text, [(t.start, t.stop) for t in turns], (turn_text(t, given) for t in turns)))

    return Document(texts, rebuild)


def _turns(block: list[re.Match[str]]) -> Iterator[tuple[int, list[re.Match[str]]]]:
    """The cue's lines cut into speakers' turns, each with where its text starts. A line that starts with a
    dash ("- Hi.", "<i>– Hi.</i>") starts a turn, and its dash (tags and spaces around it too) is copied, not
    translated: joined with the other speaker's line it moved when the text was wrapped again. A line without
    one goes on the turn before (a sentence running over its lines), so a cue without dashes is one turn."""
    run: list[re.Match[str]] = []
    start = 0
    for line in block:
        mark = _mark(line.group(1))
        if mark and run:
            yield start, run
            run = []
        if not run:
            start = line.start() + mark
        run.append(line)
    if run:
        yield start, run


def _mark(line: str) -> int:
    """Where the text after a line's speaker mark (spaces and tags, then a dash and spaces) starts; 0 without one.
    Read tag by tag: a regular expression repeating a group would keep state for each tag of a hostile line."""
    i = SPACES.match(line).end()  # type: ignore[union-attr]  # \s* always matches
    while (tag := TAG.match(line, i)) is not None:
        i = SPACES.match(line, tag.end()).end()  # type: ignore[union-attr]
    dash = DASHES.match(line, i)
    return dash.end() if dash else 0


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
