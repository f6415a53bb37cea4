"""scripts/terminology_set.py (the glossary test set from a parallel corpus) on a tiny made-up corpus: Dice's
mutual best pairs, whole-word selection of test lines, and WMT 2021-style term use on hand-made outputs."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("terminology_set", ROOT / "scripts" / "terminology_set.py")
assert _spec is not None and _spec.loader is not None
ts = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("terminology_set", ts)  # dataclasses look their module up there
_spec.loader.exec_module(ts)

# each German content word has one English partner; "Berlin" is written alike on both sides; "Wohnzimmer" is
# "living room", whose "living" must not become an entry; sentence-initial "Dogs"/"Hunde" capitalised
PAIRS = [
    ("Der Hund läuft", "the dog runs"),
    ("Ein Hund schläft", "a dog sleeps"),
    ("Der Hund bellt", "the dog barks"),
    ("Die Katze schläft", "the cat sleeps"),
    ("Eine Katze läuft", "a cat runs"),
    ("Die Katze frisst", "the cat eats"),
    ("Hunde bellen", "Dogs bark"),
    ("Zwei Hunde laufen", "two dogs run"),
    ("Viele Hunde schlafen", "many dogs sleep"),
    ("Tom wohnt in Berlin", "Tom lives in Berlin"),
    ("Anna fährt nach Berlin", "Anna drives to Berlin"),
    ("Berlin schläft", "Berlin sleeps"),
    ("Der Mann ist im Wohnzimmer", "the man is in the living room"),
    ("Ein Mann liest im Wohnzimmer", "a man reads in the living room"),
    ("Das Wohnzimmer ist groß", "the living room is big"),
    ("Der Mann schläft", "the man sleeps"),
]


def _pairs() -> dict[str, ts.Pair]:
    de, en = zip(*PAIRS)
    return {p.de: p for p in ts.mutual_best_pairs(list(de), list(en), common_words=1)}  # "the" not a neighbour


def test_dice_mutual_best_pairs_and_filters():
    pairs = _pairs()
    assert (pairs["hund"].en, pairs["katze"].en, pairs["hunde"].en, pairs["mann"].en) == ("dog", "cat", "dogs", "man")
    hund = pairs["hund"]
    assert (hund.count_de, hund.count_en, hund.count_both) == (3, 3, 3) and hund.dice == 1.0
    assert (hund.de_surface, hund.en_surface) == ("Hund", "dog")
    # "Dogs" starts a sentence once, "dogs" is inside two: the surface is the inner one
    assert pairs["hunde"].en_surface == "dogs"
    assert pairs["wohnzimmer"].phrase_with == "living room" and pairs["wohnzimmer"].phrase_share == 1.0

    entries = {(p.de_surface, p.en_surface) for p in ts.select_entries(list(pairs.values()), min_count=3,
                                                                       min_letters=3, min_dice=0.5)}
    assert {("Hund", "dog"), ("Katze", "cat"), ("Hunde", "dogs"), ("Mann", "man")} <= entries
    assert not any(s == "Wohnzimmer" or s == "Berlin" for s, _ in entries)  # half a phrase; identical words
    assert all(s.lower() != t.lower() for s, t in entries)
    assert [p.de_surface for p in ts.select_dnt(list(pairs.values()), min_count=3)] == ["Berlin"]
    # too short / too rare
    assert not ts.select_entries([pairs["hund"]], min_letters=5)
    assert not ts.select_entries([pairs["hund"]], min_count=4)


def test_whole_word_matching_and_selection():
    assert ts.has_term("Der HUND bellt.", "Hund")
    assert not ts.has_term("Die Hunde bellen", "Hund") and not ts.has_term("Hundefutter", "Hund")
    assert not ts.has_term("Ein Seehund", "Hund")
    assert ts.has_term("Die STRASSE", "Straße")                       # casefold, as runtime/glossary.py
    assert ts.has_term("new  york", "New York")                       # a space matches any whitespace
    assert ts.has_term("the dog.", "dog", case_sensitive=True) and not ts.has_term("Dog", "dog", case_sensitive=True)

    entries = [("Hund", "dog"), ("Katze", "cat")]
    src = ["Der Hund läuft", "Die Hunde laufen", "Die Katze und der Hund", "Die Katze schläft", "Nichts"]
    ref = ["The dog runs", "The dogs run", "The cat and the puppy", "A CAT sleeps", "Nothing"]
    rows, terms, mixed = ts.agreeing_lines(entries, src, ref)
    assert rows == [0, 3] and terms == [[("Hund", "dog")], [("Katze", "cat")]] and mixed == 1
    rows, terms, _ = ts.agreeing_lines(entries, src, ref, selection="any")
    assert rows == [0, 2, 3] and terms[1] == [("Katze", "cat")]
    assert ts.lines_with_terms(entries, src) == [0, 2, 3]
    # the subset for a share: best entries first, skipping one that would overshoot
    assert ts.subset_for_share([("Katze", "cat"), ("Hund", "dog")], src, 0.4) == [("Katze", "cat")]
    assert ts.subset_for_share([("Hund", "dog"), ("Katze", "cat")], src, 0.6) == [("Hund", "dog"), ("Katze", "cat")]


def test_term_use_on_hand_made_outputs():
    entries = [("Hund", "dog"), ("Katze", "cat"), ("Acme", "")]
    src = ["Der Hund und die Katze", "Ein HUND", "Acme baut", "Nichts hier"]
    out = ["The dog and the kitten", "A Dog", "ACME builds", "the dog"]
    # occurrences: Hund, Katze | Hund | Acme (do not translate: the source as found) ; line 4 has none
    assert ts.term_use(entries, src, out) == (1, 4)
    assert ts.term_use(entries, src, out, case_sensitive=False) == (3, 4)
    assert ts.term_use(entries, src, ["The dogs and the cats", "", "Acme builds", ""]) == (1, 4)
    assert ts.term_use(entries, [], []) == (0, 0)


def test_build_writes_the_set(tmp_path: Path):
    data = tmp_path / "data"
    data.mkdir()
    de, en = zip(*PAIRS)
    for name, lines in (("train.de", de), ("train.en", en),
                        ("test_2016_flickr.de", ["Der Hund schläft", "Die Hunde", "Die Katze frisst", "Ein Mann"]),
                        ("test_2016_flickr.en", ["The dog sleeps", "The dogs", "The kitten eats", "A man"])):
        (data / name).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    stats = ts.build(data, tmp_path / "out", min_count=3, min_letters=3, min_dice=0.7, common_words=1,
                     forced=(("Hund", "hound"),), speed_share=0.25, dnt_min_count=3)
    out = tmp_path / "out"
    assert (out / "test.de").read_text().splitlines() == ["Der Hund schläft", "Die Hunde", "Ein Mann"]
    assert (out / "test.en").read_text().splitlines() == ["The dog sleeps", "The dogs", "A man"]
    assert set(ts.read_glossary(out / "glossary.tsv")) == {("Hund", "dog"), ("Hunde", "dogs"), ("Mann", "man"),
                                                           ("schläft", "sleeps")}
    assert set(ts.read_glossary(out / "glossary.tsv")) < set(ts.read_glossary(out / "extracted.tsv"))
    assert (out / "forced.de").read_text().splitlines() == ["Der Hund schläft"]
    assert len((out / "speed.de").read_text().splitlines()) == 4 and (out / "all.en").read_text().count("\n") == 4
    assert ts.read_glossary(out / "dnt.tsv") == [("Berlin", "")]
    saved = json.loads((out / "stats.json").read_text())
    assert saved == json.loads(json.dumps(stats))
    assert (stats["selected_lines"], stats["glossary_entries"], stats["speed_share_with_term"]) == (3, 4, 0.25)
    assert stats["lines_with_a_disagreeing_term"] == 1  # "Katze" -> "cat", but the reference says "kitten"
