"""LibreTranslate's POST /translate_file and GET /download_file on `pipeline serve`, in process over stand-in
models that upper-case their text: each format made with its own library, sent, fetched, and read back with
that library (the text translated, the layout kept), and the refusals (unsupported format, a damaged file, a
zip bomb, an XML entity bomb, a missing file, a wrong key, an unknown id, an upload over the limit)."""

from __future__ import annotations

import io
import re
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

pytest.importorskip("starlette")
pytest.importorskip("multipart")
pytest.importorskip("httpx")
pytest.importorskip("sentencex")

from starlette.testclient import TestClient  # noqa: E402
from test_serve_bounds import KEY, state_of  # noqa: E402

from pipeline.serve import documents  # noqa: E402
from pipeline.serve.access import ApiKeys  # noqa: E402
from pipeline.serve.app import create_app  # noqa: E402

PAIRS = {"de-en": (("de",), ("en",)), "en-de": (("en",), ("de",))}


@contextmanager
def served(keys: ApiKeys | None = None) -> Iterator[TestClient]:
    with TestClient(create_app(state_of(PAIRS, keys))) as c:
        yield c


def send(c: TestClient, name: str, data: bytes, **fields: str) -> Any:
    return c.post("/translate_file", data={"source": "de", "target": "en", **fields},
                  files={"file": (name, data, "application/octet-stream")})


def roundtrip(name: str, data: bytes) -> tuple[bytes, Any]:
    """The file translated de -> en and downloaded: its bytes and the download's response."""
    with served() as c:
        r = send(c, name, data)
        assert r.status_code == 200, r.text
        url = r.json()["translatedFileUrl"]
        assert url.startswith("http://testserver/download_file/")
        got = c.get(url)
        assert got.status_code == 200, got.text
        return got.content, got


# -- each format -------------------------------------------------------------------------------------------


def test_txt_lines_translated_and_line_ends_kept():
    data = b"Der Hund.  Die Katze!\r\n\r\n  ja\n123\nEnde"
    out, r = roundtrip("notes.txt", data)
    assert out == b"DER HUND.  DIE KATZE!\r\n\r\n  JA\n123\nENDE"
    assert r.headers["content-disposition"] == 'attachment; filename="notes_en.txt"'
    assert r.headers["content-type"].startswith("text/plain")


def test_txt_with_a_utf16_bom_comes_back_in_utf16():
    out, r = roundtrip("w.txt", "\ufeffgrüße\n".encode("utf-16-le"))
    assert out == "\ufeffGRÜSSE\n".encode("utf-16-le")
    # it said charset=utf-8: a client decoding by the header (httpx, requests) read garbage
    assert r.headers["content-type"] == "text/plain; charset=utf-16" and r.text.lstrip("\ufeff") == "GRÜSSE\n"
    out, r = roundtrip("p.html", "\ufeff<p>grüße</p>".encode("utf-32-be"))
    assert r.headers["content-type"] == "text/html; charset=utf-32" and r.text.lstrip("\ufeff") == "<p>GRÜSSE</p>"


def test_html_markup_kept_text_translated():
    page = '<!DOCTYPE html><html><head><title>Titel</title></head><body><p class="x">Ein <b>fetter</b> Hund' \
           '</p><pre>code bleibt</pre><img alt="bild"></body></html>'
    out, _ = roundtrip("page.html", page.encode())
    assert out.decode() == page.replace("Titel", "TITEL").replace("Ein ", "EIN ").replace("fetter", "FETTER") \
        .replace(" Hund", " HUND")


def test_srt_timings_and_indices_copied_lines_kept():
    srt = ("1\r\n00:00:01,000 --> 00:00:04,000\r\nDas ist die erste\r\nZeile hier.\r\n\r\n"
           "2\r\n00:00:05,500 --> 00:00:07,250 X1:10\r\n<i>Kursiv</i> und normal\r\n\r\n"
           "3\r\n00:00:08,000 --> 00:00:09,000\r\n♪\r\n")
    out, r = roundtrip("film.srt", srt.encode())
    text = out.decode()
    assert re.findall(r".*-->.*", text) == re.findall(r".*-->.*", srt)
    assert text == ("1\r\n00:00:01,000 --> 00:00:04,000\r\nDAS IST DIE ERSTE\r\nZEILE HIER.\r\n\r\n"
                    "2\r\n00:00:05,500 --> 00:00:07,250 X1:10\r\n<i>KURSIV</i> UND NORMAL\r\n\r\n"
                    "3\r\n00:00:08,000 --> 00:00:09,000\r\n♪\r\n")
    assert r.headers["content-disposition"] == 'attachment; filename="film_en.srt"'


def test_docx_runs_tables_headers_and_formatting_kept():
    docx = pytest.importorskip("docx")
    d = docx.Document()
    d.add_paragraph("Erster Absatz.", style="Heading 1")
    p = d.add_paragraph("Ein ")
    bold = p.add_run("fetter")
    bold.bold = True
    italic = p.add_run(" und kursiver Satz.")
    italic.italic = True
    d.add_paragraph("Vor dem Tab\tnach dem Tab")
    d.add_table(rows=1, cols=2).cell(0, 1).text = "Zelle"
    d.sections[0].header.paragraphs[0].text = "Kopfzeile"
    buffer = io.BytesIO()
    d.save(buffer)
    out, r = roundtrip("bericht.docx", buffer.getvalue())
    assert r.headers["content-disposition"] == 'attachment; filename="bericht_en.docx"'
    got = docx.Document(io.BytesIO(out))
    assert [p.text for p in got.paragraphs] == ["ERSTER ABSATZ.", "EIN FETTER UND KURSIVER SATZ.",
                                                "VOR DEM TAB\tNACH DEM TAB"]
    assert [p.style.name for p in got.paragraphs] == ["Heading 1", "Normal", "Normal"]
    runs = got.paragraphs[1].runs  # the translation in the first run, the others emptied, none removed
    assert [(r.text, r.bold, r.italic) for r in runs] == [("EIN FETTER UND KURSIVER SATZ.", None, None),
                                                          ("", True, None), ("", None, True)]
    assert [c.text for c in got.tables[0].rows[0].cells] == ["", "ZELLE"]
    assert got.sections[0].header.paragraphs[0].text == "KOPFZEILE"
    with zipfile.ZipFile(io.BytesIO(out)) as a, zipfile.ZipFile(buffer) as b:
        assert a.namelist() == b.namelist()  # every part kept, in order


def test_pptx_slides_and_shapes_kept():
    pptx = pytest.importorskip("pptx")
    from pptx.util import Inches, Pt

    prs = pptx.Presentation()
    slide = prs.slides.add_slide(prs.slide_layouts[1])
    slide.shapes.title.text = "Der Titel"
    slide.placeholders[1].text_frame.text = "Erster Punkt"
    slide.placeholders[1].text_frame.add_paragraph().text = "Zweiter Punkt"
    box = slide.shapes.add_textbox(Inches(1), Inches(5), Inches(4), Inches(1))
    box.text_frame.text = "Ein Textfeld"
    box.text_frame.paragraphs[0].runs[0].font.size = Pt(31)
    box.text_frame.paragraphs[0].runs[0].font.bold = True
    prs.slides.add_slide(prs.slide_layouts[5]).shapes.title.text = "Zweite Folie"
    buffer = io.BytesIO()
    prs.save(buffer)
    out, _ = roundtrip("folien.pptx", buffer.getvalue())
    got = pptx.Presentation(io.BytesIO(out))
    assert len(got.slides) == 2
    shapes = list(got.slides[0].shapes)
    assert [s.shape_type for s in shapes] == [s.shape_type for s in prs.slides[0].shapes]
    assert [(s.left, s.top, s.width, s.height) for s in shapes] == \
        [(s.left, s.top, s.width, s.height) for s in prs.slides[0].shapes]
    assert [s.text_frame.text for s in shapes] == ["DER TITEL", "ERSTER PUNKT\nZWEITER PUNKT", "EIN TEXTFELD"]
    run = shapes[2].text_frame.paragraphs[0].runs[0]
    assert run.font.size == Pt(31) and run.font.bold is True
    assert got.slides[1].shapes.title.text == "ZWEITE FOLIE"


def test_odt_paragraphs_spans_and_styles_kept():
    pytest.importorskip("odf")
    from odf import teletype, text
    from odf.opendocument import OpenDocumentText, load
    from odf.style import Style, TextProperties

    doc = OpenDocumentText()
    bold = Style(name="Fett", family="text")
    bold.addElement(TextProperties(fontweight="bold"))
    doc.automaticstyles.addElement(bold)
    doc.text.addElement(text.H(outlinelevel=1, text="Die Überschrift"))
    p = text.P(text="Ein ")
    p.addElement(text.Span(stylename=bold, text="fetter"))
    p.addText(" Satz.")
    doc.text.addElement(p)
    doc.text.addElement(text.P(text="Zweiter Absatz."))
    buffer = io.BytesIO()
    doc.save(buffer)
    out, _ = roundtrip("brief.odt", buffer.getvalue())
    got = load(io.BytesIO(out))
    paragraphs = got.getElementsByType(text.P)
    assert [teletype.extractText(p) for p in got.getElementsByType(text.H)] == ["DIE ÜBERSCHRIFT"]
    assert [teletype.extractText(p) for p in paragraphs] == ["EIN FETTER SATZ.", "ZWEITER ABSATZ."]
    spans = got.getElementsByType(text.Span)
    assert len(spans) == 1 and spans[0].getAttribute("stylename") == "Fett"  # the span kept, emptied
    with zipfile.ZipFile(io.BytesIO(out)) as a:
        first = a.infolist()[0]
        assert first.filename == "mimetype" and first.compress_type == zipfile.ZIP_STORED


def test_epub_pages_translated_other_members_copied():
    buffer = io.BytesIO()
    page = '<?xml version="1.0" encoding="utf-8"?>\n<html xmlns="http://www.w3.org/1999/xhtml"><body>' \
           '<h1>Kapitel eins</h1><p>Es war <em>einmal</em>.</p></body></html>'
    with zipfile.ZipFile(buffer, "w") as z:
        z.writestr(zipfile.ZipInfo("mimetype"), "application/epub+zip")
        z.writestr("META-INF/container.xml", "<container/>", zipfile.ZIP_DEFLATED)
        z.writestr("OEBPS/content.opf", "<package><metadata>Titel</metadata></package>", zipfile.ZIP_DEFLATED)
        z.writestr("OEBPS/ch1.xhtml", page, zipfile.ZIP_DEFLATED)
    out, _ = roundtrip("buch.epub", buffer.getvalue())
    with zipfile.ZipFile(io.BytesIO(out)) as z:
        assert z.namelist() == ["mimetype", "META-INF/container.xml", "OEBPS/content.opf", "OEBPS/ch1.xhtml"]
        assert z.read("OEBPS/content.opf") == b"<package><metadata>Titel</metadata></package>"
        assert z.read("OEBPS/ch1.xhtml").decode() == page.replace("Kapitel eins", "KAPITEL EINS") \
            .replace("Es war ", "ES WAR ").replace("einmal", "EINMAL")


def test_a_page_that_declares_another_encoding_is_rebuilt_in_it():
    """An ASCII page under <meta charset="iso-8859-1"> (or an XHTML page's XML declaration) was rebuilt in UTF-8
    with the declaration kept: a browser showed "Größe" as "GrÃ¶Ãe". It stays ASCII, other characters as
    character references (right under any ASCII-compatible encoding, windows-874 as latin-1); a page that is not
    ASCII is UTF-8 whatever it declares, as before."""
    from pipeline.serve.archive_formats import read_epub
    from pipeline.serve.text_formats import read_html

    page = b'<html><head><meta charset="ISO-8859-1"></head><body><p>Die Strasse.</p></body></html>'
    for label in (b"ISO-8859-1", b"windows-874", b"x-mac-roman"):
        out = read_html(page.replace(b"ISO-8859-1", label)).rebuild(["Die Größe €"])
        assert out == page.replace(b"ISO-8859-1", label).replace(b"Die Strasse.", b"Die Gr&#246;&#223;e &#8364;")
    for same, text in ((b"utf-8", "Die Strasse."), (b"unicode-1-1-utf-8", "Die Strasse."),
                       (b"ISO-8859-1", "Die Straße.")):  # UTF-8 spelled otherwise; a page that is not ASCII
        given = page.replace(b"ISO-8859-1", same).replace(b"Die Strasse.", text.encode())
        assert read_html(given).rebuild(["Größe"]) == given.replace(text.encode(), "Größe".encode())
    xhtml = '<?xml version="1.0" encoding="ISO-8859-1"?><html xmlns="http://www.w3.org/1999/xhtml"><body><p>' \
            'Die Strasse.</p></body></html>'
    with zipfile.ZipFile(io.BytesIO(read_epub(_epub_of(xhtml)).rebuild(["Die Größe"]))) as z:
        assert z.read("OEBPS/a.xhtml") == xhtml.replace("Die Strasse.", "Die Gr&#246;&#223;e").encode()


def test_an_epub_page_is_read_by_xhtml_rules():
    """An EPUB page was parsed by HTML's rules: a <div> inside <p translate="no"> ended the paragraph there (as a
    browser does for HTML), and its words were translated although the reader keeps them in the paragraph."""
    buffer = io.BytesIO()
    page = '<?xml version="1.0"?><html xmlns="http://www.w3.org/1999/xhtml"><body><p translate="no">ACME ' \
           '<div>Hausmarke</div></p><p>Es war <b>einmal<p>ein Satz</p></b></p></body></html>'
    with zipfile.ZipFile(buffer, "w") as z:
        z.writestr(zipfile.ZipInfo("mimetype"), "application/epub+zip")
        z.writestr("META-INF/container.xml", "<container/>")
        for name in ("ch1.xhtml", "ch2.html"):  # the extension, or the XML declaration, says XHTML
            z.writestr(f"OEBPS/{name}", page)
    out, _ = roundtrip("buch.epub", buffer.getvalue())
    with zipfile.ZipFile(io.BytesIO(out)) as z:
        for name in ("ch1.xhtml", "ch2.html"):
            assert z.read(f"OEBPS/{name}").decode() == page.replace("Es war ", "ES WAR ") \
                .replace("einmal", "EINMAL").replace("ein Satz", "EIN SATZ")



def test_an_epubs_pages_count_against_the_xml_limit():
    """An EPUB's pages were parsed whatever their size (100 MiB unpacked), where Office parts stop at 32 MiB."""
    from pipeline.serve.zip_parts import MAX_XML_BYTES

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(zipfile.ZipInfo("mimetype"), "application/epub+zip")
        z.writestr("META-INF/container.xml", "<container/>")
        for k in range(3):
            z.writestr(f"OEBPS/ch{k}.xhtml", "<p>Hallo Welt</p>" + " " * (MAX_XML_BYTES // 3))
    with pytest.raises(documents.DocumentError, match=r"pages hold more than this server's limit of 33554432 bytes "
                       r"of XHTML \(32 MiB\)") as refused:
        documents.read_document("buch.epub", buffer.getvalue())
    assert refused.value.too_large


def test_html_and_epub_pages_count_their_tags_before_the_scanner_runs():
    """30 MiB of <b/> in an EPUB's pages (a 30 KB upload) took our tag scanner 18 s of the one document thread;
    a .html file's and an EPUB's pages' tags are counted first (2,000,000 at most, 413), a page at the limit read."""
    from pipeline.serve.text_formats import MAX_TAGS

    def epub(*pages: str) -> bytes:
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as z:
            z.writestr(zipfile.ZipInfo("mimetype"), "application/epub+zip")
            z.writestr("META-INF/container.xml", "<container/>")
            for k, page in enumerate(pages):
                z.writestr(f"OEBPS/ch{k}.xhtml", page)
        return buffer.getvalue()

    half = "<b/>" * (MAX_TAGS // 2 - 1)
    for name, data, what in (("seite.html", ("<p>Hallo Welt</p>" + half * 2 + "<b/>").encode(), "HTML file holds"),
                             ("buch.epub", epub("<p>Hallo Welt</p>" + half, half + "<b/><b/>"), "pages hold")):
        with pytest.raises(documents.DocumentError, match=f"{what} more than this server's limit of 2,000,000 tags"
                           ) as refused:
            documents.read_document(name, data)
        assert refused.value.too_large
    assert documents.read_document("seite.html", ("<p>Hallo Welt</p>" + half * 2).encode()).texts == ["Hallo Welt"]

def test_a_file_already_in_the_target_language_comes_back_unchanged():
    with served() as c:
        r = send(c, "x.txt", b"schon Englisch\n", source="en", target="en")
        assert r.status_code == 200, r.text
        assert c.get(r.json()["translatedFileUrl"]).content == b"schon Englisch\n"


def test_auto_detects_the_files_language_once():
    class Detector:
        seen: list[str] = []

        def best(self, text: str, usable: Any = None) -> dict[str, Any]:  # as Detector.best
            self.seen.append(text)
            return {"language": "de", "confidence": 90.0}

    state = state_of(PAIRS)
    state.detector = Detector()  # type: ignore[assignment]
    with TestClient(create_app(state)) as c:
        r = send(c, "a.txt", b"Ja\nDer Hund bellt.\n", source="auto")
        assert r.status_code == 200, r.text
        assert r.json()["detectedLanguage"] == {"language": "de", "confidence": 90.0}
        assert c.get(r.json()["translatedFileUrl"]).content == b"JA\nDER HUND BELLT.\n"
    assert Detector.seen == ["Ja\nDer Hund bellt."]  # one look at the whole text, not one per line


def test_frontend_settings_list_the_formats():
    with served() as c:
        settings = c.get("/frontend/settings").json()
    assert settings["filesTranslation"] is True
    assert settings["supportedFilesFormat"] == list(documents.SUPPORTED)


# -- refusals ----------------------------------------------------------------------------------------------


def test_unsupported_extension_lists_the_supported_ones():
    with served() as c:
        r = send(c, "program.exe", b"MZ\x90\x00")
    assert r.status_code == 400
    assert "the format .exe is not supported; supported: .txt, .html" in r.json()["error"]


def test_a_damaged_docx_is_a_400_naming_the_file():
    with served() as c:
        r = send(c, "kaputt.docx", bytes(range(256)) * 40)
    assert r.status_code == 400
    assert "'kaputt.docx': the file is not a readable Word document (.docx) (not a zip archive" in r.json()["error"]


def test_a_text_file_in_utf16_without_a_bom_is_told_to_be_saved_as_utf8():
    """ASCII text in UTF-16 without a byte-order mark decodes as UTF-8 with a NUL every other byte: it was
    refused as "its text 1 holds a NUL character", not as the encoding it is in."""
    with served() as c:
        for name, data in (("notes.txt", "Hallo Welt\n".encode("utf-16-le")),
                           ("film.srt", "1\n00:00:01,000 --> 00:00:02,000\nHallo\n".encode("utf-32-be"))):
            r = send(c, name, data)
            assert r.status_code == 400 and "is not UTF-8 text: a third or more of its bytes are 0, as in UTF-16" in \
                r.json()["error"], r.text
        assert send(c, "notes.txt", "Hallo Welt\n".encode("utf-16")).status_code == 200  # with its BOM: read


def test_a_password_protected_or_deeply_nested_document_says_so():
    """A password-protected .docx (an OLE container) was "not a zip archive: File is not a zip file"; a zip member
    with the encryption flag quoted Python's ZipInfo repr; a part nested too deep passed on libxml's advice to use
    XML_PARSE_HUGE, which no sender can act on."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        z.writestr("word/document.xml", b"<x/>")
    encrypted = bytearray(buffer.getvalue())
    encrypted[6] |= 1  # the general purpose flag's bit 0 (encrypted), in the local header and the central directory
    encrypted[encrypted.index(b"PK\x01\x02") + 8] |= 1
    deep = io.BytesIO()
    with zipfile.ZipFile(deep, "w") as z:
        z.writestr("[Content_Types].xml", b"<Types/>")
        z.writestr("word/document.xml", b"<a>" * 300 + b"</a>" * 300)
    with served() as c:
        answers = [send(c, "geheim.docx", data).json()["error"] for data in (
            b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1" + bytes(504), bytes(encrypted), deep.getvalue())]
    assert answers[0].endswith("the file is not a readable Word document (.docx) (password-protected, or an old "
                               ".doc/.ppt)"), answers[0]
    assert answers[1].endswith("the Word document (.docx) is password-protected: save it without a password"), \
        answers[1]
    assert "XML_PARSE_HUGE" not in answers[2] and "Excessive depth in document: 256" in answers[2], answers[2]


def _zip_bomb() -> bytes:
    """A .docx-shaped archive whose member unpacks to 200 MiB of zeros (about 200 KB packed)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("word/document.xml", "<w:document/>")
        info = zipfile.ZipInfo("word/media/zeros.bin")
        info.compress_type = zipfile.ZIP_DEFLATED
        with z.open(info, "w", force_zip64=True) as member:
            chunk = bytes(1 << 20)
            for _ in range(200):
                member.write(chunk)
    return buffer.getvalue()


def test_a_zip_bomb_is_refused_before_it_is_unpacked(monkeypatch):
    bomb = _zip_bomb()
    assert len(bomb) < 1 << 20
    unpacked: list[str] = []
    real_open = zipfile.ZipFile.open
    monkeypatch.setattr(zipfile.ZipFile, "open", lambda self, name, *a, **k: unpacked.append(str(name)) or
                        real_open(self, name, *a, **k))
    with served() as c:
        r = send(c, "bombe.docx", bomb)
    assert r.status_code == 413
    limit = f"unpacks to {(200 << 20) + 13} bytes, more than this server's limit of {100 << 20} (100 MiB)"
    assert limit in r.json()["error"]
    assert unpacked == []


def _lying_docx(unpacked: int) -> bytes:
    """A .docx whose document.xml holds `unpacked` bytes of zeros but declares 100."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("word/document.xml", bytes(unpacked))
    data = bytearray(buffer.getvalue())
    for signature, at in ((b"PK\x03\x04", 22), (b"PK\x01\x02", 24)):  # local header, central directory
        start = data.index(signature)
        data[start + at:start + at + 4] = (100).to_bytes(4, "little")  # "100 bytes unpacked"
    return bytes(data)


def test_a_member_holding_more_than_it_declares_is_damaged_not_unpacked():
    with served() as c:
        r = send(c, "luege.docx", _lying_docx(10 << 20))
    assert r.status_code == 400
    assert "is damaged: its member 'word/document.xml' cannot be read (BadZipFile: Bad CRC-32" in r.json()["error"]


def test_an_archive_with_a_member_twice_or_one_named_outside_it_is_damaged():
    """Two word/document.xml were both translated and written back (a 200); a member named ../../etc/x or /etc/x
    was copied into the returned file as it was."""
    import warnings

    body = '<w:document xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main"><w:body><w:p><w:r>' \
           '<w:t>Der Hund.</w:t></w:r></w:p></w:body></w:document>'
    for extra, says in (("word/document.xml", "holds 'word/document.xml' twice"),
                        ("../../tmp/x.txt", "its member '../../tmp/x.txt' names a place outside it"),
                        ("/etc/x.txt", "its member '/etc/x.txt' names a place outside it")):
        buffer = io.BytesIO()
        with warnings.catch_warnings(), zipfile.ZipFile(buffer, "w") as z:
            warnings.simplefilter("ignore")  # zipfile's "Duplicate name"
            z.writestr("word/document.xml", body)
            z.writestr(extra, body)
        with served() as c:
            r = send(c, "bericht.docx", buffer.getvalue())
        assert r.status_code == 400 and says in r.json()["error"], r.text


def test_a_member_that_lies_about_its_size_is_read_in_memory_of_the_size_it_declares():
    """zipfile's read() of a whole member asks zlib for up to 2 GiB and cuts to the declared size after: a 64 KiB
    member declaring 100 bytes took 64 MiB here (a 1 MiB upload, 2 GB of the server)."""
    import tracemalloc

    data = _lying_docx(64 << 20)
    tracemalloc.start()
    try:
        with pytest.raises(documents.DocumentError, match="Bad CRC-32"):
            documents.read_document("luege.docx", data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"{peak >> 20} MiB to read a {len(data) >> 10} KiB archive"

def _docx_of(document_xml: str) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        z.writestr("word/document.xml", document_xml)
    return buffer.getvalue()


def test_an_xml_entity_bomb_or_any_dtd_is_refused():
    body = '<w:document xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main"><w:body><w:p>' \
           '<w:r><w:t>&{};</w:t></w:r></w:p></w:body></w:document>'
    lol = '<?xml version="1.0"?><!DOCTYPE lolz [<!ENTITY lol "lol">' + "".join(
        f'<!ENTITY lol{i} "{("&lol" + str(i - 1) + ";") * 10 if i else "&lol;" * 10}">' for i in range(10)) + \
        "]>" + body.format("lol9")
    small = '<?xml version="1.0"?><!DOCTYPE d [<!ENTITY e "Hallo">]>' + body.format("e")
    with served() as c:
        started = time.monotonic()
        r = send(c, "lol.docx", _docx_of(lol))  # a billion "lol"s: libxml2 stops at its amplification limit
        assert r.status_code == 400 and "not readable XML (Maximum entity amplification" in r.json()["error"]
        assert time.monotonic() - started < 5
        r = send(c, "dtd.docx", _docx_of(small))
        assert r.status_code == 400
        assert "part 'word/document.xml' declares a DTD, which this server does not read" in r.json()["error"]


def test_an_upload_over_the_limit_is_a_413(monkeypatch):
    monkeypatch.setattr(documents, "MAX_FILE_BYTES", 1000)
    with served() as c:
        r = send(c, "gross.txt", b"a" * 200_000)
    assert r.status_code == 413
    assert "over this server's limit of 1000 bytes for a file" in r.json()["error"]


def test_missing_file_source_or_target_name_the_field():
    with served() as c:
        r = c.post("/translate_file", data={"source": "de", "target": "en"}, files={"other": ("a", b"", "text/plain")})
        assert r.status_code == 400 and r.json()["error"] == 'form field "other" is a file; send the file in "file"'
        r = c.post("/translate_file", files={"x": (None, "y")}, data={"source": "de", "target": "en"})
        assert r.status_code == 400 and r.json()["error"] == "Invalid request: missing file parameter"
        r = c.post("/translate_file", data={"target": "en"}, files={"file": ("a.txt", b"Hallo", "text/plain")})
        assert r.status_code == 400 and r.json()["error"] == "Invalid request: missing source parameter"
        r = send(c, "a.txt", b"Hallo", target="zz")
        assert r.status_code == 400 and r.json()["error"].startswith('"target" zz is not a language this server')
        r = c.post("/translate_file", json={"source": "de", "target": "en"})
        assert r.status_code == 400 and "takes multipart/form-data" in r.json()["error"]


def test_a_wrong_key_is_a_403_on_a_keyed_server(tmp_path):
    keys_file = tmp_path / "keys.txt"
    keys_file.write_text(f"{KEY}\n")
    with served(ApiKeys.read(str(keys_file), require=True)) as c:
        r = send(c, "a.txt", b"Hallo", api_key="wrong-key")
        assert r.status_code == 403 and r.json()["error"] == "Invalid API key"
        r = send(c, "a.txt", b"Hallo", api_key=KEY)
        assert r.status_code == 200, r.text


def test_an_unknown_download_id_is_a_404():
    with served() as c:
        r = c.get("/download_file/not-an-id")
    assert r.status_code == 404 and "no translated file has this id" in r.json()["error"]


def test_the_store_is_bounded_and_expires(monkeypatch):
    from pipeline.serve.file_routes import FileStore

    store = FileStore(files=2, size=10, keep_s=60)
    a, b = store.put("a", "t", b"12345"), store.put("b", "t", b"12345")
    c = store.put("c", "t", b"1")  # over 10 bytes: the oldest goes
    assert store.get(a) is None and store.get(b) and store.get(c)
    clock = [1e9]
    monkeypatch.setattr("pipeline.serve.file_routes.time.monotonic", lambda: clock[0])
    d = store.put("d", "t", b"1")
    clock[0] += 61
    assert store.get(d) is None


def test_a_download_gone_from_the_store_says_both_bounds(monkeypatch):
    """After 64 newer uploads a link is gone within seconds; its 404 spoke of the 10 minutes only."""
    from pipeline.serve import file_routes

    monkeypatch.setattr(file_routes, "STORE_FILES", 1)
    with served() as c:
        first = send(c, "a.txt", b"Hallo\n").json()["translatedFileUrl"]
        send(c, "b.txt", b"Welt\n")
        r = c.get(first)
    assert r.status_code == 404 and "kept 10 minutes after they are made, the newest 1 (256 MiB) at most" in \
        r.json()["error"], r.text


# -- hostile sizes: memory in proportion to the texts, the limit met while reading, files apart from requests --


def _peak(fn: Any, *args: Any) -> tuple[Any, int]:
    """fn(*args) (or the exception it raised) and the peak bytes Python allocated meanwhile."""
    import tracemalloc

    tracemalloc.start()
    try:
        got: Any = fn(*args)
    except Exception as e:  # noqa: BLE001 - handed back to the test
        got = e
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return got, peak


@pytest.mark.parametrize("name, data", [
    ("digits.txt", b"12\n" * 700_000),  # lines without letters: copied, never listed (1.3 GB at 20 MiB before)
    ("tags.html", b"<b>1</b>" * 250_000),  # tags and letterless text nodes: one piece, not 500,000
    ("music.srt", b"1\n00:00:01,000 --> 00:00:02,000\n\xe2\x99\xaa\n\n" * 50_000),
], ids=["txt", "html", "srt"])
def test_a_file_without_texts_costs_its_size_not_a_list_per_line(name, data):
    doc, peak = _peak(documents.read_document, name, data, 10)
    assert doc.texts == [] and doc.rebuild([]) == data
    assert peak < 4 * len(data), (peak, len(data))


@pytest.mark.parametrize("name, data", [
    ("many.txt", b"ab\n" * 700_000),
    ("many.html", b"<p>ab</p>" * 250_000),
    ("many.srt", b"1\n00:00:01,000 --> 00:00:02,000\nab\n\n" * 50_000),
], ids=["txt", "html", "srt"])
def test_a_file_past_max_sentences_is_refused_while_it_is_read(name, data):
    refused, peak = _peak(documents.read_document, name, data, 10)
    assert isinstance(refused, documents.DocumentError) and refused.too_large
    assert str(refused) == "the file has more than 10 texts, this server's limit per request (--max-sentences); " \
                           "split the file"
    assert peak < 4 * len(data), (peak, len(data))


def test_txt_and_srt_rebuild_every_byte_around_their_texts():
    txt = "eins\r\n\r\n12\rzwei\n\n  drei  \n\u2028".encode()
    doc = documents.read_document("a.txt", txt)
    assert doc.texts == ["eins", "zwei", "  drei  "]
    assert doc.rebuild(["A", "B", "C"]) == "A\r\n\r\n12\rB\n\nC\n\u2028".encode()
    srt = ("1\r\n00:00:01,000 --> 00:00:02,000\r\nguten Tag,\r\n<i>mein</i> Freund\r\n\r\n"
           "2\n00:00:03,000 --> 00:00:04,000\n\u266a  \u266a\n\n"  # no letters: copied as it is, spaces and all
           "3\n00:00:05,000 --> 00:00:06,000\nzwei\nZeilen\n").encode()
    doc = documents.read_document("a.srt", srt)
    assert doc.texts == ["guten Tag, ", "mein", " Freund", "zwei Zeilen"]  # the text between tags too
    assert doc.rebuild(["GOOD DAY, ", "MY", " FRIEND", "ONE"]).decode() == (
        "1\r\n00:00:01,000 --> 00:00:02,000\r\nGOOD DAY,\r\n<i>MY</i> FRIEND\r\n\r\n"
        "2\n00:00:03,000 --> 00:00:04,000\n\u266a  \u266a\n\n"
        "3\n00:00:05,000 --> 00:00:06,000\nONE\n")  # fewer words than lines: the last line goes


def test_files_being_read_never_hold_the_threads_that_prepare_requests(monkeypatch):
    """Uploads are read on their own thread: four large ones took the four preparing threads, and a one-word
    /translate waited 31 s behind them."""
    import threading

    entered, released, timed_out = threading.Semaphore(0), threading.Event(), []
    real = documents.read_document

    def slow(*args: Any) -> Any:
        entered.release()
        if not released.wait(30):
            timed_out.append(True)
        return real(*args)

    monkeypatch.setattr(documents, "read_document", slow)
    with served() as c:
        uploads = [threading.Thread(target=send, args=(c, f"f{k}.txt", b"Hallo\n")) for k in range(5)]
        for t in uploads:
            t.start()
        assert entered.acquire(timeout=30)
        r = c.post("/translate", json={"q": "Hallo Welt", "source": "de", "target": "en"})
        answered_first = not timed_out
        released.set()
        for t in uploads:
            t.join()
    assert r.status_code == 200 and r.json()["translatedText"] == "HALLO WELT"
    assert answered_first


def test_a_form_field_that_is_not_utf8_is_a_400_as_on_translate():
    """/translate_file read a Latin-1 field as Latin-1 (a glossary's "posä" became mojibake that never matched),
    where /translate refuses it."""
    body = (b'--B\r\nContent-Disposition: form-data; name="file"; filename="a.txt"\r\n\r\nder hund\n\r\n--B\r\n'
            b'Content-Disposition: form-data; name="source"\r\n\r\nde\r\n--B\r\n'
            b'Content-Disposition: form-data; name="target"\r\n\r\nen\r\n--B\r\n'
            b'Content-Disposition: form-data; name="glossary"\r\n\r\n{"pos\xe4": "mosin"}\r\n--B--\r\n')
    with served() as c:
        r = c.post("/translate_file", content=body, headers={"content-type": "multipart/form-data; boundary=B"})
    assert r.status_code == 400 and "form field 'glossary' is not utf-8 text" in r.json()["error"], r.text


def test_an_upload_cut_short_is_refused_not_read_in_part():
    """A body without its closing boundary lost its unfinished last part: an api_key, a glossary, a target."""
    body = (b'--B\r\nContent-Disposition: form-data; name="file"; filename="a.txt"\r\n\r\nder hund\n\r\n--B\r\n'
            b'Content-Disposition: form-data; name="source"\r\n\r\nde\r\n--B\r\n'
            b'Content-Disposition: form-data; name="target"\r\n\r\nen')
    with served() as c:
        r = c.post("/translate_file", content=body, headers={"content-type": "multipart/form-data; boundary=B"})
        assert r.status_code == 400 and "ends before its closing boundary" in r.json()["error"], r.text
        r = c.post("/translate_file", content=body + b"\r\n--B--\r\n",
                   headers={"content-type": "multipart/form-data; boundary=B"})
        assert r.status_code == 200, r.text


def test_download_names_keep_the_extension_they_were_taken_for_and_fit_a_file_system():
    """" .txt" was taken as a .txt but named ".txt_de"; "x.TxT" came back "x_de.txt"; a 300-character name gave
    a download name over 255 bytes, which no file system saves."""
    from pipeline.serve.file_routes import download_name

    assert download_name(" .txt", "de") == "file_de.txt"
    assert download_name("Bericht.DOCX", "en") == "Bericht_en.DOCX"
    assert download_name("../../etc/passwd.txt", "de") == "passwd_de.txt"
    long = download_name("ä" * 300 + ".docx", "de")
    assert len(long.encode()) <= 255 and long.endswith("ä_de.docx")


def test_an_archive_of_too_many_xml_elements_is_refused_before_its_tree_is_built():
    """32 MiB of "<a/>" in word/document.xml, a 31 KB upload, built a 1.1 GB lxml tree, and so did 31 MiB of
    "<a b0='' ... b199=''/>" (a 174 KB upload, 21,759 elements): elements and attributes are counted in the
    part's bytes before it is parsed."""
    from pipeline.serve.zip_parts import MAX_XML_NODES

    attributes = "<a " + " ".join(f"b{i}=''" for i in range(200)) + "/>"
    for filler in ("<a/>" * MAX_XML_NODES, attributes * (MAX_XML_NODES // 200)):
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as z:
            z.writestr("[Content_Types].xml", "<Types/>")
            z.writestr("word/document.xml", '<w:document xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/'
                       f'2006/main"><w:body><w:p><w:r><w:t>Hallo</w:t></w:r></w:p>{filler}</w:body></w:document>')
        assert len(buffer.getvalue()) < 256 << 10
        with pytest.raises(documents.DocumentError, match=r"text parts hold more than this server's limit of "
                           r"2,000,000 XML elements and attributes") as refused:
            documents.read_document("bericht.docx", buffer.getvalue())
    assert refused.value.too_large


def _docx_with(paragraphs: list[str], extra: dict[str, bytes] | None = None) -> bytes:
    body = "".join(f"<w:p><w:r><w:t>{text}</w:t></w:r></w:p>" for text in paragraphs)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("word/document.xml", '<w:document xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/'
                   f'2006/main"><w:body>{body}</w:body></w:document>')
        for name, content in (extra or {}).items():
            z.writestr(name, content)
    return buffer.getvalue()


def test_a_read_archive_holds_its_texts_not_what_it_unpacks_to():
    """Each upload waiting for its translation held every member unpacked (a 146 KB .docx with 99 MiB of zeros:
    450 MB, 14 such uploads 1.7 GB); the members that are not text are copied from the upload at the rebuild."""
    import tracemalloc

    zeros = bytes(40 << 20)
    data = _docx_with(["Hallo Welt"], {"word/media/image1.bin": zeros})
    tracemalloc.start()
    try:
        doc = documents.read_document("bericht.docx", data)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held < 4 << 20, f"{held >> 20} MiB held by a read {len(data) >> 10} KiB archive"
    with zipfile.ZipFile(io.BytesIO(doc.rebuild(["HELLO WORLD"]))) as z:
        assert z.read("word/media/image1.bin") == zeros and b"HELLO WORLD" in z.read("word/document.xml")


def test_a_text_repeated_past_twice_the_limit_stops_the_reading():
    """Repeated texts are sent once, so a 129 KB .docx of one text a million times passed --max-sentences and
    took 1.5 GB and 27 s (an EPUB page, 1.8 GB and 56 s): texts are counted as they occur too, up to twice the
    limit (a Word text box is stored twice), as a .txt's lines are."""
    assert len(documents.read_document("ok.docx", _docx_with(["Kasten"] * 20, None), 10).texts) == 1
    with pytest.raises(documents.DocumentError, match=r"^the file has more than 20 texts, counted each time they "
                       r"occur \(2x this server's limit per request, --max-sentences 10, of distinct ones\)"):
        documents.read_document("many.docx", _docx_with(["Kasten"] * 21), 10)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("META-INF/container.xml", "<container/>")
        z.writestr("OEBPS/a.xhtml", "<p>ab</p>" * 15)
        z.writestr("OEBPS/b.xhtml", "<p>ab</p>" * 6)
    with pytest.raises(documents.DocumentError, match=r"^the file has more than 20 texts") as refused:
        documents.read_document("buch.epub", buffer.getvalue(), 10)
    assert refused.value.too_large


def test_uploads_wait_as_bytes_while_two_are_translated(monkeypatch):
    """Every upload was read and held (its trees, its texts) while it waited for its translation: memory grew with
    the uploads sent at once. At most app.DOCUMENTS_HELD are held from reading to rebuilding."""
    import asyncio
    import threading

    from pipeline.serve import app as app_module
    from pipeline.serve import file_routes

    held, most, lock = 0, 0, threading.Lock()
    read, translate = documents.read_document, file_routes.translate_texts

    def counted(*args: Any) -> Any:
        nonlocal held, most
        doc = read(*args)
        with lock:
            held += 1
            most = max(most, held)

        def rebuild(translations: list[str]) -> bytes:
            nonlocal held
            with lock:
                held -= 1
            return doc.rebuild(translations)
        return documents.Document(doc.texts, rebuild)

    async def slow(*args: Any) -> Any:
        await asyncio.sleep(0.3)
        return await translate(*args)

    monkeypatch.setattr(documents, "read_document", counted)
    monkeypatch.setattr(file_routes, "translate_texts", slow)
    with served() as c:
        answers: list[int] = []
        sent = [threading.Thread(target=lambda k=k: answers.append(
            send(c, f"d{k}.docx", _docx_with([f"Hund {k}"])).status_code)) for k in range(6)]
        for thread in sent:
            thread.start()
        for thread in sent:
            thread.join()
    assert answers == [200] * 6 and most == app_module.DOCUMENTS_HELD == 2, (answers, most)


def test_xml_past_the_parsers_limits_is_named_so_not_damaged():
    """A 10 MB attribute or elements 300 deep (legal XML) were "damaged", with libxml2's raw advice and a line
    break in the message ("... try XML_PARSE_HUGE\\n, line 2")."""
    deep = "<w:r>" * 300 + "</w:r>" * 300
    for body, says in ((f'<w:p w:rsid="{"a" * (11 << 20)}"/>', "Buffer size limit exceeded"),
                       (deep, "Excessive depth in document: 256"), (f"<!--{'a' * (11 << 20)}-->", "Comment too big")):
        with pytest.raises(documents.DocumentError) as refused:
            documents.read_document("x.docx", _docx_of('<w:document xmlns:w="http://schemas.openxmlformats.org/'
                                                       f'wordprocessingml/2006/main"><w:body>{body}</w:body>'
                                                       "</w:document>"))
        message = str(refused.value)
        assert message.startswith("the Word document (.docx)'s part 'word/document.xml' is beyond what this server "
                                  "parses") and says in message and refused.value.too_large, message
        assert "\n" not in message and "XML_PARSE_HUGE" not in message


def test_a_docx_named_odt_is_an_opendocument_with_an_article_that_fits():
    with pytest.raises(documents.DocumentError, match=r"^the file is not an OpenDocument text \(\.odt\): it has no "
                       "content.xml"):
        documents.read_document("x.odt", _docx_with(["Hallo"]))


def test_a_line_break_in_an_uploaded_pages_text_is_a_space_not_a_cut():
    """A hard-wrapped .html (pandoc wraps at 72 columns) had each sentence cut at its line ends, the pieces
    translated apart, through /translate_file as through "format": "html"; a .txt's line breaks still cut."""
    def sentences(c: TestClient) -> float:
        found = re.search(r'^pipeline_sentences_total\{model="de-en"\} (\S+)$', c.get("/metrics").text, re.M)
        return float(found.group(1)) if found else 0.0

    with served() as c:
        for name, data, expected in (("wrapped.html", b"<p>Ein Hund\nbellt laut.</p>", 1.0),
                                     ("wrapped.epub", _epub_of("<p>Ein Hund\nbellt laut.</p>"), 1.0),
                                     ("lines.txt", b"Ein Hund\nbellt laut.", 2.0)):
            before = sentences(c)
            r = send(c, name, data)
            assert r.status_code == 200, r.text
            assert sentences(c) - before == expected, name
        assert c.get(r.json()["translatedFileUrl"]).content == b"EIN HUND\nBELLT LAUT."


def _epub_of(page: str) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        z.writestr("META-INF/container.xml", "<container/>")
        z.writestr("OEBPS/a.xhtml", page)
    return buffer.getvalue()


def test_a_file_over_the_source_token_limit_is_named_and_told_to_split_the_file():
    """A 5 MB .html answered "1335905 source tokens, ... split the request", without the file's name."""
    import dataclasses

    state = state_of(PAIRS)
    state.limits = dataclasses.replace(state.limits, max_source_tokens=50)
    with TestClient(create_app(state)) as c:
        r = send(c, "lang.txt", "".join(f"Ein Hund bellt {k} mal laut im Garten.\n" for k in range(20)).encode())
    assert r.status_code == 413, r.text
    assert re.fullmatch(r"\"file\" 'lang.txt': \d+ source tokens, more than this server's limit of 50 per request "
                        r"\(--max-source-tokens\); split the file", r.json()["error"]), r.json()


def test_a_files_text_over_the_source_limit_is_named_and_told_to_split_that_text():
    """With --long-lines error, a .docx's over-long sentence answered "... 277 tokens ...; split the line": a
    document has no lines to split."""
    state = state_of(PAIRS)
    for model in state.models.values():
        model.long_lines = "error"
    with TestClient(create_app(state)) as c:
        r = send(c, "long.txt", ("Hund" * 400 + "\n").encode())  # windows of 1,000 characters, each over the limit
    assert r.status_code == 413, r.text
    assert re.fullmatch(r"\"file\" 'long.txt' text 1 sentence:1: \d+ tokens, more than the model's limit of \d+; "
                        r"split that text", r.json()["error"]), r.json()
