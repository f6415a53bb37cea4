"""Which languages each served model translates, and the (source, target) routes of the LibreTranslate API.

`served_languages` is the one place that says what a model dir serves: the manifest's `languages` (a
multilingual model: every source to every target it lists) when it has them, else the model's name when it
is SRC-TGT ("de-en"). A model with neither is served by the native API only. No web imports."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

log = logging.getLogger(__name__)

PAIR = re.compile(r"([a-z]{2,3})-([a-z]{2,3})")  # a model named SRC-TGT
M = TypeVar("M")

# English names for /languages (LibreTranslate's "name"); a code not here is its own name.
NAMES = {
    "ar": "Arabic", "az": "Azerbaijani", "bg": "Bulgarian", "bn": "Bengali", "ca": "Catalan", "cs": "Czech",
    "da": "Danish", "de": "German", "el": "Greek", "en": "English", "eo": "Esperanto", "es": "Spanish",
    "et": "Estonian", "eu": "Basque", "fa": "Persian", "fi": "Finnish", "fr": "French", "ga": "Irish",
    "gl": "Galician", "he": "Hebrew", "hi": "Hindi", "hu": "Hungarian", "id": "Indonesian", "it": "Italian",
    "ja": "Japanese", "ko": "Korean", "lt": "Lithuanian", "lv": "Latvian", "ms": "Malay", "nb": "Norwegian",
    "nl": "Dutch", "pl": "Polish", "pt": "Portuguese", "ro": "Romanian", "ru": "Russian", "sk": "Slovak",
    "sl": "Slovenian", "sq": "Albanian", "sv": "Swedish", "th": "Thai", "tl": "Tagalog", "tr": "Turkish",
    "uk": "Ukrainian", "ur": "Urdu", "vi": "Vietnamese", "zh": "Chinese",
}


def served_languages(name: str, manifest: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(sources, targets) a model translates: the manifest's `languages` (.source, .target: codes) when it
    declares them, else (SRC,), (TGT,) from a name like "de-en", else nothing (native API only)."""
    declared = getattr(manifest, "languages", None)
    if declared is not None and (declared.source or declared.target):
        return tuple(declared.source), tuple(declared.target)
    pair = PAIR.fullmatch(name)
    return ((pair.group(1),), (pair.group(2),)) if pair else ((), ())


def language_name(code: str) -> str:
    return NAMES.get(code, code)


@dataclass
class Routes(Generic[M]):
    """(source, target) -> the model that translates it; the first model given wins a pair two serve."""

    pairs: dict[tuple[str, str], M]

    @classmethod
    def of(cls, models: Iterable[tuple[str, M, tuple[str, ...], tuple[str, ...]]]) -> Routes[M]:
        """From (name, model, sources, targets) in the order the models were given."""
        pairs: dict[tuple[str, str], M] = {}
        owner: dict[tuple[str, str], str] = {}
        for name, model, sources, targets in models:
            for src in sources:
                for tgt in targets:
                    if src == tgt:
                        continue
                    if (src, tgt) in pairs:
                        log.warning("model %s also translates %s-%s; model %s answers it", name, src, tgt,
                                    owner[(src, tgt)])
                        continue
                    pairs[(src, tgt)], owner[(src, tgt)] = model, name
        return cls(pairs)

    @property
    def codes(self) -> list[str]:
        """Every language a route starts or ends in, sorted: what detection chooses among."""
        return sorted({code for pair in self.pairs for code in pair})

    def listed(self) -> str:
        return ", ".join(f"{s}-{t}" for s, t in sorted(self.pairs)) or "none (name models SRC-TGT, like de-en)"

    def languages(self) -> list[dict[str, Any]]:
        """GET /languages: every language with the targets it translates into; a target-only language
        has no targets."""
        return [{"code": code, "name": language_name(code),
                 "targets": sorted(t for s, t in self.pairs if s == code)} for code in self.codes]
