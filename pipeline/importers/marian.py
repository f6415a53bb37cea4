"""`pipeline import marian HF_DIR --out CHECKPOINT`: an OPUS-MT / Marian model, as transformers'
`MarianMTModel.save_pretrained` and `MarianTokenizer.save_pretrained` write it, into one of our
checkpoints, which every other command then takes as it is. Reads local files only.

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

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

from model.checkpoint import save_checkpoint
from model.config import ACTIVATIONS, ConfigError, ModelConfig
from model.transformer import Transformer
from pipeline.importers.hf_files import (
    ImportRefused,
    allowed_roots,
    digest,
    flag,
    inside,
    integer,
    number,
    optional_integer,
    read_json,
    show,
    token_id,
    weight_infos,
)
from pipeline.importers.marian_weights import (
    check_weights,
    map_weights,
    read_weights,
)
from pipeline.textio import refuse_overwriting_inputs
from runtime.decoding import DecodingOptions
from runtime.tokenizer import TokenizerError, VocabTokenizer

log = logging.getLogger(__name__)

CONFIG, GENERATION, VOCAB = "config.json", "generation_config.json", "vocab.json"
SOURCE_SPM, TARGET_SPM, TOKENIZER_CONFIG = "source.spm", "target.spm", "tokenizer_config.json"
WEIGHTS = ("model.safetensors", "pytorch_model.bin")
ACTIVATION_NAMES = {"relu": "relu", "swish": "swish", "silu": "swish", "gelu": "gelu"}



GENERATION_NAMES = {"beam_size": "num_beams", "alpha": "length_penalty", "max_len_b": "max_length",
                    "min_len": "min_length"}  # our DecodingOptions fields as generation_config.json names them
MAX_POSITIONS = 16384  # OPUS-MT ships 512, Marian's big models 1024; the sinusoid table is built whole at load



MarianImportError = ImportRefused  # a directory that is not a Marian model this importer can map


def _files(hf_dir: Path) -> Path:
    """The weights file; every file the import needs is there, inside the directory (else an error
    naming it)."""
    if not hf_dir.is_dir():
        raise MarianImportError(f"{hf_dir}: no such directory (a MarianMTModel.save_pretrained directory)")
    roots = allowed_roots(hf_dir)
    for name in (CONFIG, SOURCE_SPM, TARGET_SPM, VOCAB, GENERATION, TOKENIZER_CONFIG, *WEIGHTS):
        path = hf_dir / name
        if (path.exists() or path.is_symlink()) and not inside(path, roots):
            raise MarianImportError(f"{path}: links to {os.path.realpath(path)}, outside {hf_dir}; the import "
                                    "reads only files inside the directory it is given: copy the file in")
    for name in (CONFIG, SOURCE_SPM, TARGET_SPM, VOCAB):
        if not (hf_dir / name).is_file():
            raise MarianImportError(f"{hf_dir / name}: missing; a Marian directory holds {CONFIG}, {SOURCE_SPM}, "
                                    f"{TARGET_SPM}, {VOCAB} and {' or '.join(WEIGHTS)}")
    for name in WEIGHTS:
        if (hf_dir / name).is_file():
            return hf_dir / name
    raise MarianImportError(f"{hf_dir / WEIGHTS[0]}: missing (nor is there a {WEIGHTS[1]})")


def _provenance(hf_dir: Path) -> dict[str, Any]:
    """Every file of the directory with its SHA-256; a file linking outside it is neither read nor
    hashed, but named (a counted warning, and `skipped` in the record)."""
    roots = allowed_roots(hf_dir)
    files = sorted(p for p in hf_dir.iterdir() if p.is_file())
    skipped = [p.name for p in files if not inside(p, roots)]
    if skipped:
        log.warning("%s: skipped %d file%s linking outside the directory (not read, not hashed): %s", hf_dir,
                    len(skipped), "" if len(skipped) == 1 else "s", ", ".join(skipped))
    return {"format": "marian", "directory": str(hf_dir.resolve()),
            "files": {p.name: digest(p) for p in files if p.name not in skipped}, "skipped": skipped}


# -- config.json, generation_config.json, the tokenizer ---------------------------------------------


def model_config(config: dict[str, Any], path: Path) -> ModelConfig:
    """Our ModelConfig for a Marian config.json (refusing what our model cannot compute)."""
    if config.get("model_type") != "marian":
        raise MarianImportError(f"{path}: model_type is {config.get('model_type')!r:.60}, not 'marian'")
    sizes = {key: integer(config, key, path) for key in ("vocab_size", "d_model", "encoder_attention_heads",
                                                          "encoder_ffn_dim", "encoder_layers", "decoder_layers",
                                                          "max_position_embeddings")}
    vocab = sizes["vocab_size"]
    # the depths may differ (our model has n_enc_layers and n_dec_layers: deep-encoder, shallow-decoder
    # students); one FFN width, one head count and one vocabulary are what ModelConfig holds today
    pairs = [("decoder_vocab_size", vocab), ("decoder_attention_heads", None), ("decoder_ffn_dim", None)]
    for key, expected in pairs:
        twin = key.replace("decoder_", "encoder_") if expected is None else "vocab_size"
        value, want = config.get(key), config.get(twin) if expected is None else expected
        if value is not None and value != want:
            raise MarianImportError(f"{path}: {key} {show(value)} differs from {twin} {show(want)}; only models "
                                    "with one FFN width, head count and vocabulary for encoder and decoder can be "
                                    "imported (their depths may differ)")
    if config.get("share_encoder_decoder_embeddings", True) is not True:
        raise MarianImportError(f"{path}: share_encoder_decoder_embeddings is false (separate vocabularies); only "
                                "shared-vocabulary models can be imported")
    if sizes["max_position_embeddings"] > MAX_POSITIONS:
        raise MarianImportError(f"{path}: max_position_embeddings {sizes['max_position_embeddings']} is above "
                                f"{MAX_POSITIONS} (Marian models use 512 or 1024); fix the value")
    d_model, heads = sizes["d_model"], sizes["encoder_attention_heads"]
    if d_model % heads or d_model % 2:
        raise MarianImportError(f"{path}: d_model {d_model} must be even and divisible by encoder_attention_heads "
                                f"{heads}")
    activation = config.get("activation_function")
    act = ACTIVATION_NAMES.get(activation) if isinstance(activation, str) else None
    if act not in ACTIVATIONS:
        raise MarianImportError(f"{path}: activation_function {show(activation)} is not one of "
                                f"{', '.join(ACTIVATION_NAMES)}")
    pad = token_id(config, "pad_token_id", path, vocab)
    start = pad if config.get("decoder_start_token_id") is None else token_id(
        config, "decoder_start_token_id", path, vocab)
    dropout = number(config, "dropout", path, 0.1)
    if not 0.0 <= dropout < 1.0:
        raise MarianImportError(f"{path}: dropout {dropout} must be in [0, 1)")
    try:
        return ModelConfig(
            vocab_size=vocab, d_model=d_model, n_heads=heads, d_ff=sizes["encoder_ffn_dim"],
            n_enc_layers=sizes["encoder_layers"], n_dec_layers=sizes["decoder_layers"], dropout=dropout,
            max_positions=sizes["max_position_embeddings"], pad_id=pad, bos_id=start,
            eos_id=token_id(config, "eos_token_id", path, vocab), activation=act, positions="halves",
            scale_embedding=flag(config, "scale_embedding", path, False), logits_bias=True)
    except ConfigError as e:
        raise MarianImportError(f"{path}: {e}") from None


def _suppressed(gen: dict[str, Any], where: Path, cfg: ModelConfig) -> tuple[int, ...]:
    """The ids of bad_words_ids: single-token entries only, never the eos id."""
    entries = gen.get("bad_words_ids") or []
    if not isinstance(entries, list):
        raise MarianImportError(f"{where}: bad_words_ids is {show(entries)}; expected a list of [id] lists")
    suppress = []
    for words in entries:
        if not isinstance(words, list) or len(words) != 1 or isinstance(words[0], bool) \
                or not isinstance(words[0], int):
            raise MarianImportError(f"{where}: bad_words_ids entry {show(words)}: only single-token entries "
                                    "(the padding id, as OPUS-MT ships) can be imported")
        if not 0 <= words[0] < cfg.vocab_size or words[0] == cfg.eos_id:
            raise MarianImportError(f"{where}: bad_words_ids entry {words}: not an id of the vocabulary other than "
                                    f"the eos id {cfg.eos_id} (0..{cfg.vocab_size - 1})")
        suppress.append(words[0])
    return tuple(sorted(set(suppress)))


def generation(hf_dir: Path, config: dict[str, Any], cfg: ModelConfig) -> tuple[dict[str, Any], tuple[int, ...]]:
    """(our decoding defaults, ids never generated) from generation_config.json (else config.json),
    checked here, naming its fields, rather than blamed on a command-line option later."""
    path = hf_dir / GENERATION
    gen = read_json(path) if path.is_file() else config
    where = path if path.is_file() else hf_dir / CONFIG
    suppress = _suppressed(gen, where, cfg)
    forced = gen.get("forced_eos_token_id", cfg.eos_id)
    if isinstance(forced, list) and len(forced) == 1:
        forced = forced[0]
    if forced is not None and (isinstance(forced, bool) or forced != cfg.eos_id):
        raise MarianImportError(f"{where}: forced_eos_token_id {show(forced)} is not the eos id {cfg.eos_id}")
    if gen.get("early_stopping") not in (None, False):
        raise MarianImportError(f"{where}: early_stopping {show(gen['early_stopping'])}: only transformers' default "
                                "(false) is implemented (runtime/search.py)")
    ignored = {k: gen[k] for k, default in (("no_repeat_ngram_size", 0), ("repetition_penalty", 1.0),
                                             ("do_sample", False)) if gen.get(k) not in (None, default)}
    if ignored:
        log.warning("%s: %s not imported: the model dir decodes without them", where,
                    ", ".join(f"{k}={v!r}" for k, v in ignored.items()))
    max_length = optional_integer(gen, "max_length", where, 512, minimum=3,
                                   why=" (it counts the decoder start and the EOS: 3 leaves room for one token)")
    min_length = optional_integer(gen, "min_length", where, 0, minimum=0)
    if min_length > max_length - 1:
        raise MarianImportError(f"{where}: min_length {min_length} is above max_length {max_length} - 1")
    alpha = number(gen, "length_penalty", where, 1.0)
    if alpha < 0:
        raise MarianImportError(f"{where}: length_penalty {alpha} is negative; our search takes 0 or more")
    defaults: dict[str, Any] = {
        "rules": "transformers",
        "beam_size": optional_integer(gen, "num_beams", where, 1, minimum=1),
        "alpha": alpha,
        # transformers' max_length counts the decoder start token and the EOS
        "max_len_a": 0.0, "max_len_b": max_length - 2,
        "min_len": max(0, min_length - 1),
    }
    # what a model dir's defaults must pass (runtime.decoding), named as generation_config.json names them
    problems = DecodingOptions(**defaults).problems(name=lambda field: GENERATION_NAMES.get(field, field))
    if problems:
        raise MarianImportError(f"{where}: impossible decoding defaults ({'; '.join(problems)})")
    return defaults, suppress


def _token_text(tok_config: dict[str, Any], name: str, default: str, where: Path) -> str:
    """A special token of tokenizer_config.json: a string, or an AddedToken's {"content": ...}."""
    value = tok_config.get(f"{name}_token") or default
    if isinstance(value, dict):
        value = value.get("content")
    if not isinstance(value, str):
        raise MarianImportError(f"{where}: {name}_token is {show(value)}; expected a string")
    return value


def tokenizer(hf_dir: Path, cfg: ModelConfig) -> VocabTokenizer:
    """The source/target SentencePiece models over vocab.json, checked against the model's ids."""
    path = hf_dir / TOKENIZER_CONFIG
    tok_config = read_json(path) if path.is_file() else {}
    if flag(tok_config, "separate_vocabs", path, False):
        raise MarianImportError(f"{path}: separate_vocabs is true; only a shared vocab.json can be imported")
    specials = {name: _token_text(tok_config, name, default, path)
                for name, default in (("eos", "</s>"), ("unk", "<unk>"), ("pad", "<pad>"))}
    vocab = read_json(hf_dir / VOCAB)
    try:
        tok = VocabTokenizer((hf_dir / SOURCE_SPM).read_bytes(), (hf_dir / TARGET_SPM).read_bytes(),
                             vocab, **specials)
    except TokenizerError as e:
        raise MarianImportError(f"{hf_dir / VOCAB}: {e}") from None
    except RuntimeError as e:  # SentencePiece's own parse error
        raise MarianImportError(f"{hf_dir}: {SOURCE_SPM} or {TARGET_SPM} is not a SentencePiece model ({e})") from None
    if tok.vocab_size != cfg.vocab_size:
        raise MarianImportError(f"{hf_dir / VOCAB}: {tok.vocab_size} entries but {CONFIG} says vocab_size "
                                f"{cfg.vocab_size}")
    for name, ours, theirs in (("eos", cfg.eos_id, tok.eos_id), ("pad", cfg.pad_id, tok.pad_id)):
        if ours != theirs:
            raise MarianImportError(f"{hf_dir / VOCAB}: {specials[name]} is id {theirs} but {CONFIG} says "
                                    f"{name}_token_id {ours}")
    return tok


# -- the weights: checked on the file's header, read only once they fit config.json ----------------


def import_marian(hf_dir: Path, out: Path, force: bool = False) -> dict[str, Any]:
    """Write `out`, one of our checkpoints, from a local Marian directory; returns a summary. Every
    check that can fail runs before the model is built: a hostile config.json allocates nothing."""
    hf_dir, out = Path(hf_dir), Path(out)
    refuse_overwriting_inputs([], [out], "checkpoint", input_dirs=[hf_dir])
    if out.exists() and not force:
        raise MarianImportError(f"{out}: exists; pass --force to replace it")
    weights = _files(hf_dir)
    config = read_json(hf_dir / CONFIG)
    cfg = model_config(config, hf_dir / CONFIG)
    defaults, suppress = generation(hf_dir, config, cfg)
    tok = tokenizer(hf_dir, cfg)
    cfg = dataclasses.replace(cfg, unk_id=tok.unk_id, suppress_ids=suppress)
    check_weights(weight_infos(weights), cfg, weights, hf_dir / CONFIG)
    mapped = map_weights(read_weights(weights), cfg, weights)
    model = Transformer(cfg)
    wanted = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if {k: tuple(v.shape) for k, v in mapped.items()} != wanted:  # check_weights' mapping and the model agree
        raise RuntimeError(f"the Marian mapping disagrees with the model: {sorted(set(mapped) ^ set(wanted))[:4]}")
    model.load_state_dict(mapped)
    if not bool(mapped["logits_bias"].any()):  # all zeros: no bias to add at every step
        model = _without_logits_bias(model)
    extra = {"decoding": defaults, "imported": _provenance(hf_dir)}
    sha = save_checkpoint(out, model.eval(), tok.model_bytes, extra=extra)
    log.info("imported %s: %d parameters, vocabulary %d, decoding defaults %s -> %s", hf_dir,
             sum(p.numel() for p in model.parameters()), cfg.vocab_size, defaults, out)
    return {"checkpoint": str(out), "sha256": sha, "config": cfg.to_dict(), "decoding": defaults}


def _without_logits_bias(model: Transformer) -> Transformer:
    slim = Transformer(dataclasses.replace(model.cfg, logits_bias=False))
    state = {k: v for k, v in model.state_dict().items() if k != "logits_bias"}
    slim.load_state_dict(state)
    return slim
