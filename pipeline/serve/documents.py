"""Documents in, documents out, for LibreTranslate's POST /translate_file: `read_document` takes a file's name
and bytes and gives its texts to translate, in order, and a `rebuild` that writes the same format back with
the translations in place of the texts and everything else (styles, runs, tables, slides, shapes, timings,
markup, pictures) as it was. The rules, written down in docs/serving.md:

- .txt: each line is a text; line ends and blank lines are kept.
- .html / .htm: runtime/markup.py's rule (each text node a text, the markup copied byte for byte).
- .srt: each cue's text lines are one text (joined with a space); index and timing lines are copied; the
  translation is broken at spaces into as many lines as the cue had (fewer if it has fewer words), and tags
  like <i> are copied, the text between them translated.
- .docx, .pptx, .odt, .odp: each paragraph (w:p, a:p, text:p / text:h), cut at its tabs and line breaks, is
  a text: its runs' text translated as one, the translation put in the paragraph's first run (its formatting)
  and the other runs emptied, never removed. Word: the body, headers, footers, footnotes, endnotes and
  comments; PowerPoint: slides and notes; OpenDocument: content.xml (and a text's styles.xml, which holds
  its headers and footers).
- .epub: each XHTML member as .html.
A text without letters is not a text: it is kept as it is.

Read with the standard library's zipfile and lxml (both already under python-docx and python-pptx, which
read only part of a document: no text boxes, footnotes or notes), and every archive is bounded before it is
decompressed: members, each member's declared size, their total. XML is parsed without a DTD, entities or
the network, and a part that declares a DTD is refused (no OOXML or ODF part has one)."""

from __future__ import annotations

import codecs
import io
import re
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from lxml import etree  # type: ignore[import-untyped]  # no stubs in the wheel; lxml-stubs lags it

from runtime.markup import parse_html

MAX_FILE_BYTES = 20 << 20  # an upload (POST /translate_file's "file")
MAX_UNZIPPED_BYTES = 100 << 20  # what an archive (.docx, .pptx, .odt, .odp, .epub) may unpack to, all members
MAX_MEMBERS = 10_000  # members of an archive
MAX_XML_BYTES = 32 << 20  # the XML parts parsed from one archive, together

SUPPORTED = (".txt", ".html", ".htm", ".srt", ".docx", ".pptx", ".odt", ".odp", ".epub")
MEDIA_TYPES = {
    ".txt": "text/plain; charset=utf-8", ".html": "text/html; charset=utf-8", ".htm": "text/html; charset=utf-8",
    ".srt": "application/x-subrip",
    ".docx": "application/vnd.openxmlformats-officedocument.wordprocessingml.document",
    ".pptx": "application/vnd.openxmlformats-officedocument.presentationml.presentation",
    ".odt": "application/vnd.oasis.opendocument.text",
    ".odp": "application/vnd.oasis.opendocument.presentation",
    ".epub": "application/epub+zip",
}

W = "{http://schemas.openxmlformats.org/wordprocessingml/2006/main}"
A = "{http://schemas.openxmlformats.org/drawingml/2006/main}"
TEXT = "{urn:oasis:names:tc:opendocument:xmlns:text:1.0}"
XML_SPACE = "{http://www.w3.org/XML/1998/namespace}space"


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


def read_document(filename: str, data: bytes) -> Document:
    """The file's texts and how to rebuild it (DocumentError naming what is wrong). CPU work in proportion to
    the file: the route runs it off the event loop."""
    ext = extension(filename)
    if ext not in READERS:
        raise DocumentError(f"the format {ext or '(no extension)'} is not supported; supported: "
                            f"{', '.join(SUPPORTED)}")
    if len(data) > MAX_FILE_BYTES:
        raise DocumentError(f"the file has {len(data)} bytes, more than this server's limit of {MAX_FILE_BYTES} "
                            f"({MAX_FILE_BYTES >> 20} MiB)", too_large=True)
    return READERS[ext](data)


def _letters(text: str) -> bool:
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
    places = [i for i, (line, _) in enumerate(lines) if _letters(line)]

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
        texts.extend(p for k, p in enumerate(cut) if k % 2 == 0 and _letters(p))

    def rebuild(translations: list[str]) -> bytes:
        out: list[str | None] = [line for line, _ in lines]
        given = iter(translations)
        for (first, last), cut in zip(cues, pieces):
            cue = "".join(next(given) if k % 2 == 0 and _letters(p) else p for k, p in enumerate(cut))
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


# -- archives: .docx, .pptx, .odt, .odp, .epub --------------------------------------------------------------


def _members(data: bytes, what: str) -> list[tuple[zipfile.ZipInfo, bytes]]:
    """Every member of the archive, decompressed after the bounds are checked on the sizes it declares
    (zipfile stops at the declared size and checks the CRC: a member holding more is an error, not a bomb)."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        infos = archive.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError, OSError) as e:
        raise DocumentError(f"the file is not a readable {what} (not a zip archive: {e})") from None
    if len(infos) > MAX_MEMBERS:
        raise DocumentError(f"the {what} has {len(infos)} members, more than this server's limit of {MAX_MEMBERS}",
                            too_large=True)
    total = sum(info.file_size for info in infos)
    if total > MAX_UNZIPPED_BYTES:
        raise DocumentError(f"the {what} unpacks to {total} bytes, more than this server's limit of "
                            f"{MAX_UNZIPPED_BYTES} ({MAX_UNZIPPED_BYTES >> 20} MiB)", too_large=True)
    members = []
    for info in infos:
        try:
            with archive.open(info) as member:
                content = member.read()
        except Exception as e:  # bad CRC, unknown compression, encrypted, truncated: the file's fault
            raise DocumentError(f"the {what} is damaged: its member {info.filename[:100]!r} cannot be read "
                                f"({type(e).__name__}: {e})") from None
        members.append((info, content))
    return members


def _zip(members: list[tuple[zipfile.ZipInfo, bytes]]) -> bytes:
    """The archive again, its members in their order, each compressed as it was (an OpenDocument's or EPUB's
    first member, mimetype, stays first and stored)."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        for info, content in members:
            date = info.date_time if info.date_time[0] >= 1980 else (1980, 1, 1, 0, 0, 0)
            try:
                copy = zipfile.ZipInfo(info.filename, date)
            except ValueError:
                copy = zipfile.ZipInfo(info.filename)
            copy.compress_type = zipfile.ZIP_STORED if info.compress_type == zipfile.ZIP_STORED \
                else zipfile.ZIP_DEFLATED
            copy.external_attr = info.external_attr
            archive.writestr(copy, content)
    return out.getvalue()


def _parse_xml(content: bytes, name: str, what: str) -> Any:
    parser = etree.XMLParser(resolve_entities=False, no_network=True, load_dtd=False, huge_tree=False)
    try:
        tree = etree.parse(io.BytesIO(content), parser)
    except etree.XMLSyntaxError as e:
        raise DocumentError(f"the {what} is damaged: its part {name!r} is not readable XML ({e})") from None
    if tree.docinfo.internalDTD is not None or tree.docinfo.doctype:
        raise DocumentError(f"the {what}'s part {name!r} declares a DTD, which this server does not read")
    return tree


def _serialize(tree: Any) -> bytes:
    info = tree.docinfo
    return etree.tostring(tree, xml_declaration=True, encoding=info.encoding or "UTF-8",
                          standalone=info.standalone)


Slot = tuple[Any, str]  # an element and "text" or "tail": where a piece of a paragraph's text is


def _ooxml_segments(root: Any, paragraph: str, run_text: Callable[[Any], bool], breaks: frozenset[str]
                    ) -> Iterator[list[Slot]]:
    """Each paragraph's runs of text between its breaks (tabs, line breaks), in document order; a paragraph
    inside another (a text box in a run) is its own."""
    def walk(element: Any, segments: list[list[Slot]] | None) -> Iterator[list[Slot]]:
        for child in element:
            tag = child.tag
            if tag == paragraph:
                mine: list[list[Slot]] = [[]]
                yield from walk(child, mine)
                yield from mine
            elif segments is not None and tag in breaks:
                segments.append([])
            elif segments is not None and run_text(child):
                segments[-1].append((child, "text"))
            else:
                yield from walk(child, segments)

    yield from walk(root, None)


def _odf_segments(root: Any) -> Iterator[list[Slot]]:
    """As _ooxml_segments for OpenDocument, whose paragraphs hold their text as element text and tails."""
    paragraphs = {TEXT + "p", TEXT + "h"}
    breaks = {TEXT + "tab", TEXT + "line-break", TEXT + "s"}

    def walk(element: Any, segments: list[list[Slot]] | None) -> Iterator[list[Slot]]:
        if element.tag in paragraphs:
            segments = [[]]
        if segments is not None and element.text:
            segments[-1].append((element, "text"))
        for child in element:
            if not isinstance(child.tag, str):  # comments, processing instructions: their tails still count
                pass
            elif segments is not None and child.tag in breaks:
                segments.append([])
            else:
                yield from walk(child, segments if child.tag not in paragraphs else None)
            if segments is not None and child.tail:
                segments[-1].append((child, "tail"))
        if element.tag in paragraphs:
            yield from segments  # type: ignore[misc]

    yield from walk(root, None)


def _segment_text(slots: list[Slot]) -> str:
    return "".join(getattr(element, where) or "" for element, where in slots)


def _put(slots: list[Slot], translation: str, preserve: bool) -> None:
    """The translation in the first slot (its run's formatting), the others emptied."""
    for k, (element, where) in enumerate(slots):
        setattr(element, where, translation if k == 0 else "")
        if preserve and where == "text":
            element.set(XML_SPACE, "preserve")


def _read_xml_archive(data: bytes, what: str, parts: re.Pattern[str], required: str,
                      segments: Callable[[Any], Iterator[list[Slot]]], preserve: bool) -> Document:
    members = _members(data, what)
    names = [info.filename for info, _ in members]
    if required not in names:
        raise DocumentError(f"the file is not a {what}: it has no {required}")
    slots: list[list[Slot]] = []
    trees: dict[int, Any] = {}
    parsed = 0
    for index, (info, content) in enumerate(members):
        if not parts.fullmatch(info.filename):
            continue
        parsed += len(content)
        if parsed > MAX_XML_BYTES:
            raise DocumentError(f"the {what}'s text parts hold more than this server's limit of {MAX_XML_BYTES} "
                                f"bytes of XML ({MAX_XML_BYTES >> 20} MiB)", too_large=True)
        tree = trees[index] = _parse_xml(content, info.filename, what)
        slots.extend(s for s in segments(tree.getroot()) if s and _letters(_segment_text(s)))

    def rebuild(translations: list[str]) -> bytes:
        for segment, translation in zip(slots, translations):
            _put(segment, translation, preserve)
        return _zip([(info, _serialize(trees[k]) if k in trees else content)
                     for k, (info, content) in enumerate(members)])

    return Document([_segment_text(s) for s in slots], rebuild)


DOCX_PARTS = re.compile(r"word/(document|header\d*|footer\d*|footnotes|endnotes|comments)\.xml")
PPTX_PARTS = re.compile(r"ppt/(slides/slide|notesSlides/notesSlide)\d+\.xml")


DOCX_BREAKS = frozenset({W + "tab", W + "br", W + "cr", W + "ptab"})


def read_docx(data: bytes) -> Document:
    return _read_xml_archive(data, "Word document (.docx)", DOCX_PARTS, "word/document.xml",
                             lambda root: _ooxml_segments(root, W + "p", lambda e: e.tag == W + "t", DOCX_BREAKS),
                             True)


def read_pptx(data: bytes) -> Document:
    return _read_xml_archive(data, "PowerPoint presentation (.pptx)", PPTX_PARTS, "ppt/presentation.xml",
                             lambda root: _ooxml_segments(root, A + "p", _pptx_run_text, frozenset({A + "br"})),
                             False)


def _pptx_run_text(element: Any) -> bool:
    """A run's a:t (a field's, as a slide number or date, is the application's to fill)."""
    return bool(element.tag == A + "t" and element.getparent().tag == A + "r")


def read_odt(data: bytes) -> Document:
    return _read_xml_archive(data, "OpenDocument text (.odt)", re.compile(r"content\.xml|styles\.xml"),
                             "content.xml", _odf_segments, False)


def read_odp(data: bytes) -> Document:
    return _read_xml_archive(data, "OpenDocument presentation (.odp)", re.compile(r"content\.xml"),
                             "content.xml", _odf_segments, False)


def read_epub(data: bytes) -> Document:
    what = "EPUB book (.epub)"
    members = _members(data, what)
    if not any(info.filename == "META-INF/container.xml" for info, _ in members):
        raise DocumentError(f"the file is not an {what}: it has no META-INF/container.xml")
    texts: list[str] = []
    pages: dict[int, tuple[Any, int]] = {}  # member -> its markup and how many texts it has
    for index, (info, content) in enumerate(members):
        if extension(info.filename) not in (".xhtml", ".html", ".htm"):
            continue
        try:
            markup = parse_html(content.decode("utf-8-sig"))
        except UnicodeDecodeError as e:
            raise DocumentError(f"the {what}'s page {info.filename[:100]!r} is not UTF-8 (byte {e.start})") from None
        pages[index] = (markup, len(markup.sources))
        texts.extend(markup.sources)

    def rebuild(translations: list[str]) -> bytes:
        given = iter(translations)
        out = []
        for k, (info, content) in enumerate(members):
            if k in pages:
                markup, n = pages[k]
                content = markup.rebuild([next(given) for _ in range(n)]).encode("utf-8")
            out.append((info, content))
        return _zip(out)

    return Document(texts, rebuild)


READERS: dict[str, Callable[[bytes], Document]] = {
    ".txt": read_txt, ".html": read_html, ".htm": read_html, ".srt": read_srt, ".docx": read_docx,
    ".pptx": read_pptx, ".odt": read_odt, ".odp": read_odp, ".epub": read_epub,
}
