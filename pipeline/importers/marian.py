"""The Marian family (`model_type: marian`; `pipeline import [marian] HF_DIR --out CHECKPOINT`): an OPUS-MT /
Marian model, as transformers' `MarianMTModel.save_pretrained` and `MarianTokenizer.save_pretrained` write it,
into one of our checkpoints, which every other command then takes as it is. Reads local files only; the
steps are every family's (pipeline/importers/convert.py), this module says what Marian's are.

Marian (transformers/models/marian/modeling_marian.py) is the paper's post-LN Transformer with one
embedding shared by encoder, decoder and output projection, as ours is. What it differs in becomes
data in the checkpoint (model.config.ModelConfig, runtime.tokenizer.VocabTokenizer), never a
special case in the serving code:

- the feed-forward activation (`activation_function`: OPUS-MT uses swish);
- the sinusoid table's layout (sines in the first half, cosines in the second: `positions="halves"`);
- `final_logits_bias`, added to the logits (`logits_bias`);
- the special ids (eos 0, unk 1, pad = the last id, decoder start = pad) and `bad_words_ids` [[pad]]
  (`suppress_ids`: never generated);
- a source and a target SentencePiece model over one shared vocab.json, sources without BOS
  (VocabTokenizer);
- the generation defaults it ships (num_beams, max_length, length_penalty) and transformers' beam
  search rules, which become the model dir's decoding defaults (runtime.decoding, rules
  "transformers"); command-line options still override them.
"""

from __future__ import annotations

import logging
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
    show,
    token_id,
    wrong_type,
)
from pipeline.importers.hf_generation import GENERATION_NAMES  # noqa: F401 (re-export)
from runtime.languages import LANG_CODE
from runtime.tokenizer import TokenizerError, VocabTokenizer

log = logging.getLogger(__name__)

CONFIG, GENERATION, VOCAB = "config.json", "generation_config.json", "vocab.json"
SOURCE_SPM, TARGET_SPM, TOKENIZER_CONFIG = "source.spm", "target.spm", "tokenizer_config.json"

MarianImportError = ImportRefused  # a directory that is not a Marian model this importer can map


def model_config(config: dict[str, Any], path: Path) -> ModelConfig:
    """Our ModelConfig for a Marian config.json (refusing what our model cannot compute)."""
    if config.get("model_type") != "marian":
        raise MarianImportError(f"{path}: {wrong_type(config, 'marian')}")
    sizes = shape(config, path, MAX_POSITIONS)
    vocab = sizes["vocab_size"]
    pad = token_id(config, "pad_token_id", path, vocab)
    start = pad if config.get("decoder_start_token_id") is None else token_id(
        config, "decoder_start_token_id", path, vocab)
    common = activation_and_dropout(config, path, None)
    check_tied(config, path)
    try:
        return ModelConfig(
            **sizes, **common, pad_id=pad, bos_id=start,
            eos_id=token_id(config, "eos_token_id", path, vocab), positions="halves",
            scale_embedding=flag(config, "scale_embedding", path, False), logits_bias=True)
    except ConfigError as e:
        raise MarianImportError(f"{path}: {e}") from None


def _token_text(tok_config: dict[str, Any], name: str, default: str, where: Path) -> str:
    """A special token of tokenizer_config.json: a string, or an AddedToken's {"content": ...}."""
    value = tok_config.get(f"{name}_token") or default
    if isinstance(value, dict):
        value = value.get("content")
    if not isinstance(value, str):
        raise MarianImportError(f"{where}: {name}_token is {show(value)}; expected a string")
    return value


def tokenizer(files: HFFiles, cfg: ModelConfig) -> VocabTokenizer:
    """The source/target SentencePiece models over vocab.json, checked against the model's ids."""
    hf_dir, path = files.dir, files.path(TOKENIZER_CONFIG)
    tok_config = files.optional_json(TOKENIZER_CONFIG)
    if flag(tok_config, "separate_vocabs", path, False):
        raise MarianImportError(f"{path}: separate_vocabs is true; only a shared vocab.json can be imported")
    specials = {name: _token_text(tok_config, name, default, path)
                for name, default in (("eos", "</s>"), ("unk", "<unk>"), ("pad", "<pad>"))}
    vocab = files.json(VOCAB)
    models = {name: files.read_bytes(name) for name in (SOURCE_SPM, TARGET_SPM)}
    for name, data in models.items():
        check_sentencepiece(files.path(name), data, vocab, VOCAB)
    try:
        tok = VocabTokenizer(models[SOURCE_SPM], models[TARGET_SPM],
                             vocab, eos=specials["eos"], unk=specials["unk"], pad=specials["pad"])
    except TokenizerError as e:
        raise MarianImportError(f"{hf_dir / VOCAB}: {e}") from None
    if tok.vocab_size != cfg.vocab_size:
        raise MarianImportError(f"{hf_dir / VOCAB}: {tok.vocab_size} entries but {CONFIG} says vocab_size "
                                f"{cfg.vocab_size}")
    for name, ours, theirs in (("eos", cfg.eos_id, tok.eos_id), ("pad", cfg.pad_id, tok.pad_id)):
        if ours != theirs:
            raise MarianImportError(f"{hf_dir / VOCAB}: {specials[name]} is id {theirs} but {CONFIG} says "
                                    f"{name}_token_id {ours}")
    return tok


def language_pair(files: HFFiles) -> dict[str, str] | None:
    """tokenizer_config.json's source_lang / target_lang (OPUS-MT writes them: "de", "en"), when both are
    language codes; else None, and export --src-lang/--tgt-lang can say them."""
    tok_config = files.optional_json(TOKENIZER_CONFIG)
    pair = {side: tok_config.get(f"{side}_lang") for side in ("source", "target")}
    if all(isinstance(code, str) and LANG_CODE.fullmatch(code) for code in pair.values()) and \
            pair["source"] != pair["target"]:
        return pair  # type: ignore[return-value]
    if any(pair.values()):
        log.warning("%s: source_lang %s / target_lang %s are not two language codes; give export --src-lang and "
                    "--tgt-lang", files.path(TOKENIZER_CONFIG), show(pair["source"]), show(pair["target"]))
    return None


def _tokenized(files: HFFiles, cfg: ModelConfig) -> Tokenized:
    """The tokenizer, and the language pair (served under LibreTranslate's API by these codes, whatever the
    model dir's name) as the checkpoint's extra.languages."""
    tok = tokenizer(files, cfg)
    pair = language_pair(files)
    return Tokenized(tok, extra={} if pair is None else {"languages": pair})


MARIAN = Family(
    model_type="marian", name="Marian", format="marian", what="a MarianMTModel.save_pretrained directory",
    required=(CONFIG, SOURCE_SPM, TARGET_SPM, VOCAB), optional=(GENERATION, TOKENIZER_CONFIG),
    model_config=model_config, tokenizer=_tokenized, logits_bias=True)



def import_marian(hf_dir: Path, out: Path, force: bool = False) -> dict[str, Any]:
    """`pipeline import marian`: import_checkpoint with the Marian family."""
    return import_checkpoint(hf_dir, out, force, family=MARIAN)
