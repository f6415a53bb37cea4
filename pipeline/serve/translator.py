"""The one adapter between the HTTP service and serve-batch's translation path.

Every call the server makes into encoding (blank lines, long-line policy, EOS), search
and output formatting goes through here, so the service answers exactly what
`pipeline serve-batch` writes for the same lines and there is no second decoding path.
When serve-batch's path moves, only this module follows it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from model.manifest import Manifest
from runtime.backend import Backend
from runtime.decoding import PAPER, DecodingOptions
from runtime.languages import ONE_PAIR, Direction, LanguageError, direction
from runtime.model_dir import LoadOptions, load
from runtime.sentences import DEFAULT_LANG, Split, encode_split, split_sentences
from runtime.tokenizer import AnyTokenizer
from runtime.translate import NBest, SourceTooLong, encode_sources, format_line, translate_ids

WARMUP_LINE = "warm up"


class LineTooLong(ValueError):
    """A line over the model's source limit while the policy is `error` (an HTTP 413)."""


@dataclass
class Encoded:
    """Source ids per line ([] for blank lines), or per sentence with the texts' splits, and how many
    were truncated."""

    ids: list[list[int]]
    truncated: int = 0
    splits: list[Split] | None = None

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.ids)


class Translator:
    """A loaded backend + tokenizer, seen through serve-batch's functions; `decoding` is the model's
    (its own defaults under what the server was given)."""

    def __init__(self, backend: Backend, tokenizer: AnyTokenizer, manifest: Manifest, long_lines: str = "truncate",
                 decoding: DecodingOptions = PAPER):
        self.backend = backend
        self.tokenizer = tokenizer
        self.manifest = manifest
        self.long_lines = long_lines
        self.decoding = decoding

    @classmethod
    def load(cls, model_dir: str, options: LoadOptions, long_lines: str,
             decoding_given: DecodingOptions = PAPER) -> Translator:
        """The model dir verified against its manifest and loaded (UserErrors when unusable), as every
        command loads one (runtime/model_dir.py)."""
        loaded = load(model_dir, options, decoding_given)
        return cls(loaded.backend, loaded.tokenizer, loaded.manifest, long_lines, loaded.decoding)

    def model_limit(self, key: str) -> int | None:
        """max_src_len / max_tgt_len / max_batch / max_beam as the export recorded it."""
        return getattr(self.manifest.limits, key)

    def summary(self) -> dict[str, Any]:
        """The manifest's facts a client may see (no file paths)."""
        return {"backend": self.backend.name, "device": str(self.backend.device),
                "precision": self.manifest.precision,
                "shortlist": getattr(self.backend, "shortlist", None) is not None,  # serve --shortlist
                "model_config": self.manifest.model_config.to_dict(),
                "model_limits": dataclasses.asdict(self.manifest.limits),
                "exported_with": self.manifest.versions}

    @property
    def max_src_len(self) -> int:
        return int(self.backend.max_src_len)

    def split(self, texts: list[str], lang: str = DEFAULT_LANG) -> list[Split]:
        """Each text as sentences, as serve-batch --split sentences splits a line (thread-safe, no model)."""
        return [split_sentences(text, lang) for text in texts]

    def direction(self, source: str | None, target: str | None) -> Direction:
        """The token ids that tell a multilingual model (its manifest lists languages) to translate source ->
        target; nothing for a model of one pair (ValueError naming "source" / "target" when it lacks one)."""
        if self.manifest is None or not self.manifest.model_config.languages:  # one pair: no language tokens
            return ONE_PAIR
        try:
            return direction(self.backend.cfg, source, target, source_name='"source"', target_name='"target"')
        except LanguageError as e:
            raise ValueError(str(e)) from None

    def encode(self, lines: list[str], splits: list[Split] | None = None, way: Direction = ONE_PAIR) -> Encoded:
        """serve-batch's source policy for one request's lines, or for the sentences of their `splits`, each
        source started with the direction's prefix (thread-safe, no model)."""
        try:
            if splits is not None:
                ids, truncated = encode_split(self.tokenizer, splits, self.max_src_len, self.long_lines,
                                              lambda k: f"text[{k}]", way.prefix)
                return Encoded(ids, truncated, splits)
            sources = encode_sources(self.tokenizer, lines, self.max_src_len, long_lines=self.long_lines,
                                     origin="request line", prefix=way.prefix)
        except SourceTooLong as e:
            raise LineTooLong(e.what) from None
        return Encoded(sources.ids, sources.truncated)

    def translate(self, ids: list[list[int]], decoding: DecodingOptions, first_tokens: list[int] | None = None
                  ) -> list[NBest]:
        """Hypotheses per source line, in order; batching by length inside (one thread only). first_tokens:
        per line, a multilingual model's target language token, forced first."""
        hyps = translate_ids(self.backend, ids, decoding, first_tokens)
        return [[(h.tokens, h.score) for h in nbest] for nbest in hyps]

    def format(self, nbest: NBest, n: int) -> str:
        """The line serve-batch writes for these hypotheses."""
        return format_line(self.tokenizer, nbest, n)

    def hypotheses(self, nbest: NBest) -> list[dict[str, Any]]:
        """Each hypothesis as {"text", "score"}, its text formatted as serve-batch's 1-best line."""
        return [{"text": format_line(self.tokenizer, [h], 1), "score": h[1]} for h in nbest]

    def warm_up(self, decoding: DecodingOptions) -> str:
        """One real translation, so the first request pays no lazy initialisation."""
        nbest = self.translate(self.encode([WARMUP_LINE]).ids, decoding)
        return self.format(nbest[0], 1)
