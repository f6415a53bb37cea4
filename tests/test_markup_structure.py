"""Where an element ends, and what is never prose (runtime/markup.py): translate="no" ends where a browser ends
the element (end tags may be left off), translate="yes" inside it translates again, CDATA runs to "]]>", and
MathML is copied as <code> is."""

from __future__ import annotations

import pytest
from test_markup import assert_parsed_in_linear_time

from runtime.markup import parse_html


def marked(doc: str) -> tuple[list[str], str]:
    """What the model is sent, and the document rebuilt with each translation marked as [text]."""
    markup = parse_html(doc)
    assert "".join(markup.pieces) == doc
    return markup.sources, markup.rebuild([f"[{s}]" for s in markup.sources])


@pytest.mark.parametrize("doc, sources, rebuilt", [
    ('<p translate="no">Brand<p>Second para words</p><p>Third</p>', ["Second para words", "Third"],
     '<p translate="no">Brand<p>[Second para words]</p><p>[Third]</p>'),
    ('<ul><li translate="no">ACME<li>Item words</ul><p>More</p>', ["Item words", "More"],
     '<ul><li translate="no">ACME<li>[Item words]</ul><p>[More]</p>'),
    ('<tr><td translate="no">SKU<td>Description</tr>', ["Description"],
     '<tr><td translate="no">SKU<td>[Description]</tr>'),
    ('<p translate="no">X<div>Rest</div>', ["Rest"], '<p translate="no">X<div>[Rest]</div>'),
    ('<p translate="no">Logo<hr>Below', ["Below"], '<p translate="no">Logo<hr>[Below]'),
    ('<table><tr><th translate="no">SKU<th>Name<tr><td translate="no">A1<td>Apple</table>After',
     ["Name", "Apple", "After"],
     '<table><tr><th translate="no">SKU<th>[Name]<tr><td translate="no">A1<td>[Apple]</table>[After]'),
    ('<table><tr translate="no"><td>A1<td>B2<tr><td>Row two</table>', ["Row two"],
     '<table><tr translate="no"><td>A1<td>B2<tr><td>[Row two]</table>'),
    ('<table><thead translate="no"><tr><td>Code<tbody><tr><td>Body cell</table>', ["Body cell"],
     '<table><thead translate="no"><tr><td>Code<tbody><tr><td>[Body cell]</table>'),
    ('<dl><dt translate="no">ACME<dd>Definition words<dt>Next term</dl>', ["Definition words", "Next term"],
     '<dl><dt translate="no">ACME<dd>[Definition words]<dt>[Next term]</dl>'),
    ('<select><option translate="no">XL<option>Large size<optgroup label=a><option>Small</select>',
     ["Large size", "Small"],
     '<select><option translate="no">XL<option>[Large size]<optgroup label=a><option>[Small]</select>'),
    # an ancestor's end tag ends everything inside it
    ('<ul><li><p translate="no">ACME</ul><p>More</p>', ["More"], '<ul><li><p translate="no">ACME</ul><p>[More]</p>'),
    ('<div><span translate="no">Brand</div>Words', ["Words"], '<div><span translate="no">Brand</div>[Words]'),
    ('<table><tr><td><code>x = 1</td><td>Cell words</table>', ["Cell words"],
     '<table><tr><td><code>x = 1</td><td>[Cell words]</table>'),
])
def test_translate_no_ends_where_a_browser_ends_the_element(doc, sources, rebuilt):
    assert marked(doc) == (sources, rebuilt)


@pytest.mark.parametrize("doc, sources", [
    ('<div translate="no">A<div>nested</div>B<p>para</div>After', ["After"]),  # an explicit end tag, nested
    ('<p translate="no">Brand <b>bold</b> name</p>After', ["After"]),
    ('<ul translate="no"><li>one<li>two</ul>After', ["After"]),  # the list's items inherit it
    ('<span translate="no">X<div>Y</span>Z</div>W', []),  # a browser ignores </span> across an open <div>
    ('<div><b translate="no">Bold</div>still bold</b>Not', ["Not"]),  # <b> is reopened after </div>, as bold is
    ('<p><code>x<p>y</code>Words', ["Words"]),
    ('<td><b translate="no">X</td><td>Y', ["Y"]),  # ... but not past the end of a cell
])
def test_what_a_browser_keeps_open_stays_copied(doc, sources):
    assert marked(doc)[0] == sources


def test_translate_yes_inside_translate_no_translates_again():
    doc = ('<div translate="no">Keep <span translate="yes">translate this <i>too</i></span> kept '
           '<p translate="yes">Para words<p>Kept again</div>After<code>x <span translate="yes">y</span></code>')
    assert marked(doc) == (
        ["translate this ", "too", "Para words", "After"],
        '<div translate="no">Keep <span translate="yes">[translate this ]<i>[too]</i></span> kept '
        '<p translate="yes">[Para words]<p>Kept again</div>[After]<code>x <span translate="yes">y</span></code>')


@pytest.mark.parametrize("doc, sources, rebuilt", [
    ("<p><![CDATA[a > b inline cdata words]]></p>", [], "<p><![CDATA[a > b inline cdata words]]></p>"),
    ("<p>Before <![CDATA[x > y]] > z]]> after words</p>", ["Before ", " after words"],
     "<p>[Before ]<![CDATA[x > y]] > z]]>[ after words]</p>"),
    ("<p>Words<![CDATA[ never closed > <b>bold</b>", ["Words"], "<p>[Words]<![CDATA[ never closed > <b>bold</b>"),
    ("<p>Words<![cdata[a > b]]>", ["Words", " b]]>"], "<p>[Words]<![cdata[a >[ b]]>]"),  # case-sensitive
])
def test_cdata_runs_to_its_end_and_is_copied(doc, sources, rebuilt):
    assert marked(doc) == (sources, rebuilt)


def test_mathml_is_copied_as_code_is():
    doc = ("<p>Math says <math><mi>x</mi><mo>&gt;</mo><mi>y</mi></math> always.</p>"
           "<p>Also <math display=block><mrow><mtext>if and only if</mtext><mi>z</mi></mrow></math>end</p>")
    assert marked(doc) == (
        ["Math says ", " always.", "Also ", "end"],
        "<p>[Math says ]<math><mi>x</mi><mo>&gt;</mo><mi>y</mi></math>[ always.]</p>"
        "<p>[Also ]<math display=block><mrow><mtext>if and only if</mtext><mi>z</mi></mrow></math>[end]</p>")


# Made to be slow for the tree kept: implied ends, formatting reopened, ignored end tags, unterminated CDATA.
HOSTILE = {
    "unterminated CDATA": lambda n: "<![CDATA[" * 1000 * n,
    "paragraphs and blocks": lambda n: "<div>" * 600 * n + "<p>x" * 600 * n,
    "formatting closed by a block": lambda n: ("<div>" + "".join(f"<{t}>" for t in "abisu" * 4) + "</div>") * 60 * n,
    "ignored end tags": lambda n: "<span>" * 400 * n + "<div>" + "</span>" * 400 * n,
    "lists in lists": lambda n: "<ul><li>" * 400 * n + "</ul>" * 400 * n,
    "reopened translate values": lambda n: ("<p>" + "".join(f"<b translate=v{k}>" for k in range(20)) + "x") * 60 * n,
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_parsing_time_grows_linearly_with_the_document(name):
    """As tests/test_markup.py times it: 4x the document must take under 8x the 1x time."""
    assert_parsed_in_linear_time(name, HOSTILE[name])


def test_xhtml_rules_end_an_element_at_its_end_tag_only():
    doc = '<p translate="no">ACME <div>Hausmarke</div></p><p>Es war <b>fett<p>neu</p></b> und</p>'
    assert parse_html(doc, xml=True).sources == ["Es war ", "fett", "neu", " und"]
    assert parse_html(doc).sources == ["Hausmarke", "Es war ", "fett", "neu", " und"]  # HTML: <div> ends the <p>
    assert "".join(parse_html(doc, xml=True).pieces) == doc
