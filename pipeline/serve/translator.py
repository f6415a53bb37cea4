"""A served model dir: what the server knows of it and the one call it makes into the search.

Texts become units and units become answers in the text service (runtime/texts.py: encode_texts in
service.encode, finish_texts in the answers of native.py and libre.py), the very functions serve-batch
writes its lines with, so the service answers exactly what `pipeline serve-batch` writes for the same texts
and there is no second decoding path. The search is the loaded model's (runtime/model_dir.py Loaded.translate),
called by the batcher's threads: as many batches at once as the backend decodes (`parallel_batches`), each call
decoding its own batches one at a time."""

from __future__ import annotations

import dataclasses
from typing import Any

from model.manifest import Manifest
from runtime.backend import Backend
from runtime.decoding import PAPER, DecodingOptions
from runtime.languages import ONE_PAIR, Direction, LanguageError, direction
from runtime.model_dir import Loaded, LoadOptions, load
from runtime.texts import TextPolicy, encode_texts, finish_texts
from runtime.tokenizer import AnyTokenizer
from runtime.translate import NBest

WARMUP_LINE = "warm up"


class Translator:
    """A loaded model dir (its backend, tokenizer, manifest and decoding: the model's own defaults under what
    the server was given) and the server's --long-lines policy, each an attribute set once from `loaded` (the
    routes read them on every request)."""

    def __init__(self, loaded: Loaded, long_lines: str = "truncate"):
        self.loaded = loaded
        self.long_lines = long_lines
        self.backend: Backend = loaded.backend
        self.tokenizer: AnyTokenizer = loaded.tokenizer
        self.manifest: Manifest = loaded.manifest
        self.decoding: DecodingOptions = loaded.decoding
        self.max_src_len = int(loaded.backend.max_src_len)
        self.parallel_batches = int(loaded.backend.parallel_batches)  # the batcher's calls at once

    @classmethod
    def load(cls, model_dir: str, options: LoadOptions, long_lines: str,
             decoding_given: DecodingOptions = PAPER) -> Translator:
        """The model dir verified against its manifest and loaded (UserErrors when unusable), as every
        command loads one (runtime/model_dir.py)."""
        return cls(load(model_dir, options, decoding_given), long_lines)

    def model_limit(self, key: str) -> int | None:
        """max_src_len / max_tgt_len / max_batch / max_beam as the export recorded it."""
        return getattr(self.manifest.limits, key)

    def summary(self) -> dict[str, Any]:
        """The manifest's facts a client may see (no file paths)."""
        return {"backend": self.backend.name, "device": str(self.backend.device),
                "precision": self.manifest.precision,
                "shortlist": self.backend.shortlist is not None,  # serve --shortlist
                "batches_at_once": self.parallel_batches,  # --parallel-batches (the batcher's threads)
                "model_config": self.manifest.model_config.to_dict(),
                "model_limits": dataclasses.asdict(self.manifest.limits),
                "exported_with": self.manifest.versions}

    def direction(self, source: str | None, target: str | None) -> Direction:
        """The token ids that tell a multilingual model (its manifest lists languages) to translate source ->
        target; nothing for a model of one pair (ValueError naming "source" / "target" when it lacks one)."""
        if self.manifest is None or not self.manifest.model_config.languages:  # one pair: no language tokens
            return ONE_PAIR
        try:
            return direction(self.backend.cfg, source, target, source_name='"source"', target_name='"target"')
        except LanguageError as e:
            raise ValueError(str(e)) from None

    def translate(self, ids: list[list[int]], decoding: DecodingOptions, first_tokens: list[int] | None = None,
                  constraints: list[list[list[int]]] | None = None) -> list[NBest]:
        """Hypotheses per source, in order; batching by length inside, one batch at a time (the batcher makes up
        to `parallel_batches` of these calls at once, each on its share of the threads). first_tokens: per
        source, a multilingual model's target language token, forced first; constraints: per source, a
        glossary's target token phrases ([] for none), decoded apart by constrained search."""
        return self.loaded.translate(ids, decoding, first_tokens, constraints=constraints, workers=1)

    def warm_up(self, decoding: DecodingOptions) -> str:
        """One real translation, so the first request pays no lazy initialisation."""
        encoded = encode_texts(self.tokenizer, [WARMUP_LINE], self.max_src_len, TextPolicy(self.long_lines))
        return finish_texts(self.tokenizer, encoded, self.translate(encoded.ids, decoding), 1)[0].text
