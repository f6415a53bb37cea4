"""Parsing hostile input takes memory in proportion to it, a few bytes a character at most: the HTML tokenizer,
an SRT cue's speaker mark and a language code are read without a regular expression that repeats a group
(Python's `re` keeps state for each repeat: about 80 bytes a character, so a 140 KB EPUB of `<a b=`, 90 MiB
unpacked, held 7.7 GB of a server). Measured with tracemalloc, which sees `re`'s allocations."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest

from runtime.languages import LANG_CODE
from runtime.markup import parse_html

MIB = 1 << 20


def peak_bytes(call: Callable[[], Any]) -> int:
    tracemalloc.start()
    try:
        call()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


HOSTILE_HTML = {
    "a tag never closed, its attributes '=' without values": "<p>Hallo Welt</p>" + "<a b=" * (MIB // 5),
    "a tag never closed, many attributes": "<p>Hallo Welt</p><a " + "b=c " * (MIB // 4),
    "a closed tag of many attributes": "<p>Hallo Welt</p><a " + "b='c' " * (MIB // 6) + ">Welt</a>",
    "a closed tag of many '='": "<p>Hallo Welt</p><a " + "b= " * (MIB // 3) + ">Welt</a>",
}


@pytest.mark.parametrize("name", list(HOSTILE_HTML))
def test_html_tags_are_read_in_memory_in_proportion_to_them(name):
    doc = HOSTILE_HTML[name]
    markup = parse_html(doc)
    assert "".join(markup.pieces) == doc and markup.sources[0] == "Hallo Welt"
    assert peak_bytes(lambda: parse_html(doc)) < 8 * len(doc), name


def test_a_tag_with_a_quoted_gt_still_ends_at_its_own_gt():
    doc = '<a title="x > y" b=\'>\' c= "z">Welt</a><p d=e"f>Hallo'
    assert parse_html(doc).sources == ["Welt", "Hallo"]
    assert parse_html('<a title="never closed>Welt</a>').sources == []  # a tag to the end, as in a browser


def test_srt_speaker_marks_are_read_in_memory_in_proportion_to_the_line():
    pytest.importorskip("starlette")  # pipeline.serve's package needs the serve extra
    from pipeline.serve.text_formats import read_srt

    line = "<i>" * (MIB // 3) + "- Hallo Welt"
    data = f"1\n00:00:01,000 --> 00:00:02,000\n{line}\n- Noch einer\n".encode()
    assert read_srt(data).texts == ["Hallo Welt", "Noch einer"]  # two speakers' turns, marks copied
    assert peak_bytes(lambda: read_srt(data)) < 8 * len(data)


def test_a_language_code_is_checked_in_memory_in_proportion_to_it():
    hostile = "en" + "-a" * (MIB // 2)
    assert LANG_CODE.fullmatch(hostile) is None
    assert peak_bytes(lambda: LANG_CODE.fullmatch(hostile)) < MIB
    for code in ("de", "eng_Latn", "pt-BR", "sr-Latn-RS", "en-US-u-ca-gregory-nu-latn"):
        assert LANG_CODE.fullmatch(code), code


@pytest.mark.parametrize("tag", ["<b>", "<div>", "<span translate=no>"])
def test_unclosed_elements_are_held_as_deep_as_a_browser_nests(tag):
    """Each open element was held (about 130 bytes): a 31 KB EPUB page of ten million unclosed <b> took a server
    from 0.4 to 1.8 GB. Past MAX_OPEN (512, Chromium's parser's depth) the innermost ends first."""
    from runtime.markup import MAX_OPEN

    doc = "<p>Hallo Welt</p>" + tag * (MIB // len(tag)) + "Noch einer"
    markup = parse_html(doc)
    assert "".join(markup.pieces).replace("Hallo Welt", "").replace("Noch einer", "") == \
        "<p></p>" + tag * (MIB // len(tag))
    assert markup.sources == ["Hallo Welt"] + ([] if "no" in tag else ["Noch einer"])
    assert peak_bytes(lambda: parse_html(doc)) < 3 * len(doc)  # was over 40 times
    # the translate state of the elements kept open is still theirs
    assert parse_html('<b translate="no">' + "<i>" * (MAX_OPEN * 2) + "Welt").sources == []
    assert parse_html("<i>" * (MAX_OPEN * 2) + '<b translate="no">Welt</b> Hallo').sources == [" Hallo"]
