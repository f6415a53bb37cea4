"""Documents split into sentences and rebuilt: every character of whitespace kept, a text without a
boundary is one sentence, an empty text stays empty, line breaks always separate."""

from __future__ import annotations

import random

import pytest

from pipeline.serve_batch import sentences
from pipeline.serve_batch.sentences import Split, split_sentences

pytest.importorskip("sentencex")


@pytest.mark.parametrize("lang, text, expected", [
    ("en", "Mr. Smith went to Washington. He arrived at 3 p.m. yesterday.",
     ["Mr. Smith went to Washington.", "He arrived at 3 p.m. yesterday."]),
    ("de", "Das ist z. B. ein Test.  Er kam um 3 Uhr an!", ["Das ist z. B. ein Test.", "Er kam um 3 Uhr an!"]),
    ("fr", "Il a dit bonjour. Qui veut le voir ?", ["Il a dit bonjour.", "Qui veut le voir ?"]),
    ("de", "ein hund ohne punkt", ["ein hund ohne punkt"]),
    ("en", "", []),
    ("en", " \t ", []),
    ("en", "One.\n\nTwo\nThree. Four.", ["One.", "Two", "Three.", "Four."]),
])
def test_sentences_and_the_whitespace_between_them(lang, text, expected):
    split = split_sentences(text, lang)
    assert split.sentences == expected
    assert split.rebuild(split.sentences) == text
    assert all(not g.strip() for g in split.gaps) and len(split.gaps) == len(expected) + 1


def test_rebuild_keeps_every_character_of_whitespace():
    split = split_sentences("  Der Hund bellt.\t Die Katze schläft!\r\n\n  Gut. ", "de")
    assert split.sentences == ["Der Hund bellt.", "Die Katze schläft!", "Gut."]
    assert split.rebuild(["A.", "B!", "C."]) == "  A.\t B!\r\n\n  C. "
    assert [split.piece(j, t) for j, t in enumerate(["A.", "B!", "C."])] == ["  A.\t ", "B!\r\n\n  ", "C. "]
    assert split_sentences("\n \n", "en").rebuild([]) == "\n \n"
    with pytest.raises(ValueError):
        split.rebuild(["A."])


def test_random_texts_rebuild_exactly():
    rng = random.Random(0)
    parts = ["Der Hund.", "die katze", "Mr.", "Dr. X sagt: „Ja.“", "3.5", "?", "!", " ", "  ", "\t", "\n", "\r\n",
             "\u00a0", "é", "z. B."]
    for _ in range(300):
        text = "".join(rng.choice(parts) for _ in range(rng.randint(0, 12)))
        split = split_sentences(text, rng.choice(["en", "de", "fr"]))
        assert split.rebuild(split.sentences) == text
        assert all(s and s == s.strip() and "\n" not in s for s in split.sentences)


def test_a_segmenter_that_changes_text_falls_back_to_lines(monkeypatch):
    monkeypatch.setattr(sentences, "_segmenter", lambda: lambda lang, line: [line.upper()])
    assert split_sentences(" a. b\nc ", "en") == Split(["a. b", "c"], [" ", "\n", " "])
