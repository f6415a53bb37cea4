"""A made-up language pair the project generates itself, so `pipeline train` with no data
does something real on a machine with no network.

The source language ("S") is SVO with postnominal adjectives and no agreement:

    da kito-s lumi paka tempa u ravo [ipo da sonu]      (the big cats see a dog [near the house])

The target language ("T") is SOV with prenominal adjectives in mirrored order, articles
marked for definiteness, gender, number and case (nominative subject, accusative
object, dative after a postposition), adjectives agreeing with the noun's gender and
number, nouns with gender-specific plurals, and the verb agreeing with the subject's
number and carrying tense; negation follows the verb:

    rezo zalimi kitare mon ravu [ri sonu zeno] pakadin nu

Every noun's gender lives only in the target lexicon, so a model has to look the source
noun up (attention) to choose the article and adjective endings, and has to move the
verb and the prepositional phrase to the end (reordering). The lexicon is fixed (built
from a constant seed); `seed` only changes which sentences are drawn.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path

from pipeline.textio import atomic_output

log = logging.getLogger(__name__)

_LEXICON_SEED = 20170612  # the paper's arXiv date: the language never changes
GENDERS = ("m", "f", "n")
CASES = ("nom", "acc", "dat")


@dataclass(frozen=True)
class Lexicon:
    """Source word -> target word(s), plus each target noun's gender."""

    nouns: list[tuple[str, str, str]]  # (source root, target root, gender)
    adjectives: list[tuple[str, str]]
    verbs: list[tuple[str, str]]
    prepositions: list[tuple[str, str]]  # source preposition -> target postposition
    articles: dict[tuple[bool, str, str], str]  # (definite, gender or "pl", case) -> article


def _words(rng: random.Random, n: int, onsets: str, vowels: str, syllables: tuple[int, int],
           taken: set[str]) -> list[str]:
    """n new pronounceable words that end in a vowel, unique across the whole lexicon."""
    out = []
    while len(out) < n:
        k = rng.randint(*syllables)
        word = "".join(rng.choice(onsets) + rng.choice(vowels) for _ in range(k))
        if word not in taken:
            taken.add(word)
            out.append(word)
    return out


def build_lexicon(n_nouns: int = 60, n_adjectives: int = 30, n_verbs: int = 30,
                  n_prepositions: int = 8) -> Lexicon:
    """The fixed lexicon (same on every machine and every run)."""
    rng = random.Random(_LEXICON_SEED)
    taken = {"da", "u", "sum", "ka", "ne", "nu"}
    src_on, src_v = "kptlsmnbv", "aio"
    tgt_on, tgt_v = "zrdgfhwyj", "aeu"
    nouns = list(zip(_words(rng, n_nouns, src_on, src_v, (2, 2), taken),
                     _words(rng, n_nouns, tgt_on, tgt_v, (2, 2), taken),
                     (GENDERS[i % 3] for i in range(n_nouns))))
    adjectives = list(zip(_words(rng, n_adjectives, src_on, src_v, (2, 3), taken),
                          _words(rng, n_adjectives, tgt_on, tgt_v, (2, 3), taken)))
    verbs = list(zip(_words(rng, n_verbs, src_on, src_v, (2, 3), taken),
                     _words(rng, n_verbs, tgt_on, tgt_v, (2, 3), taken)))
    preps = list(zip(_words(rng, n_prepositions, src_on, src_v, (1, 2), taken),
                     _words(rng, n_prepositions, tgt_on, tgt_v, (2, 2), taken)))
    # Articles: one distinct made-up form per (definiteness, gender/plural, case).
    forms = _words(rng, 2 * 4 * 3, "rmsl", "aeiou", (1, 2), taken)
    articles = {}
    i = 0
    for definite in (True, False):
        for g in (*GENDERS, "pl"):
            for case in CASES:
                articles[(definite, g, case)] = forms[i] + ("" if definite else "n")
                i += 1
    return Lexicon(nouns, adjectives, verbs, preps, articles)


_ADJ_ENDING = {"m": "o", "f": "a", "n": "e", "pl": "i"}
_PLURAL_ENDING = {"m": "re", "f": "ne", "n": "ru"}


def _noun_phrase(rng: random.Random, lex: Lexicon, case: str) -> tuple[str, str]:
    """(source NP, target NP): det noun adj* -> article adj*(mirrored, agreeing) noun."""
    src_root, tgt_root, gender = rng.choice(lex.nouns)
    plural = rng.random() < 0.4
    definite = rng.random() < 0.6
    adjs = rng.sample(lex.adjectives, rng.choice((0, 0, 1, 1, 2)))
    src_det = "da" if definite else ("sum" if plural else "u")
    src = [src_det, src_root + ("s" if plural else "")] + [a for a, _ in adjs]
    agree = "pl" if plural else gender
    tgt = [lex.articles[(definite, agree, case)]]
    tgt += [t + _ADJ_ENDING[agree] for _, t in reversed(adjs)]
    tgt.append(tgt_root + (_PLURAL_ENDING[gender] if plural else ""))
    return " ".join(src), " ".join(tgt)


def sentence_pair(rng: random.Random, lex: Lexicon) -> tuple[str, str]:
    """One (source, target) pair: S V O [PP] -> S O [PP] V."""
    subj_src, subj_tgt = _noun_phrase(rng, lex, "nom")
    subj_plural = subj_src.split()[1].endswith("s")
    obj_src, obj_tgt = _noun_phrase(rng, lex, "acc")
    verb_src, verb_tgt = rng.choice(lex.verbs)
    past, negated = rng.random() < 0.3, rng.random() < 0.2
    src = [subj_src] + (["ne"] if negated else []) + (["ka"] if past else []) + [verb_src, obj_src]
    tgt = [subj_tgt, obj_tgt]
    if rng.random() < 0.5:
        prep_src, post_tgt = rng.choice(lex.prepositions)
        pp_src, pp_tgt = _noun_phrase(rng, lex, "dat")
        src += [prep_src, pp_src]
        tgt += [pp_tgt, post_tgt]
    tgt.append(verb_tgt + ("di" if past else "") + ("n" if subj_plural else "t"))
    if negated:
        tgt.append("nu")
    return " ".join(src), " ".join(tgt)


def generate(n: int, seed: int, lex: Lexicon | None = None) -> tuple[list[str], list[str]]:
    """n pairs drawn with `seed` (the same seed always gives the same pairs)."""
    lex = lex or build_lexicon()
    rng = random.Random(seed)
    pairs = [sentence_pair(rng, lex) for _ in range(n)]
    return [s for s, _ in pairs], [t for _, t in pairs]


SPLITS = ("train", "valid", "test")


def write_corpus(out_dir: Path, n_train: int = 30000, n_valid: int = 500, n_test: int = 500,
                 seed: int = 1) -> dict[str, tuple[Path, Path]]:
    """Write train/valid/test .src/.tgt files into out_dir (atomically, reused when the
    same sizes and seed were written before). Returns {split: (src path, tgt path)}.

    Splits are drawn from disjoint seeds, so valid/test sentences are mostly unseen and
    BLEU measures generalisation, not recall.
    """
    out_dir = Path(out_dir)
    sizes = {"train": n_train, "valid": n_valid, "test": n_test}
    stamp = out_dir / "CORPUS"
    wanted = f"synthetic v1 seed={seed} " + " ".join(f"{k}={v}" for k, v in sizes.items())
    paths = {split: (out_dir / f"{split}.src", out_dir / f"{split}.tgt") for split in SPLITS}
    if stamp.is_file() and stamp.read_text().strip() == wanted and all(
            p.is_file() for pair in paths.values() for p in pair):
        return paths
    lex = build_lexicon()
    for i, split in enumerate(SPLITS):
        src, tgt = generate(sizes[split], seed * 1000 + i, lex)
        for path, lines in zip(paths[split], (src, tgt)):
            with atomic_output(path) as f:
                f.write("".join(line + "\n" for line in lines))
    with atomic_output(stamp) as f:
        f.write(wanted + "\n")
    log.info("wrote the built-in synthetic corpus to %s (%s)", out_dir, wanted)
    return paths
