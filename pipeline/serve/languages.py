"""Which languages each served model translates, and the (source, target) routes of the LibreTranslate API.

`served_languages` is the one place that says what a model dir serves: the manifest's `languages` (a
multilingual model: every source to every target it lists) when it has them, else the model's name when it
is SRC-TGT ("de-en"). A model with neither is served by the native API only. No web imports."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable
from typing import Any, Generic, TypeVar

from model.errors import UserError
from runtime.languages import folded_spellings, spelled, two_letter

log = logging.getLogger(__name__)

MAX_LANGUAGES = 1000  # per model and side: GET /languages lists up to this squared
PAIR = re.compile(r"([a-z]{2,3})-([a-z]{2,3})", re.IGNORECASE)  # a model named SRC-TGT (DE-EN: de, en)
M = TypeVar("M")

def served_languages(name: str, manifest: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(sources, targets) a model translates: the manifest's `languages` (.source, .target: codes) when it
    declares them, else (SRC,), (TGT,) from a name like "de-en", else nothing (native API only)."""
    declared = getattr(manifest, "languages", None)
    if declared is not None and (declared.source or declared.target):
        many = max(len(declared.source), len(declared.target))
        if many > MAX_LANGUAGES:
            raise UserError(f"manifest.json lists {many} languages, more than the {MAX_LANGUAGES} a served model may "
                            "have (NLLB has 202); export the model again")
        return tuple(declared.source), tuple(declared.target)
    pair = PAIR.fullmatch(name)
    return ((pair.group(1).lower(),), (pair.group(2).lower(),)) if pair else ((), ())


def language_name(code: str) -> str:
    """The English name of a code as CLDR gives it (langcodes: de German, eng_Latn English, zho_Hant Chinese
    (Traditional), pt-BR Portuguese (Brazil), ace_Arab Acehnese (Arabic)), else the code itself. A table of 46
    two-letter codes named 147 of NLLB's 202 by their code."""
    import langcodes  # its name data (29 MB resident) only where a server lists languages

    try:
        name = str(langcodes.Language.get(code.replace("_", "-")).display_name())
    except (langcodes.LanguageTagError, ValueError):
        return code
    return code if name.startswith("Unknown language") else name


def preferred(codes: Iterable[str], language: str = "en") -> str | None:
    """The first of `codes` that is `language` (an ISO 639-1 code), however the model spells it (en, eng_Latn)."""
    return next((c for c in codes if two_letter(c) == language), None)


LISTED = 20  # pairs an error message names; past that it counts them and points at GET /languages


class Routes(Generic[M]):
    """(source, target) -> the model that translates it; the first model given wins a pair two serve.

    Held per model as sets of codes, not as pairs: a lookup costs the number of models, memory the number of
    codes, and GET /languages is built once here (NLLB serves 202 x 201 pairs; built per request, the list
    cost N^3 and stalled the event loop)."""

    def __init__(self, models: list[tuple[str, M, frozenset[str], frozenset[str]]]):
        self._models = models
        targets: dict[str, set[str]] = {}
        for _, _, sources, reached in models:
            for src in sources:
                targets.setdefault(src, set()).update(reached)
        for src, found in targets.items():
            found.discard(src)
        self.codes = sorted({src for src, into in targets.items() if into}.union(*targets.values()))
        self.targets = sorted(set().union(*targets.values()))  # the codes some model translates into
        self.sources = sorted(src for src, into in targets.items() if into)
        self._folded = folded_spellings(self.codes)
        self.count = sum(len(t) for t in targets.values())
        self._languages = [{"code": code, "name": language_name(code), "targets": sorted(targets.get(code, ()))}
                           for code in self.codes]
        self.languages_json = json.dumps(self._languages, ensure_ascii=False).encode("utf-8")  # GET /languages
        for name, _, sources, into in models:
            for src in sources:
                for other, _, s2, t2 in models:
                    if other == name:
                        break
                    shared = (into & t2) - {src} if src in s2 else set()
                    if shared:
                        log.warning("model %s also translates %s-%s; model %s answers it", name, src,
                                    min(shared), other)

    @classmethod
    def of(cls, models: Iterable[tuple[str, M, tuple[str, ...], tuple[str, ...]]]) -> Routes[M]:
        """From (name, model, sources, targets) in the order the models were given."""
        return cls([(name, model, frozenset(sources), frozenset(targets)) for name, model, sources, targets in models])

    def spelled(self, code: str) -> str:
        """A served code as the models spell it, whatever the case it is given in (DE: de; ENG_LATN: eng_Latn), as
        LibreTranslate lowercases codes; unchanged when no served code, or two, match it."""
        return spelled(code, self._folded)

    def model(self, source: str, target: str) -> M | None:
        """The model that translates source into target, or None."""
        if source == target:
            return None
        for _, model, sources, targets in self._models:
            if source in sources and target in targets:
                return model
        return None

    def targets_of(self, source: str) -> list[str]:
        """The codes `source` is translated into, sorted."""
        return next((list(lang["targets"]) for lang in self._languages if lang["code"] == source), [])

    def pairs(self) -> list[tuple[str, str]]:
        """Every (source, target) served, sorted."""
        return [(str(lang["code"]), str(t)) for lang in self._languages for t in lang["targets"]]

    def listed(self) -> str:
        """The served pairs for a message: each one while they are few, else how many and where to look."""
        if self.count == 0:
            return ("none: no model records its language pair; serve it as `--model de-en=MODEL_DIR` (its source and "
                    "target codes), or export it with --src-lang and --tgt-lang")
        if self.count > LISTED:
            return f"{self.count} pairs of {len(self.codes)} languages (GET /languages lists them)"
        return ", ".join(f"{s}-{t}" for s, t in self.pairs())

    def languages(self) -> list[dict[str, Any]]:
        """GET /languages: every language with the targets it translates into; a target-only language
        has no targets."""
        return self._languages
