#!/usr/bin/env python
"""A terminology test set for glossaries (constrained beam search) from Multi30k De->En, in numpy.

    python scripts/terminology_set.py --data /work/shared/corpora/multi30k --out runs/terms

The glossary is learned from the training pairs: words are Unicode `\\w+` runs, lowercased for counting;
c(w) is the number of pairs whose German side holds w, c(e) likewise for English, c(w, e) the pairs
holding both; Dice = 2 c(w, e) / (c(w) + c(e)). An entry is a mutual best pair (e is w's best partner
and w is e's, over all words) with c(w) >= --min-count, both words >= --min-letters long, Dice >=
--min-dice, and w != e. Mutual best pairs of identical words (names, brands) become do-not-translate
candidates instead (dnt.tsv: c(w) >= --dnt-min-count and the same most frequent surface form on both
sides, so "Skateboard"/"skateboard" is not one).

OUT gets:
  extracted.tsv          every entry learned (source in its most frequent German surface form, target
                         in its most frequent English one), best Dice first
  glossary.tsv           the entries used in test.de
  test.de, test.en       test_2016_flickr lines where some entry's source occurs in the source (whole
                         word, case-insensitive) and its target in the reference (whole word,
                         case-insensitive), and no occurring entry's target is missing from the
                         reference (--selection all, the default: every term agrees with the reference;
                         --selection any keeps lines with a disagreeing term too)
  all.de, all.en         the whole of test_2016_flickr (lines without terms must not change)
  forced.tsv             FORCED: unusual targets the model would not choose; forced.de/.en the lines
                         holding any of their sources
  speed.tsv, speed.de    test_2016_flickr's 1,000 lines and a subset of extracted.tsv (best Dice first,
                         skipping entries that would take the share above --speed-share) under which
                         about --speed-share of them hold a term
  dnt.tsv                do-not-translate candidates (source, empty target)
  stats.json             entries, lines selected, terms per line, the speed file's share

Matching follows runtime/glossary.py: whole words (no letter, digit, underscore or combining mark on
either side), NFC and casefold unless case-sensitive, a space in a term matching any whitespace run.
Output is deterministic (ties broken by the words' order).
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import re
import sys
import unicodedata
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from term_pairs import (  # noqa: E402, F401  (scripts/ is not a package; Pair and words re-exported)
    Pair,
    mutual_best_pairs,
    select_dnt,
    select_entries,
    words,
)

# hand-picked unusual targets for frequent Multi30k words (checked against test_2016_flickr in stats.json)
FORCED = (("Hund", "hound"), ("Mann", "gentleman"), ("Frau", "lady"), ("Junge", "lad"), ("Mädchen", "lass"),
          ("Straße", "roadway"), ("Wasser", "waters"), ("Kind", "youngster"), ("Hemd", "tunic"),
          ("Männer", "gentlemen"), ("Frauen", "ladies"))


# -- text -----------------------------------------------------------------------------------------


def read_lines(path: Path) -> list[str]:
    """A text file (plain or .gz) as lines without their newline."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8", newline="\n") as f:
        return [line.rstrip("\n").rstrip("\r") for line in f]


def find_corpus_file(data: Path, stem: str) -> Path:
    for name in (f"{stem}.gz", stem):
        if (data / name).is_file():
            return data / name
    raise SystemExit(f"{data}: neither {stem}.gz nor {stem} found")


def write_lines(path: Path, lines: list[str]) -> None:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


@functools.lru_cache(maxsize=1 << 16)
def _fold(text: str, case_sensitive: bool) -> str:
    text = unicodedata.normalize("NFC", text)
    return text if case_sensitive else unicodedata.normalize("NFC", text.casefold())


_EDGE = r"[\w\u0300-\u036f\u1ab0-\u1aff\u1dc0-\u1dff\u20d0-\u20ff\ufe20-\ufe2f]"


@functools.cache
def term_pattern(term: str, case_sensitive: bool) -> re.Pattern[str]:
    """A term as a whole-word pattern over text folded as _fold does (a space matches any whitespace run)."""
    body = r"\s+".join(re.escape(part) for part in _fold(term, case_sensitive).split())
    return re.compile(rf"(?<!{_EDGE}){body}(?!{_EDGE})")


def has_term(text: str, term: str, case_sensitive: bool = False) -> bool:
    """Whether `term` occurs in `text` as a whole word (or words)."""
    return term_pattern(term, case_sensitive).search(_fold(text, case_sensitive)) is not None


def occurring(entries: list[tuple[str, str]], source: str) -> list[tuple[str, str]]:
    """The entries whose source term occurs in `source` (whole word, case-insensitive)."""
    return [(s, t) for s, t in entries if has_term(source, s)]


def agreeing_lines(entries: list[tuple[str, str]], sources: list[str], refs: list[str],
                   selection: str = "all") -> tuple[list[int], list[list[tuple[str, str]]], int]:
    """Indices of the lines whose source holds an entry's source term and whose reference holds its target
    (both whole word, case-insensitive), their agreeing entries, and how many lines hold a term whose target
    the reference lacks. selection "all": a line holding such a term is left out; "any": kept if another
    term agrees."""
    chosen, terms, disagreeing = [], [], 0
    for i, (src, ref) in enumerate(zip(sources, refs)):
        found = occurring(entries, src)
        agree = [(s, t) for s, t in found if has_term(ref, t)]
        disagreeing += len(agree) < len(found)
        if agree and (selection == "any" or len(agree) == len(found)):
            chosen.append(i)
            terms.append(agree)
    return chosen, terms, disagreeing


def lines_with_terms(entries: list[tuple[str, str]], sources: list[str]) -> list[int]:
    return [i for i, src in enumerate(sources) if occurring(entries, src)]


def subset_for_share(entries: list[tuple[str, str]], sources: list[str], share: float) -> list[tuple[str, str]]:
    """Entries, in their order, each kept unless it takes the share of lines holding a term above `share`."""
    limit = int(round(share * len(sources)))
    covered: set[int] = set()
    kept = []
    for entry in entries:
        hits = {i for i, src in enumerate(sources) if has_term(src, entry[0])}
        if hits and len(covered | hits) <= limit:
            kept.append(entry)
            covered |= hits
    return kept


# -- term use -------------------------------------------------------------------------------------


def term_use(entries: list[tuple[str, str]], sources: list[str], outputs: list[str],
             case_sensitive: bool = True) -> tuple[int, int]:
    """WMT 2021 terminology style: over every (line, entry) whose source term occurs in the source (whole word,
    case-insensitive), how many outputs hold the target term as a whole word (case-sensitive as the glossary
    writes it, or not). An entry with an empty target (do not translate) wants the source as found.
    Returns (used, occurrences)."""
    if len(sources) != len(outputs):
        raise ValueError(f"{len(sources)} source lines but {len(outputs)} output lines")
    patterns = [(term_pattern(s, False), s, t) for s, t in entries]
    used = total = 0
    for src, out in zip(sources, outputs):
        folded_src = _fold(src, False)
        for pattern, source, target in patterns:
            if pattern.search(folded_src) is None:
                continue
            total += 1
            if not target:
                target = source_as_found(src, source)
            used += has_term(out, target, case_sensitive)
    return used, total


def source_as_found(text: str, term: str) -> str:
    """For do-not-translate: the text matching `term` (whole word, case-insensitive) as written, else the term."""
    body = r"\s+".join(re.escape(part) for part in unicodedata.normalize("NFC", term).split())
    m = re.search(rf"(?<!{_EDGE}){body}(?!{_EDGE})", unicodedata.normalize("NFC", text), re.IGNORECASE)
    return " ".join(m.group(0).split()) if m else term


def read_glossary(path: Path) -> list[tuple[str, str]]:
    """A glossary TSV as (source, target) pairs (blank and # lines skipped; a missing target is "")."""
    out = []
    for line in path.read_text(encoding="utf-8-sig").split("\n"):
        if not line.strip() or line.startswith("#"):
            continue
        source, _, target = line.partition("\t")
        out.append((" ".join(source.split()), " ".join(target.split())))
    return out


def write_glossary(path: Path, entries: list[tuple[str, str]]) -> None:
    write_lines(path, [f"{s}\t{t}" for s, t in entries])


# -- the set --------------------------------------------------------------------------------------


def build(data: Path, out: Path, *, min_count: int = 20, min_letters: int = 4, min_dice: float = 0.5,
          max_phrase_share: float = 0.7, common_words: int = 20, dnt_min_count: int = 5,
          speed_share: float = 0.3, selection: str = "all", forced: tuple[tuple[str, str], ...] = FORCED,
          test: str = "test_2016_flickr") -> dict:
    """Learn the glossary from DATA's train pair, build the sets from its TEST pair into OUT; the stats."""
    train_de = read_lines(find_corpus_file(data, "train.de"))
    train_en = read_lines(find_corpus_file(data, "train.en"))
    test_de = read_lines(find_corpus_file(data, f"{test}.de"))
    test_en = read_lines(find_corpus_file(data, f"{test}.en"))
    if len(test_de) != len(test_en):
        raise SystemExit(f"{test}: {len(test_de)} German lines but {len(test_en)} English lines")
    pairs = mutual_best_pairs(train_de, train_en, common_words)
    chosen = select_entries(pairs, min_count, min_letters, min_dice, max_phrase_share)
    extracted = [(p.de_surface, p.en_surface) for p in chosen]
    dnt = select_dnt(pairs, dnt_min_count, min_letters)

    rows, terms, disagreeing = agreeing_lines(extracted, test_de, test_en, selection)
    used = {e for line in terms for e in line}
    glossary = [e for e in extracted if e in used]
    speed = subset_for_share(extracted, test_de, speed_share)
    speed_rows = lines_with_terms(speed, test_de)
    forced_rows = lines_with_terms(list(forced), test_de)

    out.mkdir(parents=True, exist_ok=True)
    write_glossary(out / "extracted.tsv", extracted)
    write_lines(out / "pairs.tsv", ["de\ten\tc_de\tc_en\tc_both\tdice\tphrase_share\tphrase\tkept"] + [
        f"{p.de_surface}\t{p.en_surface}\t{p.count_de}\t{p.count_en}\t{p.count_both}\t{p.dice:.3f}\t"
        f"{p.phrase_share:.2f}\t{p.phrase_with}\t{int(p in chosen)}"
        for p in sorted(pairs, key=lambda p: (-p.dice, p.de)) if p.count_de >= min_count]),
    write_glossary(out / "glossary.tsv", glossary)
    write_lines(out / "test.de", [test_de[i] for i in rows])
    write_lines(out / "test.en", [test_en[i] for i in rows])
    write_lines(out / "all.de", test_de)
    write_lines(out / "all.en", test_en)
    write_glossary(out / "forced.tsv", list(forced))
    write_lines(out / "forced.de", [test_de[i] for i in forced_rows])
    write_lines(out / "forced.en", [test_en[i] for i in forced_rows])
    write_glossary(out / "speed.tsv", speed)
    write_lines(out / "speed.de", test_de)
    write_glossary(out / "dnt.tsv", [(p.de_surface, "") for p in dnt])

    per_line = Counter(len(t) for t in terms)
    forced_counts = {s: sum(has_term(line, s) for line in test_de) for s, _ in forced}
    stats = {
        "data": str(data), "test": test,
        "thresholds": {"min_count": min_count, "min_letters": min_letters, "min_dice": min_dice,
                       "max_phrase_share": max_phrase_share, "common_words": common_words,
                       "dnt_min_count": dnt_min_count, "speed_share": speed_share, "selection": selection},
        "mutual_best_pairs": len(pairs),
        "extracted_entries": len(extracted),
        "glossary_entries": len(glossary),
        "test_lines": len(test_de),
        "lines_with_any_term": len(lines_with_terms(extracted, test_de)),
        "lines_with_a_disagreeing_term": disagreeing,
        "selected_lines": len(rows),
        "terms_in_selected_lines": sum(len(t) for t in terms),
        "terms_per_selected_line": {str(k): per_line[k] for k in sorted(per_line)},
        "mean_terms_per_selected_line": round(sum(len(t) for t in terms) / max(1, len(rows)), 3),
        "forced_entries": len(forced),
        "forced_lines": len(forced_rows),
        "forced_source_lines": forced_counts,
        # how often a reference already holds the forced target (whole word, case-insensitive): near 0
        "forced_targets_in_references": "{}/{}".format(*term_use(list(forced), test_de, test_en, False)),
        "speed_lines": len(test_de),
        "speed_entries": len(speed),
        "speed_lines_with_term": len(speed_rows),
        "speed_share_with_term": round(len(speed_rows) / max(1, len(test_de)), 4),
        "natural_share_with_term": round(len(lines_with_terms(extracted, test_de)) / max(1, len(test_de)), 4),
        "dnt_entries": len(dnt),
    }
    (out / "stats.json").write_text(json.dumps(stats, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True, help="Multi30k dir: train.de/.en, TEST.de/.en (.gz or not)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--test", default="test_2016_flickr", help="the test set's file stem [%(default)s]")
    ap.add_argument("--min-count", type=int, default=20, help="c(w) at least [%(default)s]")
    ap.add_argument("--min-letters", type=int, default=4, help="letters of each word at least [%(default)s]")
    ap.add_argument("--min-dice", type=float, default=0.5, help="Dice at least [%(default)s]")
    ap.add_argument("--max-phrase-share", type=float, default=0.7,
                    help="drop an entry whose target has one same neighbour in at least this share of the pairs "
                         "holding both words (half of a two-word phrase) [%(default)s]")
    ap.add_argument("--common-words", type=int, default=20,
                    help="neighbours among this many most frequent English words do not count [%(default)s]")
    ap.add_argument("--dnt-min-count", type=int, default=5, help="do-not-translate: c(w) at least [%(default)s]")
    ap.add_argument("--speed-share", type=float, default=0.3, help="speed.de lines holding a term [%(default)s]")
    ap.add_argument("--selection", choices=("all", "any"), default="all",
                    help="test.de: lines whose every term agrees with the reference, or any one [%(default)s]")
    args = ap.parse_args()
    stats = build(args.data, args.out, min_count=args.min_count, min_letters=args.min_letters,
                  min_dice=args.min_dice, max_phrase_share=args.max_phrase_share,
                  common_words=args.common_words, dnt_min_count=args.dnt_min_count, speed_share=args.speed_share,
                  selection=args.selection, test=args.test)
    print(json.dumps(stats, indent=2, ensure_ascii=False))


if __name__ == "__main__":
    main()
