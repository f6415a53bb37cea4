"""Glossaries: "always translate X as Y" and "never translate this name", as constraints for search.

A glossary is loaded and checked once (runtime/glossary_file.py: `load_glossary` for a TSV file,
`glossary_from_mapping` for an inline one sent with an HTTP request); for each source sentence
`terms_for` finds its terms and turns their targets into the model's target tokens, which constrained
search (runtime/constrained.py) forces into the output; `applied_terms` then says which targets the output
holds. docs/glossary.md is the user's guide.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from model.config import UNK_ID
from runtime.errors import RuntimeUserError

MAX_TERM_CHARS = 100  # characters of a source or target term, after whitespace is collapsed
MAX_SENTENCE_TERMS = 16  # distinct targets forced into one sentence's translation
MAX_TERM_TOKENS = 32  # target tokens of one term

EncodeTarget = Callable[[list[str]], list[list[int]]]
DecodeTarget = Callable[[list[list[int]]], list[str]]

_SPACE = re.compile(r"\s+")
_WORD = re.compile(r"\w")


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

    def spans(self, text: str) -> list[tuple[int, int]]:
        """Where its terms are in `text` (start, end), as terms_for finds them: no sentence boundary may cut one."""
        return [(m.start, m.end) for m in self._folded_matcher.find(text)]


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
    # each forced target as the model writes it (its tokens decoded: the tokenizer's normalisation drops or
    # rewrites some characters, a joiner for one); empty without a decoder
    spelled: tuple[str, ...] = ()


NO_TERMS = Terms()

# -- loading --------------------------------------------------------------------------------------


def _fold(text: str, case_sensitive: bool) -> str:
    """The form terms are compared in: NFC, then casefolded (and NFC again: casefold can decompose)."""
    text = unicodedata.normalize("NFC", text)
    return text if case_sensitive else unicodedata.normalize("NFC", text.casefold())


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


MAX_NESTING = 200  # groups inside groups in the trie's regex: Python's compiler recurses per level and failed past
# about 440 at the default recursion limit (360 from 300 frames down), but not in a process that raised it (torch's
# compiler does): a fixed bound refuses the same glossaries in every process


def _nesting(node: dict[str, Any]) -> int:
    """How deep _trie_pattern's groups nest: one level where a term ends and others go on, one where paths branch."""
    deepest, stack = 0, [(node, 0)]
    while stack:
        here, depth = stack.pop()
        children = [child for symbol, child in here.items() if symbol]
        if children:
            depth += ("" in here) + (len(children) > 1)
            deepest = max(deepest, depth)
            stack.extend((child, depth) for child in children)
    return deepest


def _mark(char: str) -> bool:
    """Whether `char` joins the character before it in NFC: a combining mark, or a Hangul vowel or final jamo
    (decomposed Korean, as macOS and PDF extraction write it, composes into syllables: 한 is 3 jamo)."""
    return unicodedata.category(char).startswith("M") or "\u1160" <= char <= "\u11ff" or "\ud7b0" <= char <= "\ud7ff"


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
        try:
            if _nesting(root) > MAX_NESTING:
                raise RecursionError
            self.pattern = re.compile(r"(?<!\w)" + _trie_pattern(root) + r"(?!\w)") if root else None
        except RecursionError:  # terms that each extend another, hundreds deep (case folding lengthens some)
            raise RuntimeUserError("the glossary's terms nest too deeply to be matched: hundreds of them each "
                                   "begin with another; leave out the intermediate ones") from None

    def fold(self, text: str) -> tuple[str, list[int] | None]:
        """The folded text and, where folding changed lengths, the original offset of each folded character
        (plus one for the end). Each unit (a character with the marks and jamo after it, _mark) is folded alone."""
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
            bounded = self._bounded(folded, origin, s, e)
            while not bounded:  # the longest term here ends inside a word: a shorter one may not
                m = self._shorter(folded, s, e)
                if m is None:
                    break
                e = m.end()
                bounded = self._bounded(folded, origin, s, e)
            if m is None or not bounded:
                pos = s + 1
                continue
            start, end = (s, e) if origin is None else (origin[s], origin[e])
            entry = self.entries[_SPACE.sub(" ", m.group())]
            matches.append(Match(start, end, entry, text[start:end]))
            pos = e
        return matches


    @staticmethod
    def _bounded(folded: str, origin: list[int] | None, s: int, e: int) -> bool:
        """folded[s:e] is whole: no combining mark beside it, and (where folding changed lengths) it starts and
        ends where an original character does."""
        bounded = (s == 0 or not _mark(folded[s - 1])) and (e == len(folded) or not _mark(folded[e]))
        if origin is not None:
            bounded = bounded and (s == 0 or origin[s - 1] != origin[s]) and origin[e - 1] != origin[e]
        return bounded

    def _shorter(self, folded: str, s: int, e: int) -> re.Match[str] | None:
        """The longest term starting at s and ending before e, followed by no word character."""
        assert self.pattern is not None
        while e > s + 1:
            m = self.pattern.match(folded, s, e - 1)  # the end of the slice passes the pattern's (?!\w) ...
            if m is None:
                return None
            e = m.end()
            if e == len(folded) or not _WORD.match(folded, e):  # ... so the real next character is checked here
                return m
        return None


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
        which = (f"the character{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}" if unknown
                 else "a part of it")
        raise RuntimeUserError(f"{term}: the model's vocabulary cannot spell {which} (its tokenizer maps "
                               f"{'them' if len(unknown) > 1 else 'it'} to the unknown token); change the term or "
                               "leave it out")
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
              case_sensitive: bool = False, decode_target: DecodeTarget | None = None) -> Terms:
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
    spelled = tuple(decode_target(constraints)) if decode_target is not None and constraints else ()
    return Terms(tuple(matches), tuple(constrained), constraints, max(0, len(targets) - MAX_SENTENCE_TERMS), spelled)


def applied_terms(terms: Terms, output_text: str) -> list[dict[str, Any]]:
    """Which of the sentence's terms its translation holds, once per (source term, target) in text order:
    `{"source", "target", "applied", "constrained"}`. Applied is an exact substring match (as the WMT 2021
    terminology task's exact-match accuracy counts), after NFKC on both sides (the model's SentencePiece
    normalises its output so) or of the target as the model spells it (Terms.spelled); constrained is false for
    a target beyond MAX_SENTENCE_TERMS."""
    output = unicodedata.normalize("NFKC", output_text)
    spelled = dict(zip(terms.targets, terms.spelled))
    report: dict[tuple[str, str], dict[str, Any]] = {}
    for match in terms.matches:
        target = unicodedata.normalize("NFC", match.target)
        forms = (target, spelled[target]) if target in spelled else (target,)
        report.setdefault((match.entry.source, target), {
            "source": match.entry.source, "target": target,
            "applied": any(unicodedata.normalize("NFKC", form) in output for form in forms),
            "constrained": target in terms.targets})
    return list(report.values())
