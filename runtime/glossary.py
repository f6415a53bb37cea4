"""Glossaries: "always translate X as Y" and "never translate this name", as constraints for search.

A glossary is loaded and checked once (`load_glossary` for a TSV file, `glossary_from_mapping` for an
inline one sent with an HTTP request); for each source sentence `terms_for` finds its terms and turns
their targets into the model's target tokens, which constrained search (runtime/constrained.py) forces
into the output; `applied_terms` then says which targets the output holds. docs/glossary.md is the
user's guide.

Decisions, each so that one glossary means one thing:
- Matching is whole words (no letter, digit or underscore, nor a combining mark, on either side), on
  text and terms folded alike: NFC, then Unicode casefold (so "ÄPFEL" finds "Äpfel" and "STRASSE"
  finds "Straße"), unless `case_sensitive`. Offsets always refer to the original text. A space in a term
  matches any run of whitespace. At each position the longest term wins ("New York" over "York"),
  matches never overlap, and the leftmost starts first.
- A conflict is only the same source term (compared folded, as matching does) with two different
  targets, or once do-not-translate and once with a target. Identical duplicates are kept once. Terms
  that overlap otherwise ("New York" and "York") are not conflicts: longest-first decides.
- A sentence with more distinct targets than MAX_SENTENCE_TERMS keeps the first ones in text order as
  constraints; the rest are counted (`Terms.dropped`) and reported as not constrained, never refused,
  so one long sentence does not fail a whole request.
- A target is encoded on its own (`encode_target([target])`): SentencePiece's dummy prefix makes it
  "▁target", the pieces it has after a space mid-sentence and at the start of a sentence alike.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from model.config import UNK_ID
from runtime.errors import RuntimeUserError

MAX_TERM_CHARS = 100  # characters of a source or target term, after whitespace is collapsed
MAX_GLOSSARY_TERMS = 10_000  # entries of one glossary file
MAX_REQUEST_TERMS = 256  # entries of a glossary sent inline with a request
MAX_SENTENCE_TERMS = 16  # distinct targets forced into one sentence's translation
MAX_TERM_TOKENS = 32  # target tokens of one term

EncodeTarget = Callable[[list[str]], list[list[int]]]

_SPACE = re.compile(r"\s+")
_BOM = "\ufeff"


@dataclass(frozen=True)
class Entry:
    """One glossary line. `dnt`: do not translate; the source text as found in the sentence is the target
    (then `target` is the glossary's spelling of the source, for reports)."""

    source: str
    target: str
    dnt: bool


@dataclass(frozen=True)
class Match:
    """A term found in a sentence: `text[start:end] == found`."""

    start: int
    end: int
    entry: Entry
    found: str

    @property
    def target(self) -> str:
        """What must appear in the output: the entry's target, or for do-not-translate the source as found
        (its whitespace collapsed)."""
        return _SPACE.sub(" ", self.found) if self.entry.dnt else self.entry.target


@dataclass(frozen=True)
class Glossary:
    """Checked entries (no conflicts, no duplicates), each with where it was first given (`places`: FILE:LINE or
    glossary['KEY'], for messages). The matchers are compiled on first use and kept."""

    entries: tuple[Entry, ...]
    places: tuple[str, ...] = field(default=(), compare=False)

    def __len__(self) -> int:
        return len(self.entries)

    @cached_property
    def _folded_matcher(self) -> _Matcher:
        return _Matcher(self.entries, case_sensitive=False)

    @cached_property
    def _exact_matcher(self) -> _Matcher:
        return _Matcher(self.entries, case_sensitive=True)

    def matcher(self, case_sensitive: bool = False) -> _Matcher:
        return self._exact_matcher if case_sensitive else self._folded_matcher


EMPTY_GLOSSARY = Glossary(())


@dataclass(frozen=True)
class Terms:
    """One sentence's glossary terms: every match (text order), the distinct targets forced into its
    translation (at most MAX_SENTENCE_TERMS, text order) with their target tokens, and how many distinct
    targets were beyond that limit."""

    matches: tuple[Match, ...] = ()
    targets: tuple[str, ...] = ()
    constraints: list[list[int]] = field(default_factory=list)
    dropped: int = 0


NO_TERMS = Terms()

# -- loading --------------------------------------------------------------------------------------


def _fold(text: str, case_sensitive: bool) -> str:
    """The form terms are compared in: NFC, then casefolded (and NFC again: casefold can decompose)."""
    text = unicodedata.normalize("NFC", text)
    return text if case_sensitive else unicodedata.normalize("NFC", text.casefold())


def _field(text: str) -> str:
    return _SPACE.sub(" ", text.strip())


def _entry(source: str, target: str, where: str) -> Entry:
    """An entry from its two fields, or a RuntimeUserError starting with `where`."""
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


def _describe(entry: Entry) -> str:
    return f"{entry.source!r} (do not translate)" if entry.dnt else f"{entry.source!r} -> {entry.target!r}"


def _checked(entries: list[tuple[Entry, str]]) -> Glossary:
    """The glossary of (entry, where) pairs: identical duplicates dropped; the same source term (folded) with
    two targets refused in one line naming both."""
    seen: dict[str, tuple[Entry, str]] = {}
    kept: dict[tuple[str, str, bool], str] = {}  # entry -> where it was first given
    for entry, where in entries:
        key = _fold(entry.source, case_sensitive=False)
        meaning = (entry.dnt, "" if entry.dnt else unicodedata.normalize("NFC", entry.target))
        first = seen.setdefault(key, (entry, where))
        first_meaning = (first[0].dnt, "" if first[0].dnt else unicodedata.normalize("NFC", first[0].target))
        if meaning != first_meaning:
            raise RuntimeUserError(f"{where}: {_describe(entry)} conflicts with {first[1]}: {_describe(first[0])} "
                                   f"(the same source term, compared case-insensitively, with two targets)")
        kept.setdefault((entry.source, entry.target, entry.dnt), where)
    return Glossary(tuple(Entry(*k) for k in kept), tuple(kept.values()))


def load_glossary(path: str | Path) -> Glossary:
    """A glossary file: UTF-8 TSV, `source<TAB>target` a line, an empty or absent target meaning do not
    translate; blank lines and lines starting with `#` skipped, a BOM dropped. Every problem is one
    RuntimeUserError naming FILE:LINE."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise RuntimeUserError(f"{path}: cannot read the glossary ({e.strerror or e})") from None
    if data.startswith(_BOM.encode()):
        data = data[len(_BOM.encode()):]
    entries: list[tuple[Entry, str]] = []
    for number, raw in enumerate(data.split(b"\n"), start=1):
        where = f"{path}:{number}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise RuntimeUserError(f"{where}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                                   f"save the glossary as UTF-8") from None
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.split("\t")
        if len(fields) > 2:
            raise RuntimeUserError(f"{where}: {len(fields)} tab-separated fields, at most 2 (source term, "
                                   f"target term)")
        if len(entries) == MAX_GLOSSARY_TERMS:
            raise RuntimeUserError(f"{where}: more than MAX_GLOSSARY_TERMS ({MAX_GLOSSARY_TERMS}) entries in "
                                   f"one glossary; keep the terms that matter or split it by domain")
        entries.append((_entry(fields[0], fields[1] if len(fields) == 2 else "", where), where))
    return _checked(entries)


def glossary_from_mapping(mapping: Any, where: str = "glossary", limit: int = MAX_REQUEST_TERMS) -> Glossary:
    """An inline glossary (`{"Hund": "dog", "Acme": ""}`, "" meaning do not translate), checked as a file
    is; errors name `where` (the request's field) and the entry."""
    if not isinstance(mapping, Mapping):
        raise RuntimeUserError(f"{where}: expected an object of source term -> target term, not "
                               f"{type(mapping).__name__}")
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
        entries.append((_entry(source, target, place), place))
    return _checked(entries)

# -- matching -------------------------------------------------------------------------------------


def _trie_pattern(node: dict[str, Any]) -> str:
    """The regex of a trie of terms: one branch per next symbol (a character, or " " for any whitespace run),
    so matching costs the length of a term, not the number of terms. A term that ends here makes the rest
    optional; greedy, so the longest term is tried first and shorter ones on backtracking."""
    end = "" in node
    branches = [(r"\s+" if symbol == " " else re.escape(symbol)) + _trie_pattern(child)
                for symbol, child in sorted(node.items()) if symbol]
    if not branches:
        return ""
    body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
    return "(?:" + body + ")?" if end else body


def _mark(char: str) -> bool:
    return unicodedata.category(char).startswith("M")


class _Matcher:
    """All terms of a glossary as one compiled trie regex over folded text, and the entry of each folded term."""

    def __init__(self, entries: Sequence[Entry], case_sensitive: bool):
        self.case_sensitive = case_sensitive
        self.entries: dict[str, Entry] = {}
        for entry in entries:  # one entry per folded term: entries sharing one have the same meaning
            self.entries.setdefault(_fold(entry.source, case_sensitive), entry)
        root: dict[str, Any] = {}
        for term in self.entries:
            node = root
            for char in term:
                node = node.setdefault(char, {})
            node[""] = {}
        self.pattern = re.compile(r"(?<!\w)" + _trie_pattern(root) + r"(?!\w)") if root else None

    def fold(self, text: str) -> tuple[str, list[int] | None]:
        """The folded text and, where folding changed lengths, the original offset of each folded character
        (plus one for the end). Each unit (a character with the combining marks after it) is folded alone."""
        if unicodedata.is_normalized("NFC", text):
            if self.case_sensitive:
                return text, None
            folded = text.casefold()  # character by character: full case folding has no context
            if unicodedata.is_normalized("NFC", folded):
                if len(folded) == len(text):
                    return folded, None
                return folded, [i for i, c in enumerate(text) for _ in c.casefold()] + [len(text)]
        parts: list[str] = []
        origin: list[int] = []
        start = 0
        for i in range(1, len(text) + 1):
            if i == len(text) or not _mark(text[i]):
                unit = _fold(text[start:i], self.case_sensitive)
                parts.append(unit)
                origin.extend([start] * len(unit))
                start = i
        origin.append(len(text))
        return "".join(parts), origin

    def find(self, text: str) -> list[Match]:
        if self.pattern is None or not text:
            return []
        folded, origin = self.fold(text)
        matches: list[Match] = []
        pos = 0
        while (m := self.pattern.search(folded, pos)) is not None:
            s, e = m.span()
            bounded = (s == 0 or not _mark(folded[s - 1])) and (e == len(folded) or not _mark(folded[e]))
            if origin is not None:  # a match must start and end where an original character does
                bounded = bounded and (s == 0 or origin[s - 1] != origin[s]) and origin[e - 1] != origin[e]
            if not bounded:
                pos = s + 1
                continue
            start, end = (s, e) if origin is None else (origin[s], origin[e])
            entry = self.entries[_SPACE.sub(" ", m.group())]
            matches.append(Match(start, end, entry, text[start:end]))
            pos = e
        return matches


def find_terms(glossary: Glossary, text: str, case_sensitive: bool = False) -> list[Match]:
    """The glossary's terms in `text`, in text order: whole words, longest first, never overlapping."""
    return glossary.matcher(case_sensitive).find(text)

# -- constraints ----------------------------------------------------------------------------------


def _distinct_targets(matches: Sequence[Match]) -> dict[str, Match]:
    """Each distinct target (NFC) with the first match that asks for it, in text order."""
    targets: dict[str, Match] = {}
    for match in matches:
        targets.setdefault(unicodedata.normalize("NFC", match.target), match)
    return targets


def constraints_for(matches: Sequence[Match], encode_target: EncodeTarget, unk_id: int = UNK_ID) -> list[list[int]]:
    """The target tokens of each distinct target of `matches` (text order): `encode_target` is the model's
    target-side tokenizer (`tokenizer.encode`, no EOS), `unk_id` its unknown token (`tokenizer.unk_id`
    where it has one; a joint model's is model.config.UNK_ID). A target the vocabulary cannot spell, or
    spells as no tokens or more than MAX_TERM_TOKENS, is a RuntimeUserError naming the term; more than
    MAX_SENTENCE_TERMS targets is one too (terms_for keeps the first ones instead)."""
    targets = _distinct_targets(matches)
    if len(targets) > MAX_SENTENCE_TERMS:
        raise RuntimeUserError(f"{len(targets)} distinct glossary targets for one sentence "
                               f"({', '.join(map(repr, list(targets)[:3]))}, ...), more than MAX_SENTENCE_TERMS "
                               f"({MAX_SENTENCE_TERMS})")
    if not targets:
        return []
    encoded = encode_target(list(targets))
    for (target, match), tokens in zip(targets.items(), encoded, strict=True):
        _check_tokens(match.entry, target, tokens, encode_target, unk_id)
    return [list(tokens) for tokens in encoded]


def _check_tokens(entry: Entry, target: str, tokens: Sequence[int], encode_target: EncodeTarget,
                  unk_id: int, where: str = "") -> None:
    term = f"{where}: {entry.source!r} -> {target!r}" if where else f"glossary term {entry.source!r} -> {target!r}"
    if not tokens:
        raise RuntimeUserError(f"{term}: the model's tokenizer encodes the target as no tokens")
    if unk_id in tokens:
        chars = list(dict.fromkeys(c for c in target if not c.isspace()))
        unknown = [c for c, ids in zip(chars, encode_target(chars), strict=True) if unk_id in ids]
        which = "".join(unknown) or "a part of it"
        raise RuntimeUserError(f"{term}: the model's vocabulary cannot spell {which!r} (its tokenizer maps it to "
                               f"the unknown token); change the term or leave it out")
    if len(tokens) > MAX_TERM_TOKENS:
        raise RuntimeUserError(f"{term}: the target is {len(tokens)} tokens, more than MAX_TERM_TOKENS "
                               f"({MAX_TERM_TOKENS})")


def check_targets(glossary: Glossary, encode_target: EncodeTarget, unk_id: int = UNK_ID) -> None:
    """Refuse, once when a glossary is loaded for a model, a fixed target that model cannot spell (as
    constraints_for would for each sentence), naming where the entry was given. Do-not-translate targets depend
    on the sentence: checked there."""
    places = glossary.places or ("",) * len(glossary.entries)
    fixed = [(entry, where) for entry, where in zip(glossary.entries, places, strict=True) if not entry.dnt]
    for (entry, where), tokens in zip(fixed, encode_target([e.target for e, _ in fixed]), strict=True):
        _check_tokens(entry, entry.target, tokens, encode_target, unk_id, where)


def terms_for(glossary: Glossary, text: str, encode_target: EncodeTarget, unk_id: int = UNK_ID,
              case_sensitive: bool = False) -> Terms:
    """One sentence's Terms: its matches, and the first MAX_SENTENCE_TERMS distinct targets (text order)
    with their tokens; the number beyond is `dropped`. A do-not-translate term as the sentence spells it
    that the vocabulary cannot spell (a capital its SentencePiece never saw) is left to the model, not
    forced: applied_terms reports it unconstrained. A fixed target is checked at load (check_targets)."""
    matches = find_terms(glossary, text, case_sensitive)
    if not matches:
        return NO_TERMS
    targets = list(_distinct_targets(matches).items())
    kept = targets[:MAX_SENTENCE_TERMS]
    constrained: list[str] = []
    constraints: list[list[int]] = []
    for (target, match), tokens in zip(kept, encode_target([t for t, _ in kept]), strict=True):
        try:
            _check_tokens(match.entry, target, tokens, encode_target, unk_id)
        except RuntimeUserError:
            if not match.entry.dnt:
                raise
            continue
        constrained.append(target)
        constraints.append(list(tokens))
    return Terms(tuple(matches), tuple(constrained), constraints, max(0, len(targets) - MAX_SENTENCE_TERMS))


def applied_terms(terms: Terms, output_text: str) -> list[dict[str, Any]]:
    """Which of the sentence's terms its translation holds, once per (source term, target) in text order:
    `{"source", "target", "applied", "constrained"}`. Applied is an exact substring match (as the WMT 2021
    terminology task's exact-match accuracy counts), after NFKC on both sides (the model's SentencePiece
    normalises its output so); constrained is false for a target beyond MAX_SENTENCE_TERMS."""
    output = unicodedata.normalize("NFKC", output_text)
    constrained = set(terms.targets)
    report: dict[tuple[str, str], dict[str, Any]] = {}
    for match in terms.matches:
        target = unicodedata.normalize("NFC", match.target)
        report.setdefault((match.entry.source, target), {
            "source": match.entry.source, "target": target,
            "applied": unicodedata.normalize("NFKC", target) in output, "constrained": target in constrained})
    return list(report.values())
