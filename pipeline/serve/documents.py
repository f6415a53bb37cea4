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
A text without letters is not a text: it is kept as it is. A text found several times is translated once.

Read with the standard library's zipfile and lxml (both already under python-docx and python-pptx, which
read only part of a document: no text boxes, footnotes or notes), and every archive is bounded before it is
decompressed: members, each member's declared size, their total. XML is parsed without a DTD, entities or
the network, and a part that declares a DTD is refused (no OOXML or ODF part has one)."""

from __future__ import annotations

from collections.abc import Callable

from pipeline.serve.archive_formats import read_docx, read_epub, read_odp, read_odt, read_pptx
from pipeline.serve.text_formats import BOMS, Document, DocumentError, extension, read_html, read_srt, read_txt

__all__ = ["MAX_FILE_BYTES", "MEDIA_TYPES", "SUPPORTED", "Document", "DocumentError", "extension", "media_type",
           "read_document"]

MAX_FILE_BYTES = 20 << 20  # an upload (POST /translate_file's "file")

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


def media_type(ext: str, data: bytes) -> str:
    """A translated file's type: a text file written back in UTF-16 or UTF-32 (as it came, its byte-order mark
    kept) says that charset, not UTF-8."""
    kind = MEDIA_TYPES[ext]
    for bom, encoding in BOMS:
        if data.startswith(bom) and "charset=utf-8" in kind:
            return kind.replace("utf-8", encoding[:6])  # utf-16 / utf-32 (the mark tells the byte order)
    return kind


def read_document(filename: str, data: bytes, max_texts: int | None = None) -> Document:
    """The file's texts and how to rebuild it (DocumentError naming what is wrong; too_large past MAX_FILE_BYTES
    or `max_texts` texts, the plain formats refused as soon as they pass it, before the rest is parsed). CPU
    work in proportion to the file: the route runs it off the event loop."""
    ext = extension(filename)
    if ext not in READERS:
        raise DocumentError(f"the format {ext or '(no extension)'} is not supported; supported: "
                            f"{', '.join(SUPPORTED)}")
    if len(data) > MAX_FILE_BYTES:
        raise DocumentError(f"the file has {len(data)} bytes, more than this server's limit of {MAX_FILE_BYTES} "
                            f"({MAX_FILE_BYTES >> 20} MiB)", too_large=True)
    if ext in PLAIN:
        return _once_each(PLAIN[ext](data, max_texts))
    doc = _once_each(ARCHIVES[ext](data, max_texts))  # its texts (each with letters) counted each time they occur
    # as they are read (at most twice max_texts: zip_parts.REPEATS), and the distinct ones here
    if max_texts is not None and len(doc.texts) > max_texts:
        raise DocumentError(f"the file has {len(doc.texts)} texts, more than this server's limit of {max_texts} per "
                            "request (--max-sentences); split the file", too_large=True)
    return doc


def _once_each(doc: Document) -> Document:
    """The document with each distinct text sent once and its translation put wherever the text is: a repeated
    heading, cell or footer costs one translation and reads the same everywhere, and Word's text box, stored
    twice (mc:Choice and mc:Fallback), counts once against --max-sentences."""
    first: dict[str, int] = {}
    at = [first.setdefault(text, len(first)) for text in doc.texts]
    if len(first) == len(doc.texts):
        return doc
    return Document(list(first), lambda translations: doc.rebuild([translations[k] for k in at]), doc.soft_breaks)


PLAIN: dict[str, Callable[[bytes, int | None], Document]] = {
    ".txt": read_txt, ".html": read_html, ".htm": read_html, ".srt": read_srt}
ARCHIVES: dict[str, Callable[[bytes, int | None], Document]] = {
    ".docx": read_docx, ".pptx": read_pptx, ".odt": read_odt, ".odp": read_odp, ".epub": read_epub}
READERS = {**PLAIN, **ARCHIVES}
