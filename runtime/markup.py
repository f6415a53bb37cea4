"""HTML in, HTML out: the text of a document is translated and its markup kept byte for byte.

The document is cut into markup and text by a small tokenizer of our own, which follows the HTML standard's
tokenizer for what a translation service needs to know (where each tag, comment, doctype and processing
instruction starts and ends, the tag's name, its translate attribute, raw-text elements) and builds no tree.
It visits every character a bounded number of times, so any document costs time and memory in proportion to
its size.
The standard library's html.parser was quadratic on unterminated constructs (`<a ` or `<!--` repeated:
CPython gh-135462), so 36 KB held a request for 11 s. The rule, written down in docs/serving.md:

- Every tag, attribute (alt and title included), comment, doctype and processing instruction is copied
  from the source unchanged.
- Each text node (the text between two tags) is translated on its own, as a document (split into
  sentences, its whitespace kept). So an inline tag splits the sentence it is in: in `The <b>big</b> dog`
  the model sees "The ", "big" and " dog" apart, and the tags stay where they were; words are never moved
  across a tag.
- The content of <code>, <pre>, <script>, <style>, <math> and of any element with translate="no" is copied
  unchanged (translate="yes" inside translate="no" translates again, as the attribute is inherited), and so
  is a text node without letters (whitespace, numbers, punctuation, entities alone). An element ends where a
  browser ends it: end tags may be left off (`<li translate="no">ACME<li>Item`), so the open elements are
  kept with enough of the standard's tree rules to know that (implied end tags, scopes, formatting elements
  reopened), each step constant time.
- A CDATA section (`<![CDATA[a > b]]>`, in XHTML and in <svg>) runs to its `]]>` and is copied.
- Entities: the model sees the characters they stand for; in the translation each character that the
  source wrote as an entity is written with the same entity again, and &, < are escaped.
- A construct that never ends (`<b` or `<!--` with no closing `>` / `-->`) runs to the end of the document,
  as in a browser: everything from it on is copied unchanged, never translated.
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

from runtime.sentences import has_letters

SKIP = frozenset({"code", "pre", "script", "style", "math"})
VOID = frozenset({"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "param", "source",
                  "track", "wbr"})
RAW_TEXT = frozenset({"script", "style"})  # their content is text up to the matching end tag, never tags
# What the standard's tree builder needs here: where an element is ended without its end tag.
SPECIAL = frozenset("""address applet article aside blockquote body button caption center colgroup dd details dialog
    dir div dl dt fieldset figcaption figure footer form frameset h1 h2 h3 h4 h5 h6 head header hgroup html iframe li
    listing main marquee menu nav noembed noframes noscript object ol p plaintext pre script search section select
    style summary table tbody td template textarea tfoot th thead title tr ul xmp""".split())
FORMATTING = frozenset("a b big code em font i nobr s small strike strong tt u".split())
MARKERS = frozenset("applet caption marquee object td template th".split())  # formatting inside them ends there
DEFAULT = frozenset("applet caption html marquee object table td template th".split())  # scope boundaries
BUTTON, LIST, OPTION = DEFAULT | {"button"}, DEFAULT | {"dl", "ol", "ul"}, DEFAULT | {"datalist", "optgroup", "select"}
TABLE = frozenset({"html", "table", "template"})
CELLS, SECTIONS = (("td", TABLE), ("th", TABLE)), ("tbody", "tfoot", "thead")
# A start tag -> the elements it ends (innermost of the name) when one is open in scope, that is with no
# boundary inside it: <p> ends at a block's start tag, <li> at the next <li>, a cell at the next cell or row, ...
IMPLIED: dict[str, tuple[tuple[str, frozenset[str]], ...]] = {
    **{name: (("p", BUTTON),) for name in """address article aside blockquote center details dialog dir div dl
        fieldset figcaption figure footer form h1 h2 h3 h4 h5 h6 header hgroup hr listing main menu nav ol p pre
        search section summary table ul xmp""".split()},
    "li": (("li", LIST), ("p", BUTTON)), "dd": (("dd", LIST), ("dt", LIST), ("p", BUTTON)),
    "option": (("option", OPTION),), "optgroup": (("option", OPTION), ("optgroup", OPTION - {"optgroup"})),
    "td": CELLS, "th": CELLS, "tr": (*CELLS, ("tr", TABLE)),
    **{name: (*CELLS, *((ended, TABLE) for ended in ("tr", *SECTIONS))) for name in SECTIONS},
}
IMPLIED["dt"] = IMPLIED["dd"]
END_SCOPE = {"p": BUTTON, "li": LIST, **{name: TABLE for name in ("table", "td", "th", "tr", *SECTIONS)}}
ENTITY = re.compile(r"&(#[0-9]+|#[xX][0-9a-fA-F]+|[A-Za-z][A-Za-z0-9]*);?")
# A start or end tag's name from its "<" (then attributes, a value quoted after "=" may hold ">", then ">": _tag).
TAG_NAME = re.compile(r"</?([A-Za-z][^\t\n\f\r />]*)")
TAG_STOPS = re.compile(r"""[>"'=]""")  # in a tag's attributes: its end, or what may open a quoted value
QUOTED = re.compile(r"""[\t\n\f\r ]*["']""")
# One attribute of a tag's attribute text: its name, then its value (quoted, unquoted, or none). Read one after
# the other from the start, so a quoted value (title='x translate="no"') is a value, never taken for attributes.
ATTRIBUTE = re.compile(r"""([^\t\n\f\r />][^\t\n\f\r />=]*)(?:[\t\n\f\r ]*=[\t\n\f\r ]*(?:"([^"]*)"|'([^']*)'|"""
                       r"""([^\t\n\f\r >]*)))?""")


@dataclass
class Markup:
    """A document as pieces of its source; `texts[k]` is the piece index of the k-th text to translate,
    `sources[k]` what the model sees, `entities[k]` how the source spelled its characters."""

    pieces: list[str]
    texts: list[int] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    entities: list[dict[str, str]] = field(default_factory=list)
    # per text, whether its line breaks show (inside <textarea>): elsewhere a line break in HTML's text is a space
    kept_breaks: list[bool] = field(default_factory=list)
    # what copies the rest of the document untranslated at its end: an element whose content is never translated
    # left open (<script>, <pre>, ...) or a construct never ended (a comment); "" when none
    unclosed: str = ""

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


def _runs(document: str, tree: _Open) -> Iterator[tuple[int, int, bool]]:
    """(start, stop, translatable) for each construct in order: text runs, and markup (tags, comments,
    declarations, CDATA, raw-text content, and an unterminated construct with the rest of the document, named in
    `tree.cut`). `tree` holds the open elements."""
    n, i = len(document), 0
    closes = {close: _Ahead(document, close) for close in ("-->", "--!>")}
    cdata = _Ahead(document, "]]>")
    while i < n:
        lt = document.find("<", i)
        if lt < 0:
            yield i, n, tree.translated()
            return
        if lt > i:
            yield i, lt, tree.translated()
        nxt = document[lt + 1:lt + 2]
        if nxt.isascii() and nxt.isalpha() or nxt == "/" and document[lt + 2:lt + 3].isascii() \
                and document[lt + 2:lt + 3].isalpha():
            tag = _tag(document, lt)
            if tag is None:  # "<b" with no ">" after it: a tag to the end of the document
                tree.cut = "a tag (no >)"
                yield lt, n, False
                return
            name, attributes, i = tag
            yield lt, i, False
            if nxt == "/":
                tree.end(name)
                continue
            closed = document.endswith("/>", lt, i) or name in VOID
            tree.start(name, "" if closed else _translate(attributes), closed)
            if not closed and name in RAW_TEXT:  # its content is copied up to its end tag, which the loop reads next
                found = re.compile(rf"</{name}[\t\n\f\r />]", re.IGNORECASE).search(document, i)
                stop = n if found is None else found.start()
                if stop > i:
                    yield i, stop, False
                i = stop
            continue
        if document.startswith("<!--", lt):  # it ends at "-->" or "--!>", or at once as "<!-->" or "<!--->"
            short = 5 if document.startswith(">", lt + 4) else 6 if document.startswith("->", lt + 4) else 0
            ends = [] if short else [e + len(c) for c, e in ((c, closes[c].find(lt + 4)) for c in closes) if e >= 0]
            stop = lt + short if short else min(ends, default=n)
            tree.cut = tree.cut if short or ends else "a comment (no -->)"
        elif document.startswith("<![CDATA[", lt):  # to its "]]>", whatever ">" it holds
            end = cdata.find(lt + 9)
            stop = n if end < 0 else end + 3
            tree.cut = tree.cut if end >= 0 else "a CDATA section (no ]]>)"
        elif nxt in ("!", "?", "/"):  # a declaration, processing instruction, or "</" + not a letter
            end = document.find(">", lt + 2)
            stop = n if end < 0 else end + 1
            tree.cut = tree.cut if end >= 0 else "a declaration (no >)"
        else:  # "<" before a space, a digit, ...: text, as in a browser
            yield lt, lt + 1, tree.translated()
            i = lt + 1
            continue
        yield lt, stop, False
        i = stop


MAX_OPEN = 512  # open elements at most, as Chromium's HTML parser (kMaximumHTMLParserDOMTreeDepth)


class _Open:
    """The open elements, innermost last, as a browser's tree builder keeps them, with the translate state of
    each one's content: YES, NO (translate="no", inherited until a translate="yes"), or COPIED (<code>, <pre>,
    <script>, <style>, <math>: whatever is inside). Each name's positions are kept, so whether an element is
    open in scope costs a few look-ups, and each element is pushed and popped once (or a bounded number of
    times reopened): the stack costs time in proportion to the tags."""

    YES, NO, COPIED = range(3)

    def __init__(self, xml: bool = False) -> None:
        self.xml = xml  # XHTML (an EPUB page): elements end at their end tags only, none implied or reopened
        self.cut = ""  # an unterminated construct that ran to the end of the document
        self.names: list[str] = []
        self.owns: list[str] = []  # each element's own translate value, to reopen it with
        self.states: list[int] = []
        self.at: dict[str, list[int]] = {}  # name -> its positions in the stack, innermost last
        self.special = [-1]  # the positions of SPECIAL elements, innermost last

    def translated(self) -> bool:
        return not self.states or self.states[-1] == self.YES

    def last(self, name: str) -> int:
        at = self.at.get(name)
        return at[-1] if at else -1

    def in_scope(self, name: str, boundaries: frozenset[str]) -> bool:
        k = self.last(name)
        return k >= 0 and all(self.last(b) <= k for b in boundaries)

    def start(self, name: str, own: str, closed: bool) -> None:
        """A start tag ends the elements it implies ended; `closed` (void or "/>") opens nothing."""
        for ended, boundaries in () if self.xml else IMPLIED.get(name, ()):
            if self.in_scope(ended, boundaries):
                self.pop_to(self.last(ended))
        if not closed:
            self.push(name, own)

    def push(self, name: str, own: str) -> None:
        if len(self.names) >= MAX_OPEN:  # as deep as a browser nests: the innermost ends first (the new element
            self._drop_innermost()  # is its sibling), so ten million unclosed <b> hold 512, not 1.3 GB
        own = own if own in ("yes", "no") else ""  # any other value inherits
        state = self.states[-1] if self.states else self.YES
        if state != self.COPIED:
            state = self.COPIED if name in SKIP else self.NO if own == "no" else self.YES if own == "yes" else state
        if name in SPECIAL:
            self.special.append(len(self.names))
        self.at.setdefault(name, []).append(len(self.names))
        self.names.append(name)
        self.owns.append(own)
        self.states.append(state)

    def end(self, name: str) -> None:
        """An end tag ends its innermost open element and all inside it, where a browser would: a special
        element's or a formatting element's when in scope, another's when no special element is inside it
        (`</span>` is ignored across an open <div>); </body> and </html> end nothing."""
        k = self.last(name)
        if k < 0 or name in ("body", "html"):
            return
        if self.xml:  # the innermost open element of that name, whatever is inside it
            self.pop_to(k)
        elif name in SPECIAL or name in FORMATTING:
            if self.in_scope(name, END_SCOPE.get(name, DEFAULT)):
                self.pop_to(k)
        elif k > self.special[-1]:
            self.pop_to(k)

    def _drop_innermost(self) -> tuple[str, str]:
        name, own = self.names.pop(), self.owns.pop()
        self.states.pop()
        self.at[name].pop()
        if self.special[-1] == len(self.names):
            self.special.pop()
        return name, own

    def pop_to(self, k: int) -> None:
        """Ends the element at position k and all inside it. The formatting elements inside it (<b>, <code>, ...)
        are reopened as a browser reconstructs them, so `<div><b translate="no">x</div>y` keeps y, unless a
        marker (a cell, <object>, ...) ended with them; reopened once per name and translate value."""
        reopen: list[tuple[str, str]] = []
        while len(self.names) > k:
            name, own = self._drop_innermost()
            if name in MARKERS:
                reopen.clear()
            elif name in FORMATTING and not self.xml and len(self.names) > k and (name, own) not in reopen:
                reopen.append((name, own))
        for name, own in reversed(reopen):
            self.push(name, own)


def _tag(document: str, lt: int) -> tuple[str, str, int] | None:
    """The tag at document[lt] ("<" then a letter, or "</" then one): its lower-cased name, its attribute text and
    where it ends (after its ">"); None when it never ends. Read left to right, each character once: a quote
    opens a value only after "=" (and spaces), and such a value runs to its closing quote whatever ">" it holds.
    (A regular expression that repeats a group keeps state for each repeat: 80 bytes a character of the tag.)"""
    name = TAG_NAME.match(document, lt)
    assert name is not None, "called at '<' + a letter"
    i = name.end()
    while (stop := TAG_STOPS.search(document, i)) is not None:
        j, char = stop.start(), stop.group()
        if char == ">":
            return name.group(1).lower(), document[name.end():j], j + 1
        i = j + 1
        if char == "=" and (quote := QUOTED.match(document, i)) is not None:
            close = document.find(quote.group()[-1], quote.end())
            if close < 0:
                return None
            i = close + 1
    return None


def _translate(attributes: str) -> str:
    """The value of a tag's first translate attribute (the standard keeps the first of a repeated one), lower-cased
    and stripped; "" without one."""
    for m in ATTRIBUTE.finditer(attributes):
        if m.group(1).lower() == "translate":
            return "".join(v or "" for v in m.groups()[1:]).strip().lower()
    return ""


class _Ahead:
    """document.find(pattern, start) for starts that only grow: the last answer is kept while it lies ahead (or
    none was found), so each pattern scans the document once however many comments look for it."""

    def __init__(self, document: str, pattern: str):
        self.document, self.pattern, self.found, self.searched = document, pattern, -1, False

    def find(self, start: int) -> int:
        if not self.searched or 0 <= self.found < start:
            self.found, self.searched = self.document.find(self.pattern, start), True
        return self.found


class TooManyTexts(ValueError):
    """The document holds more than the `max_texts` its caller allows (found while parsing, before the rest)."""

    def __init__(self, limit: int):
        super().__init__(f"more than {limit} texts")
        self.limit = limit


def parse_html(document: str, max_texts: int | None = None, xml: bool = False) -> Markup:
    """The document's pieces: markup copied, and each text node with letters (adjacent text runs together) to
    translate; a text node without letters is copied as markup is, so the pieces grow with the texts, not
    with the tags. Past `max_texts` texts, TooManyTexts at once. `xml`: XHTML's rules (an EPUB page), where an
    element ends at its end tag only: `<p translate="no"><div>` keeps the div inside the paragraph."""
    markup = Markup([])
    copied = 0  # document[copied:] is not in markup.pieces yet
    span: list[int] = []  # the text node being read: [start, stop]

    def close_text() -> None:
        nonlocal copied
        raw = document[span[0]:span[1]]
        text = html.unescape(raw)
        if not has_letters(text):
            return
        if max_texts is not None and len(markup.texts) >= max_texts:
            raise TooManyTexts(max_texts)
        if span[0] > copied:
            markup.pieces.append(document[copied:span[0]])
        markup.texts.append(len(markup.pieces))
        markup.pieces.append(raw)
        markup.sources.append(text)
        markup.kept_breaks.append(tree.last("textarea") >= 0)
        markup.entities.append(_spelled(raw))
        copied = span[1]

    tree = _Open(xml)
    for start, stop, translatable in _runs(document, tree):
        if translatable and span and span[1] == start:
            span[1] = stop
            continue
        if span:
            close_text()
        span = [start, stop] if translatable else []
    if span:
        close_text()
    if copied < len(document):
        markup.pieces.append(document[copied:])
    markup.unclosed = tree.cut or next((f"<{name}>" for name in tree.names if name in SKIP), "")
    return markup


def _spelled(raw: str) -> dict[str, str]:
    """Each character the source wrote as an entity -> that entity, as written."""
    spelled: dict[str, str] = {}
    for m in ENTITY.finditer(raw):
        char = html.unescape(m.group(0))
        if len(char) == 1 and char != m.group(0):
            spelled.setdefault(char, m.group(0) if m.group(0).endswith(";") else m.group(0) + ";")
    return spelled
