"""Accuracy and speed of sentence segmenters on en/de/fr paragraphs whose boundaries are known.

    pip install --target DIR sentencex pysbd blingfire
    PYTHONPATH=DIR python scripts/compare_segmenters.py

The real paragraphs are Multi30k test_2016 (de, en) from ../shared/corpora/multi30k (MULTI30K to override).
"""
import gzip
import os
import re
import time
from pathlib import Path

GOLD = {
    "en": [
        ["Mr. Smith went to Washington.", "He arrived at 3 p.m. yesterday."],
        ["The price rose by 3.5% in Q1.", "Analysts, e.g. at J.P. Morgan, were surprised!"],
        ['She said: "Stop."', "Then she left?", "Nobody knows."],
        ["Dr. Brown lives on St. James St. near the U.S. embassy.", "It is 2 km away."],
        ["See Fig. 3 for details.", "The results (cf. Table 2) differ."],
        ["A man rides a bike without a full stop"],
        ["Version 2.0 was released on Jan. 5.", "It fixed 12 bugs."],
        ["Who is there?", "It's me!", "Open the door."],
    ],
    "de": [
        ["Das ist z. B. ein Test.", "Er kam um 3 Uhr an!"],
        ["Dr. Müller wohnt in der Hauptstr. 5.", "Er ist 45 Jahre alt."],
        ["Am 3. Oktober ist Feiertag.", "Die Geschäfte sind geschlossen."],
        ["Sie sagte: „Komm bitte.“", "Dann ging sie."],
        ["Das kostet ca. 20 Euro bzw. 25 Franken.", "Ist das zu teuer?"],
        ["Ein Hund läuft über die Wiese ohne Punkt"],
        ["Vgl. S. 12 ff. im Anhang.", "Dort steht alles."],
        ["Prof. Dr. Schmidt hält um 10.30 Uhr einen Vortrag.", "Alle sind eingeladen."],
    ],
    "fr": [
        ["M. Dupont est arrivé.", "Il a dit bonjour."],
        ["Mme Martin habite au 3, rue de la Paix.", "Elle a 40 ans."],
        ["Il a dit : « Bonjour. »", "Puis il est parti."],
        ["Le prix est de 3,5 millions d'euros, etc.", "C'est beaucoup !"],
        ["Voir p. 12 pour les détails.", "Les résultats diffèrent."],
        ["Un chien court dans le parc sans point"],
        ["Le Dr Leblanc est là.", "Qui veut le voir ?"],
        ["Nous partons le 1er janv. à 8 h.", "Soyez à l'heure."],
    ],
}


def sentencex_split(lang):
    import sentencex
    return lambda text: [s.strip() for s in sentencex.segment(lang, text) if s.strip()]


def pysbd_split(lang):
    import pysbd
    seg = pysbd.Segmenter(language=lang, clean=False)
    return lambda text: [s.strip() for s in seg.segment(text) if s.strip()]


def blingfire_split(lang):
    import blingfire
    return lambda text: [s.strip() for s in blingfire.text_to_sentences(text).split("\n") if s.strip()]


def multi30k(lang, n=50, per=20):
    """Paragraphs of `per` Multi30k test_2016 sentences (those ending in . ! or ?), the lines as gold."""
    root = Path(os.environ.get("MULTI30K", Path(__file__).resolve().parents[2] / "shared/corpora/multi30k"))
    path = root / f"test_2016_flickr.{lang}.gz"
    lines = [s.strip() for s in gzip.open(path, "rt", encoding="utf-8") if re.search(r"[.!?]$", s.strip())]
    return [lines[i:i + per] for i in range(0, min(len(lines), n * per) - per + 1, per)]


def main():
    real = {lang: multi30k(lang) for lang in ("de", "en")}
    for name, make in [("sentencex", sentencex_split), ("pysbd", pysbd_split), ("blingfire", blingfire_split)]:
        t0 = time.perf_counter()
        splitters = {lang: make(lang) for lang in GOLD}
        setup = time.perf_counter() - t0
        right = total = 0
        wrong = []
        for lang, paragraphs in GOLD.items():
            for sents in paragraphs:
                got = splitters[lang](" ".join(sents))
                total += 1
                if got == sents:
                    right += 1
                else:
                    wrong.append(f"{lang}: {got}")
        texts = [(lang, " ".join(s for p in paragraphs for s in p)) for lang, paragraphs in GOLD.items()]
        t0 = time.perf_counter()
        chars = 0
        for _ in range(20):
            for lang, text in texts:
                splitters[lang](text)
                chars += len(text)
        secs = time.perf_counter() - t0
        print(f"{name}: {right}/{total} paragraphs right; import+setup {setup * 1000:.0f} ms; "
              f"{chars / secs / 1e6:.2f} M chars/s ({secs * 1e6 / (20 * len(texts)):.0f} us per paragraph of "
              f"{sum(len(t) for _, t in texts) // len(texts)} chars)")
        for lang, paragraphs in real.items():
            gold = [s for p in paragraphs for s in p]
            got = [s for p in paragraphs for s in splitters[lang](" ".join(p))]
            print(f"    multi30k {lang}: {len(got)} sentences found for {len(gold)}, "
                  f"{len(set(got) & set(gold))} exactly right ({len(paragraphs)} paragraphs of 20)")
        for w in wrong:
            print("   ", w)


if __name__ == "__main__":
    main()
