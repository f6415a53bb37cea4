"""What sits inside a paragraph of a .docx, .pptx or .odt on POST /translate_file: footnotes, comments and
frames anchored in an OpenDocument sentence stay out of it and keep their citation, author, date and alt text;
text:s (a double space) and bookmarks never cut a sentence; a field's value (page number, date, slide number)
is never part of the sentence around it, and comes back as it was. Each read with read_odt / read_docx /
read_pptx and rebuilt with every text in brackets, so where each translation went shows; then the same files
through /translate_file."""

from __future__ import annotations

import io
import zipfile
from typing import Any

import pytest

pytest.importorskip("starlette")
pytest.importorskip("multipart")
pytest.importorskip("httpx")
pytest.importorskip("sentencex")

from lxml import etree  # type: ignore[import-untyped]  # noqa: E402
from test_serve_files import _docx_of, roundtrip, send, served  # noqa: E402

from pipeline.serve.archive_formats import read_docx, read_odt, read_pptx  # noqa: E402
from pipeline.serve.text_formats import Document, DocumentError  # noqa: E402

NS = {"office": "urn:oasis:names:tc:opendocument:xmlns:office:1.0",
      "text": "urn:oasis:names:tc:opendocument:xmlns:text:1.0",
      "draw": "urn:oasis:names:tc:opendocument:xmlns:drawing:1.0",
      "svg": "urn:oasis:names:tc:opendocument:xmlns:svg-compatible:1.0",
      "dc": "http://purl.org/dc/elements/1.1/", "xlink": "http://www.w3.org/1999/xlink",
      "w": "http://schemas.openxmlformats.org/wordprocessingml/2006/main",
      "a": "http://schemas.openxmlformats.org/drawingml/2006/main",
      "p": "http://schemas.openxmlformats.org/presentationml/2006/main"}
XMLNS = " ".join(f'xmlns:{k}="{v}"' for k, v in NS.items())


def _odt(body: str) -> bytes:
    """An .odt whose office:text is `body` (mimetype first and stored, as OpenDocument wants)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        z.writestr(zipfile.ZipInfo("mimetype"), "application/vnd.oasis.opendocument.text")
        z.writestr("content.xml", f'<?xml version="1.0" encoding="UTF-8"?><office:document-content {XMLNS} '
                                  f'office:version="1.3"><office:body><office:text>{body}</office:text></office:body>'
                                  "</office:document-content>", zipfile.ZIP_DEFLATED)
    return buffer.getvalue()


def _pptx(paragraph: str) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        z.writestr("ppt/presentation.xml", f"<p:presentation {XMLNS}/>")
        z.writestr("ppt/slides/slide1.xml", f"<p:sld {XMLNS}><p:cSld><p:spTree><p:sp><p:txBody>{paragraph}"
                                            "</p:txBody></p:sp></p:spTree></p:cSld></p:sld>")
    return buffer.getvalue()


def _docx(paragraph: str) -> bytes:
    return _docx_of(f"<w:document {XMLNS}><w:body>{paragraph}</w:body></w:document>")


def _bracketed(doc: Document) -> bytes:
    return doc.rebuild([f"[{t}]" for t in doc.texts])


def _part(data: bytes, name: str) -> Any:
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return etree.fromstring(z.read(name))


def _texts(root: Any, path: str) -> list[str]:
    return ["".join(e.itertext()) for e in root.xpath(path, namespaces=NS)]


ANCHORED = ('<text:p>da vopa vobi kinisa<text:note text:id="n1" text:note-class="footnote"><text:note-citation>1'
            "</text:note-citation><text:note-body><text:p>Die Anmerkung.</text:p></text:note-body></text:note>"
            " u misa<office:annotation><dc:creator>Hans Muster</dc:creator><dc:date>2024-05-01T10:00:00</dc:date>"
            "<text:p>Ein Kommentar.</text:p></office:annotation> bokomi"
            '<draw:frame draw:name="Bild1"><draw:image xlink:href="Pictures/a.png"/><svg:title>Der Titel</svg:title>'
            "<svg:desc>Eine Beschreibung</svg:desc></draw:frame> sipona.</text:p>")


def test_odt_notes_comments_and_frames_are_not_part_of_the_sentence() -> None:
    doc = read_odt(_odt(ANCHORED))
    assert doc.texts == ["Die Anmerkung.", "Ein Kommentar.", "da vopa vobi kinisa u misa bokomi sipona."]
    root = _part(_bracketed(doc), "content.xml")
    assert _texts(root, "//text:note-citation") == ["1"]
    assert _texts(root, "//dc:creator") == ["Hans Muster"] and _texts(root, "//dc:date") == ["2024-05-01T10:00:00"]
    assert _texts(root, "//svg:title") == ["Der Titel"] and _texts(root, "//svg:desc") == ["Eine Beschreibung"]
    assert _texts(root, "//text:note-body/text:p") == ["[Die Anmerkung.]"]
    assert _texts(root, "//office:annotation/text:p") == ["[Ein Kommentar.]"]
    sentence = root.xpath("//office:text/text:p", namespaces=NS)[0]
    assert sentence.text == "[da vopa vobi kinisa u misa bokomi sipona.]"  # the anchors after it, their tails empty
    assert [child.tail for child in sentence] == [None, None, None]


def test_odt_spaces_are_part_of_the_sentence_and_indentation_is_kept() -> None:
    body = ('<text:p><text:s text:c="4"/>Eingerückt</text:p>'
            '<text:p> <text:s text:c="3"/>Auch eingerückt</text:p>'
            '<text:p>Ein Satz <text:s/>mit <text:s/>Leerraum<text:span>, hier <text:s text:c="zz"/>auch'
            '</text:span> und <text:s text:c="-2"/>dort.</text:p>'
            '<text:p>Name:<text:s text:c="10"/>Wert</text:p>')  # a gap of the layout: two texts, the gap kept
    doc = read_odt(_odt(body))
    assert doc.texts == ["Eingerückt", "Auch eingerückt", "Ein Satz  mit  Leerraum, hier  auch und  dort.",
                         "Name:", "Wert"]
    root = _part(doc.rebuild(["INDENTED", "ALSO INDENTED", "A SENTENCE WITH SPACE, HERE TOO AND THERE.", "NAME:",
                              "VALUE"]), "content.xml")
    first, second, third, fourth = root.xpath("//office:text/text:p", namespaces=NS)
    assert fourth.text == "NAME:" and fourth[0].get(f"{{{NS['text']}}}c") == "10" and fourth[0].tail == "VALUE"
    assert etree.tostring(first[0], with_tail=True).endswith(b' text:c="4"/>INDENTED')
    assert second.text == " " and second[0].get(f"{{{NS['text']}}}c") == "3" and second[0].tail == "ALSO INDENTED"
    assert third.xpath(".//text:s", namespaces=NS) == []
    assert "".join(third.itertext()) == "A SENTENCE WITH SPACE, HERE TOO AND THERE."
    assert len(third.xpath("text:span", namespaces=NS)) == 1  # the span kept, emptied


def test_odt_fields_are_cut_off_and_kept_bookmarks_cut_nothing() -> None:
    body = ('<text:p>Seite <text:page-number text:select-page="current">7</text:page-number> von '
            '<text:page-count>10</text:page-count> Seiten, Stand <text:date text:date-value="2024-05-01">1. Mai 2024'
            '</text:date>, siehe <text:bookmark text:name="a"/>das <text:bookmark-start text:name="b"/>Kapitel'
            '<text:bookmark-end text:name="b"/> <text:soft-page-break/>hier.</text:p>')
    doc = read_odt(_odt(body))
    assert doc.texts == ["Seite ", " von ", " Seiten, Stand ", "1. Mai 2024", ", siehe das Kapitel hier."]
    root = _part(_bracketed(doc), "content.xml")
    assert _texts(root, "//text:page-number") == ["7"] and _texts(root, "//text:page-count") == ["10"]
    assert _texts(root, "//text:date") == ["[1. Mai 2024]"]  # a date in words is translated, alone
    assert _texts(root, "//office:text/text:p") == ["[Seite ]7[ von ]10[ Seiten, Stand ][1. Mai 2024]"
                                                    "[, siehe das Kapitel hier.]"]
    assert len(root.xpath("//text:bookmark | //text:bookmark-start | //text:bookmark-end", namespaces=NS)) == 3


def test_docx_complex_and_simple_fields_are_cut_off_and_kept() -> None:
    paragraph = ('<w:p><w:r><w:t xml:space="preserve">Seite </w:t></w:r><w:r><w:fldChar w:fldCharType="begin"/>'
                 '</w:r><w:r><w:instrText xml:space="preserve"> PAGE </w:instrText></w:r><w:r><w:fldChar '
                 'w:fldCharType="separate"/></w:r><w:r><w:t>7</w:t></w:r><w:r><w:fldChar w:fldCharType="end"/></w:r>'
                 '<w:r><w:t xml:space="preserve"> von </w:t></w:r><w:fldSimple w:instr="NUMPAGES"><w:r><w:t>10</w:t>'
                 '</w:r></w:fldSimple><w:r><w:t xml:space="preserve"> Seiten, Stand </w:t></w:r><w:fldSimple '
                 'w:instr="DATE"><w:r><w:t>1. Mai</w:t></w:r></w:fldSimple><w:r><w:t>.</w:t></w:r></w:p>')
    doc = read_docx(_docx(paragraph))
    assert doc.texts == ["Seite ", " von ", " Seiten, Stand ", "1. Mai"]
    root = _part(_bracketed(doc), "word/document.xml")
    assert _texts(root, "//w:t") == ["[Seite ]", "7", "[ von ]", "10", "[ Seiten, Stand ]", "[1. Mai]", "."]
    assert _texts(root, "//w:instrText") == [" PAGE "]


def test_docx_links_made_as_fields_stay_in_their_sentence() -> None:
    """A HYPERLINK field (as a w:hyperlink) holds words of the sentence: cutting at its marks made "Visit ",
    "our web site", " for details." three texts, translated apart."""
    paragraph = ('<w:p><w:r><w:t xml:space="preserve">Besuche </w:t></w:r><w:r><w:fldChar w:fldCharType="begin"/>'
                 '</w:r><w:r><w:instrText xml:space="preserve"> HYPERLINK "http://x.example" </w:instrText></w:r><w:r>'
                 '<w:fldChar w:fldCharType="separate"/></w:r><w:r><w:t>unsere Seite</w:t></w:r><w:r><w:fldChar '
                 'w:fldCharType="end"/></w:r><w:r><w:t xml:space="preserve"> oder </w:t></w:r><w:fldSimple '
                 'w:instr=" HYPERLINK &quot;http://y&quot; "><w:r><w:t>die andere</w:t></w:r></w:fldSimple><w:r><w:t '
                 'xml:space="preserve">, Seite </w:t></w:r><w:r><w:fldChar w:fldCharType="begin"/></w:r><w:r>'
                 '<w:instrText> PAGE </w:instrText></w:r><w:r><w:fldChar w:fldCharType="separate"/></w:r><w:r><w:t>3'
                 '</w:t></w:r><w:r><w:fldChar w:fldCharType="end"/></w:r><w:r><w:t>.</w:t></w:r></w:p>')
    doc = read_docx(_docx(paragraph))
    assert doc.texts == ["Besuche unsere Seite oder die andere, Seite "]  # the page number still cut off
    root = _part(_bracketed(doc), "word/document.xml")
    assert _texts(root, "//w:t")[0] == "[Besuche unsere Seite oder die andere, Seite ]"
    assert _texts(root, "//w:t")[-2:] == ["3", "."]


def test_pptx_fields_are_cut_off_and_kept() -> None:
    paragraph = ('<a:p><a:r><a:t>Folie </a:t></a:r><a:fld id="{B6F15528-21DE-4FAA-801E-634DDDAF4B2B}" '
                 'type="slidenum"><a:t>7</a:t></a:fld><a:r><a:t> von 10</a:t></a:r></a:p>')
    doc = read_pptx(_pptx(paragraph))
    assert doc.texts == ["Folie ", " von 10"]
    root = _part(_bracketed(doc), "ppt/slides/slide1.xml")
    assert _texts(root, "//a:t") == ["[Folie ]", "7", "[ von 10]"]


def test_pptx_tabs_inside_a_run_cut_the_paragraph_as_words_do() -> None:
    """PowerPoint keeps a tab in its run's text ("Preis\t12 Euro\tpro Stück"): the columns were one sentence,
    translated together, and the tab lost; docs/serving.md says a paragraph is cut at its tabs."""
    paragraph = ('<a:p><a:r><a:rPr b="1"/><a:t>Name:\tDer große Hund</a:t></a:r></a:p><a:p><a:r><a:t>Preis\t\t12 '
                 'Euro\tpro Stück</a:t></a:r><a:r><a:t>!</a:t></a:r></a:p><a:p><a:r><a:t>\t</a:t></a:r></a:p>')
    doc = read_pptx(_pptx(paragraph))
    assert doc.texts == ["Name:", "Der große Hund", "Preis", "12 Euro", "pro Stück!"]
    root = _part(_bracketed(doc), "ppt/slides/slide1.xml")
    first, second, third = root.xpath("//a:p", namespaces=NS)
    assert _texts(first, ".//a:t") == ["[Name:]", "\t", "[Der große Hund]"]
    assert [r.find("a:rPr", namespaces=NS).get("b") for r in first.xpath("a:r", namespaces=NS)] == ["1"] * 3
    assert "".join(_texts(second, ".//a:t")) == "[Preis]\t\t[12 Euro]\t[pro Stück!]"
    assert _texts(third, ".//a:t") == ["\t"]

def test_pptx_tabs_are_counted_before_their_runs_are_made(monkeypatch) -> None:
    """An 859-byte upload of "x<tab>" 100,000 times made 100,000 copies of its run (667 MiB) before the texts
    were counted and refused."""
    from pipeline.serve import archive_formats

    made = archive_formats._ooxml_segments
    monkeypatch.setattr(archive_formats, "_ooxml_segments", lambda root, *a: pytest.fail(
        "runs made before counting") if len(root.findall(f".//{archive_formats.A}r")) > 1000 else made(root, *a))
    bomb = _pptx("<a:p><a:r><a:t>" + "x\t" * 100_000 + "</a:t></a:r></a:p>")
    with pytest.raises(DocumentError, match="more than 100 texts") as e:
        read_pptx(bomb, max_texts=100)
    assert e.value.too_large
    assert read_pptx(_pptx("<a:p><a:r><a:t>" + "x\t" * 50 + "</a:t></a:r></a:p>"), max_texts=100).texts == ["x"] * 50


def test_a_docx_saved_by_word_online_names_its_main_part_document2() -> None:
    """Word Online saves the body as word/document2.xml (its _rels say so): "not a Word document (.docx): it has
    no word/document.xml", where Word and python-docx open it."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        z.writestr("word/document2.xml", f"<w:document {XMLNS}><w:body><w:p><w:r><w:t>Der Hund.</w:t></w:r></w:p>"
                                         "</w:body></w:document>")
    doc = read_docx(buffer.getvalue())
    assert doc.texts == ["Der Hund."]
    assert _texts(_part(_bracketed(doc), "word/document2.xml"), "//w:t") == ["[Der Hund.]"]
    empty = io.BytesIO()
    with zipfile.ZipFile(empty, "w") as z:
        z.writestr("word/styles.xml", "<x/>")
    with pytest.raises(DocumentError, match=r"not a Word document \(\.docx\): it has no word/document\.xml"):
        read_docx(empty.getvalue())


def test_a_password_protected_odt_is_said_so_not_damaged() -> None:
    """An encrypted ODF file's parts are ciphertext: "is damaged: ... not readable XML", where the OLE case of
    Office said password-protected."""
    import os

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        z.writestr("mimetype", "application/vnd.oasis.opendocument.text")
        z.writestr("META-INF/manifest.xml", '<manifest:manifest xmlns:manifest="urn:oasis:names:tc:opendocument:'
                   'xmlns:manifest:1.0"><manifest:file-entry manifest:full-path="content.xml"><manifest:encryption-'
                   'data manifest:checksum-type="SHA1/1K"/></manifest:file-entry></manifest:manifest>')
        z.writestr("content.xml", os.urandom(300))
    with pytest.raises(DocumentError, match=r"^the OpenDocument text \(\.odt\) is password-protected; save it "):
        read_odt(buffer.getvalue())


def test_odt_and_docx_through_translate_file() -> None:
    out, _ = roundtrip("anker.odt", _odt(ANCHORED + '<text:p>Seite <text:page-number>7</text:page-number> mit '
                                                    '<text:s/>Abstand.</text:p>'))
    root = _part(out, "content.xml")
    first, second = root.xpath("//office:text/text:p", namespaces=NS)
    assert first.text == "DA VOPA VOBI KINISA U MISA BOKOMI SIPONA."
    assert "".join(second.itertext()) == "SEITE 7 MIT  ABSTAND."  # the stand-in model keeps the two spaces
    assert second.xpath(".//text:s", namespaces=NS) == []
    assert _texts(root, "//text:note-citation") == ["1"] and _texts(root, "//dc:creator") == ["Hans Muster"]
    assert _texts(root, "//svg:title") == ["Der Titel"] and _texts(root, "//text:page-number") == ["7"]
    assert _texts(root, "//text:note-body/text:p") == ["DIE ANMERKUNG."]
    out, _ = roundtrip("seite.docx", _docx('<w:p><w:r><w:t xml:space="preserve">Seite </w:t></w:r><w:fldSimple '
                                           'w:instr="PAGE"><w:r><w:t>7</w:t></w:r></w:fldSimple><w:r><w:t '
                                           'xml:space="preserve"> von zehn</w:t></w:r></w:p>'))
    assert _texts(_part(out, "word/document.xml"), "//w:t") == ["SEITE ", "7", " VON ZEHN"]


def test_docx_hidden_text_rubies_symbols_controls_and_tracked_insertions() -> None:
    """A second audit's Word constructs: the translation went into a hidden first run (the whole paragraph
    invisible), into a superscript one (the sentence made superscript) and into a tracked insertion (rejecting it
    deleted the sentence); a ruby's reading was merged into the sentence; a non-breaking hyphen, a symbol and a
    page number fell out of the text and piled up after it; a content control's value was emptied."""
    hidden = '<w:r><w:rPr><w:vanish/></w:rPr><w:t xml:space="preserve">[vor dem Senden löschen] </w:t></w:r>'
    shown = '<w:r><w:rPr><w:vanish w:val="0"/></w:rPr><w:t xml:space="preserve">Sichtbar </w:t></w:r>'
    paragraphs = [
        f'<w:p>{hidden}{shown}<w:r><w:t>bleibt der Satz.</w:t></w:r></w:p>',
        '<w:p><w:r><w:rPr><w:vertAlign w:val="superscript"/></w:rPr><w:t>1</w:t></w:r><w:r><w:t xml:space="preserve">'
        ' Eine Fußnote hier.</w:t></w:r></w:p>',
        '<w:p><w:ins w:id="1" w:author="A"><w:r><w:t xml:space="preserve">Neu am Anfang </w:t></w:r></w:ins><w:r>'
        '<w:t>eines alten Satzes.</w:t></w:r></w:p>',
        '<w:p><w:r><w:t xml:space="preserve">Ich lerne </w:t></w:r><w:r><w:ruby><w:rubyPr/><w:rt><w:r><w:t>kanji'
        '</w:t></w:r></w:rt><w:rubyBase><w:r><w:t>漢字</w:t></w:r></w:rubyBase></w:ruby></w:r><w:r><w:t '
        'xml:space="preserve"> jeden Tag.</w:t></w:r></w:p>',
        '<w:p><w:r><w:t>eine Non</w:t></w:r><w:r><w:noBreakHyphen/></w:r><w:r><w:t>Profit Gruppe, drücke</w:t></w:r>'
        '<w:r><w:sym w:font="Wingdings" w:char="F0E0"/></w:r><w:r><w:t xml:space="preserve"> dann Seite </w:t></w:r>'
        '<w:r><w:pgNum/></w:r></w:p>',
        '<w:p><w:r><w:t xml:space="preserve">Auswahl: </w:t></w:r><w:sdt><w:sdtPr><w:alias w:val="x"/></w:sdtPr>'
        '<w:sdtContent><w:r><w:t>Ja bitte</w:t></w:r></w:sdtContent></w:sdt></w:p>',
    ]
    doc = read_docx(_docx("".join(paragraphs)))
    assert doc.texts == ["Sichtbar bleibt der Satz.", "1 Eine Fußnote hier.", "Neu am Anfang eines alten Satzes.",
                         "Ich lerne 漢字 jeden Tag.", "eine Non\u2011Profit Gruppe, drücke", " dann Seite ",
                         "Auswahl: ", "Ja bitte"]
    root = _part(_bracketed(doc), "word/document.xml")
    first, second, third, fourth, fifth, sixth = root.xpath("//w:body/w:p", namespaces=NS)
    assert _texts(first, ".//w:t") == ["[vor dem Senden löschen] ", "[Sichtbar bleibt der Satz.]", ""]
    assert _texts(second, ".//w:t") == ["", "[1 Eine Fußnote hier.]"]  # in the plain run, not all superscript
    assert _texts(third, ".//w:ins//w:t") == [""]
    assert _texts(third, "w:r/w:t") == ["[Neu am Anfang eines alten Satzes.]"]
    assert _texts(fourth, ".//w:rt//w:t") == ["kanji"] and _texts(fourth, ".//w:rubyBase//w:t") == [""]
    assert _texts(fifth, ".//w:t")[0] == "[eine Non\u2011Profit Gruppe, drücke]"
    assert fifth.xpath(".//w:noBreakHyphen", namespaces=NS) == [] and len(fifth.xpath(".//w:sym | .//w:pgNum",
                                                                                        namespaces=NS)) == 2
    assert _texts(sixth, ".//w:sdtContent//w:t") == ["[Ja bitte]"]


def test_docx_text_a_tracked_move_took_away_is_kept_as_deleted_text() -> None:
    """Moved-away text (w:moveFrom, in w:t) was translated and the paragraph's translation put in it: accepting the
    move left the paragraph empty, and the moved sentence was translated twice (here and at its w:moveTo)."""
    paragraphs = [
        '<w:p><w:moveFrom w:id="1" w:author="A"><w:r><w:t xml:space="preserve">Ein verschobener Satz. </w:t></w:r>'
        '</w:moveFrom><w:r><w:t>Der Hund läuft schnell.</w:t></w:r></w:p>',
        '<w:p><w:moveTo w:id="2" w:author="A"><w:r><w:t>Ein verschobener Satz.</w:t></w:r></w:moveTo></w:p>',
    ]
    doc = read_docx(_docx("".join(paragraphs)))
    assert doc.texts == ["Der Hund läuft schnell.", "Ein verschobener Satz."]
    first, second = _part(_bracketed(doc), "word/document.xml").xpath("//w:body/w:p", namespaces=NS)
    assert _texts(first, ".//w:moveFrom//w:t") == ["Ein verschobener Satz. "]  # as it was: the move deletes it
    assert _texts(first, "w:r/w:t") == ["[Der Hund läuft schnell.]"]
    assert _texts(second, ".//w:t") == ["[Ein verschobener Satz.]"]


def test_odt_ruby_page_number_placeholders_and_deleted_text() -> None:
    """ODT's ruby base word was cut out of its sentence (its reading and base after the translation); a slide's
    "<number>" placeholder was sent to the model and replaced; the text a tracked change deleted was translated
    (Word's w:delText is not)."""
    body = ('<text:tracked-changes><text:changed-region text:id="c1"><text:deletion><text:p>Gelöschter Text.</text:p>'
            '</text:deletion></text:changed-region></text:tracked-changes>'
            '<text:p>Ich lerne <text:ruby><text:ruby-base>漢字</text:ruby-base><text:ruby-text>kanji</text:ruby-text>'
            '</text:ruby> jeden Tag.</text:p>'
            '<text:p>Folie <text:page-number>&lt;number&gt;</text:page-number></text:p>')
    doc = read_odt(_odt(body))
    assert doc.texts == ["Ich lerne 漢字 jeden Tag.", "Folie "]
    root = _part(_bracketed(doc), "content.xml")
    assert _texts(root, "//text:deletion/text:p") == ["Gelöschter Text."]
    assert _texts(root, "//text:ruby-text") == ["kanji"] and _texts(root, "//text:page-number") == ["<number>"]


def test_odt_tracked_insertions_get_no_translation_even_across_paragraphs() -> None:
    """A paragraph that began with a tracked insertion got its whole translation inside it (rejecting the change
    in LibreOffice deleted the sentence); Word's was right. Also for an insertion that began a paragraph before."""
    body = ('<text:tracked-changes><text:changed-region text:id="c1"><text:insertion/></text:changed-region>'
            '<text:changed-region text:id="c2"><text:insertion/></text:changed-region></text:tracked-changes>'
            '<text:p><text:change-start text:change-id="c1"/>Neu am Anfang <text:change-end text:change-id="c1"/>'
            'eines alten Satzes.</text:p>'
            '<text:p>Alt <text:span>und <text:change-start text:change-id="c2"/>neu bis</text:span></text:p>'
            '<text:p>hier<text:change-end text:change-id="c2"/> und weiter.</text:p>')
    doc = read_odt(_odt(body))
    assert doc.texts == ["Neu am Anfang eines alten Satzes.", "Alt und neu bis", "hier und weiter."]
    root = _part(_bracketed(doc), "content.xml")
    first, second, third = root.xpath("//office:text/text:p", namespaces=NS)
    assert not first.xpath("text:change-start", namespaces=NS)[0].tail  # the inserted words' place: emptied
    assert first.xpath("text:change-end", namespaces=NS)[0].tail == "[Neu am Anfang eines alten Satzes.]"
    assert second.text == "[Alt und neu bis]"
    assert not third.text and third.xpath("text:change-end", namespaces=NS)[0].tail == "[hier und weiter.]"


def test_strict_open_xml_is_refused_not_returned_untranslated() -> None:
    """A .docx / .pptx saved as Strict Open XML (other namespaces for the same parts) came back 200 unchanged."""
    strict = _docx_of('<w:document xmlns:w="http://purl.oclc.org/ooxml/wordprocessingml/main"><w:body><w:p><w:r>'
                      '<w:t>Hallo Welt</w:t></w:r></w:p></w:body></w:document>')
    with pytest.raises(DocumentError, match=r"saved as Strict Open XML \('word/document.xml'\), which this server "
                       r"does not read; save it in the default \(transitional\) format"):
        read_docx(strict)
    with served() as c:
        r = send(c, "streng.docx", strict)
    assert r.status_code == 400 and "Strict Open XML" in r.json()["error"]


def test_a_text_found_twice_is_translated_once_and_put_in_both_places() -> None:
    """Word stores a text box twice (mc:Choice for new readers, mc:Fallback for old ones): each paragraph was a
    text of its own, translated twice and counted twice against --max-sentences; a repeated heading likewise."""
    from pipeline.serve.documents import read_document

    box = ('<w:txbxContent><w:p><w:r><w:t>Im Kasten</w:t></w:r></w:p></w:txbxContent>')
    body = (f'<w:p><w:r><w:t>Kapitel</w:t></w:r></w:p><w:p><w:r><mc:AlternateContent '
            f'xmlns:mc="http://schemas.openxmlformats.org/markup-compatibility/2006"><mc:Choice Requires="wps">'
            f'<w:drawing>{box}</w:drawing></mc:Choice><mc:Fallback><w:pict>{box}</w:pict></mc:Fallback>'
            f'</mc:AlternateContent></w:r></w:p><w:p><w:r><w:t>Kapitel</w:t></w:r></w:p>')
    data = _docx(body)
    doc = read_document("kasten.docx", data, max_texts=2)  # 4 texts, 2 of them distinct
    assert doc.texts == ["Kapitel", "Im Kasten"]
    root = _part(_bracketed(doc), "word/document.xml")
    assert _texts(root, "//w:t") == ["[Kapitel]", "[Im Kasten]", "[Im Kasten]", "[Kapitel]"]
    lines = read_document("zeilen.txt", b"Ja.\nNein.\nJa.\n")
    assert lines.texts == ["Ja.", "Nein."] and lines.rebuild(["Yes.", "No."]) == b"Yes.\nNo.\nYes.\n"
    # a text file counts every text as it reads it (refused at once past the limit: a file of a million short
    # lines would cost a list entry each); an archive, read whole within its bounds, its distinct texts
    with pytest.raises(DocumentError, match="more than 1 texts"):
        read_document("b.txt", b"Ja.\nJa.\n", max_texts=1)
