"""Archives read within bounds (POST /translate_file's .docx, .pptx, .odt, .odp, .epub): members and declared
sizes checked before anything is decompressed, XML parts counted in bytes and elements before lxml builds a tree,
and parsed without a DTD, entities or the network. The formats' own rules are archive_formats.py's."""

from __future__ import annotations

import io
import zipfile
from typing import Any

from lxml import etree  # type: ignore[import-untyped]  # no stubs in the wheel; lxml-stubs lags it

from pipeline.serve.text_formats import DocumentError

MAX_UNZIPPED_BYTES = 100 << 20  # what an archive (.docx, .pptx, .odt, .odp, .epub) may unpack to, all members
MAX_MEMBERS = 10_000  # members of an archive
MAX_XML_BYTES = 32 << 20  # the XML parts parsed from one archive, together
MAX_XML_ELEMENTS = 2_000_000  # their elements: lxml's tree costs ~130 bytes each (32 MiB of "<a/>" took 1.1 GB)


def members(data: bytes, what: str) -> list[tuple[zipfile.ZipInfo, bytes]]:
    """Every member, decompressed once the declared sizes are within bounds (zipfile stops at the declared size and
    checks the CRC: more is an error, not a bomb); each read asks for that size (a whole-member read() asks zlib
    for up to 2 GiB and cuts after: a 1 MiB member declaring 10 bytes held 2 GB)."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        infos = archive.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError, OSError) as e:
        ole = data[:4] == b"\xd0\xcf\x11\xe0"  # password-protected Office files are OLE containers, not zips
        why = "password-protected, or an old .doc/.ppt" if ole else f"not a zip archive: {e}"
        raise DocumentError(f"the file is not a readable {what} ({why})") from None
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
                content = member.read(info.file_size + 1)
        except Exception as e:  # bad CRC, unknown compression, encrypted, truncated: the file's fault
            raise DocumentError(f"the {what} is password-protected: save it without a password" if info.flag_bits & 1
                                else f"the {what} is damaged: its member {info.filename[:100]!r} cannot be read "
                                f"({type(e).__name__}: {str(e)[:200]})") from None
        members.append((info, content))
    return members


def zipped(members: list[tuple[zipfile.ZipInfo, bytes]]) -> bytes:
    """The archive again, members in order, each compressed as it was (an ODF's or EPUB's mimetype: first, stored)."""
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


def parse_xml(content: bytes, name: str, what: str) -> Any:
    parser = etree.XMLParser(resolve_entities=False, no_network=True, load_dtd=False, huge_tree=False)
    try:
        tree = etree.parse(io.BytesIO(content), parser)
    except etree.XMLSyntaxError as e:  # libxml's own advice (XML_PARSE_HUGE) is none a sender can act on
        why = str(e).replace(", use XML_PARSE_HUGE option", "")
        raise DocumentError(f"the {what} is damaged: its part {name!r} is not readable XML ({why})") from None
    if tree.docinfo.internalDTD is not None or tree.docinfo.doctype:
        raise DocumentError(f"the {what}'s part {name!r} declares a DTD, which this server does not read")
    return tree


def serialize(tree: Any) -> bytes:
    info = tree.docinfo
    return etree.tostring(tree, xml_declaration=True, encoding=info.encoding or "UTF-8",
                          standalone=info.standalone)


class XmlBudget:
    """The XML of one archive, counted part by part before it is parsed: at most MAX_XML_BYTES and, for a tree
    (lxml's), MAX_XML_ELEMENTS elements, each past its limit a DocumentError (413) naming the parts (`held`)."""

    def __init__(self, what: str, held: str):
        self.what, self.held = what, held
        self.bytes = self.elements = 0

    def take(self, content: bytes, *, tree: bool = True) -> None:
        self.bytes += len(content)
        if self.bytes > MAX_XML_BYTES:
            self._refuse(f"{MAX_XML_BYTES} bytes of {'XML' if tree else 'XHTML'} ({MAX_XML_BYTES >> 20} MiB)")
        if tree:
            self.elements += content.count(b"<") - content.count(b"</")  # comments too: a bound, not a parse
            if self.elements > MAX_XML_ELEMENTS:
                self._refuse(f"{MAX_XML_ELEMENTS:,} XML elements")

    def _refuse(self, limit: str) -> None:
        raise DocumentError(f"the {self.what}'s {self.held} hold more than this server's limit of {limit}",
                            too_large=True)
