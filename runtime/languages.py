"""A translation direction for a multilingual model: which languages a model dir serves, and what a
(source, target) pair means in token ids.

A model of one language pair (the paper's, Marian's) has no language tokens: its direction is the
empty one. A multilingual model (M2M-100, NLLB: ModelConfig.languages) is told both languages in
tokens: its source starts with the source language's token, and the target language's token is
forced as the first generated one (runtime/search.py, `first_tokens`). Both are data of the model
config, so every backend and every command handles them the same way.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from model.config import ModelConfig
from runtime.errors import RuntimeUserError

# A language code: de, eng, pt-BR, eng_Latn, sr-Latn-RS (subtags bounded: a regular expression keeps state for each
# repeat of a group, so an unbounded one cost 80 bytes a character of a hostile "source" field)
LANG_CODE = re.compile(r"[A-Za-z]{2,3}([-_][A-Za-z0-9]{1,8}){0,8}")
# file-name extensions that look like language codes to LANG_CODE but say what a file holds, not its language
NOT_LANGUAGES = frozenset({"txt", "tsv", "csv", "xml", "htm", "srt", "md", "log", "out", "tok", "bpe", "raw", "src",
                           "tgt", "hyp", "ref", "sgm", "gz", "bz2", "xz", "zst"})


def language_suffix(suffix: str) -> bool:
    """Whether a file name's last extension (without its dot: `de` of train.de) names a language."""
    return bool(LANG_CODE.fullmatch(suffix)) and suffix.lower() not in NOT_LANGUAGES


class LanguageError(RuntimeUserError):
    """A language the model does not have, or languages a one-pair model cannot take."""


@dataclass(frozen=True)
class Direction:
    """Token ids for one (source, target) pair: `prefix` starts every source, `first` is forced as every
    translation's first token. The empty direction (a one-pair model) adds nothing."""

    source: str | None = None
    target: str | None = None
    prefix: tuple[int, ...] = ()
    first: int | None = None

    def first_tokens(self, n: int) -> list[int] | None:
        """`first` for n sources (runtime.translate.translate_ids), or None when nothing is forced."""
        return None if self.first is None else [self.first] * n


ONE_PAIR = Direction()


def codes(cfg: ModelConfig) -> list[str]:
    """The language codes a model serves, in the model's order ([] for a one-pair model)."""
    return [code for code, _ in cfg.languages]


def direction(cfg: ModelConfig, source: str | None, target: str | None, *, source_name: str = "--src-lang",
              target_name: str = "--tgt-lang") -> Direction:
    """The direction `source` -> `target` of this model, or a LanguageError naming the field and the
    languages the model has. A multilingual model needs both; a one-pair model takes neither."""
    ids = cfg.language_ids
    if not ids:
        given = [f"{name} {value}" for name, value in ((source_name, source), (target_name, target)) if value]
        if given:
            raise LanguageError(f"{' and '.join(given)}: this model translates one language pair and has no "
                                "language tokens; leave the languages out")
        return ONE_PAIR
    for name, value in ((source_name, source), (target_name, target)):
        if not value:
            raise LanguageError(f"{name} is required: this model translates between {len(ids)} languages "
                                f"({_listed(cfg)})")
        if value not in ids:
            near = _near(value, codes(cfg))
            raise LanguageError(f"{name} {value[:40]!r} is not a language of this model; "
                                + (f"did you mean {', '.join(near)}? " if near else "") + f"it has {_listed(cfg)}")
    assert source is not None and target is not None
    return Direction(source, target, (ids[source],), ids[target])


def _near(value: str, known: list[str], most: int = 5) -> list[str]:
    """Codes the user may have meant: the same in another case, or starting with what was given (en: eng_Latn,
    the NLLB spelling of a two-letter code is its three-letter one with a script)."""
    key = value.casefold()
    same = [c for c in known if c.casefold() == key]
    return same or [c for c in known if key and c.casefold().startswith(key)][:most]


def _listed(cfg: ModelConfig, limit: int = 40) -> str:
    names = codes(cfg)
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
