"""The built-in calibration sample: what `pipeline export --int8` measures static activation scales on when the
model brings no held-out sentences (an imported Marian, M2M-100 or NLLB model given no --reference-src), and the
check that decides whether they are kept.

calibration_sample.tsv holds 100 sentences written for this project in 10 languages, line-aligned: a header of
ISO 639-1 codes, then one sentence per column per row. A model of one pair whose codes are known (an import's
tokenizer_config, or --src-lang/--tgt-lang) and both among them calibrates on the 100 sentences of its source
language; a multilingual model on every sample language it has into English, and English into German (or the
first other), 100 lines in all, each direction its own rows (calibration and the check below decode them
twice in fp32: minutes for a 600M-parameter model on 2 cores). Other models keep per-row scales.

Sentences of a fixed sample are not the user's text, so the scales are kept only if they pass `pipeline parity`'s
int8 gate on it: the model dir's int8 graphs (ONNX Runtime) and the fp32 PyTorch model translate the sample with the
model's own decoding options, and |BLEU(int8) - BLEU(fp32)| against the sample's references must be at most
INT8_MAX_BLEU_DELTA. Otherwise the export writes per-row graphs, and the manifest and a warning say why. The
gate means most for a model that translates the sample well: a model of another domain scores low on it either
way (the Multi30k `small`: BLEU 1 on the sample), where the share of lines int8 translates as fp32 does, which the
manifest records beside it, says more.
"""

from __future__ import annotations

import importlib.resources
from typing import Any

from export.options import Calibration, SampleDirection
from model.config import ModelConfig
from model.manifest import Languages
from runtime.backend import Backend
from runtime.decoding import DecodingOptions
from runtime.tokenizer import AnyTokenizer
from runtime.translate import encode_sources, format_line, translate_ids

SAMPLE_FILE = "calibration_sample.tsv"
TELLING_BLEU = 5.0  # the fp32 model's BLEU on the sample under which its gate tells little (the export says so)
MULTILINGUAL_LINES = 100  # a multilingual model's sample lines in all, as many as a one-pair model's
PIVOT = "en"  # a multilingual model's sample directions: every other language into it, and it into SECOND
SECOND = "de"
# ISO 639-2/3 codes of the sample's languages (NLLB's eng_Latn, a model dir named deu): their ISO 639-1 code
LONG_CODES = {"eng": "en", "deu": "de", "ger": "de", "fra": "fr", "fre": "fr", "spa": "es", "ita": "it",
              "por": "pt", "nld": "nl", "dut": "nl", "pol": "pl", "ces": "cs", "cze": "cs", "rus": "ru"}


def read_sample() -> dict[str, list[str]]:
    """{ISO 639-1 code: its 100 sentences}, line-aligned across languages."""
    text = importlib.resources.files("export").joinpath(SAMPLE_FILE).read_text(encoding="utf-8")
    header, *rows = [line.split("\t") for line in text.splitlines()]
    return {code: [row[i] for row in rows] for i, code in enumerate(header)}


def sample_language(code: str) -> str:
    """The sample's code for a model's language code: de, de-DE, deu, eng_Latn -> de / en (unchanged if unknown)."""
    base = code.replace("-", "_").split("_")[0].lower()
    return LONG_CODES.get(base, base)


def sample_for(cfg: ModelConfig, pair: Languages | None) -> tuple[tuple[SampleDirection, ...], str]:
    """The sample's directions for this model (none when its languages are unknown or not the sample's), and what
    to call them in the export's one line, or why there are none."""
    sample = read_sample()
    have = ", ".join(sample)
    if cfg.languages:
        present: dict[str, str] = {}
        for code, _ in cfg.languages:
            present.setdefault(sample_language(code), code)
        present = {lang: code for lang, code in present.items() if lang in sample}
        others = [lang for lang in present if lang != PIVOT]
        if PIVOT not in present or not others:
            return (), f"this multilingual model has too few of the built-in sample's languages ({have})"
        ways = [(lang, PIVOT) for lang in others] + [(PIVOT, SECOND if SECOND in present else others[0])]
        per = max(1, MULTILINGUAL_LINES // len(ways))
        rows = len(sample[PIVOT])
        directions = []
        for i, (src, tgt) in enumerate(ways):
            take = [(i * per + j) % rows for j in range(min(per, rows))]
            directions.append(SampleDirection((present[src], present[tgt]), [sample[src][r] for r in take],
                                              [sample[tgt][r] for r in take]))
        return tuple(directions), f"the built-in sample ({len(others)} languages -> {PIVOT}, {ways[-1][0]} -> " \
                                  f"{ways[-1][1]})"
    if pair is None:
        return (), "this model's languages are unknown (export --src-lang/--tgt-lang name them)"
    src, tgt = sample_language(pair.source[0]), sample_language(pair.target[0])
    if src not in sample or tgt not in sample:
        return (), f"{pair.source[0]} -> {pair.target[0]} is not among the built-in sample's languages ({have})"
    return (SampleDirection(None, sample[src], sample[tgt]),), f"the built-in sample ({src} -> {tgt})"


def sample_calibration(cfg: ModelConfig, pair: Languages | None) -> tuple[Calibration | None, str]:
    """The sample as calibration lines (default ones, gated), or None and why not."""
    directions, said = sample_for(cfg, pair)
    if not directions:
        return None, said
    return Calibration([x for d in directions for x in d.lines], said, default=True, directions=directions), said


def encoded(tokenizer: AnyTokenizer, cfg: ModelConfig, calibration: Calibration, max_src_len: int,
            ) -> tuple[list[list[int]], list[int] | None]:
    """The calibration lines as source ids, with each one's forced first token (None: a model of one pair): the
    sample's in their directions, the user's in theirs (a multilingual model's --src-lang/--tgt-lang)."""
    ids: list[list[int]] = []
    first: list[int] = []
    for d in calibration.directions or (SampleDirection(None, calibration.lines, []),):
        way = d.direction(cfg)
        ids += encode_sources(tokenizer, d.lines, max_src_len, origin=calibration.origin, prefix=way.prefix).ids
        first += way.first_tokens(len(d.lines)) or []
    return ids, first or None


def translations(backend: Backend, tokenizer: AnyTokenizer, sample: tuple[SampleDirection, ...],
                 decoding: DecodingOptions) -> list[str]:
    """The sample's lines as `backend` translates them, as serve-batch writes them."""
    out: list[str] = []
    for d in sample:
        way = d.direction(backend.cfg)
        ids = encode_sources(tokenizer, d.lines, backend.max_src_len, prefix=way.prefix).ids
        nbest = translate_ids(backend, ids, decoding, first_tokens=way.first_tokens(len(ids)))
        out += [format_line(tokenizer, [(h.tokens, h.score) for h in hyps], 1) for hyps in nbest]
    return out


def gate(reference: Backend, int8: Backend, tokenizer: AnyTokenizer, sample: tuple[SampleDirection, ...],
         decoding: DecodingOptions, max_bleu_delta: float) -> dict[str, Any]:
    """Parity's int8 gate on the sample: BLEU of the fp32 `reference` and of the `int8` backend against the
    sample's references, and whether they differ by at most max_bleu_delta."""
    import sacrebleu

    refs = [x for d in sample for x in d.references]
    ours, theirs = translations(reference, tokenizer, sample, decoding), translations(int8, tokenizer, sample, decoding)
    fp32, quantized = (sacrebleu.corpus_bleu(hyps, [refs]).score for hyps in (ours, theirs))
    delta = quantized - fp32
    return {"lines": len(refs), "bleu_fp32": round(fp32, 2), "bleu_int8": round(quantized, 2),
            "delta": round(delta, 2), "max_bleu_delta": max_bleu_delta, "passed": abs(delta) <= max_bleu_delta,
            # not gated (parity does not gate int8 by it): how many lines int8 translates as fp32 does
            "identical": round(sum(a == b for a, b in zip(ours, theirs)) / len(refs), 3)}
