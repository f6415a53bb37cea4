""".srt files for POST /translate_file, read and rebuilt directly (pipeline/serve/text_formats.py): dialogue
cues keep each speaker's dash on its line, and a cue without the blank line after it keeps the next cue."""

from __future__ import annotations

import pytest

from pipeline.serve.text_formats import read_srt

DIALOGUE = ("1\r\n00:00:01,000 --> 00:00:03,000\r\n- Hi there.\r\n- Hello, how are you doing?\r\n\r\n"
            "2\r\n00:00:04,000 --> 00:00:06,000\r\n<i>-Where are you</i>\r\n<i>going tonight?</i>\r\n"
            "  \u2013  Home.\r\n\r\n"
            "3\r\n00:00:07,000 --> 00:00:09,000\r\nWho is it?\r\n- Me, your neighbour\r\nfrom downstairs.\r\n")


def test_srt_dialogue_lines_keep_their_speaker_dashes():
    doc = read_srt(DIALOGUE.encode())
    assert doc.texts == ["Hi there.", "Hello, how are you doing?", "Where are you", "going tonight?", "Home.",
                         "Who is it?", "Me, your neighbour from downstairs."]
    assert doc.rebuild(list(doc.texts)) == DIALOGUE.encode()  # the identity translation changes nothing
    out = doc.rebuild([f"[{t}]" for t in doc.texts]).decode()
    assert out == ("1\r\n00:00:01,000 --> 00:00:03,000\r\n- [Hi there.]\r\n- [Hello, how are you doing?]\r\n\r\n"
                   "2\r\n00:00:04,000 --> 00:00:06,000\r\n<i>-[Where are you]</i>\r\n<i>[going tonight?]</i>\r\n"
                   "  \u2013  [Home.]\r\n\r\n"
                   "3\r\n00:00:07,000 --> 00:00:09,000\r\n[Who is it?]\r\n- [Me, your neighbour\r\n"
                   "from downstairs.]\r\n")  # a speaker's sentence over two lines is still one text, re-wrapped


def test_srt_a_cue_without_dashes_is_still_one_text_wrapped_again():
    doc = read_srt(b"1\n00:00:01,000 --> 00:00:02,000\nein langer Satz\nin zwei Zeilen - nicht zwei\n")
    assert doc.texts == ["ein langer Satz in zwei Zeilen - nicht zwei"]
    assert doc.rebuild(["A B C D"]) == b"1\n00:00:01,000 --> 00:00:02,000\nA B\nC D\n"


MISSING_BLANK = ("\ufeff4\r\n00:00:07,000 --> 00:00:08,000\r\nNo blank line after\r\n"
                 "5\r\n00:00:09,000 --> 00:00:10,000 X1:40 X2:600\r\nNext cue text\r\n"
                 "00:00:11,000 --> 00:00:12,000\r\nNo index, no blank line\r\nChapter\r\n2\r\n\r\n"
                 "7\r\n00:00:13,000 --> 00:00:14,000\r\n8\r\n00:00:15,000 --> 00:00:16,000\r\nLast\r\n\r\n")


def test_srt_a_timing_line_starts_a_cue_even_without_a_blank_line_before_it():
    data = MISSING_BLANK.encode()
    doc = read_srt(data)
    # cue 5's index and timing are never text; "2" ending at the blank line is text (no timing line follows)
    assert doc.texts == ["No blank line after", "Next cue text", "No index, no blank line Chapter 2", "Last"]
    assert doc.rebuild([f"[{t}]" for t in doc.texts]) == (
        "\ufeff4\r\n00:00:07,000 --> 00:00:08,000\r\n[No blank line after]\r\n"
        "5\r\n00:00:09,000 --> 00:00:10,000 X1:40 X2:600\r\n[Next cue text]\r\n"
        "00:00:11,000 --> 00:00:12,000\r\n[No index,\r\nno blank line\r\nChapter 2]\r\n\r\n"
        "7\r\n00:00:13,000 --> 00:00:14,000\r\n8\r\n00:00:15,000 --> 00:00:16,000\r\n[Last]\r\n\r\n").encode()


def test_srt_dialogue_and_a_missing_blank_line_through_translate_file():
    roundtrip = pytest.importorskip("test_serve_files").roundtrip  # its stand-in model upper-cases
    srt = ("1\n00:00:01,000 --> 00:00:02,000\n- Hallo du.\n- Guten Morgen, wie geht es dir?\n"
           "2\n00:00:03,000 --> 00:00:04,000\nDanke, gut.\n")
    out, _ = roundtrip("film.srt", srt.encode())
    assert out.decode() == ("1\n00:00:01,000 --> 00:00:02,000\n- HALLO DU.\n- GUTEN MORGEN, WIE GEHT ES DIR?\n"
                            "2\n00:00:03,000 --> 00:00:04,000\nDANKE, GUT.\n")


@pytest.mark.parametrize("data", [b"1\n00:01,000 --> 00:02,000\nHallo Welt\n", b"Hallo Welt\n",
                                  b"1\n00:00:01,000 -> 00:00:02,000\nHallo Welt\n"])
def test_an_srt_file_without_a_cue_is_a_400_not_itself_unchanged(data):
    """Timings without hours, a plain text named .srt, a broken arrow: no cue was found, and the file came back
    200, unchanged, as if translated."""
    test_serve_files = pytest.importorskip("test_serve_files")
    with test_serve_files.served() as c:
        r = test_serve_files.send(c, "film.srt", data)
    assert r.status_code == 400 and "film.srt': the .srt file has no subtitle cue" in r.json()["error"], r.text
    assert read_srt(b"").texts == read_srt(b"\n\n").texts == []  # an empty file is an empty translation
