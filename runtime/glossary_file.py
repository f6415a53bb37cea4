"""Glossaries in: a TSV file (`load_glossary`) or an inline mapping sent with an HTTP request
(`glossary_from_mapping`), each entry checked and the whole checked once, into a runtime/glossary.py `Glossary`
whose matcher is compiled before it is used, so that a glossary that cannot be matched is refused where it is
loaded (a server's start, a request's 400), never when a sentence meets it. docs/glossary.md says what a file
may hold; every refusal is one RuntimeUserError naming FILE:LINE or glossary['KEY'].

What a careless file holds is refused rather than loaded as terms that can never match or be reported:
characters no one types in a term (control and format characters, a byte-order mark mid-file, a zero-width
space, SentencePiece's meta symbol; joiners, which some scripts spell with, are kept), a file that is CSV, a
JSON object that repeats a key. The file is read bounded (MAX_GLOSSARY_BYTES), so /dev/zero is refused, not
read for ever. `open_glossary` reads a command's files and checks them against the model that applies them."""

from __future__ import annotations

import codecs
import logging
import os
import re
import unicodedata
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from runtime.backend import Backend
from runtime.errors import RuntimeUserError
from runtime.glossary import _SPACE, MAX_TERM_CHARS, Entry, Glossary, _fold, check_targets
from runtime.tokenizer import AnyTokenizer

log = logging.getLogger(__name__)

MAX_GLOSSARY_TERMS = 10_000  # entries (lines that are not blank or comments) of one glossary file
MAX_REQUEST_TERMS = 256  # entries of a glossary sent inline with a request
MAX_GLOSSARY_BYTES = 16 << 20  # far above MAX_GLOSSARY_TERMS entries of two MAX_TERM_CHARS terms
_BOM = "\ufeff"
_JOINERS = frozenset("\u200c\u200d")  # zero-width non-joiner and joiner: part of Persian, Indic and emoji spelling
_PIECE_MARK = "\u2581"  # SentencePiece's word-start symbol: a target holding it is spelled as something else


def _field(text: str) -> str:
    return _SPACE.sub(" ", text.strip())


def _unseen(term: str) -> str | None:
    """The first character of `term` that no one means to type in a term: a control, format (but a joiner) or
    surrogate character, or SentencePiece's meta symbol; None when there is none."""
    for char in term:
        kind = unicodedata.category(char)
        if kind in ("Cc", "Cs") or kind == "Cf" and char not in _JOINERS or char == _PIECE_MARK:
            return char
    return None


def _entry(source: str, target: str, where: str, in_file: bool = True) -> Entry:
    """An entry from its two fields, or a RuntimeUserError starting with `where`. The fields are checked as
    written: whitespace is collapsed after, so a control that is whitespace to Python (U+001F, NEL, a form feed)
    is refused, not made a space. `in_file`: a NUL suggests UTF-16 (not in a request's JSON)."""
    for name, term in (("source", source), ("target", target)):
        char = _unseen(term.strip(" \t\r\n"))
        if char is not None:
            what = unicodedata.name(char, "a surrogate" if unicodedata.category(char) == "Cs" else "a control")
            hint = "; is the file UTF-16? save it as UTF-8" if char == "\0" and in_file else ""
            raise RuntimeUserError(f"{where}: the {name} term {_short(term)} holds U+{ord(char):04X} ({what}), a "
                                   f"character that is not part of a term: remove it{hint}")
    source, target = _field(source), _field(target)
    if not source:
        raise RuntimeUserError(f"{where}: the source term is empty (a line is `source<TAB>target`)")
    for name, term in (("source", source), ("target", target)):
        if len(term) > MAX_TERM_CHARS:
            raise RuntimeUserError(f"{where}: the {name} term {_short(term)} is {len(term)} characters, more than "
                                   f"MAX_TERM_CHARS ({MAX_TERM_CHARS})")
    return Entry(source, target or source, dnt=not target)


def _short(term: str, limit: int = 30) -> str:
    """A term in a message: quoted, cut at `limit` characters."""
    return repr(term) if len(term) <= limit else repr(term[:limit]) + "..."


def _alike(one: str, other: str) -> str:
    """How two source terms that fold alike are the same term (a message's words)."""
    if one == other:
        return "the same source term"
    if unicodedata.normalize("NFC", one) == unicodedata.normalize("NFC", other):  # they print alike: spelt out
        return (f"the same source term in two Unicode compositions, {ascii(one)} and {ascii(other)}: terms are "
                "compared composed (NFC)")
    return "the same source term, compared case-insensitively"


def _describe(entry: Entry) -> str:
    return f"{entry.source!r} (do not translate)" if entry.dnt else f"{entry.source!r} -> {entry.target!r}"


def _checked(entries: list[tuple[Entry, str]], source: str) -> Glossary:
    """The glossary of (entry, where) pairs: identical duplicates dropped; the same source term (folded) with
    two targets refused in one line naming both; its matcher compiled (a RuntimeUserError naming `source`, the
    files or the request's field, if it cannot be)."""
    seen: dict[str, tuple[Entry, str]] = {}
    kept: dict[tuple[str, str, bool], str] = {}  # entry -> where it was first given
    for entry, where in entries:
        key = _fold(entry.source, case_sensitive=False)
        meaning = (entry.dnt, "" if entry.dnt else unicodedata.normalize("NFC", entry.target))
        first = seen.setdefault(key, (entry, where))
        first_meaning = (first[0].dnt, "" if first[0].dnt else unicodedata.normalize("NFC", first[0].target))
        if meaning != first_meaning:
            raise RuntimeUserError(f"{where}: {_describe(entry)} conflicts with {first[1]}: {_describe(first[0])} "
                                   f"({_alike(entry.source, first[0].source)}, with two targets)")
        kept.setdefault((entry.source, entry.target, entry.dnt), where)
    glossary = Glossary(tuple(Entry(*k) for k in kept), tuple(kept.values()))
    try:
        glossary.matcher()
    except RuntimeUserError as e:  # terms nested too deeply: it named neither the files nor the field
        raise RuntimeUserError(f"{source}: {e}") from None
    return glossary


def _read(path: str | Path) -> bytes:
    """The file's bytes, at most MAX_GLOSSARY_BYTES (a pipe is read once, as any file)."""
    if str(path) == "":
        raise RuntimeUserError("the glossary path is empty (on a command line: is a shell variable unset?)")
    if str(path) == "-" and not os.path.exists("-"):  # said "-: cannot read the glossary (No such file ...)"
        raise RuntimeUserError("a glossary is read from a file, not standard input ('-'); give its path, or a pipe "
                               "as <(command)")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_GLOSSARY_BYTES + 1)
    except OSError as e:
        raise RuntimeUserError(f"{path}: cannot read the glossary ({e.strerror or e})") from None
    if len(data) > MAX_GLOSSARY_BYTES:
        raise RuntimeUserError(f"{path}: the glossary is over {MAX_GLOSSARY_BYTES >> 20} MiB, more than "
                               f"MAX_GLOSSARY_TERMS ({MAX_GLOSSARY_TERMS}) entries could fill")
    return data


def load_glossary(path: str | Path) -> Glossary:
    """A glossary file: UTF-8 TSV, `source<TAB>target` a line, an empty or absent target meaning do not
    translate; blank lines and lines whose first character that is not a space is `#` skipped, a BOM at
    its start dropped. Every problem is one RuntimeUserError naming FILE:LINE."""
    return _checked(_file_entries(path), str(path))


def load_glossaries(paths: Sequence[str | Path]) -> Glossary:
    """Several glossary files as one (each read as load_glossary reads it): a term two of them give two targets
    is a conflict naming both FILE:LINEs, a term they give alike is kept once."""
    return _checked([entry for path in paths for entry in _file_entries(path)], ", ".join(map(str, paths)))


# a separator as a CSV row holds it between two fields: text on both sides, no space after, not between digits
_PAIRED = {sep: re.compile(rf"(?<=[^\s\d]){sep}(?=\S)|(?<=\S){sep}(?=[^\s\d])") for sep in ",;"}
_ENTITY = re.compile(r"&#?\w+;")  # an HTML character reference ends in a semicolon: no separator


def _unquoted(field: str) -> str | None:
    """A field quoted as a CSV writer quotes one that holds a quote (between quotes, its own quotes doubled:
    pandas' to_csv with a tab separator, Python's csv, Excel's tab-separated export): its text; None otherwise."""
    body = field.strip(" \r")  # a doubled quote inside: a writer quoting as needed writes "Bond" as """Bond"""
    inner = body[1:-1]
    if len(body) >= 2 and body[0] == body[-1] == '"' and '""' in inner and '"' not in inner.replace('""', ""):
        return inner.replace('""', '"')
    return None


def _file_entries(path: str | Path) -> list[tuple[Entry, str]]:
    data = _read(path)
    for mark, name in ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"),
                       (codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16")):
        if data.startswith(mark):  # Excel's "Unicode Text": said "not UTF-8 (byte 0xff at column 1)" alone
            raise RuntimeUserError(f"{path}: is {name} (its byte order mark), not UTF-8; save the glossary as UTF-8 "
                                   f"(iconv -f {name} -t UTF-8)")
    if data.startswith(_BOM.encode()):
        data = data[len(_BOM.encode()):]
    entries: list[tuple[Entry, str]] = []
    tabs, separators = 0, {",": 0, ";": 0}  # CSV's (Excel writes ; where , is the decimal mark: de, fr)
    paired = {",": 0, ";": 0}  # lines of one field holding a separator as a CSV row does
    suspects: list[tuple[str, str]] = []  # and where
    quoted = 0  # fields quoted as a CSV writer quotes them
    for number, raw in enumerate(data.split(b"\n"), start=1):
        where = f"{path}:{number}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise RuntimeUserError(f"{where}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                                   f"save the glossary as UTF-8") from None
        if "\r" in line.removesuffix("\r"):  # CRLF is a line end; a CR inside a line is lines ended by CR alone
            raise RuntimeUserError(f"{where}: a carriage return (CR) inside the line: its lines end in CR alone (as "
                                   "classic Mac OS wrote them); save the glossary with LF or CRLF line ends")
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        fields = line.split("\t")
        if len(fields) > 2:
            raise RuntimeUserError(f"{where}: {len(fields)} tab-separated fields, at most 2 (source term, "
                                   f"target term)")
        if len(entries) == MAX_GLOSSARY_TERMS:
            raise RuntimeUserError(f"{where}: more than MAX_GLOSSARY_TERMS ({MAX_GLOSSARY_TERMS}) entries in "
                                   f"one glossary; keep the terms that matter or split it by domain")
        tabs += len(fields) == 2
        for separator in separators:  # between two fields ("Hund;dog"), not ending a term ("&nbsp;")
            separators[separator] += separator in line.strip().strip(separator)
            if len(fields) == 1 and _PAIRED[separator].search(_ENTITY.sub("", line)):  # "vobi,guret", not
                paired[separator] += 1  # "Acme, Inc.", "1,000" nor "AT&amp;T"
                suspects.append((where, separator))
        plain = [_unquoted(field) for field in fields]
        quoted += sum(p is not None for p in plain)
        fields = [field if p is None else p for field, p in zip(fields, plain)]
        entries.append((_entry(fields[0], fields[1] if len(fields) == 2 else "", where), where))
    if quoted:  # counted, not silent: a term whose quotes were kept never matched
        log.info("%s: %d field(s) quoted as a CSV writer quotes them (pandas, Excel), read without their quotes",
                 path, quoted)
    for separator, name in ((",", "a comma"), (";", "a semicolon")):
        if entries and not tabs and (separators[separator] == len(entries) or 2 * paired[separator] >=
                                     len(entries)):  # a CSV, some of its rows perhaps of one field
            held = "every line holds" if separators[separator] == len(entries) else \
                f"{paired[separator]} of its {len(entries)} lines hold"
            raise RuntimeUserError(f"{path}: {held} {name} and none a tab: a glossary is tab-separated "
                                   "(source<TAB>target), not CSV; a line without a tab is a term not to translate "
                                   "(for a file of such terms, end one line with a tab)")
    if tabs and suspects:  # "vobi,guret" among tab-separated lines: a pair typed as CSV, kept as one term
        where, separator = suspects[0]
        raise RuntimeUserError(f"{where}: no tab but a {'comma' if separator == ',' else 'semicolon'}, where the "
                               "other lines are tab-separated: put a tab between the source and the target term, "
                               f"or end the line with a tab to keep it a term not to translate ({len(suspects)} "
                               "such line(s))")
    return entries


def glossary_from_mapping(mapping: Any, where: str = "glossary", limit: int = MAX_REQUEST_TERMS) -> Glossary:
    """An inline glossary (`{"Hund": "dog", "Acme": ""}`, "" meaning do not translate), checked as a file
    is; errors name `where` (the request's field) and the entry. A mapping whose `repeated_keys` lists keys
    its JSON gave twice (pipeline/serve/http.py reads objects so) is refused: one of the two would be lost."""
    if not isinstance(mapping, Mapping):
        raise RuntimeUserError(f"{where}: expected an object of source term -> target term, not "
                               f"{type(mapping).__name__}")
    repeated = getattr(mapping, "repeated_keys", ())
    if repeated:
        raise RuntimeUserError(f"{where}[{_short(str(repeated[0]))}]: the key is given twice in the object; "
                               "give each source term once")
    if len(mapping) > limit:
        raise RuntimeUserError(f"{where}: {len(mapping)} entries, more than MAX_REQUEST_TERMS ({limit}) in one "
                               f"request; load a larger glossary on the server")
    entries: list[tuple[Entry, str]] = []
    for source, target in mapping.items():
        place = f"{where}[{_short(source) if isinstance(source, str) else repr(source)}]"
        if not isinstance(source, str):
            raise RuntimeUserError(f"{place}: the source term must be a string, not {type(source).__name__}")
        if not isinstance(target, str):
            raise RuntimeUserError(f'{place}: the target term must be a string ("" = do not translate), not '
                                   f"{type(target).__name__}")
        entries.append((_entry(source, target, place, in_file=False), place))
    return _checked(entries, where)


def open_glossary(paths: Sequence[str] | str | None, tokenizer: AnyTokenizer, backend: Backend) -> Glossary | None:
    """The glossary files read as one and checked once (every fixed target spelled by the model's vocabulary), for
    a backend that can apply it; None without a path. RuntimeUserErrors name the file's line, or the backend."""
    if not paths:
        return None
    refuse_without_gather(backend)  # before reading the file: the fix is the backend, whatever the file holds
    glossary = load_glossaries([paths] if isinstance(paths, str) else paths)
    check_glossary(glossary, tokenizer, backend)
    return glossary


def check_glossary(glossary: Glossary, tokenizer: AnyTokenizer, backend: Backend) -> None:
    """RuntimeUserError unless this model can apply `glossary`: its backend gathers, and its vocabulary spells
    every fixed target (runtime/glossary.py check_targets)."""
    refuse_without_gather(backend)
    check_targets(glossary, tokenizer.encode, tokenizer.unk_id)


def refuse_without_gather(backend: Backend) -> None:
    """A glossary needs a backend whose decoder step returns any id's log-prob (Backend.gathers)."""
    if not backend.gathers:
        raise RuntimeUserError(no_gather(backend.name, backend.shortlist is not None))


def no_gather(backend: str, shortlisted: bool = False) -> str:
    if shortlisted:  # the cause itself, first (it came last, after advice that did not apply)
        return ("a glossary needs the log-probs of a term's tokens over the whole vocabulary, which the shortlisted "
                "step (--shortlist) does not compute: leave out --shortlist to use a glossary")
    if backend == "onnxruntime":  # it said "use the onnxruntime backend" to a user on it
        return ("the onnxruntime backend cannot apply a glossary to this model dir: it has no "
                "decoder_constrained.onnx (exported before glossaries); export it again with this version, or use "
                "the torch backend with its eager step, without --shortlist")
    return (f"the {backend} backend cannot apply a glossary here: use the onnxruntime backend on a model dir "
            "exported by this version (it holds decoder_constrained.onnx), or the torch backend with its eager step, "
            "without --shortlist")
