"""The archive formats of POST /translate_file (.docx, .pptx, .odt, .odp, .epub): their paragraphs' texts out and
translations back, read within zip_parts.py's bounds; the rules are documents.py's."""

from __future__ import annotations

import codecs
import copy
import re
from collections.abc import Callable, Iterator
from typing import Any

from lxml import etree  # type: ignore[import-untyped]  # no stubs in the wheel; lxml-stubs lags it

from pipeline.serve.text_formats import Document, DocumentError, declared_encoding, extension, too_many_texts
from pipeline.serve.zip_parts import Archive, XmlBudget, parse_xml, serialize
from runtime.markup import TooManyTexts, parse_html
from runtime.sentences import has_letters

W = "{http://schemas.openxmlformats.org/wordprocessingml/2006/main}"
A = "{http://schemas.openxmlformats.org/drawingml/2006/main}"
TEXT = "{urn:oasis:names:tc:opendocument:xmlns:text:1.0}"
XML_SPACE = "{http://www.w3.org/XML/1998/namespace}space"
STRICT = "{http://purl.oclc.org/ooxml/"  # Strict Open XML's namespaces: the same parts under other names


Slot = tuple[Any, str]  # where a piece of a paragraph's text is: an element and "text" or "tail"; a text:s and "spaces"


def _ooxml_segments(root: Any, paragraph: str, text: str, breaks: frozenset[str],
                    fields: frozenset[str] = frozenset(), inline: Callable[[Any], set[Any]] = lambda root: set(),
                    skipped: Callable[[Any], bool] = lambda element: False) -> Iterator[list[Slot]]:
    """Each paragraph's runs of text (`text` elements) between its breaks (tabs, line breaks, a complex
    field's marks), in document order; a paragraph inside another (a text box in a run) is its own. A field
    (`fields`) is cut off on both sides: its value is never merged with the sentence around it. `inline`: the
    field elements of `root` that are neither (a link's words are the sentence's). What is `skipped` (hidden
    text, a ruby's reading) is copied as it is, and the sentence flows around it. A character element (CHARS:
    Word's non-breaking hyphen) is its character in the text."""
    kept = inline(root)

    def walk(element: Any, segments: list[list[Slot]] | None) -> Iterator[list[Slot]]:
        for child in element:
            tag = child.tag
            if skipped(child):
                continue
            if segments is not None and tag in CHARS:
                segments[-1].append((child, "char"))
            elif tag == paragraph:
                mine: list[list[Slot]] = [[]]
                yield from walk(child, mine)
                yield from mine
            elif segments is not None and tag in breaks and child not in kept:
                segments.append([])
            elif segments is not None and tag == text and child.text and not child.text.strip("\t"):
                segments.append([])  # tabs alone (a pptx run's, _tabs_apart): a break, kept as it is
            elif segments is not None and tag == text:
                segments[-1].append((child, "text"))
            elif segments is not None and tag in fields and child not in kept:
                segments.append([])
                yield from walk(child, segments)
                segments.append([])
            else:
                yield from walk(child, segments)

    yield from walk(root, None)


ODF_PARAGRAPHS = frozenset({TEXT + "p", TEXT + "h"})
# their text is the sentence's (a ruby's base word too; its reading is anchored)
ODF_INLINE = frozenset({TEXT + "span", TEXT + "a", TEXT + "meta", TEXT + "ruby", TEXT + "ruby-base"})
ODF_BREAKS = frozenset({TEXT + "tab", TEXT + "line-break"})
ODF_ANCHORED = frozenset({TEXT + "note", TEXT + "ruby-text"})  # and all outside TEXT: office:annotation, draw:frame
# cuts whose value the application fills (a slide's "<number>" placeholder too): never sent, never changed
ODF_FILLED = frozenset({TEXT + "page-number", TEXT + "page-count"})
CHANGE_START, CHANGE_END = TEXT + "change-start", TEXT + "change-end"  # a tracked change's marks in a paragraph
ODF_SKIPPED = frozenset({TEXT + "tracked-changes"})  # the text a tracked change deleted: copied, as Word's delText
MAX_SPACES = 16  # what one text:s adds to a text: no more characters than its XML, whatever its text:c says


def _odf_segments(root: Any) -> Iterator[list[Slot]]:
    """As _ooxml_segments for OpenDocument, whose paragraphs hold their text as element text and tails.
    text:s (extra spaces) of one space (a double space) is part of the sentence; of more, a gap the layout
    needs (ODF shows consecutive spaces as one), kept as it is, and a cut. What is anchored in
    a paragraph (a footnote, a comment, a frame, ruby) is not: its own paragraphs are texts of their own and
    the rest (citation, author, date, alt text) is copied, so the anchor ends up after the translated sentence,
    as a Word footnote reference does. Any other text element that holds text is a field (page number, date,
    reference) cut off on both sides; one that holds none (a bookmark, a change mark) never cuts a sentence."""
    def walk(element: Any, segments: list[list[Slot]] | None) -> Iterator[list[Slot]]:
        if element.tag in ODF_PARAGRAPHS:
            segments = [[]]
        if segments is not None and element.text:
            segments[-1].append((element, "text"))
        for child in element:
            tag = child.tag
            if not isinstance(tag, str):  # comments, processing instructions: their tails still count
                pass
            elif tag in ODF_SKIPPED:
                continue
            elif segments is not None and tag in ODF_FILLED:
                segments.append([])
            elif segments is None or tag in ODF_PARAGRAPHS or tag in ODF_ANCHORED or not tag.startswith(TEXT):
                yield from walk(child, None)
            elif tag in ODF_BREAKS:
                segments.append([])
            elif tag == TEXT + "s" and _spaces(child) > 1:  # 3 spaces or more: a gap of the layout, kept, a cut
                segments.append([])
            elif tag == TEXT + "s":  # the second space of a double one: part of the sentence
                segments[-1].append((child, "spaces"))
            elif tag in ODF_INLINE:
                yield from walk(child, segments)
            elif any(child.itertext()):  # a field
                segments.append([])
                yield from walk(child, segments)
                segments.append([])
            if segments is not None and child.tail:
                segments[-1].append((child, "tail"))
        if element.tag in ODF_PARAGRAPHS:
            yield from (_unindented(s) for s in segments)  # type: ignore[union-attr]

    yield from walk(root, None)


def _unindented(segment: list[Slot]) -> list[Slot]:
    """The segment from its first text on: the spaces and blank text before it are indentation, left as is."""
    for k, slot in enumerate(segment):
        if slot[1] in ("text", "tail") and _segment_text([slot]).strip():
            return segment[k:]
    return []


def _spaces(element: Any) -> int:
    """The spaces a text:s stands for: text:c, 1 when it is missing or not a count."""
    try:
        return min(max(int(element.get(TEXT + "c", "1")), 1), MAX_SPACES)
    except ValueError:
        return 1


W_CHARS = {W + "noBreakHyphen": "\u2011"}
CHARS = frozenset(W_CHARS)


def _segment_text(slots: list[Slot]) -> str:
    return "".join(" " * _spaces(element) if where == "spaces" else W_CHARS[element.tag] if where == "char"
                   else getattr(element, where) or "" for element, where in slots)


Prefer = Callable[[Any, str], bool]  # may a text slot (element, where) hold its paragraph's translation (_put)?


def _put(slots: list[Slot], translation: str, preserve: bool, prefer: Prefer | None = None) -> None:
    """The translation in the first text slot `prefer`red (else the first; its run's formatting), the others emptied;
    text:s and character elements removed (the translation has its own), their tails kept."""
    texts = [(element, where) for element, where in slots if where in ("text", "tail")]
    first = next((k for k, slot in enumerate(texts) if prefer is None or prefer(*slot)), 0)
    for k, (element, where) in enumerate(texts):
        setattr(element, where, translation if k == first else "")
        if preserve and where == "text":
            element.set(XML_SPACE, "preserve")
    for element, where in slots:
        parent = element.getparent()
        if where in ("text", "tail") or parent is None:
            continue
        previous = element.getprevious()
        if element.tail and previous is not None:
            previous.tail = (previous.tail or "") + element.tail
        elif element.tail:
            parent.text = (parent.text or "") + element.tail
        parent.remove(element)


def _read_xml_archive(data: bytes, what: str, parts: re.Pattern[str], required: str,
                      segments: Callable[[Any], Iterator[list[Slot]]], preserve: bool,
                      prefer: Callable[[Any], Prefer] | None = None, max_texts: int | None = None) -> Document:
    archive = Archive(data, what)
    if required not in archive.names and not any(parts.fullmatch(name) and name.startswith(required.split(".")[0])
                                                 for name in archive.names):  # (Word Online's word/document2.xml)
        raise DocumentError(f"the file is not {'an' if what[0] in 'AEIOU' else 'a'} {what}: it has no {required}")
    if b"encryption-data" in (archive.small("META-INF/manifest.xml") or b""):  # ODF's: its parts are ciphertext
        raise DocumentError(f"the {what} is password-protected; save it without a password")  # (it was "damaged")
    slots: list[list[Slot]] = []
    rules: list[Prefer | None] = []  # each segment's part's rule
    trees: dict[int, Any] = {}
    budget = XmlBudget(what, "text parts", max_texts)
    for index, info, content in archive.members(lambda name: parts.fullmatch(name) is not None):
        budget.take(content)
        tree = trees[index] = parse_xml(content, info.filename, what)
        if str(tree.getroot().tag).startswith(STRICT):
            raise DocumentError(f"the {what} is saved as Strict Open XML ({info.filename!r}), which this server does "
                                "not read; save it in the default (transitional) format")
        for segment in segments(tree.getroot()):
            if segment and has_letters(_segment_text(segment)):
                slots.append(segment)
                budget.found()
        rules.extend([prefer(tree.getroot()) if prefer else None] * (len(slots) - len(rules)))

    def rebuild(translations: list[str]) -> bytes:
        for segment, translation, rule in zip(slots, translations, rules):
            _put(segment, translation, preserve, rule)
        return archive.rebuilt({k: serialize(tree) for k, tree in trees.items()})

    return Document([_segment_text(s) for s in slots], rebuild, True)


DOCX_PARTS = re.compile(r"word/(document\d*|header\d*|footer\d*|footnotes|endnotes|comments)\.xml")
PPTX_PARTS = re.compile(r"ppt/(slides/slide|notesSlides/notesSlide)\d+\.xml")


# fldChar: the marks around a complex field's code and shown value, which is thus a text of its own; a symbol of
# a symbol font (no Unicode character) and a page number
DOCX_BREAKS = frozenset({W + "tab", W + "br", W + "cr", W + "ptab", W + "fldChar", W + "sym", W + "pgNum"})
DOCX_FIELDS = frozenset({W + "fldSimple", W + "sdt"})  # a content control's value is the control's, as a field's
PPTX_BREAKS = frozenset({A + "br", A + "fld"})  # a field's text (slide number, date) is the application's to fill


def read_docx(data: bytes, max_texts: int | None = None) -> Document:
    return _read_xml_archive(data, "Word document (.docx)", DOCX_PARTS, "word/document.xml",
                             lambda root: _ooxml_segments(root, W + "p", W + "t", DOCX_BREAKS, DOCX_FIELDS,
                                                          _docx_links, _docx_unseen), True, lambda root: _docx_plain,
                             max_texts)


def _docx_unseen(element: Any) -> bool:
    """A hidden run (w:vanish), a ruby's reading (w:rt) or text a tracked move took away (w:moveFrom, in w:t where a
    deletion's is w:delText: it was translated, and the paragraph's translation put in it, so accepting the move
    deleted the sentence): not words of the sentence the reader sees."""
    if element.tag in (W + "rt", W + "moveFrom"):
        return True
    return element.tag == W + "r" and _on(element.find(f"{W}rPr/{W}vanish"))


def _on(toggle: Any) -> bool:
    """A Word toggle property present and not turned off (w:val 0, false or off)."""
    return toggle is not None and toggle.get(W + "val", "true").lower() not in ("0", "false", "off")


def _docx_plain(text: Any, where: str) -> bool:
    """A w:t the paragraph's translation may go into: not superscript or subscript (a footnote mark's format would
    become the sentence's) and not inside a tracked insertion or move (rejecting it would delete the sentence)."""
    run = text.getparent()
    shift = run.find(f"{W}rPr/{W}vertAlign") if run is not None else None
    return (shift is None or shift.get(W + "val") not in ("superscript", "subscript")) and next(
        text.iterancestors(W + "ins", W + "moveTo"), None) is None


def _docx_links(root: Any) -> set[Any]:
    """The marks (begin, separate, end) of the complex fields, and the simple fields, that are links (HYPERLINK):
    their shown value is words of the sentence, as a w:hyperlink's are, never cut off."""
    links = {e for e in root.iter(W + "fldSimple") if e.get(W + "instr", "").upper().split()[:1] == ["HYPERLINK"]}
    open_fields: list[tuple[list[Any], list[str]]] = []  # nested fields: each its marks and its code
    for element in root.iter(W + "fldChar", W + "instrText"):
        if element.tag == W + "instrText":
            if open_fields:
                open_fields[-1][1].append(element.text or "")
        elif element.get(W + "fldCharType") == "begin":
            open_fields.append(([element], []))
        elif open_fields:
            open_fields[-1][0].append(element)
            if element.get(W + "fldCharType") == "end":
                marks, code = open_fields.pop()
                if "".join(code).upper().split()[:1] == ["HYPERLINK"]:  # field codes ignore case
                    links.update(marks)
    return links


def read_pptx(data: bytes, max_texts: int | None = None) -> Document:
    return _read_xml_archive(data, "PowerPoint presentation (.pptx)", PPTX_PARTS, "ppt/presentation.xml",
                             lambda root: _ooxml_segments(_tabs_apart(root, max_texts), A + "p", A + "t",
                                                          PPTX_BREAKS),
                             False, max_texts=max_texts)


def _tabs_apart(root: Any, max_texts: int | None) -> Any:
    """`root` with each tab PowerPoint keeps inside a run's a:t ("Name:\tDer Hund") in a run of its own, which
    _ooxml_segments takes for a break, as Word's w:tab (the columns were one sentence and their tab lost). The
    runs it would make are counted first, against the texts a request may have (max_texts: "x\t" 100,000 times,
    an 859-byte upload, made 667 MiB of copies before the texts were counted)."""
    split = [(t, parts) for t in root.iter(A + "t") if "\t" in (t.text or "") and (t.text or "").strip("\t")
             and t.getparent() is not None and t.getparent().tag == A + "r"
             for parts in ([part for part in re.split("(\t+)", t.text) if part],)]
    if max_texts is not None and sum(len(parts) for _, parts in split) > 2 * max_texts + 1:  # a text, a tab...
        raise too_many_texts(max_texts)
    for t, parts in split:
        t.text, after = parts[0], t.getparent()
        for part in parts[1:]:
            clone = copy.deepcopy(after)
            clone.tail = None
            clone.find(A + "t").text = part
            after.addnext(clone)
            after = clone
    return root


def read_odt(data: bytes, max_texts: int | None = None) -> Document:
    return _read_xml_archive(data, "OpenDocument text (.odt)", re.compile(r"content\.xml|styles\.xml"),
                             "content.xml", _odf_segments, False, _odf_plain, max_texts)


def read_odp(data: bytes, max_texts: int | None = None) -> Document:
    return _read_xml_archive(data, "OpenDocument presentation (.odp)", re.compile(r"content\.xml"),
                             "content.xml", _odf_segments, False, _odf_plain, max_texts)


def _odf_plain(root: Any) -> Prefer:
    """The text slots of the part that a paragraph's translation may go into: not inside a tracked change (between
    a text:change-start and its text:change-end: rejecting an insertion would delete the sentence), as in Word
    (_docx_plain). One walk of the part, when it has such marks."""
    if next(root.iter(CHANGE_START), None) is None:
        return lambda element, where: True
    inside: set[tuple[Any, str]] = set()
    open_changes: set[str] = set()
    for event, node in etree.iterwalk(root, events=("start", "end")):
        if event == "start" and node.tag == CHANGE_START:
            open_changes.add(node.get(TEXT + "change-id", ""))
        elif event == "start" and node.tag == CHANGE_END:
            open_changes.discard(node.get(TEXT + "change-id", ""))
        if open_changes:  # a node's text follows its start; its tail, its end
            inside.add((node, "text" if event == "start" else "tail"))
    return lambda element, where: (element, where) not in inside


def read_epub(data: bytes, max_texts: int | None = None) -> Document:
    what = "EPUB book (.epub)"
    archive = Archive(data, what)
    if "META-INF/container.xml" not in archive.names:
        raise DocumentError(f"the file is not an {what}: it has no META-INF/container.xml")
    texts: list[str] = []
    pages: dict[int, tuple[Any, int, str]] = {}  # member -> its markup, how many texts it has, its encoding
    budget = XmlBudget(what, "pages", max_texts)
    for index, info, content in archive.members(lambda name: extension(name) in (".xhtml", ".html", ".htm")):
        budget.take(content, tree=False)  # (our tag scanner's, not a tree: its memory grows with the texts)
        left = budget.left()
        try:
            page = content.decode("utf-8-sig")  # .xhtml, or an XML declaration: XHTML's rules, not HTML's
            xhtml = extension(info.filename) == ".xhtml" or page.lstrip().startswith("<?xml")
            markup = parse_html(page, left, xml=xhtml)
        except UnicodeDecodeError as e:
            raise DocumentError(f"the {what}'s page {info.filename[:100]!r} is not UTF-8 (byte {e.start})") from None
        except TooManyTexts as e:  # stopped as soon as it had one more than left
            budget.found(e.limit + 1)
            raise
        budget.found(len(markup.sources))
        encoding = "utf-8" if content.startswith(codecs.BOM_UTF8) else declared_encoding(page) or "utf-8"
        pages[index] = (markup, len(markup.sources), encoding)
        texts.extend(markup.sources)

    def rebuild(translations: list[str]) -> bytes:
        given = iter(translations)
        return archive.rebuilt({k: markup.rebuild([next(given) for _ in range(n)]).encode(encoding,
                                                                                          "xmlcharrefreplace")
                                for k, (markup, n, encoding) in pages.items()})

    return Document(texts, rebuild, True)
