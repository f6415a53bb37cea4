"""The M2M-100 family and its NLLB variant (`model_type: m2m_100`; `pipeline import [m2m100|nllb] HF_DIR --out
CHECKPOINT`): an M2M-100 model (facebook/m2m100_*), as transformers' `M2M100ForConditionalGeneration.save_pretrained`
and `M2M100Tokenizer.save_pretrained` write it, into one of our checkpoints: one model for many language pairs.
Reads local files only; the steps are every family's (pipeline/importers/convert.py), this module says what
M2M-100's and NLLB's are.

M2M-100 (transformers/models/m2m_100/modeling_m2m_100.py) is the paper's Transformer with one shared
embedding, like ours; what it differs in is data of the checkpoint (model.config.ModelConfig), never a
special case in the serving code:

- pre-LN blocks and a final LayerNorm per stack (`pre_norm`);
- fairseq's sinusoid table, whose position t is row t + padding id + 1 (`positions="fairseq"`,
  `position_offset`);
- the language tokens `__xx__` (ids after vocab.json's, in the order of the tokenizer's language-code list):
  a source starts with its language's token, and the target language's token is forced as the first
  generated one (`languages`; runtime/languages.py); 8 "madeup" ids pad the embedding;
- decoder start = EOS (id 2), padding 1, and generate's settings (num_beams, max_length, early_stopping)
  as the model dir's decoding defaults (pipeline/importers/hf_generation.py).

The tokenizer (one SentencePiece model looked up in vocab.json, as M2M100Tokenizer does) goes into the
checkpoint and the model dir like Marian's (runtime.tokenizer.VocabTokenizer).

NLLB-200 (facebook/nllb-200-*) is the same architecture with another tokenizer: its ids are tokenizer.json's
(the SentencePiece pieces shifted by fairseq's offset, then the language codes such as `eng_Latn` as added
tokens), and its pieces are cut by the sentencepiece.bpe.model the hub's directories ship. Sources are
[language] pieces </s> (NllbTokenizer's default; its legacy_behaviour suffix form is refused).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from model.config import ConfigError, ModelConfig
from pipeline.importers.bart_config import MAX_POSITIONS, activation_and_dropout, check_tied, shape
from pipeline.importers.convert import import_checkpoint
from pipeline.importers.family import Family, Tokenized
from pipeline.importers.hf_files import (
    HFFiles,
    ImportRefused,
    check_sentencepiece,
    flag,
    optional_integer,
    show,
    token_id,
    wrong_type,
)
from runtime.tokenizer import TokenizerError, VocabTokenizer, id_gap

CONFIG, VOCAB, SPM = "config.json", "vocab.json", "sentencepiece.bpe.model"
TOKENIZER_CONFIG, GENERATION, TOKENIZER_JSON = "tokenizer_config.json", "generation_config.json", "tokenizer.json"
NLLB_CODE = re.compile(r"[a-z]{3}_[A-Z][a-z]{3}")  # eng_Latn: NLLB's language tokens are their codes
MADEUP = "madeupword{:04d}"  # fairseq's names of the ids that only pad the embedding
WHAT = "an M2M100ForConditionalGeneration.save_pretrained directory (M2M-100 or NLLB)"


def model_config(config: dict[str, Any], path: Path) -> ModelConfig:
    """Our ModelConfig for an M2M-100 config.json, without its languages (the tokenizer gives them)."""
    if config.get("model_type") != "m2m_100":
        raise ImportRefused(f"{path}: {wrong_type(config, 'm2m_100')}")
    sizes = shape(config, path, MAX_POSITIONS)
    vocab = sizes["vocab_size"]
    pad = token_id(config, "pad_token_id", path, vocab)
    eos = token_id(config, "eos_token_id", path, vocab)
    start = eos if config.get("decoder_start_token_id") is None else token_id(
        config, "decoder_start_token_id", path, vocab)
    common = activation_and_dropout(config, path, "relu")
    check_tied(config, path)
    try:
        return ModelConfig(**sizes, **common, pad_id=pad, bos_id=start, eos_id=eos,
                           positions="fairseq", position_offset=pad + 1, pre_norm=True,
                           scale_embedding=flag(config, "scale_embedding", path, True), logits_bias=False)
    except ConfigError as e:
        raise ImportRefused(f"{path}: {e}") from None


def language_codes(tok_config: dict[str, Any], where: Path) -> list[str]:
    """The tokenizer's language codes, in the order their token ids follow vocab.json's: the list
    M2M100Tokenizer names by `language_codes` (transformers holds them: "m2m100", 100 codes; "wmt21", 8)."""
    from transformers.models.m2m_100.tokenization_m2m_100 import FAIRSEQ_LANGUAGE_CODES

    name = tok_config.get("language_codes", "m2m100")
    if not isinstance(name, str) or name not in FAIRSEQ_LANGUAGE_CODES:
        raise ImportRefused(f"{where}: language_codes is {show(name)}; expected one of "
                            f"{', '.join(FAIRSEQ_LANGUAGE_CODES)}")
    return list(FAIRSEQ_LANGUAGE_CODES[name])


def is_nllb(hf_dir: Path | HFFiles) -> bool:
    """Whether the directory holds NLLB's tokenizer (tokenizer.json, no vocab.json) rather than M2M-100's."""
    files = hf_dir if isinstance(hf_dir, HFFiles) else HFFiles(hf_dir)
    tok_config = files.optional_json(TOKENIZER_CONFIG)
    return tok_config.get("tokenizer_class") in ("NllbTokenizer", "NllbTokenizerFast") or (
        not files.has(VOCAB) and files.has(TOKENIZER_JSON))


def nllb_vocabulary(files: HFFiles) -> tuple[dict[str, int], list[tuple[str, int]]]:
    """tokenizer.json's piece -> id (its model's vocabulary and its added tokens) and the language codes
    among the added tokens, by id."""
    path = files.path(TOKENIZER_JSON)
    data = files.json(TOKENIZER_JSON)
    model = data.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if not isinstance(vocab, dict) or not all(isinstance(i, int) for i in vocab.values()):
        raise ImportRefused(f"{path}: model.vocab is not a piece -> id object (a BPE tokenizer.json, as NLLB's)")
    added = data.get("added_tokens") or []
    if not isinstance(added, list) or not all(isinstance(a, dict) and isinstance(a.get("content"), str)
                                              and isinstance(a.get("id"), int) for a in added):
        raise ImportRefused(f"{path}: added_tokens must be a list of {{\"id\", \"content\"}} objects")
    full = dict(vocab)
    for token in added:
        if full.get(token["content"], token["id"]) != token["id"]:
            raise ImportRefused(f"{path}: {token['content']!r} has two ids")
        full[token["content"]] = token["id"]
    languages = sorted(((a["content"], a["id"]) for a in added if NLLB_CODE.fullmatch(a["content"])),
                       key=lambda pair: pair[1])
    if not languages:
        raise ImportRefused(f"{path}: no language tokens (such as eng_Latn) among added_tokens")
    return full, languages


def tokenizer(files: HFFiles, cfg: ModelConfig) -> tuple[VocabTokenizer, list[tuple[str, int]]]:
    """The SentencePiece model over vocab.json, its language tokens and madeup ids appended (as
    M2M100Tokenizer numbers them), or over NLLB's tokenizer.json, checked against the model's ids; and the
    (code, token id) pairs. cfg.vocab_size must have been checked against the weights' header (check_weights):
    the madeup ids fill the vocabulary up to it."""
    hf_dir, path = files.dir, files.path(TOKENIZER_CONFIG)
    tok_config = files.optional_json(TOKENIZER_CONFIG)
    nllb = is_nllb(files)
    if nllb:
        if tok_config.get("legacy_behaviour") is True:
            raise ImportRefused(f"{path}: legacy_behaviour is true (the language token after the source's </s>); "
                                "only NllbTokenizer's default, the language token first, is imported")
        full, languages = nllb_vocabulary(files)
        hidden = [code for code, _ in languages]
    else:
        full, languages = _m2m100_vocabulary(files, tok_config, path)
        hidden = [f"__{code}__" for code, _ in languages]
    said = id_gap(full.values())
    if said:
        where = files.path(TOKENIZER_JSON) if nllb else f"{files.path(VOCAB)} with its language tokens"
        raise ImportRefused(f"{where}: the tokenizer's ids are not 0..{len(full) - 1} without gaps or repeats "
                            f"({said})")
    if len(full) > cfg.vocab_size:
        default = (f" ({TOKENIZER_CONFIG} is missing: its language_codes were taken to be M2M-100's 100; copy the "
                   "model's own)" if not nllb and not path.is_file() else "")
        raise ImportRefused(f"{hf_dir}: the tokenizer has {len(full)} ids (with its language tokens), more than "
                            f"{CONFIG}'s vocab_size {cfg.vocab_size}{default}")
    madeup_words = optional_integer(tok_config, "num_madeup_words", files.path(TOKENIZER_CONFIG), 8, minimum=0)
    if not nllb and len(full) + madeup_words != cfg.vocab_size:
        # the language tokens are numbered after vocab.json's ids: one id more or less there moves every one
        raise ImportRefused(f"{files.path(VOCAB)}: {len(full) - len(languages)} ids and {len(languages)} language "
                            f"tokens, with M2M100Tokenizer's {madeup_words} madeup ids {len(full) + madeup_words}, "
                            f"not {CONFIG}'s vocab_size {cfg.vocab_size}: the files are of different models")
    spm_bytes = files.read_bytes(SPM)
    check_sentencepiece(files.path(SPM), spm_bytes, full, TOKENIZER_JSON if nllb else VOCAB)
    madeup = [MADEUP.format(k) for k in range(cfg.vocab_size - len(full))]
    for token in madeup:
        full[token] = len(full)
    hidden += [t for t in ("<s>", "<mask>") if t in full] + madeup
    try:
        tok = VocabTokenizer(spm_bytes, spm_bytes, full, hidden=hidden, code_prefix=False)
    except TokenizerError as e:
        raise ImportRefused(f"{hf_dir}: {e}") from None
    for name, ours, theirs in (("eos", cfg.eos_id, tok.eos_id), ("pad", cfg.pad_id, tok.pad_id)):
        if ours != theirs:
            raise ImportRefused(f"{hf_dir}: the tokenizer's {tok.specials[name]} is id {theirs} but {CONFIG} says "
                                f"{name}_token_id {ours}")
    return tok, languages


def _m2m100_vocabulary(files: HFFiles, tok_config: dict[str, Any], path: Path
                       ) -> tuple[dict[str, int], list[tuple[str, int]]]:
    """vocab.json with M2M100Tokenizer's language tokens numbered after it, and the (code, id) pairs."""
    hf_dir = files.dir
    codes = language_codes(tok_config, path)
    vocab = files.json(VOCAB)
    if not all(isinstance(i, int) for i in vocab.values()):
        raise ImportRefused(f"{hf_dir / VOCAB}: every entry must map a piece to an integer id")
    base = len(vocab)
    languages = [(code, base + i) for i, code in enumerate(codes)]
    full = dict(vocab)
    for code, i in languages:
        token = f"__{code}__"
        if token in full:
            raise ImportRefused(f"{hf_dir / VOCAB}: holds the language token {token!r}, which M2M100Tokenizer "
                                "numbers after the vocabulary")
        full[token] = i
    return full, languages


def _tokenized(files: HFFiles, cfg: ModelConfig) -> Tokenized:
    """The tokenizer, and its languages as the model's (ModelConfig.languages)."""
    tok, languages = tokenizer(files, cfg)
    return Tokenized(tok, config={"languages": tuple(languages)})


NLLB = Family(
    model_type="m2m_100", name="NLLB", format="nllb", what=WHAT, required=(CONFIG, TOKENIZER_JSON, SPM),
    optional=(GENERATION, TOKENIZER_CONFIG), model_config=model_config, tokenizer=_tokenized, logits_bias=False,
    detect=is_nllb)
M2M100 = Family(
    model_type="m2m_100", name="M2M-100", format="m2m100", what=WHAT, required=(CONFIG, VOCAB, SPM),
    optional=(GENERATION, TOKENIZER_CONFIG), model_config=model_config, tokenizer=_tokenized, logits_bias=False,
    variants=(NLLB,))


def import_m2m100(hf_dir: Path, out: Path, force: bool = False) -> dict[str, Any]:
    """`pipeline import m2m100` (and `nllb`): import_checkpoint with the M2M-100 family, NLLB's tokenizer when the
    directory holds it."""
    return import_checkpoint(hf_dir, out, force, family=M2M100)
