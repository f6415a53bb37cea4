"""The word pairs of scripts/terminology_set.py: Dice co-occurrence over a parallel corpus, mutual best
partners, half-phrases dropped, and the entries and do-not-translate candidates chosen from them (numpy)."""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from dataclasses import dataclass

import numpy as np

WORD = re.compile(r"\w+")


def words(text: str) -> list[str]:
    """The surface words of a text (Unicode \\w+ runs, NFC)."""
    return WORD.findall(unicodedata.normalize("NFC", text))


@dataclass(frozen=True)
class Pair:
    """One learned entry: lowercased words, their surface forms, counts and Dice."""

    de: str
    en: str
    de_surface: str
    en_surface: str
    count_de: int
    count_en: int
    count_both: int
    dice: float
    phrase_share: float = 0.0  # of the pairs holding both: the share where `en` has `phrase_with` beside it
    phrase_with: str = ""      # the most frequent neighbour of `en` there, among the not-so-common words


# -- learning the glossary ------------------------------------------------------------------------


def _vocab(tokenised: list[list[str]]) -> tuple[list[str], dict[str, int], np.ndarray]:
    """The sorted vocabulary, its index, and document frequencies (pairs holding each word)."""
    vocab = sorted({w for sent in tokenised for w in sent})
    index = {w: i for i, w in enumerate(vocab)}
    df = np.zeros(len(vocab), dtype=np.int64)
    for sent in tokenised:
        for w in set(sent):
            df[index[w]] += 1
    return vocab, index, df


def _surfaces(lines: list[str]) -> dict[str, str]:
    """Each lowercased word's most frequent surface form after a sentence's first word (which is capitalised
    whatever it is), or anywhere for words seen only first; ties: the lowercase form, then the smallest."""
    inner: Counter[str] = Counter()
    first: Counter[str] = Counter()
    for line in lines:
        found = words(line)
        first.update(found[:1])
        inner.update(found[1:])
    best: dict[str, tuple[int, int, bool]] = {}
    surface: dict[str, str] = {}
    for form in sorted(inner.keys() | first.keys()):
        key, score = form.lower(), (inner[form], first[form], form == form.lower())
        if key not in best or score > best[key]:
            best[key], surface[key] = score, form
    return surface


def mutual_best_pairs(src_lines: list[str], tgt_lines: list[str], common_words: int = 20) -> list[Pair]:
    """Every mutual best Dice pair (lowercased words), unfiltered, with counts, surfaces and phrase shares
    (neighbours among the `common_words` most frequent English words not counted)."""
    if len(src_lines) != len(tgt_lines):
        raise ValueError(f"{len(src_lines)} source lines but {len(tgt_lines)} target lines")
    src_tok = [[w.lower() for w in words(s)] for s in src_lines]
    tgt_tok = [[w.lower() for w in words(t)] for t in tgt_lines]
    src_vocab, src_index, src_df = _vocab(src_tok)
    tgt_vocab, tgt_index, tgt_df = _vocab(tgt_tok)
    n_tgt = len(tgt_vocab)
    keys = []
    for s, t in zip(src_tok, tgt_tok):
        si = np.fromiter(sorted({src_index[w] for w in s}), dtype=np.int64)
        ti = np.fromiter(sorted({tgt_index[w] for w in t}), dtype=np.int64)
        if si.size and ti.size:
            keys.append((si[:, None] * n_tgt + ti[None, :]).ravel())
    if not keys:
        return []
    pair_keys, both = np.unique(np.concatenate(keys), return_counts=True)
    si, ti = pair_keys // n_tgt, pair_keys % n_tgt
    dice = 2.0 * both / (src_df[si] + tgt_df[ti])
    # best partner of each source word: highest Dice, ties to the smaller target id (lexsort is stable)
    order = np.lexsort((ti, -dice, si))
    first = np.ones(order.size, dtype=bool)
    first[1:] = si[order][1:] != si[order][:-1]
    best_of_src = dict(zip(si[order][first].tolist(), ti[order][first].tolist()))
    order = np.lexsort((si, -dice, ti))
    first = np.ones(order.size, dtype=bool)
    first[1:] = ti[order][1:] != ti[order][:-1]
    best_of_tgt = dict(zip(ti[order][first].tolist(), si[order][first].tolist()))
    src_surface, tgt_surface = _surfaces(src_lines), _surfaces(tgt_lines)
    lookup = dict(zip(pair_keys.tolist(), range(pair_keys.size)))
    mutual = {src_vocab[s]: tgt_vocab[t] for s, t in best_of_src.items() if best_of_tgt.get(t) == s}
    common = {tgt_vocab[i] for i in np.argsort(-tgt_df, kind="stable")[:common_words].tolist()}
    neighbours = _neighbours(mutual, src_tok, tgt_tok, common)
    pairs = []
    for de, en in sorted(mutual.items()):
        s, t = src_index[de], tgt_index[en]
        k = lookup[s * n_tgt + t]
        counts = neighbours.get(de, Counter())
        (side, word), n = min(counts.items(), key=lambda kv: (-kv[1], kv[0])) if counts else (("", ""), 0)
        pairs.append(Pair(de, en, src_surface[de], tgt_surface[en], int(src_df[s]), int(tgt_df[t]),
                          int(both[k]), float(dice[k]), n / int(both[k]),
                          f"{en} {word}" if side == "R" else f"{word} {en}" if side else ""))
    return pairs


def _neighbours(mutual: dict[str, str], src_tok: list[list[str]], tgt_tok: list[list[str]],
                common: set[str]) -> dict[str, Counter[tuple[str, str]]]:
    """For each source word, over the pairs holding it and its partner: in how many each (side, word) stood
    beside the partner (left "L" or right "R"; common words not counted)."""
    out: dict[str, Counter[tuple[str, str]]] = {}
    for s, t in zip(src_tok, tgt_tok):
        for de in set(s):
            en = mutual.get(de)
            if en is None or en not in t:
                continue
            seen = set()
            for i, word in enumerate(t):
                if word != en:
                    continue
                if i > 0 and t[i - 1] not in common:
                    seen.add(("L", t[i - 1]))
                if i + 1 < len(t) and t[i + 1] not in common:
                    seen.add(("R", t[i + 1]))
            out.setdefault(de, Counter()).update(seen)
    return out


def _letters(word: str) -> int:
    return sum(ch.isalpha() for ch in word)


def select_entries(pairs: list[Pair], min_count: int = 20, min_letters: int = 4, min_dice: float = 0.5,
                   max_phrase_share: float = 0.7) -> list[Pair]:
    """The glossary entries among mutual best pairs: frequent, long enough, Dice high enough, not identical,
    the target not mostly half of a two-word phrase ("Wohnzimmer" -> "living" of "living room");
    best Dice first (ties by the German word)."""
    kept = [p for p in pairs if p.count_de >= min_count and _letters(p.de) >= min_letters
            and _letters(p.en) >= min_letters and p.dice >= min_dice and p.de != p.en
            and p.phrase_share < max_phrase_share]
    return sorted(kept, key=lambda p: (-p.dice, p.de))


def select_dnt(pairs: list[Pair], min_count: int = 5, min_letters: int = 4) -> list[Pair]:
    """Do-not-translate candidates: mutual best pairs of one word written the same on both sides."""
    kept = [p for p in pairs if p.de == p.en and p.de_surface == p.en_surface and p.count_de >= min_count
            and _letters(p.de) >= min_letters]
    return sorted(kept, key=lambda p: (-p.count_de, p.de))


# -- test sets ------------------------------------------------------------------------------------


