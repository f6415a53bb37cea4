"""Archives read within bounds (POST /translate_file's .docx, .pptx, .odt, .odp, .epub): members and declared
sizes checked before anything is decompressed, XML parts counted in bytes and nodes before lxml builds a tree,
and parsed without a DTD, entities or the network. The formats' own rules are archive_formats.py's."""

from __future__ import annotations

import io
import re
import shutil
import zipfile
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from lxml import etree  # type: ignore[import-untyped]  # no stubs in the wheel; lxml-stubs lags it

from pipeline.serve.text_formats import MAX_TAGS, DocumentError

MAX_UNZIPPED_BYTES = 100 << 20  # what an archive (.docx, .pptx, .odt, .odp, .epub) may unpack to, all members
MAX_MEMBERS = 10_000  # members of an archive
MAX_XML_BYTES = 32 << 20  # the XML parts parsed from one archive, together
# their elements and attributes, the nodes of lxml's tree: ~130 bytes an element, ~220 an attribute (32 MiB of
# "<a/>" took 1.1 GB, of "<a b0='' ... b199=''/>" 1.1 GB too)
MAX_XML_NODES = 2_000_000
REPEATS = 2  # texts counted each time they occur: at most this many times --max-sentences (distinct ones: once)
CHUNK = 1 << 20  # a member is read or copied this much at a time when it is not held whole


class Archive:
    """An upload opened as a zip once its member count and declared sizes are within bounds. Its members are
    decompressed one at a time (`members`), each read through once so that damage is found before any translation,
    and only those a reader asks for are held; `rebuilt` copies the others from the upload again, a chunk at a
    time: what an upload holds while its texts are translated is the upload, not what it unpacks to."""

    def __init__(self, data: bytes, what: str):
        self.data, self.what = data, what
        try:
            self.infos = self._open().infolist()
        except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError, OSError) as e:
            ole = data[:4] == b"\xd0\xcf\x11\xe0"  # password-protected Office files are OLE containers, not zips
            why = "password-protected, or an old .doc/.ppt" if ole else f"not a zip archive: {e}"
            raise DocumentError(f"the file is not a readable {what} ({why})") from None
        if len(self.infos) > MAX_MEMBERS:
            raise DocumentError(f"the {what} has {len(self.infos)} members, more than this server's limit of "
                                f"{MAX_MEMBERS}", too_large=True)
        total = sum(info.file_size for info in self.infos)
        if total > MAX_UNZIPPED_BYTES:
            raise DocumentError(f"the {what} unpacks to {total} bytes, more than this server's limit of "
                                f"{MAX_UNZIPPED_BYTES} ({MAX_UNZIPPED_BYTES >> 20} MiB)", too_large=True)
        self.names = [info.filename for info in self.infos]
        seen: set[str] = set()  # two members of one name (both were translated and written back: which one an
        for name in self.names:  # application reads is its own choice); a name that climbs out of the archive
            if name in seen:
                raise DocumentError(f"the {what} is damaged: it holds {name[:100]!r} twice")
            if name.startswith(("/", "\\")) or ".." in name.replace("\\", "/").split("/"):
                raise DocumentError(f"the {what} is damaged: its member {name[:100]!r} names a place outside it")
            seen.add(name)

    def _open(self) -> zipfile.ZipFile:
        return zipfile.ZipFile(io.BytesIO(self.data))

    def small(self, name: str, limit: int = 1 << 20) -> bytes | None:
        """Member `name` when it is there and declares at most `limit` bytes (read no further than that), else None."""
        info = next((i for i in self.infos if i.filename == name and i.file_size <= limit), None)
        if info is None:
            return None
        try:
            with self._open() as archive, archive.open(info) as member:
                return member.read(limit + 1)
        except (zipfile.BadZipFile, ValueError, EOFError, OSError, NotImplementedError):
            return None

    def members(self, wanted: Callable[[str], bool]) -> Iterator[tuple[int, zipfile.ZipInfo, bytes]]:
        """The `wanted` members (by name) as (index, info, bytes), in order; every other one read through in chunks
        (its CRC checked) and dropped. zipfile stops at the declared size and checks the CRC: more is an error, not
        a bomb; each read asks for a bounded size (a whole-member read() asks zlib for up to 2 GiB and cuts after:
        a 1 MiB member declaring 10 bytes held 2 GB)."""
        with self._open() as archive:
            for index, info in enumerate(self.infos):
                try:
                    with archive.open(info) as member:
                        if wanted(info.filename):
                            yield index, info, member.read(info.file_size + 1)
                        else:
                            while member.read(CHUNK):
                                pass
                except DocumentError:
                    raise
                except Exception as e:  # bad CRC, unknown compression, encrypted, truncated: the file's fault
                    raise DocumentError(f"the {self.what} is password-protected: save it without a password"
                                        if info.flag_bits & 1 else f"the {self.what} is damaged: its member "
                                        f"{info.filename[:100]!r} cannot be read ({type(e).__name__}: "
                                        f"{str(e)[:200]})") from None

    def rebuilt(self, replaced: Mapping[int, bytes]) -> bytes:
        """The archive again, members in order, each compressed as it was (an ODF's or EPUB's mimetype: first,
        stored), the `replaced` ones (by index) with their new bytes, the rest copied a chunk at a time."""
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w") as archive, self._open() as source:
            for index, info in enumerate(self.infos):
                date = info.date_time if info.date_time[0] >= 1980 else (1980, 1, 1, 0, 0, 0)
                try:
                    copy = zipfile.ZipInfo(info.filename, date)
                except ValueError:
                    copy = zipfile.ZipInfo(info.filename)
                copy.compress_type = zipfile.ZIP_STORED if info.compress_type == zipfile.ZIP_STORED \
                    else zipfile.ZIP_DEFLATED
                copy.external_attr = info.external_attr
                if index in replaced:
                    archive.writestr(copy, replaced[index])
                    continue
                with source.open(info) as member, archive.open(copy, "w") as target:
                    shutil.copyfileobj(member, target, CHUNK)
        return out.getvalue()


def parse_xml(content: bytes, name: str, what: str) -> Any:
    parser = etree.XMLParser(resolve_entities=False, no_network=True, load_dtd=False, huge_tree=False)
    try:
        tree = etree.parse(io.BytesIO(content), parser)
    except etree.XMLSyntaxError as e:  # libxml's own advice (XML_PARSE_HUGE) is none a sender can act on
        why = re.sub(r",? (use|try) XML_PARSE_HUGE( option)?", "", str(e)).replace("\n", "")
        if why.startswith(("Resource limit exceeded", "Excessive depth")) or " too big" in why:  # legal XML, past
            # libxml2's limits (a text, an attribute, a comment, CDATA or a processing instruction over 10 MB)
            raise DocumentError(f"the {what}'s part {name!r} is beyond what this server parses ({why}): a text or "
                                "an attribute (a comment, CDATA) over 10 MB, or elements nested over 256 deep",
                                too_large=True) from None
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
    (lxml's), MAX_XML_NODES elements and attributes, else (a page for our tag scanner) MAX_TAGS tags, each past
    its limit a DocumentError (413) naming the parts (`held`). And its texts as they are found, each time one
    occurs: at most REPEATS x `max_texts` (a Word text box is stored twice; documents.py counts distinct ones
    against `max_texts`), so that a file of one text repeated a million times stops as the plain formats do, at
    once, not after building the lot."""

    def __init__(self, what: str, held: str, max_texts: int | None = None):
        self.what, self.held = what, held
        self.bytes = self.nodes = self.tags = self.texts = 0
        self.max_texts = None if max_texts is None else REPEATS * max_texts

    def take(self, content: bytes, *, tree: bool = True) -> None:
        self.bytes += len(content)
        if self.bytes > MAX_XML_BYTES:
            self._refuse(f"{MAX_XML_BYTES} bytes of {'XML' if tree else 'XHTML'} ({MAX_XML_BYTES >> 20} MiB)")
        if tree:  # tags and "=" (comments and text's "=" too: a bound, not a parse)
            self.nodes += content.count(b"<") - content.count(b"</") + content.count(b"=")
            if self.nodes > MAX_XML_NODES:
                self._refuse(f"{MAX_XML_NODES:,} XML elements and attributes")
        else:
            self.tags += content.count(b"<")
            if self.tags > MAX_TAGS:
                self._refuse(f"{MAX_TAGS:,} tags")

    def left(self) -> int | None:
        """How many more texts may be found (None: no limit)."""
        return None if self.max_texts is None else self.max_texts - self.texts

    def found(self, n: int = 1) -> None:
        self.texts += n
        if self.max_texts is not None and self.texts > self.max_texts:
            raise DocumentError(f"the file has more than {self.max_texts} texts, counted each time they occur "
                                f"({REPEATS}x this server's limit per request, --max-sentences "
                                f"{self.max_texts // REPEATS}, of distinct ones); split the file", too_large=True)

    def _refuse(self, limit: str) -> None:
        raise DocumentError(f"the {self.what}'s {self.held} hold more than this server's limit of {limit}",
                            too_large=True)
