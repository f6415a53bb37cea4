"""The text service (runtime/texts.py) on its own, over a character tokenizer and a made-up search: what
encode_texts keeps per unit and per text, how refusals name a unit, and what finish_texts makes of the units'
hypotheses. test_text_service.py pins what every surface answers through it against the tree before it."""

from __future__ import annotations

import pytest

from runtime.texts import Lines, Listed, Located, TextPolicy, TooManyUnits, encode_texts, finish_texts, hypotheses
from runtime.translate import SourceTooLong, format_line

pytest.importorskip("sentencex")

EOS = 2


class CharTokenizer:
    """Each character one piece (its code point + 3), then EOS; decoding upper-cases."""

    def encode_source(self, texts: list[str]) -> list[list[int]]:
        return [[ord(c) + 3 for c in text] + [EOS] for text in texts]

    def decode(self, ids: list[list[int]]) -> list[str]:
        return ["".join(chr(i - 3) for i in seq if i > EOS).upper() for seq in ids]

    def source_cut(self, text: str, pieces: int) -> int:
        return min(len(text), max(pieces, 0))


TOK = CharTokenizer()


def search(ids: list[list[int]], n: int = 1) -> list[list[tuple[list[int], float]]]:
    """The source copied as the best hypothesis, then its reversals and a fixed one, each scored lower."""
    out = []
    for src in ids:
        body = [i for i in src if i > EOS]
        hyps = [(body, -1.0), (body[::-1], -2.0), ([ord("x") + 3], -3.0)][:n] if src else []
        out.append(hyps)
    return out


def test_plain_texts_are_one_unit_each_blank_ones_too():
    encoded = encode_texts(TOK, ["ab", "", "  ", "abcdefgh"], 6, TextPolicy(prefix=(99,)))
    assert encoded.units == ["ab", "", "  ", "abcdefgh"]
    assert encoded.owners == [0, 1, 2, 3] and encoded.spans == [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]
    assert encoded.ids[:3] == [[99, 100, 101, EOS], [], []]
    assert encoded.ids[3] == [99, 100, 101, 102, 103, EOS]  # cut to 6 tokens, EOS kept
    assert encoded.empty == [False, True, True, False] and encoded.truncated == [0, 0, 0, 1]
    assert encoded.tokens == 10 and encoded.split(0) is None


def test_documents_are_their_sentences_and_each_text_knows_its_cuts():
    """A sentence longer than the model takes is cut into sentences that fit (at whitespace past the middle of
    what fits, else where it stops fitting): "Klmnopqrstuv wx." was cut to 7 pieces and "rstuv wx." lost (a
    sentence of 1,400 characters to a model's 128 tokens, "1 line truncated")."""
    texts = ["Ab cd. Ef gh!  Ij", "   ", "Klmnopqrstuv wx. Yz"]
    encoded = encode_texts(TOK, texts, 8, TextPolicy(split="sentences"))
    assert encoded.units == ["Ab cd.", "Ef gh!", "Ij", "Klmnopq", "rstuv", "wx.", "Yz"]
    assert encoded.owners == [0, 0, 0, 2, 2, 2, 2] and encoded.spans == [range(0, 3), range(3, 3), range(3, 7)]
    assert encoded.empty == [False, True, False] and encoded.truncated == [0, 0, 0]
    assert encoded.split(1) is not None and encoded.split(1).gaps == ["   "]
    results = finish_texts(TOK, encoded, search(encoded.ids), 1)
    assert [r.text for r in results] == ["AB CD. EF GH!  IJ", "   ", "KLMNOPQ RSTUV WX. YZ"]
    assert results[2].units == ["KLMNOPQ", "RSTUV", "WX.", "YZ"] and results[2].truncated == 0
    # refused as before where long lines are (--long-lines error), and one unit of a plain text still truncated
    with pytest.raises(SourceTooLong, match="sentence:1: 17 tokens"):
        encode_texts(TOK, texts[2:], 8, TextPolicy(long_lines="error", split="sentences"))
    assert encode_texts(TOK, texts[2:], 8, TextPolicy()).truncated == [1]
    # a document's score: its sentences' best scores averaged by their length in tokens
    assert results[0].score == pytest.approx(-1.0) and results[1].score is None and results[1].empty


def test_html_units_are_its_text_nodes_sentences_and_the_markup_is_kept():
    texts = ["<p>Ab. Cd <b>ef</b> &amp; gh</p>", "<br>", "plain"]
    encoded = encode_texts(TOK, texts, 100, TextPolicy(format="html"))
    assert encoded.units == ["Ab.", "Cd", "ef", "& gh", "plain"]
    assert encoded.owners == [0, 0, 0, 0, 2] and encoded.empty == [False, True, False]
    results = finish_texts(TOK, encoded, search(encoded.ids), 1)
    assert [r.text for r in results] == ["<p>AB. CD <b>EF</b> &amp; GH</p>", "<br>", "PLAIN"]
    assert results[0].alternatives == [] and results[1].score is None


@pytest.mark.parametrize("policy, origin, message", [
    (TextPolicy(long_lines="error"), Lines("in.txt", 10), "in.txt:11: 6 tokens"),
    (TextPolicy(long_lines="error"), Listed(), "text[1]: 6 tokens"),
    (TextPolicy(long_lines="error"), Located(["a.txt", "b.txt"], [7, 3]), "b.txt:3: 6 tokens"),
    (TextPolicy(long_lines="error", split="sentences"), Lines("in.txt", 10), "in.txt:11 sentence:2: 6 tokens"),
    (TextPolicy(long_lines="error", split="sentences"), Listed(), "text[1] sentence:2: 6 tokens"),
    (TextPolicy(long_lines="error", format="html"), Lines("row"), "row:2 text node 2 sentence:2: 6 tokens"),
    # the request's own text, not the m-th text node of all the texts (text[2] here, a text never sent); its node
    # by number within it (the second: a line's first node was named as its tenth would be)
    (TextPolicy(long_lines="error", format="html"), Listed(), "text[1] text node 2 sentence:2: 6 tokens"),
    (TextPolicy(long_lines="error", format="html"), Listed(["q[0]", "q[3]"]),
     "q[3] text node 2 sentence:2: 6 tokens"),
])
def test_a_refused_unit_is_named_as_its_surface_names_it(policy, origin, message):
    texts = ["<i>ab</i>", "<b>x</b>Ab. Abcde"] if policy.format == "html" else ["ab", "Ab. Abcde"]
    if not policy.documents:
        texts = ["ab", "abcde"]
    with pytest.raises(SourceTooLong) as refused:
        encode_texts(TOK, texts, 5, policy, origin)
    assert str(refused.value).startswith(message + ", more than the model's limit of 5; pass --long-lines")


def test_units_are_counted_before_any_is_tokenized():
    class Refusing(CharTokenizer):
        def encode_source(self, texts: list[str]) -> list[list[int]]:
            raise AssertionError("tokenized before the count")

    with pytest.raises(TooManyUnits) as refused:
        encode_texts(Refusing(), ["Ab. Cd.", "Ef. Gh."], 100, TextPolicy(split="sentences"), max_units=3)
    assert (refused.value.limit, refused.value.counted) == (3, False)  # splitting stopped at the fourth
    with pytest.raises(TooManyUnits) as refused:  # lines are counted whole
        encode_texts(Refusing(), ["Ab. Cd.", "Ef. Gh.", "x", "y"], 100, TextPolicy(), max_units=3)
    assert (refused.value.count, refused.value.limit, refused.value.counted) == (4, 3, True)
    assert len(encode_texts(TOK, ["Ab. Cd.", "Ef. Gh."], 100, TextPolicy(split="sentences"), max_units=4).ids) == 4


def test_nbest_lines_hypotheses_and_alternatives():
    encoded = encode_texts(TOK, ["ab", "", "aa"], 100, TextPolicy())
    nbest = search(encoded.ids, 3)
    results = finish_texts(TOK, encoded, nbest, 3)
    assert [r.text for r in results] == [format_line(TOK, nb, 3) for nb in nbest]
    assert results[0].hypotheses == [("AB", -1.0), ("BA", -2.0), ("X", -3.0)] == hypotheses(TOK, nbest[0])
    assert results[0].alternatives == ["BA", "X"] and results[2].alternatives == ["X"]  # "AA" reversed is "AA"
    assert results[0].score == -1.0 and results[1].score is None and results[1].text == " ||| 0.0000"
    documents = encode_texts(TOK, ["Ab. Cd."], 100, TextPolicy(split="sentences"))
    [doc] = finish_texts(TOK, documents, search(documents.ids, 2), 2)
    assert doc.text == "AB. CD." and doc.alternatives == [".BA .DC"] and doc.hypotheses == []


def test_a_sentence_without_letters_is_copied_not_translated():
    """A document's "123", date or emoji line went to the model, which invented words for it (serving.md:
    text without letters is returned unchanged); a plain text is still one unit, whatever it holds."""
    texts = ["Ab cd.\n123\n2024-01-01 \U0001F600", "<p>Ab.\n42</p>", "99"]
    encoded = encode_texts(TOK, texts[:1], 64, TextPolicy(split="sentences"))
    assert encoded.units == ["Ab cd.", "123", "2024-01-01 \U0001F600"] and encoded.copied == [False, True, True]
    assert encoded.ids[1:] == [[], []] and encoded.tokens == 7  # the model sees only "Ab cd."
    [result] = finish_texts(TOK, encoded, search(encoded.ids, 2), 2)
    assert result.text == "AB CD.\n123\n2024-01-01 \U0001F600" and result.units[1:] == ["123", "2024-01-01 \U0001F600"]
    assert result.alternatives == [".DC BA\n123\n2024-01-01 \U0001F600"]  # copied in every alternative too
    html = encode_texts(TOK, texts[1:2], 64, TextPolicy(format="html"))
    assert finish_texts(TOK, html, search(html.ids), 1)[0].text == "<p>AB.\n42</p>"
    plain = encode_texts(TOK, texts[2:], 64, TextPolicy())
    assert plain.copied == [False] and finish_texts(TOK, plain, search(plain.ids), 1)[0].text == "99"


def test_serve_batch_warns_of_an_html_line_that_leaves_script_or_pre_open(tmp_path, caplog):
    """--format html reads each line as a document: a whole HTML file split into lines had its script's code
    translated and <pre>'s later lines kept (or the reverse) without a word. Warned once a file, naming the line."""
    import logging

    from pipeline.serve_batch.translation import ServeBatchOptions, read_windows

    page = tmp_path / "page.html"
    page.write_text("<p>Hallo Welt</p>\n<p>Noch <b>einer</b></p>\n<script>\nvar a = 'x';\n</script>\n<pre>a\n")
    opts = ServeBatchOptions(format="html", window=2)
    with caplog.at_level(logging.WARNING):
        windows = list(read_windows(str(page), TOK, 100, opts))
    assert sum(len(w.encoded.markups) for w in windows) == 6  # every line read, as before
    warned = [r.getMessage() for r in caplog.records if "leaves" in r.getMessage()]
    assert warned == [f"{page}:3: the line leaves <script> open, so the rest of it is copied untranslated: "
                      "--format html reads each line as an HTML document; a multi-line HTML file is one document "
                      "(translate it with `pipeline serve`'s POST /translate_file, or put each document on one "
                      "line)"]
    # each such line counted: the first named, then how many in all (three lines left <pre>, <b and <!-- open: one
    # warning named the first, the others went uncounted)
    page.write_text("<pre>a\n<p>ok</p>\n<b\n<!-- x\n")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        list(read_windows(str(page), TOK, 100, opts))
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and said[0].startswith(f"{page}:1: the line leaves <pre> open") and said[1] == (
        f"{page}: 3 lines in all leave a tag, comment or <script>/<pre> open; the rest of each was copied untranslated")
    caplog.clear()
    page.write_text("<p>Hallo</p>\n<p>Welt</p>\n")
    with caplog.at_level(logging.WARNING):
        list(read_windows(str(page), TOK, 100, opts))
    assert not caplog.records


def test_serve_batch_windows_end_at_their_bytes_too(tmp_path, monkeypatch):
    """A window was --window lines whatever their size: 10,000 lines of 30 KB held 1.5 GB. It ends past
    WINDOW_BYTES of text too; every line is read once, in order."""
    from pipeline.serve_batch import translation

    monkeypatch.setattr(translation, "WINDOW_BYTES", 30)
    src = tmp_path / "in.txt"
    src.write_text("".join(f"line {i:05d}\n" for i in range(7)))  # 11 bytes a line
    windows = list(translation.read_windows(str(src), TOK, 100, translation.ServeBatchOptions()))
    assert [len(w.encoded.units) for w in windows] == [3, 3, 1]
    assert [u for w in windows for u in w.encoded.units] == [f"line {i:05d}" for i in range(7)]


def test_serve_batch_windows_of_documents_end_at_their_sentences(tmp_path, monkeypatch):
    """With --split sentences a window of 400 lines of 400 sentences (640 KB, under WINDOW_BYTES) held 160,000
    sentences at once: 329 MB. It ends past about WINDOW_SENTENCES sentences too (122 MB), lines read in order."""
    from pipeline.serve_batch import translation

    monkeypatch.setattr(translation, "WINDOW_SENTENCES", 10)
    src = tmp_path / "in.txt"
    src.write_text("".join(f"Ab {i}. Cd. Ef.\n" for i in range(7)))  # 3 sentences a line, counted as 1 + 2 ends
    opts = translation.ServeBatchOptions(split="sentences")
    windows = list(translation.read_windows(str(src), TOK, 100, opts))
    assert [len(w.encoded.spans) for w in windows] == [4, 3]  # 12 >= 10 after line 4
    assert [u for w in windows for u in w.encoded.units][:3] == ["Ab 0.", "Cd.", "Ef."]
    plain = list(translation.read_windows(str(src), TOK, 100, translation.ServeBatchOptions()))
    assert [len(w.encoded.spans) for w in plain] == [7]  # a line is a unit: only lines and bytes end a window


class DroppingTokenizer(CharTokenizer):
    """As SentencePiece does with U+200B, U+200C and a BOM: those characters leave no piece."""

    def encode_source(self, texts: list[str]) -> list[list[int]]:
        return super().encode_source([t.translate({0x200B: None, 0x200C: None, 0xFEFF: None}) for t in texts])


def test_a_text_the_tokenizer_keeps_nothing_of_is_blank_and_never_translated():
    """A line of U+200B (or a BOM mid-file, from `cat` of files saved with one) is not blank to str.strip(), so
    its source was EOS alone: the model, given nothing, invented a whole sentence, counted as translated."""
    encoded = encode_texts(DroppingTokenizer(), ["ab", "\u200b", "\ufeff\u200c", "a\u200bb"], 8, TextPolicy())
    assert encoded.ids == [[100, 101, EOS], [], [], [100, 101, EOS]]
    assert encoded.empty == [False, True, True, False]
    assert [r.text for r in finish_texts(TOK, encoded, search(encoded.ids), 1)] == ["AB", "", "", "AB"]


def test_a_blank_line_in_an_nbest_file_is_one_empty_hypothesis_with_its_score():
    """With --nbest N each line holds `text ||| score` pairs; a blank line was a bare empty line (a parser taking
    pairs broke on it), where the HTTP API answers it {"text": "", "score": 0}."""
    assert format_line(TOK, [], 2) == " ||| 0.0000" and format_line(TOK, [], 1) == ""
    assert format_line(TOK, [([100, 101], -1.0), ([101], -2.5)], 2) == "AB ||| -1.0000 ||| B ||| -2.5000"


def test_serve_batch_writes_an_empty_line_for_a_line_of_zero_width_characters(fp32_dir, tmp_path):
    from helpers import run_cli

    src, out = tmp_path / "in.txt", tmp_path / "out.txt"
    src.write_text("\u200b\n\u200c\u200b\n\ufeff\n")
    assert run_cli("serve-batch", fp32_dir, src, "--output", out, "--no-progress") == 0
    assert out.read_text() == "\n\n\n"


def test_a_line_break_in_markups_text_is_a_space_not_a_cut():
    """HTML wrapped at 72 columns (pandoc's default) had each sentence cut at its line ends and the pieces
    translated apart: in an HTML text node, and in the texts a file's markup gave (soft_breaks), a line break is
    whitespace inside a sentence; in a plain document it still separates."""
    page = "<p>Ab cd\nef gh. Ij\r\nkl!</p>"
    html = encode_texts(TOK, [page], 64, TextPolicy(format="html"))
    assert html.units == ["Ab cd\nef gh.", "Ij\r\nkl!"]
    results = finish_texts(TOK, html, search(html.ids), 1)
    assert [r.text for r in results] == ["<p>AB CD\nEF GH. IJ\r\nKL!</p>"]
    # a <textarea> shows its line breaks: there they still separate
    assert encode_texts(TOK, ["<textarea>Ab cd\nef gh</textarea>"], 64, TextPolicy(format="html")).units == [
        "Ab cd", "ef gh"]
    texts = ["Ab cd\nef gh. Ij\nkl!"]
    assert encode_texts(TOK, texts, 64, TextPolicy(split="sentences", soft_breaks=True)).units == [
        "Ab cd\nef gh.", "Ij\nkl!"]
    assert encode_texts(TOK, texts, 64, TextPolicy(split="sentences")).units == ["Ab cd", "ef gh.", "Ij", "kl!"]


def test_a_short_sentence_that_normalises_long_is_measured_not_assumed_to_fit():
    """60 x U+FDFA (each 18 characters once NFKC-normalised, ~9 pieces) was taken to fit untokenized, a
    quarter of the limit in characters, and truncated: only an ASCII sentence of at most the limit in characters
    is taken to fit without the tokenizer."""
    from runtime.texts import _fitting

    asked: list[str] = []

    class Expanding(CharTokenizer):
        def source_cut(self, text: str, pieces: int) -> int:
            asked.append(text)
            return min(len(text), max(pieces // 9, 0))  # each character 9 pieces

    fit = _fitting(Expanding(), 21, TextPolicy(split="sentences"))
    assert fit is not None and fit("a" * 20) == 20 and asked == []  # ASCII within the limit: untokenized
    assert fit("\ufdfa" * 5) == 2 and asked == ["\ufdfa" * 5]
    assert _fitting(Expanding(), 21, TextPolicy(split="sentences", long_lines="error")) is None


def test_splitting_stops_once_a_text_holds_more_sentences_than_the_limit(monkeypatch):
    """An 8 MB one-line document was split whole (a 17 MB one: 17 s and 370 MB) before --max-sentences refused
    it; the split stops at the sentence past the limit, HTML text nodes included, and the whole text is never
    segmented."""
    from runtime import sentences

    real, seen = sentences._segmenter(), []

    def counting() -> object:
        def segment(lang: str, text: str) -> list[str]:
            seen.append(len(text))
            return real(lang, text)
        return segment

    monkeypatch.setattr(sentences, "_segmenter", counting)
    document = "Ja. " * 2_000_000
    for policy, text in ((TextPolicy(split="sentences"), document), (TextPolicy(format="html"),
                                                                    f"<p>{document[:4000]}</p><p>{document}</p>")):
        seen.clear()
        with pytest.raises(TooManyUnits) as refused:
            encode_texts(TOK, ["Ab. Cd.", text], 100, policy, max_units=100)
        assert refused.value.limit == 100 and not refused.value.counted
        assert sum(seen) < 20 * sentences.WINDOW, sum(seen)  # of 8,000,000 characters
    assert len(encode_texts(TOK, [document[:400]], 100, TextPolicy(split="sentences"), max_units=100).ids) == 100
    # a glossary's term joins two sentences after the split: 6 found, 5 translated, within a limit of 5 (refused)
    from runtime.glossary_file import glossary_from_mapping

    text = "Da kinisa. Da tava. Da moka. Da vobi. Da sinas. Da noso."
    class Spelling(CharTokenizer):  # what the glossary's terms need besides: their targets' pieces
        unk_id = 0

        def encode(self, texts: list[str]) -> list[list[int]]:
            return [[ord(c) + 3 for c in text] for text in texts]

    joined = encode_texts(Spelling(), [text], 100, TextPolicy(split="sentences"), max_units=5,
                          glossary=glossary_from_mapping({"vobi. Da sinas": "zorro"}))
    assert len(joined.units) == 5 and "Da vobi. Da sinas." in joined.units
    seen.clear()  # with a glossary the split still stops, at 64 x the limit (its terms join sentences after it)
    with pytest.raises(TooManyUnits):
        encode_texts(Spelling(), [document], 100, TextPolicy(split="sentences"), max_units=100,
                     glossary=glossary_from_mapping({"vobi. Da sinas": "zorro"}))
    assert sum(seen) < 64 * 20 * sentences.WINDOW, sum(seen)  # of 8,000,000 characters
