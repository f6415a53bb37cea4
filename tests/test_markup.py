"""HTML kept byte for byte (runtime/markup.py): what is markup, what is text, and time in proportion to the
document whatever it holds (html.parser took 11 s on 36 KB of unterminated tags: CPython gh-135462)."""

from __future__ import annotations

import functools
import timeit
from collections.abc import Callable

import pytest

from runtime.markup import parse_html


def texts(doc: str) -> list[str]:
    return parse_html(doc).sources


def test_tags_comments_and_skipped_elements_are_markup():
    doc = ('<!DOCTYPE html><p class="x" title="Ein Hund">Ein <b>großer</b> Hund &amp; eine&nbsp;Katze.</p>'
           '<pre>kein hund</pre><code>x = 1</code><script>var s = "<p>hund</p>";</script>'
           '<style>p { color: red }</style><span translate="no">Hund <i>da</i></span><!-- ein Hund --><br/>'
           '<?php echo 1 ?><a href="x>y" title=\'q"\'>Link</a>')
    assert texts(doc) == ["Ein ", "großer", " Hund & eine\xa0Katze.", "Link"]
    markup = parse_html(doc)
    assert "".join(markup.pieces) == doc
    assert markup.rebuild(["A ", "B", " C & D\xa0E. <x>", "L"]) == doc.replace("Ein <b>großer", "A <b>B").replace(
        "Hund &amp; eine&nbsp;Katze.", "C &amp; D&nbsp;E. &lt;x>").replace(">Link<", ">L<")


@pytest.mark.parametrize("doc, translated", [
    ("<p>unfinished <b", ["unfinished "]),  # a tag without ">" runs to the end: copied
    ("<p>Text<!-- open comment <b>Hund</b>", ["Text"]),
    ("<p>Text <a title=\"open>Hund</a> mehr", ["Text "]),  # a quoted value without its quote
    ("3 < 4 ist wahr", ["3 < 4 ist wahr"]),  # "<" before a space is text
    ("a</>b", ["a", "b"]),
    ("<SCRIPT>if (a<b) x</SCRIPT >Danach", ["Danach"]),  # raw text to its end tag, any case
    ("<style>a{}", []),  # raw text without an end tag: the rest
    ('<div TRANSLATE = no>nein <div>auch</div> nein</div>ja', ["ja"]),  # translate="no", nested
    ("<p>Hund</p  >Katze", ["Hund", "Katze"]),
    # comments end where the standard ends them: "<!-->" and "<!--->" at once, "--!>" as "-->" (the text after
    # them was copied untranslated as part of the comment)
    ("<!-->Hund<!-- x -->Katze", ["Hund", "Katze"]),
    ("<!--->Hund<!-- x -->Katze", ["Hund", "Katze"]),
    ("<!--a--!>Hund<!-- y -->Katze", ["Hund", "Katze"]),
    ("<!-- a --!> b -->Hund", [" b -->Hund"]),
    # translate="no" counts as an attribute only, never inside another's value (the text was copied)
    ("<div title='x translate=\"no\"'>Hund</div>", ["Hund"]),
    ('<div title="a translate=no ">Hund</div>', ["Hund"]),
    ("<p translate=yes translate=no>Hund</p>", ["Hund"]),  # the first of a repeated attribute counts
])
def test_unusual_markup(doc, translated):
    markup = parse_html(doc)
    assert markup.sources == translated
    assert "".join(markup.pieces) == doc
    assert markup.rebuild(markup.sources).replace("&lt;", "<") == doc


# Documents made to be slow, about 5,000-15,000 characters at 1x: html.parser rescanned the rest of the
# document from every unterminated construct.
HOSTILE = {
    "unterminated start tags": lambda n: "<a " * 1700 * n,
    "unterminated end tags": lambda n: "</a " * 1300 * n,
    "unterminated comments": lambda n: "<!--" * 1300 * n,
    "unterminated quoted values": lambda n: '<a b="' * 900 * n,
    "many attributes, no end": lambda n: "<a " + "b=c " * 1300 * n,
    "a long name": lambda n: "<a" + "b" * 5000 * n,
    "text and stray <": lambda n: "x <p>y</p> < " * 400 * n,
    "declarations": lambda n: "<!x" * 1700 * n,
    "comments closed by --!>": lambda n: "<!--a--!>x" * 700 * n,  # each looked for "-->" to the end
    "comments closed by -->": lambda n: "<!-- a -->x" * 700 * n,  # ... and for "--!>"
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_parsing_time_grows_linearly_with_the_document(name):
    """Twice the document, twice the time: 4x the document must take under 8x the 1x time (linear is 4x,
    quadratic 16x); timed as tests/test_sentences.py times the splitter (best of 7 alternating rounds)."""
    assert_parsed_in_linear_time(name, HOSTILE[name])


def assert_parsed_in_linear_time(name: str, build: Callable[[int], str]) -> None:
    """parse_html of build(1), build(2), build(4), each rebuilt whole: 4x the document under 8x the 1x time."""
    docs = [build(n) for n in (1, 2, 4)]
    for doc in docs:
        assert "".join(parse_html(doc).pieces) == doc
    calls = [functools.partial(parse_html, doc) for doc in docs]
    number = max(1, round(0.02 / min(timeit.repeat(calls[0], number=1, repeat=3))))
    rounds = [[timeit.timeit(call, number=number) / number for call in calls] for _ in range(7)]
    seconds = [min(times) for times in zip(*rounds)]
    print(f"{name}: 1x {seconds[0] * 1e3:.2f} ms, 4x {seconds[2] * 1e3:.2f} ms ({len(docs[0])} characters at 1x)")
    assert seconds[2] / seconds[0] < 8, f"{name}: 4x the document took {seconds[2] / seconds[0]:.1f}x the time"
