"""The one text service: texts in, results out, around the search. serve-batch, the native HTTP API,
LibreTranslate's API and the Ray / Spark Translator each hand it their texts and get back, per text, what
they write or answer; none of them rebuilds those facts on its own.

    encoded = encode_texts(tokenizer, texts, max_src_len, TextPolicy(split="sentences"), origin="in.txt")
    nbest = loaded.translate(encoded.ids)                    # per unit, runtime/model_dir.py
    results = finish_texts(tokenizer, encoded, nbest, n=1)   # per text: .text, .score, .truncated, ...

A unit is what the model translates: a text (format "text", split "none"), one of its sentences (split
"sentences": the text is a document, rebuilt around its sentences' translations with the whitespace it had,
runtime/sentences.py), or one sentence of an HTML text node (format "html": each text node a document, the
markup copied byte for byte, runtime/markup.py). encode_texts keeps per unit what the model saw and the exact
string that became it (`units`: glossaries match on these), and per text its units, whether it was empty, how
many of its units were cut to the model's source limit, its sentences and its markup; finish_texts turns the
units' hypotheses back into one TextResult per text."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from runtime.decoding import DecodingOptions
from runtime.errors import RuntimeUserError
from runtime.glossary import NO_TERMS, Glossary, Terms, applied_terms, find_terms, terms_for
from runtime.markup import Markup, parse_html
from runtime.sentences import DEFAULT_LANG, Split, TooManySentences, fitted, has_letters, split_sentences
from runtime.tokenizer import AnyTokenizer
from runtime.translate import NBest, encode_sources, format_hypotheses

FORMATS = ("text", "html")


@dataclass(frozen=True)
class TextPolicy:
    """How texts become units: `long_lines` "truncate" / "error" (runtime.translate.encode_sources), `split`
    "none" / "sentences", `format` "text" / "html" (each text node split into sentences, whatever `split`
    says), `lang` the sentence rules' language, `prefix` the tokens that start every source (a multilingual
    model's source language: runtime/languages.py Direction.prefix)."""

    long_lines: str = "truncate"
    split: str = "none"
    format: str = "text"
    lang: str = DEFAULT_LANG
    prefix: tuple[int, ...] = ()
    same_language: bool = False  # the source is the target (Direction.same): every text answered as it came
    soft_breaks: bool = False  # texts taken out of markup (a file's): a line break is a space (as in an HTML node)

    @property
    def documents(self) -> bool:
        """Whether a text is a document of units (sentences, text nodes) rather than one unit."""
        return self.split == "sentences" or self.format == "html"


class Origin(Protocol):
    """How the refusal of a long unit (long_lines "error") names it: a plain text k as `origin:line` (the
    pair encode_sources names a line by), a sentence j of text k's document as `document(k) sentence:j+1`,
    of its HTML text node m (1, 2, ... in text k) as `node(k, m) sentence:j+1`."""

    def line(self, k: int) -> tuple[str, int | None]: ...

    def document(self, k: int) -> str: ...

    def node(self, k: int, m: int) -> str: ...


@dataclass(frozen=True)
class Lines:
    """Texts as numbered lines (serve-batch's file:line, Ray's row:N): text k is `name:first_line + k`, its HTML
    text node m `name:line text node m`."""

    name: str = "input"
    first_line: int = 1

    def line(self, k: int) -> tuple[str, int]:
        return self.name, self.first_line + k

    def document(self, k: int) -> str:
        return f"{self.name}:{self.first_line + k}"

    def node(self, k: int, m: int) -> str:
        return f"{self.document(k)} text node {m}"


@dataclass(frozen=True)
class Located:
    """Texts from files named per text (Ray's origin columns): text k is `paths[k]:lines[k]`."""

    paths: Sequence[object]
    lines: Sequence[object]

    def line(self, k: int) -> tuple[str, int]:
        return str(self.paths[k]), int(self.lines[k])  # type: ignore[call-overload]

    def document(self, k: int) -> str:
        path, line = self.line(k)
        return f"{path}:{line}"

    def node(self, k: int, m: int) -> str:
        return f"{self.document(k)} text node {m}"


@dataclass(frozen=True)
class Listed:
    """Texts of an HTTP request: text k is `names[k]` (q[3], a file's text 4) or `text[k]`; a node `... text node m`."""

    names: Sequence[str] = ()

    def line(self, k: int) -> tuple[str, int | None]:
        return self.document(k), None

    def document(self, k: int) -> str:  # the request's own name, else its place in the native API's list
        return self.names[k] if self.names else f"text[{k}]"

    def node(self, k: int, m: int) -> str:
        return f"{self.document(k)} text node {m}"


Hypotheses = list[tuple[str, float]]  # a unit's hypotheses as (text, score), best first


@dataclass
class EncodedTexts:
    """What encoding learned. Per unit (in text order): `ids` the source the model sees ([] for a blank text),
    `units` the exact string that was encoded, `owners` its text. Per text: `spans` its units, `empty` nothing
    to translate (blank, no sentence, no text node with letters), `truncated` its units cut to the source
    limit, `documents` its sentences (one Split with split "sentences", one per text node with html, none for
    a plain text), `markups` its markup (html)."""

    policy: TextPolicy
    ids: list[list[int]] = field(default_factory=list)
    units: list[str] = field(default_factory=list)
    owners: list[int] = field(default_factory=list)
    spans: list[range] = field(default_factory=list)
    empty: list[bool] = field(default_factory=list)
    truncated: list[int] = field(default_factory=list)
    documents: list[list[Split]] = field(default_factory=list)
    markups: list[Markup | None] = field(default_factory=list)
    terms: list[Terms] | None = None  # with a glossary: per unit, its terms found and their target tokens
    # per unit: copied, not translated (ids []): a document's sentence without letters (numbers, dates, emoji), or
    # with same_language every unit (LibreTranslate's rule, on every surface: a model invents a "translation")
    copied: list[bool] = field(default_factory=list)
    pieced: int = 0  # texts with a sentence over the source limit, cut into sentences that fit (fitted)

    @property
    def constraints(self) -> list[list[list[int]]] | None:
        """Per unit, the target token phrases its translation must hold (the search's `constraints`); None
        without a glossary or when no unit holds a term, so the search runs exactly as without one."""
        if self.terms is None or not any(t.constraints for t in self.terms):
            return None
        return [t.constraints for t in self.terms]

    @property
    def texts_cut(self) -> int:
        """Texts with a unit cut to the source limit (a text of three cut sentences counts once)."""
        return sum(1 for cut in self.truncated if cut)

    @property
    def tokens(self) -> int:
        """Source tokens of every unit (EOS and prefix included)."""
        return sum(len(s) for s in self.ids)

    def hypotheses(self, tokenizer: AnyTokenizer, u: int, nbest: NBest) -> Hypotheses:
        """Unit u's hypotheses (best first): the search's; a copied unit's is itself, scored 0 ([] for a blank)."""
        return hypotheses(tokenizer, nbest) or ([(self.units[u], 0.0)] if self.copied[u] else [])

    @staticmethod
    def best(hyps: Hypotheses) -> str:
        return hyps[0][0] if hyps else ""

    def min_len_over(self, decoding: DecodingOptions, max_tgt_len: int) -> int:
        """Texts with a unit whose maximum output length (runtime.search's cap) is below --min-len: it cannot hold."""
        if decoding.min_len == 0:
            return 0
        return len({self.owners[u] for u, line in enumerate(self.ids) if line and min(
            math.floor(decoding.max_len_a * len(line) + decoding.max_len_b), max_tgt_len - 1) < decoding.min_len})

    def stopped_at_limit(self, results: list[NBest], decoding: DecodingOptions, max_tgt_len: int) -> int:
        """Texts with a unit whose best translation ran to the model's target positions (export --max-tgt-len)
        where --max-len-a/-b allowed more: cut there (runtime.search's cap), not ended by the model."""
        cap = max_tgt_len - 1
        return len({self.owners[u] for u, (line, nbest) in enumerate(zip(self.ids, results)) if line and nbest
                    and len(nbest[0][0]) >= cap and decoding.max_len_a * len(line) + decoding.max_len_b >= cap + 1})

    def split(self, k: int) -> Split | None:
        """Text k's sentences with split "sentences" (format text); None otherwise."""
        docs = self.documents[k]
        return docs[0] if docs and self.markups[k] is None else None


class TooManyUnits(RuntimeUserError):
    """More units than encode_texts' `max_units`, before any is tokenized: for the caller to phrase (a 413)."""

    def __init__(self, count: int, limit: int, counted: bool = True):  # counted: False when splitting stopped
        super().__init__(f"{count if counted else 'more'} units, more than the limit of {limit}")
        self.count, self.limit, self.counted = count, limit, counted


def encode_texts(tokenizer: AnyTokenizer, texts: list[str], max_src_len: int, policy: TextPolicy,
                 origin: str | Origin = "input", max_units: int | None = None,
                 glossary: Glossary | None = None) -> EncodedTexts:
    """The texts as units of source ids under `policy`, with what each text is made of. A document's sentence
    over max_src_len tokens is cut into sentences that fit (long_lines "truncate"; counted in `pieced`); any other
    unit over it is cut (counted on its text) or refused as `origin` names it (a SourceTooLong; a str origin names
    a file's lines). More than `max_units` units (the HTTP APIs' limit on sentences) is a TooManyUnits, before any
    is tokenized. With a `glossary`, each unit's terms are found in its text and their targets tokenized."""
    named = Lines(origin) if isinstance(origin, str) else origin
    out = EncodedTexts(policy)
    where: list[tuple[str, int | None]] = []  # per unit of a document: how a refusal names it
    glossary = glossary if glossary is not None and len(glossary) and not policy.same_language else None
    whole = None if glossary is None else glossary.spans  # no sentence boundary inside a term
    fit = _fitting(tokenizer, max_src_len, policy)
    limit = None if policy.same_language else max_units  # (none translated)
    def split(node: str, soft: bool, taken: int = 0) -> Split:  # its sentences, stopped past the request's limit
        try:  # taken: by this text's nodes before; with a glossary 64x, as its terms join sentences after a split
            left = None if limit is None else (limit - len(out.units) - taken) * (1 if whole is None else 64)
            return split_sentences(node, policy.lang, whole, soft, left)
        except TooManySentences:
            raise TooManyUnits(len(out.units), limit or 0, counted=False) from None

    for k, text in enumerate(texts):
        start = len(out.units)
        markup = parse_html(text) if policy.format == "html" and not policy.same_language else None  # (as it came)
        if markup is not None:
            docs, taken = [], 0
            for node, kept in zip(markup.sources, markup.kept_breaks):
                docs.append(split(node, not kept, taken))
                taken += len(docs[-1].sentences)
            names = [named.node(k, m) for m in range(1, len(docs) + 1)]
            empty = not docs
        elif policy.split == "sentences":
            docs, names = [split(text, policy.soft_breaks)], [named.document(k)]
            empty = not docs[0].sentences
        else:
            docs, names = [], []
            out.units.append(text)
            empty = not text.strip()
        fits = [fitted(doc, fit, whole) for doc in docs] if fit is not None else docs
        out.pieced, docs = out.pieced + any(f is not d for f, d in zip(fits, docs)), fits
        for doc, name in zip(docs, names):
            out.units += doc.sentences
            where += [(f"{name} sentence", j + 1) for j in range(len(doc.sentences))]
        out.owners += [k] * (len(out.units) - start)
        out.spans.append(range(start, len(out.units)))
        out.empty.append(empty)
        out.documents.append(docs)
        out.markups.append(markup)
    if limit is not None and len(out.units) > limit:
        raise TooManyUnits(len(out.units), limit)
    # every unit whole in one call (blank ones []), then the limit applied unit by unit by encode_sources
    # itself: each text learns how many of its units were cut, and a refusal reads as it always has
    # a sentence without letters is copied as it is: a model invents words for "123" or a date; unless the glossary
    # gives one of its terms a target ("2024" -> "FY24"), which only a translation can hold
    out.copied = [policy.same_language or policy.documents and not has_letters(unit) and not has_fixed_term(
        glossary, unit) for unit in out.units]
    out.ids = encode_sources(tokenizer, ["" if copy else unit for unit, copy in zip(out.units, out.copied)],
                             sys.maxsize, long_lines=policy.long_lines, prefix=policy.prefix).ids
    if not policy.documents:  # a line the tokenizer keeps nothing of is as blank as whitespace
        out.empty = [empty or not (out.ids[span.start] or out.copied[span.start])
                     for empty, span in zip(out.empty, out.spans)]
    out.truncated = [0] * len(texts)
    seen = list(out.units)  # per unit, the text the model sees: a cut unit's glossary terms are found in it alone
    for u, seq in enumerate(out.ids):
        if len(seq) > max_src_len:
            if glossary is not None:
                seen[u] = _kept_text(tokenizer, out.units[u], max_src_len - len(policy.prefix))
            name, line = where[u] if policy.documents else named.line(out.owners[u])
            limited = encode_sources(tokenizer, [out.units[u]], max_src_len, long_lines=policy.long_lines,
                                    origin=name, first_line=line, prefix=policy.prefix)
            out.ids[u] = limited.ids[0]
            out.truncated[out.owners[u]] += limited.truncated
    if glossary is not None:
        out.terms = [terms_for(glossary, unit, tokenizer.encode, tokenizer.unk_id, decode_target=tokenizer.decode)
                     if ids else NO_TERMS
                     for unit, ids in zip(seen, out.ids)]
    return out


def _fitting(tokenizer: AnyTokenizer, max_src_len: int, policy: TextPolicy) -> Callable[[str], int] | None:
    """Where a document's sentence stops fitting the model (its length when it fits: runtime/sentences.py
    fitted cuts it there), under long_lines "truncate"; None where a long sentence is refused instead, or
    nothing is translated. An ASCII sentence of at most the pieces in characters fits untokenized (NFKC leaves
    ASCII as it is, a piece at least a character; U+FDFA alone is 18 characters once normalised)."""
    pieces = max_src_len - 1 - len(policy.prefix)  # EOS, and a multilingual source's language token
    if not policy.documents or policy.long_lines != "truncate" or policy.same_language or pieces < 1:
        return None
    return lambda sentence: len(sentence) if len(sentence) <= pieces and sentence.isascii() else \
        tokenizer.source_cut(sentence, pieces)


def has_fixed_term(glossary: Glossary | None, text: str) -> bool:
    """Whether `text` holds a glossary term with a target of its own (not a do-not-translate one)."""
    return glossary is not None and any(not m.entry.dnt for m in find_terms(glossary, text))


def _kept_text(tokenizer: AnyTokenizer, text: str, limit: int) -> str:
    """The start of `text` that truncation keeps (its pieces and EOS in `limit` tokens), less the word it cuts."""
    low = tokenizer.source_cut(text, limit - 1)
    while 0 < low < len(text) and all(c.isalnum() or c == "_" for c in text[low - 1:low + 1]):  # a word cut is
        low -= 1  # not a term
    return text[:low]


def hypotheses(tokenizer: AnyTokenizer, nbest: NBest) -> Hypotheses:
    """Each hypothesis' text (as format_line writes a 1-best line) and score, best first; [] for a blank unit."""
    if not nbest:
        return []
    return list(zip(tokenizer.decode([tokens for tokens, _ in nbest]), (score for _, score in nbest)))


@dataclass
class TextResult:
    """One text's translation. `text`: the line serve-batch writes (n-best `text ||| score` joined by ' ||| '
    when n > 1 for a plain text; a document rebuilt around its sentences' best translations; HTML around its
    text nodes'). `alternatives`: the other translations, each k-th hypothesis (a document's rebuilt from its
    sentences' k-th), one equal to the text or an earlier one dropped; none for HTML. `hypotheses`: a plain
    text's (text, score), best first. `score`: a plain text's best score; a document's sentences' best scores
    averaged by their length in tokens, an HTML text's nodes' averaged by their length in characters; None
    when nothing was translated. `units`: each unit's best translation (encoded.spans gives their units)."""

    text: str
    alternatives: list[str]
    hypotheses: Hypotheses
    score: float | None
    truncated: int
    empty: bool
    units: list[str]
    terms: list[dict[str, object]] | None = None  # with a glossary: its terms and whether each was applied


def _average(weighted: list[tuple[int, float]]) -> float | None:
    total = sum(w for w, _ in weighted)
    return sum(w * s for w, s in weighted) / total if total else None


def _document_score(nbests: list[NBest]) -> float | None:
    return _average([(len(nb[0][0]) + 1, nb[0][1]) for nb in nbests if nb])


def finish_texts(tokenizer: AnyTokenizer, encoded: EncodedTexts, nbest_per_unit: list[NBest], n: int
                 ) -> list[TextResult]:
    """One TextResult per text, in order, from each unit's hypotheses (n: the n-best asked for)."""
    if len(nbest_per_unit) != len(encoded.ids):
        raise ValueError(f"{len(nbest_per_unit)} hypotheses lists for {len(encoded.ids)} units")
    return [finish_text(tokenizer, encoded, k, nbest_per_unit, n) for k in range(len(encoded.spans))]


def finish_text(tokenizer: AnyTokenizer, encoded: EncodedTexts, k: int, nbest_per_unit: list[NBest], n: int
                ) -> TextResult:
    """Text k's TextResult from its units' hypotheses (`nbest_per_unit` holds at least those of its span: a
    stream finishes each text once its units are translated)."""
    span = encoded.spans[k]
    outs = {u: encoded.hypotheses(tokenizer, u, nbest_per_unit[u]) for u in span}
    best = {u: encoded.best(h) for u, h in outs.items()}
    docs, markup = encoded.documents[k], encoded.markups[k]
    truncated, empty = encoded.truncated[k], encoded.empty[k]
    others: list[str]
    if not encoded.policy.documents or not docs and markup is None:  # (a same-language HTML text: whole)
        u = span.start
        hyps = nbest_per_unit[u]
        text = format_hypotheses(outs[u], n) if n > 1 else best[u]
        others = _distinct(best[u], [h for h, _ in outs[u][1:n]])
        result = TextResult(text, others, outs[u], hyps[0][1] if hyps else None, truncated, empty, [best[u]])
    else:
        pieces, scores, u = [], [], span.start
        for doc in docs:
            stop = u + len(doc.sentences)
            pieces.append(doc.rebuild([best[v] for v in range(u, stop)]))
            scores.append(_document_score(nbest_per_unit[u:stop]))
            u = stop
        if markup is not None:
            text = markup.rebuild(pieces)
            score = _average([(len(src), s) for src, s in zip(markup.sources, scores) if s is not None])
            others = []
        else:
            text, score = pieces[0], scores[0]
            others = _distinct(text, [docs[0].rebuild([(outs[v][j] if j < len(outs[v]) else outs[v][0])[0]
                                                       if outs[v] else best[v] for v in span])
                                      for j in range(1, n)])
        result = TextResult(text, others, [], score, truncated, empty, [best[u] for u in span])
    if encoded.terms is not None:
        result.terms = [row for u in span for row in applied_terms(encoded.terms[u], best[u])]
    return result


def term_counts(results: list[TextResult]) -> tuple[int, int]:
    """The glossary's terms found in these texts, and how many of them their translations hold."""
    terms = [row for result in results for row in result.terms or ()]
    return len(terms), sum(bool(row["applied"]) for row in terms)


def _distinct(text: str, candidates: list[str]) -> list[str]:
    """The candidates unlike `text` and every earlier one (as LibreTranslate lists alternatives)."""
    out: list[str] = []
    for candidate in candidates:
        if candidate != text and candidate not in out:
            out.append(candidate)
    return out
