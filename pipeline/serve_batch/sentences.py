"""Documents as sentences: a text split into sentences and rebuilt around their translations with every
character of whitespace it had between them (`--split sentences`, `"split": "sentences"`).

Line breaks always separate; within a line sentencex finds the boundaries (the most accurate of three
segmenters on en / de / fr, and fast: docs/serving.md links the comparison). A sentence never holds a line break and
never starts or ends with whitespace; a text with no boundary is one sentence; an empty or
whitespace-only text has none and is rebuilt as it was."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from model.errors import UserError
from runtime.translate import encode_sources

SPLIT_MODES = ("none", "sentences")
DEFAULT_LANG = "en"
_EDGES = re.compile(r"^(\s*)(.*?)(\s*)$", re.S)


@dataclass(frozen=True)
class Split:
    """text == gaps[0] + sentences[0] + gaps[1] + ... + sentences[-1] + gaps[-1]."""

    sentences: list[str]
    gaps: list[str]  # whitespace only, one more than sentences

    def piece(self, j: int, translation: str) -> str:
        """Sentence j's translation with the whitespace after it (the first also with the whitespace
        before it): the pieces of all sentences, joined, are `rebuild`."""
        return (self.gaps[0] if j == 0 else "") + translation + self.gaps[j + 1]

    def rebuild(self, translations: list[str]) -> str:
        """The text with each sentence replaced by its translation."""
        if len(translations) != len(self.sentences):
            raise ValueError(f"{len(translations)} translations for {len(self.sentences)} sentences")
        return "".join(self.piece(j, t) for j, t in enumerate(translations)) if translations else self.gaps[0]


def _segmenter() -> Callable[[str, str], list[str]]:
    try:
        from sentencex import segment
    except ImportError:
        raise UserError('splitting into sentences needs sentencex, which is not installed: '
                        'pip install -e ".[serve]"') from None
    return lambda lang, line: list(segment(lang, line))


def split_sentences(text: str, lang: str = DEFAULT_LANG) -> Split:
    """`text` as sentences and the whitespace around them (lang: an ISO 639 code; unknown codes get
    sentencex's language-neutral rules)."""
    segment = _segmenter()
    split = _split(text, lambda line: segment(lang, line))
    if split.rebuild(split.sentences) != text:  # a segmenter that dropped or changed a character
        return _split(text, lambda line: [line])  # each line one sentence: nothing lost
    return split


def _split(text: str, segment: Callable[[str], list[str]]) -> Split:
    sentences: list[str] = []
    gaps = [""]
    for i, line in enumerate(text.split("\n")):
        gaps[-1] += "\n" if i else ""
        for piece in segment(line) if line.strip() else [line]:
            lead, body, trail = _EDGES.fullmatch(piece).groups()  # type: ignore[union-attr]
            gaps[-1] += lead
            if body:
                sentences.append(body)
                gaps.append("")
            gaps[-1] += trail
    return Split(sentences, gaps)


def encode_split(tokenizer: Any, splits: list[Split], max_src_len: int, long_lines: str,
                 where: Callable[[int], str]) -> tuple[list[list[int]], int]:
    """Source ids of every sentence of every text, in order, and how many were truncated; with
    long_lines "error" a sentence over the limit is refused as `where(k) sentence:N` (text k)."""
    ids: list[list[int]] = []
    truncated = 0
    for k, split in enumerate(splits):
        sources = encode_sources(tokenizer, split.sentences, max_src_len, long_lines=long_lines,
                                 origin=f"{where(k)} sentence")
        ids += sources.ids
        truncated += sources.truncated
    return ids, truncated


def rebuild_all(splits: list[Split], translations: list[str]) -> list[str]:
    """Each text rebuilt from its sentences' translations (all texts' sentences, in order)."""
    texts, start = [], 0
    for split in splits:
        texts.append(split.rebuild(translations[start:start + len(split.sentences)]))
        start += len(split.sentences)
    return texts
