"""Documents as sentences: a text split into sentences and rebuilt around their translations with every
character of whitespace it had between them (`--split sentences`, `"split": "sentences"`).

Line breaks always separate (every one str.splitlines knows: \n, \r\n, a lone \r, U+2028, U+2029, NEL, vertical
tab, form feed, \x1c-\x1e), except in the text of markup (`soft`: HTML's, an office document's), where a line
break is a space; within a line sentencex finds the boundaries (the most accurate of three segmenters on en / de
/ fr, and fast: docs/serving.md links the comparison). A sentence never holds a hard line break and never starts
or ends with whitespace; a text with no boundary is one sentence (cut at whitespace
past WINDOW characters); an empty or whitespace-only text has none and is rebuilt as it was.

The time is linear in the text whatever it holds (a request body is anyone's): the segmenter sees at most
WINDOW characters at a time, and whitespace is measured with str.strip, not a backtracking pattern."""

from __future__ import annotations

import itertools
import re
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from runtime.errors import RuntimeUserError
from runtime.languages import two_letter

SPLIT_MODES = ("none", "sentences")
DEFAULT_LANG = "en"
# sentencex's time grows with the square of its input on some texts (boundaries with no space after
# them, as in Chinese: 100,000 characters took 2.5 s), and it holds the GIL, which stalls the server's
# event loop too. A window bounds each call (about 1 ms at worst) and a long sentence (_windowed).
WINDOW = 1000
CONTEXT = 200  # the text around a boundary that decides it
GLUED_ENDS = ".!?"  # a segmenter's boundary after one of these with no whitespace after it is none ("Dipl.-Ing.",
# a typo's "ging.Dann"), unless a wide character follows (Chinese and Japanese put no space after a sentence)
# every whitespace character the segmenter sees as a space (sentencex panics on "B\u00a0. x": a byte offset inside a
# multi-byte space; the Rust panic is a BaseException no `except Exception` caught), one character for one
_SPACES = {c: " " for c in range(0x3001) if chr(c).isspace() and c != 0x20}
# a line break (the ones str.splitlines splits at; \r\n is one), kept as the whitespace between sentences
LINE_BREAK = re.compile("(\r\n|[\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029])")


@dataclass(frozen=True)
class Split:
    """text == gaps[0] + sentences[0] + gaps[1] + ... + sentences[-1] + gaps[-1]."""

    sentences: list[str]
    gaps: list[str]  # whitespace only, one more than sentences

    def piece(self, j: int, translation: str) -> str:
        """Sentence j's translation with the whitespace after it (the first also with the whitespace
        before it): the pieces of all sentences, joined, are `rebuild`. Sentences the source ran together
        (Chinese has no space after a sentence; a window cut) are not run together in a translation that
        ends in a narrow character ("I have a dog. It is big!"); a sentence kept as it was stays so."""
        gap = self.gaps[j + 1]
        if not gap and j + 1 < len(self.sentences) and translation != self.sentences[j] and translation[-1:] \
                and not translation[-1].isspace() and unicodedata.east_asian_width(translation[-1]) not in "WF":
            gap = " "
        return (self.gaps[0] if j == 0 else "") + translation + gap

    def rebuild(self, translations: list[str]) -> str:
        """The text with each sentence replaced by its translation."""
        if len(translations) != len(self.sentences):
            raise ValueError(f"{len(translations)} translations for {len(self.sentences)} sentences")
        return "".join(self.piece(j, t) for j, t in enumerate(translations)) if translations else self.gaps[0]


def has_letters(text: str) -> bool:
    """Whether `text` holds a letter: text without one (numbers, dates, emoji, punctuation) is copied, never
    translated, on every surface (a model invents words for it)."""
    return any(c.isalpha() for c in text)


def _segmenter() -> Callable[[str, str], list[str]]:
    try:
        from sentencex import segment
    except ImportError:
        raise RuntimeUserError('splitting into sentences needs sentencex, which is not installed: '
                        'pip install -e ".[serve]"') from None

    def pieces(lang: str, text: str) -> list[str]:
        """text cut where sentencex cuts it (its whitespace seen as spaces), glued across GLUED_ENDS; the text
        whole if sentencex fails or changes a character."""
        seen = text.translate(_SPACES)
        try:
            found = list(segment(lang, seen))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException:  # noqa: BLE001 - a Rust panic (pyo3's PanicException): the text stays one piece
            return [text]
        if "".join(found) != seen:
            return [text]
        out: list[str] = []
        at = 0
        for piece in found:
            original, at = text[at:at + len(piece)], at + len(piece)
            if out and out[-1][-1:] in GLUED_ENDS and original[:1] and not original[0].isspace() and \
                    unicodedata.east_asian_width(original[0]) not in "WF":
                out[-1] += original  # (within one window: at most WINDOW characters)
            else:
                out.append(original)
        return out

    return pieces


class TooManySentences(Exception):
    """split_sentences found more sentences than its `most` and stopped there."""


class _Budget:
    """The sentences a text may still hold (`most`); each line's are taken off as they are found."""

    def __init__(self, most: int | None):
        self.left = most

    def take(self, pieces: Sequence[str]) -> None:
        if self.left is not None:
            self.left -= sum(1 for piece in pieces if not piece.isspace() and piece)
            if self.left < 0:
                raise TooManySentences


def split_sentences(text: str, lang: str = DEFAULT_LANG,
                    whole: Callable[[str], Sequence[tuple[int, int]]] | None = None, soft: bool = False,
                    most: int | None = None) -> Split:
    """`text` as sentences and the whitespace around them (lang: an ISO 639 code, NLLB's eng_Latn too; unknown codes
    get sentencex's language-neutral rules). `whole(text)`: spans of it no boundary may cut (a glossary's terms:
    "1. FC Köln" was cut after "1.", and its term found in neither sentence). `soft`: a line break is whitespace
    like any other, inside a sentence too (the text of markup: HTML wrapped at 72 columns had each sentence cut
    at its line ends, and the pieces translated apart). `most`: past that many sentences, TooManySentences as soon
    as they are found (a 17 MB line was split whole, 17 s and 370 MB, before the HTTP APIs' limit refused it)."""
    segment = _segmenter()
    lang = two_letter(lang) or lang
    budget = _Budget(most)
    split = _split(text, lambda line: _windowed(lambda window: segment(lang, window), line, budget), soft)
    return joined_across(split, whole(text), soft) if whole is not None and len(split.sentences) > 1 else split


def _windowed(segment: Callable[[str], list[str]], line: str, budget: _Budget | None = None) -> list[str]:
    """The line cut where segment(line) cuts it, each call on at most WINDOW characters. A boundary
    depends on the text around it: a window starts at the sentence before (when it is short) and the
    boundaries found up to CONTEXT characters before its end (at least one) are kept. A window without
    a boundary is cut after its last whitespace past the middle (a sentence that long is cut), else at
    its end. A segmenter that changes a character leaves the line one sentence. `budget`: takes each piece
    with text off as it is cut."""
    budget = budget or _Budget(None)
    cuts = [0]  # where the sentences found so far start
    while True:
        start = cuts[-1]
        first = cuts[-2] if len(cuts) > 1 and start - cuts[-2] <= CONTEXT else start
        window = line[first:first + WINDOW]
        found = segment(window)
        if "".join(found) != window:
            budget.take([line[start:]])
            return [line]
        ends = [first + end for end in itertools.accumulate(map(len, found)) if first + end > start]
        if first + len(window) == len(line):
            budget.take([line[a:b] for a, b in itertools.pairwise([start, *ends])])
            return [line[a:b] for a, b in itertools.pairwise(cuts + ends)]
        ends.pop()  # the window's end, not the line's
        kept = [end for end in ends if end <= first + WINDOW - CONTEXT]
        new = kept or ends[:1] or [start + _cut(line[start:first + WINDOW])]
        budget.take([line[a:b] for a, b in itertools.pairwise([start, *new])])
        cuts += new


def _cut(window: str) -> int:
    """Where a window without a sentence boundary is cut: after its last whitespace past the middle."""
    for i in range(len(window) - 1, len(window) // 2 - 1, -1):
        if window[i].isspace():
            return i + 1
    return len(window)


def _split(text: str, segment: Callable[[str], list[str]], soft: bool = False) -> Split:
    sentences: list[str] = []
    gaps: list[str] = []
    gap: list[str] = []  # the whitespace since the last sentence, in parts (joined once: linear)
    parts = [text] if soft else LINE_BREAK.split(text)  # lines, each followed by its break
    for i in range(0, len(parts), 2):
        line = parts[i]
        if i:
            gap.append(parts[i - 1])
        for piece in segment(line) if line.strip() else [line]:
            body = piece.strip()
            if not body:
                gap.append(piece)
                continue
            lead = len(piece) - len(piece.lstrip())
            gap.append(piece[:lead])
            gaps.append("".join(gap))
            sentences.append(body)
            gap = [piece[lead + len(body):]]
    gaps.append("".join(gap))
    return Split(sentences, gaps)


def joined_across(split: Split, spans: Sequence[tuple[int, int]], soft: bool = False) -> Split:
    """`split` with the sentences that a span of its text (start, end: a glossary term's) runs across joined
    into one, with the whitespace between them, unless a line break lies between them (a sentence holds none,
    unless the breaks are `soft`) or
    the sentence would pass WINDOW characters (as long as a sentence gets: terms chained across every boundary
    made a whole document one sentence, cut to the model's limit)."""
    if not spans or len(split.sentences) < 2:
        return split
    sentences, gaps = [[split.sentences[0]]], [split.gaps[0]]  # each sentence in parts (joined once: linear)
    size = len(split.sentences[0])  # of the last sentence
    end = len(split.gaps[0]) + size  # where the last sentence ends in the text
    spans = sorted(spans)
    k = 0
    for j in range(1, len(split.sentences)):
        gap, sentence = split.gaps[j], split.sentences[j]
        start = end + len(gap)
        while k < len(spans) and spans[k][1] <= end:
            k += 1
        if (k < len(spans) and spans[k][0] < end and spans[k][1] > start and (soft or not LINE_BREAK.search(gap))
                and size + len(gap) + len(sentence) <= WINDOW):
            sentences[-1] += [gap, sentence]
            size += len(gap) + len(sentence)
        else:
            gaps.append(gap)
            sentences.append([sentence])
            size = len(sentence)
        end = start + len(sentence)
    return Split(["".join(parts) for parts in sentences], gaps + [split.gaps[-1]])


def fitted(split: Split, end: Callable[[str], int],
           whole: Callable[[str], Sequence[tuple[int, int]]] | None = None) -> Split:
    """`split` with each sentence longer than the model takes cut until every piece fits: `end(sentence)` is
    where the part that fits ends (its length when all of it does), and the cut falls after the last whitespace
    past the middle of that part (else at its end), the whitespace kept between the pieces, as a window's cut
    is; never inside a span `whole` keeps whole (a glossary's term: cut before it). A sentence of 1,400
    characters was cut to the model's 128 tokens and the rest lost."""
    sentences, gaps = [], [split.gaps[0]]
    for sentence, after in zip(split.sentences, split.gaps[1:]):
        rest = sentence
        while 0 < (fits := end(rest)) < len(rest):
            at = _cut(rest[:fits])
            for a, b in whole(rest) if whole is not None else ():
                if a < at < b:
                    at = a if a > 0 else b  # before the term; a term from the start longer than fits: after it
            body = rest[:at].rstrip()
            remainder = rest[len(body):]
            tail = remainder.lstrip()
            if not body or not tail:
                break
            sentences.append(body)
            gaps.append(remainder[:len(remainder) - len(tail)])
            rest = tail
        sentences.append(rest)
        gaps.append(after)
    return Split(sentences, gaps) if len(sentences) > len(split.sentences) else split
