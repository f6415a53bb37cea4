"""HTML in, HTML out: the text of a document is translated and its markup kept byte for byte.

The parser is the standard library's html.parser: it is maintained with Python, tolerant (it never raises on
bad markup: whatever it cannot read as a tag is text), and it streams, so a large document costs time in
proportion to it; a translation service needs no tree. The rule, written down in docs/serving.md:

- Every tag, attribute (alt and title included), comment, doctype and processing instruction is copied
  from the source unchanged.
- Each text node (the text between two tags) is translated on its own, as a document (split into
  sentences, its whitespace kept). So an inline tag splits the sentence it is in: in `The <b>big</b> dog`
  the model sees "The ", "big" and " dog" apart, and the tags stay where they were; words are never moved
  across a tag.
- The content of <code>, <pre>, <script>, <style> and of any element with translate="no" is copied
  unchanged, and so is a text node without letters (whitespace, numbers, punctuation, entities alone).
- Entities: the model sees the characters they stand for; in the translation each character that the
  source wrote as an entity is written with the same entity again, and &, < are escaped.
- What the parser does not account for exactly (a construct it skips) is copied unchanged, never
  translated, so the output's markup is the input's.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass, field
from html.parser import HTMLParser

SKIP = frozenset({"code", "pre", "script", "style"})
VOID = frozenset({"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "param", "source",
                  "track", "wbr"})
MAYBE_TAG = re.compile(r"<[A-Za-z/!?]")
ENTITY = re.compile(r"&(#[0-9]+|#[xX][0-9a-fA-F]+|[A-Za-z][A-Za-z0-9]*);?")


@dataclass
class Markup:
    """A document as pieces of its source; `texts[k]` is the piece index of the k-th text to translate,
    `sources[k]` what the model sees, `entities[k]` how the source spelled its characters."""

    pieces: list[str]
    texts: list[int] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    entities: list[dict[str, str]] = field(default_factory=list)

    def rebuild(self, translations: list[str]) -> str:
        """The document with the k-th text replaced by translations[k] (escaped as its source was)."""
        if len(translations) != len(self.texts):
            raise ValueError(f"{len(translations)} translations for {len(self.texts)} texts")
        out = list(self.pieces)
        for index, text, spelled in zip(self.texts, translations, self.entities):
            out[index] = _escape(text, spelled)
        return "".join(out)


def _escape(text: str, spelled: dict[str, str]) -> str:
    return "".join(spelled.get(c) or ("&amp;" if c == "&" else "&lt;" if c == "<" else c) for c in text)


class _Events(HTMLParser):
    """Where each construct starts, and whether it is text to translate."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=False)
        self.events: list[tuple[tuple[int, int], bool]] = []  # (line, column), translatable
        self.skip: list[str] = []  # the element that opened a copied region, once per nesting level

    def _mark(self, translatable: bool) -> None:
        self.events.append((self.getpos(), translatable and not self.skip))

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._mark(False)
        opens = tag in SKIP or any(k == "translate" and (v or "").strip().lower() == "no" for k, v in attrs)
        if tag in VOID:
            return
        if self.skip and tag == self.skip[0]:
            self.skip.append(tag)
        elif not self.skip and opens:
            self.skip.append(tag)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._mark(False)

    def handle_endtag(self, tag: str) -> None:
        self._mark(False)
        if self.skip and tag == self.skip[0]:
            self.skip.pop()

    def handle_data(self, data: str) -> None:
        self._mark(True)

    def handle_entityref(self, name: str) -> None:
        self._mark(True)

    def handle_charref(self, name: str) -> None:
        self._mark(True)

    def handle_comment(self, data: str) -> None:
        self._mark(False)

    def handle_decl(self, decl: str) -> None:
        self._mark(False)

    def handle_pi(self, data: str) -> None:
        self._mark(False)

    def unknown_decl(self, data: str) -> None:
        self._mark(False)


def parse_html(document: str) -> Markup:
    """The document's pieces: markup copied, text nodes (adjacent data and entities together) to translate."""
    parser = _Events()
    parser.feed(document)
    parser.close()
    starts = [0]
    for line in document.split("\n")[:-1]:
        starts.append(starts[-1] + len(line) + 1)
    offsets = [starts[line - 1] + col for (line, col), _ in parser.events] + [len(document)]
    merged: list[tuple[int, int, bool]] = []  # start, stop, translatable
    for k, (_, translatable) in enumerate(parser.events):
        start, stop = offsets[k], offsets[k + 1]
        if stop <= start:
            continue
        if merged and merged[-1][2] == translatable:
            merged[-1] = (merged[-1][0], stop, translatable)
        else:
            merged.append((start, stop, translatable))
    if offsets[0] > 0:  # nothing reported before the first event: copy it
        merged.insert(0, (0, offsets[0], False))
    markup = Markup([document[a:b] for a, b, _ in merged])
    for index, (start, stop, translatable) in enumerate(merged):
        raw = document[start:stop]
        text = html.unescape(raw)
        # a run holding what may be markup the parser passed over ("</>", an unfinished tag) is copied
        if translatable and not MAYBE_TAG.search(raw) and any(c.isalpha() for c in text):
            markup.texts.append(index)
            markup.sources.append(text)
            markup.entities.append(_spelled(raw))
    return markup


def _spelled(raw: str) -> dict[str, str]:
    """Each character the source wrote as an entity -> that entity, as written."""
    spelled: dict[str, str] = {}
    for m in ENTITY.finditer(raw):
        char = html.unescape(m.group(0))
        if len(char) == 1 and char != m.group(0):
            spelled.setdefault(char, m.group(0) if m.group(0).endswith(";") else m.group(0) + ";")
    return spelled
