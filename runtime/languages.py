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
from collections.abc import Iterable
from dataclasses import dataclass

from model.config import ModelConfig
from model.manifest import Languages
from runtime.errors import RuntimeUserError

# A language code: de, eng, pt-BR, eng_Latn, sr-Latn-RS (subtags bounded: a regular expression keeps state for each
# repeat of a group, so an unbounded one cost 80 bytes a character of a hostile "source" field)
LANG_CODE = re.compile(r"[A-Za-z]{2,3}([-_][A-Za-z0-9]{1,8}){0,8}")
# file-name extensions that look like language codes to LANG_CODE but say what a file holds, not its language,
# however ISO 639-3 reads some (tar, tex, doc); pl (Polish), ts (Tsonga) and sh stay languages
NOT_LANGUAGES = frozenset({"txt", "tsv", "csv", "xml", "htm", "srt", "md", "log", "out", "tok", "bpe", "raw", "src",
                           "tgt", "hyp", "ref", "sgm", "gz", "bz2", "xz", "zst", "tar", "tgz", "zip", "rar", "tex",
                           "doc", "pdf", "rtf", "odt", "ods", "odp", "ppt", "xls", "vtt", "ass", "ssa", "sub", "sbv",
                           "tmx", "xlf", "po", "pot", "js", "py", "rb", "yml", "ini", "cfg", "dat", "bin", "bak",
                           "tmp", "old", "sql"})


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

    @property
    def same(self) -> bool:
        """Whether the source is the target language (a multilingual model's en -> en): nothing to translate."""
        return self.source is not None and self.source == self.target

    def first_tokens(self, n: int) -> list[int] | None:
        """`first` for n sources (runtime.translate.translate_ids), or None when nothing is forced."""
        return None if self.first is None else [self.first] * n


ONE_PAIR = Direction()


def codes(cfg: ModelConfig) -> list[str]:
    """The language codes a model serves, in the model's order ([] for a one-pair model)."""
    return [code for code, _ in cfg.languages]


def direction(cfg: ModelConfig, source: str | None, target: str | None, *, source_name: str = "--src-lang",
              target_name: str = "--tgt-lang", pair: Languages | None = None) -> Direction:
    """The direction `source` -> `target` of this model, or a LanguageError naming the field and the
    languages the model has. A multilingual model needs both; a one-pair model takes none but its own (`pair`: the
    one its model dir records; they change nothing, as the native API takes them)."""
    ids = cfg.language_ids
    if not ids:
        sides = ((source_name, source, pair.source if pair else ()), (target_name, target, pair.target if pair else ()))
        given = [f"{name} {value}" for name, value, own in sides
                 if value and spelled(value, folded_spellings(own)) not in own]
        if given:
            if pair and pair.source and pair.target:
                many = "; a model into many (an OPUS-MT *-mul, *-ROMANCE) is told its target by each source line's " \
                    "first token, as in transformers: start the lines with >>fr<<" if "mul" in pair.target else ""
                raise LanguageError(f"{' and '.join(given)}: this model translates one language pair "
                                    f"({pair.source[0]}-{pair.target[0]}, no language tokens); give its own "
                                    f"languages or leave them out{many}")
            raise LanguageError(f"{' and '.join(given)}: this model translates one language pair (no language "
                                "tokens) and its model dir records none; leave them out (export with --src-lang "
                                "and --tgt-lang records them)")
        return ONE_PAIR
    folded = folded_spellings(ids)  # any case (EN, ENG_LATN), as LibreTranslate takes codes, as the model spells it
    source, target = (spelled(source, folded) if source else source), (spelled(target, folded) if target else target)
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


def folded_spellings(codes: Iterable[str]) -> dict[str, str]:
    """Each code by its case-folded form (de: de, eng_latn: eng_Latn); codes two spell alike are left out."""
    folded: dict[str, list[str]] = {}
    for code in codes:
        folded.setdefault(code.casefold(), []).append(code)
    return {key: spellings[0] for key, spellings in folded.items() if len(spellings) == 1}


def spelled(code: str, folded: dict[str, str]) -> str:
    """A code as the model spells it, whatever the case it is given in (DE: de; ENG_LATN: eng_Latn); unchanged when
    no code, or two, match it (`folded`: folded_spellings)."""
    return code if code in folded.values() else folded.get(code.casefold(), code)


def _near(value: str, known: list[str], most: int = 5) -> list[str]:
    """Codes the user may have meant: the same in another case; for a two-letter code, the model's codes of that
    language (ISO_639_1: ja -> jpn_Jpan, fa -> pes_Arab; a prefix gave jav_Latn, Javanese, and fao_Latn,
    Faroese); else the codes starting with what was given (eng: eng_Latn)."""
    key = value.casefold()
    same = [c for c in known if c.casefold() == key]
    if same:
        return same
    if len(key) == 2:
        return [c for c in known if ISO_639_1.get(c.split("_")[0].casefold()) == key][:most]
    return [c for c in known if key and c.casefold().startswith(key)][:most]


def _listed(cfg: ModelConfig, limit: int = 40) -> str:
    names = codes(cfg)
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


# ISO 639-3 codes (NLLB's, before its script: eng_Latn; the macrolanguage and the individual code NLLB uses for it)
# of the ISO 639-1 languages that language detection (py3langid) and sentence rules (sentencex) know by two letters
ISO_639_1 = dict(pair.split(":") for pair in (
    "afr:af amh:am arg:an ara:ar arb:ar asm:as aze:az azj:az bak:ba bel:be bul:bg ben:bn bre:br bos:bs cat:ca ces:cs "
    "cym:cy dan:da deu:de dzo:dz ell:el eng:en epo:eo spa:es est:et ekk:et eus:eu fas:fa pes:fa fin:fi fao:fo fra:fr "
    "fry:fy gle:ga gla:gd glg:gl guj:gu hau:ha heb:he hin:hi hrv:hr hat:ht hun:hu hye:hy ind:id ibo:ig isl:is ita:it "
    "jpn:ja jav:jv kat:ka kaz:kk khm:km kan:kn kor:ko kur:ku kmr:ku kir:ky lat:la ltz:lb lug:lg lin:ln lao:lo lit:lt "
    "lav:lv lvs:lv mlg:mg plt:mg mkd:mk mal:ml mon:mn khk:mn mar:mr msa:ms zsm:ms mlt:mt mya:my nep:ne npi:ne nld:nl "
    "nno:nn nor:no nob:no oci:oc orm:om gaz:om ori:or ory:or pan:pa pol:pl pus:ps pbt:ps por:pt que:qu quy:qu ron:ro "
    "rus:ru kin:rw san:sa sme:se sin:si slk:sk slv:sl sna:sn som:so sqi:sq als:sq srp:sr sot:st swe:sv swa:sw swh:sw "
    "tam:ta tel:te tgk:tg tha:th tuk:tk tgl:tl tur:tr tat:tt uig:ug ukr:uk urd:ur uzb:uz uzn:uz vie:vi wln:wa xho:xh "
    "yor:yo zho:zh zul:zu").split())


def own_languages(cfg: ModelConfig, pair: Languages | None, source: str | None, target: str | None
                  ) -> tuple[str | None, str | None]:
    """(source, target) as the model takes them: a one-pair model's own codes are the same as none (None, None),
    others as the model spells them (EN: en); a LanguageError as `direction` gives one."""
    way = direction(cfg, source, target, pair=pair)
    return (None, None) if way is ONE_PAIR else (way.source, way.target)


def same_language_notice(code: str) -> str:
    """What serve-batch and ray-translate say of a job whose source is its target (Direction.same)."""
    return f"--src-lang and --tgt-lang are both {code}: every line is written as it came (a model would invent a " \
        "translation)"


def two_letter(code: str) -> str | None:
    """The ISO 639-1 code of a model's language code (de, eng, eng_Latn, pt-BR: de, en, en, pt), None when it has
    none here. Detection and sentence rules know languages so; NLLB's codes are ISO 639-3 with a script."""
    base = re.split(r"[-_]", code, maxsplit=1)[0].lower()
    return base if len(base) == 2 else ISO_639_1.get(base)
