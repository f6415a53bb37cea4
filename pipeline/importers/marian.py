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
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import torch

from model.checkpoint import save_checkpoint
from model.config import ACTIVATIONS, ModelConfig
from model.errors import UserError
from model.transformer import Transformer, sinusoidal_positions
from runtime.tokenizer import TokenizerError, VocabTokenizer

log = logging.getLogger(__name__)

CONFIG, GENERATION, VOCAB = "config.json", "generation_config.json", "vocab.json"
SOURCE_SPM, TARGET_SPM, TOKENIZER_CONFIG = "source.spm", "target.spm", "tokenizer_config.json"
WEIGHTS = ("model.safetensors", "pytorch_model.bin")
ACTIVATION_NAMES = {"relu": "relu", "swish": "swish", "silu": "swish", "gelu": "gelu"}

# Marian's per-layer module names -> ours (post-LN residual blocks hold our LayerNorms).
ENCODER_LAYER = {
    "self_attn.q_proj": "self_attn.q_proj", "self_attn.k_proj": "self_attn.k_proj",
    "self_attn.v_proj": "self_attn.v_proj", "self_attn.out_proj": "self_attn.out_proj",
    "self_attn_layer_norm": "res_attn.norm", "fc1": "ffn.w1", "fc2": "ffn.w2", "final_layer_norm": "res_ffn.norm",
}
DECODER_LAYER = {
    "self_attn.q_proj": "self_attn.q_proj", "self_attn.k_proj": "self_attn.k_proj",
    "self_attn.v_proj": "self_attn.v_proj", "self_attn.out_proj": "self_attn.out_proj",
    "self_attn_layer_norm": "res_self.norm",
    "encoder_attn.q_proj": "cross_attn.q_proj", "encoder_attn.k_proj": "cross_attn.k_proj",
    "encoder_attn.v_proj": "cross_attn.v_proj", "encoder_attn.out_proj": "cross_attn.out_proj",
    "encoder_attn_layer_norm": "res_cross.norm", "fc1": "ffn.w1", "fc2": "ffn.w2", "final_layer_norm": "res_ffn.norm",
}
EMBEDDINGS = ("model.shared.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight",
              "lm_head.weight")
POSITIONS = ("model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight")
LOGITS_BIAS = "final_logits_bias"


class MarianImportError(UserError):
    """A directory that is not a Marian model this importer can map (names the file)."""


def layer_name(marian_name: str) -> str | None:
    """Our state-dict name of a Marian per-layer tensor; None when it is not one."""
    for side, table in (("encoder", ENCODER_LAYER), ("decoder", DECODER_LAYER)):
        prefix = f"model.{side}.layers."
        if marian_name.startswith(prefix):
            index, rest = marian_name[len(prefix):].split(".", 1)
            module, leaf = rest.rsplit(".", 1)
            if module in table:
                return f"{side}.{index}.{table[module]}.{leaf}"
    return None


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise MarianImportError(f"{path}: unreadable ({e})") from None
    if not isinstance(data, dict):
        raise MarianImportError(f"{path}: expected a JSON object")
    return data


def _files(hf_dir: Path) -> Path:
    """The weights file; every file the import needs is there (else an error naming it)."""
    if not hf_dir.is_dir():
        raise MarianImportError(f"{hf_dir}: no such directory (a MarianMTModel.save_pretrained directory)")
    for name in (CONFIG, SOURCE_SPM, TARGET_SPM, VOCAB):
        if not (hf_dir / name).is_file():
            raise MarianImportError(f"{hf_dir / name}: missing; a Marian directory holds {CONFIG}, {SOURCE_SPM}, "
                               f"{TARGET_SPM}, {VOCAB} and {' or '.join(WEIGHTS)}")
    for name in WEIGHTS:
        if (hf_dir / name).is_file():
            return hf_dir / name
    raise MarianImportError(f"{hf_dir / WEIGHTS[0]}: missing (nor is there a {WEIGHTS[1]})")


def model_config(config: dict[str, Any], path: Path, suppress: tuple[int, ...]) -> ModelConfig:
    """Our ModelConfig for a Marian config.json (refusing what our model cannot compute)."""
    if config.get("model_type") != "marian":
        raise MarianImportError(f"{path}: model_type is {config.get('model_type')!r}, not 'marian'")

    def need(key: str) -> Any:
        if key not in config:
            raise MarianImportError(f"{path}: no {key!r}")
        return config[key]

    vocab = need("vocab_size")
    pairs = [("decoder_vocab_size", vocab), ("decoder_layers", None), ("decoder_attention_heads", None),
             ("decoder_ffn_dim", None)]
    for key, expected in pairs:
        twin = key.replace("decoder_", "encoder_") if expected is None else "vocab_size"
        value, want = config.get(key), config.get(twin) if expected is None else expected
        if value is not None and value != want:
            raise MarianImportError(f"{path}: {key} {value} differs from {twin} {want}; only models with one shared "
                               "shape and vocabulary for encoder and decoder can be imported")
    if config.get("share_encoder_decoder_embeddings", True) is not True:
        raise MarianImportError(f"{path}: share_encoder_decoder_embeddings is false (separate vocabularies); only "
                           "shared-vocabulary models can be imported")
    act = ACTIVATION_NAMES.get(str(need("activation_function")))
    if act not in ACTIVATIONS:
        raise MarianImportError(f"{path}: activation_function {config['activation_function']!r} is not one of "
                           f"{', '.join(ACTIVATION_NAMES)}")
    pad = need("pad_token_id")
    return ModelConfig(
        vocab_size=vocab, d_model=need("d_model"), n_heads=need("encoder_attention_heads"),
        d_ff=need("encoder_ffn_dim"), n_enc_layers=need("encoder_layers"), n_dec_layers=need("decoder_layers"),
        dropout=float(config.get("dropout", 0.1)), max_positions=need("max_position_embeddings"),
        pad_id=pad, bos_id=config.get("decoder_start_token_id", pad), eos_id=need("eos_token_id"),
        activation=act, positions="halves", scale_embedding=bool(config.get("scale_embedding", False)),
        logits_bias=True, suppress_ids=suppress)


def generation(hf_dir: Path, config: dict[str, Any], cfg_eos: int) -> tuple[dict[str, Any], tuple[int, ...]]:
    """(our decoding defaults, ids never generated) from generation_config.json (else config.json)."""
    path = hf_dir / GENERATION
    gen = _json(path) if path.is_file() else config
    where = path if path.is_file() else hf_dir / CONFIG
    suppress = []
    for words in gen.get("bad_words_ids") or []:
        if not isinstance(words, list) or len(words) != 1 or not isinstance(words[0], int):
            raise MarianImportError(f"{where}: bad_words_ids entry {words!r}: only single-token entries (the "
                               "padding id, as OPUS-MT ships) can be imported")
        suppress.append(words[0])
    forced = gen.get("forced_eos_token_id", cfg_eos)
    if forced not in (None, cfg_eos):
        raise MarianImportError(f"{where}: forced_eos_token_id {forced} is not the eos id {cfg_eos}")
    if gen.get("early_stopping") not in (None, False):
        raise MarianImportError(f"{where}: early_stopping {gen['early_stopping']!r}: only transformers' default "
                           "(false) is implemented (runtime/search.py)")
    ignored = {k: gen[k] for k, default in (("no_repeat_ngram_size", 0), ("repetition_penalty", 1.0),
                                             ("do_sample", False)) if gen.get(k) not in (None, default)}
    if ignored:
        log.warning("%s: %s not imported: the model dir decodes without them", where,
                    ", ".join(f"{k}={v!r}" for k, v in ignored.items()))
    max_length = int(gen.get("max_length") or 512)
    if max_length < 3:
        raise MarianImportError(f"{where}: max_length {max_length} leaves no room for a translation")
    defaults = {
        "rules": "transformers",
        "beam_size": int(gen.get("num_beams") or 1),
        "alpha": float(gen.get("length_penalty", 1.0)),
        # transformers' max_length counts the decoder start token and the EOS
        "max_len_a": 0.0, "max_len_b": max_length - 2,
        "min_len": max(0, int(gen.get("min_length") or 0) - 1),
    }
    return defaults, tuple(sorted(set(suppress)))


def tokenizer(hf_dir: Path, cfg: ModelConfig) -> VocabTokenizer:
    """The source/target SentencePiece models over vocab.json, checked against the model's ids."""
    tok_config = _json(hf_dir / TOKENIZER_CONFIG) if (hf_dir / TOKENIZER_CONFIG).is_file() else {}
    if tok_config.get("separate_vocabs"):
        raise MarianImportError(f"{hf_dir / TOKENIZER_CONFIG}: separate_vocabs is true; only a shared vocab.json "
                           "can be imported")
    specials = {name: str(tok_config.get(f"{name}_token") or default)
                for name, default in (("eos", "</s>"), ("unk", "<unk>"), ("pad", "<pad>"))}
    vocab = _json(hf_dir / VOCAB)
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


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a torn or foreign file: name it
        raise MarianImportError(f"{path}: unreadable weights ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict):
        raise MarianImportError(f"{path}: not a state dict")
    return state


def map_weights(state: dict[str, torch.Tensor], cfg: ModelConfig, path: Path) -> dict[str, torch.Tensor]:
    """Our state dict from Marian's: every tensor placed or checked, none left over, none missing."""
    state = {k: v.float() for k, v in state.items()}
    present = [k for k in EMBEDDINGS if k in state]
    if not present:
        raise MarianImportError(f"{path}: no embedding ({' / '.join(EMBEDDINGS)})")
    emb = state[present[0]]
    for k in present[1:]:
        if not torch.equal(state[k], emb):
            raise MarianImportError(f"{path}: {k} differs from {present[0]}: the model does not tie its embeddings "
                               "and output projection, which our model requires")
    ours: dict[str, torch.Tensor] = {"embed.weight": emb}
    bias = state.get(LOGITS_BIAS)
    ours["logits_bias"] = torch.zeros(cfg.vocab_size) if bias is None else bias.reshape(-1)
    table = sinusoidal_positions(cfg.max_positions, cfg.d_model, "halves")
    for k in POSITIONS:
        if k in state and not torch.allclose(state[k], table, atol=1e-4):
            raise MarianImportError(f"{path}: {k} is not Marian's sinusoidal table")
    for k, v in state.items():
        if k in EMBEDDINGS or k in POSITIONS or k == LOGITS_BIAS:
            continue
        name = layer_name(k)
        if name is None:
            raise MarianImportError(f"{path}: tensor {k!r} has no place in our model (not a Marian layout this "
                               "importer knows)")
        ours[name] = v
    return ours


def digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def import_marian(hf_dir: Path, out: Path, force: bool = False) -> dict[str, Any]:
    """Write `out`, one of our checkpoints, from a local Marian directory; returns a summary."""
    hf_dir, out = Path(hf_dir), Path(out)
    if out.exists() and not force:
        raise MarianImportError(f"{out}: exists; pass --force to replace it")
    weights = _files(hf_dir)
    config = _json(hf_dir / CONFIG)
    defaults, suppress = generation(hf_dir, config, int(config.get("eos_token_id", 0)))
    cfg = model_config(config, hf_dir / CONFIG, suppress)
    tok = tokenizer(hf_dir, cfg)
    cfg = dataclasses.replace(cfg, unk_id=tok.unk_id)
    model = Transformer(cfg)
    mapped = map_weights(read_weights(weights), cfg, weights)
    result = model.load_state_dict(mapped, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise MarianImportError(f"{weights}: tensors missing for {result.missing_keys[:4]} "
                           f"{'(and more)' if len(result.missing_keys) > 4 else ''}; unexpected "
                           f"{result.unexpected_keys[:4]}")
    for name, ours in mapped.items():
        if tuple(ours.shape) != tuple(model.state_dict()[name].shape):
            raise MarianImportError(f"{weights}: {name} has shape {tuple(ours.shape)}, {CONFIG} implies "
                               f"{tuple(model.state_dict()[name].shape)}")
    if not bool(mapped["logits_bias"].any()):  # all zeros: no bias to add at every step
        model = _without_logits_bias(model)
    files = sorted(p for p in hf_dir.iterdir() if p.is_file())
    extra = {"decoding": defaults,
             "imported": {"format": "marian", "directory": str(hf_dir.resolve()),
                          "files": {p.name: digest(p) for p in files}}}
    sha = save_checkpoint(out, model.eval(), tok.model_bytes, extra=extra)
    log.info("imported %s: %d parameters, vocabulary %d, decoding defaults %s -> %s", hf_dir,
             sum(p.numel() for p in model.parameters()), cfg.vocab_size, defaults, out)
    return {"checkpoint": str(out), "sha256": sha, "config": cfg.to_dict(), "decoding": defaults}


def _without_logits_bias(model: Transformer) -> Transformer:
    slim = Transformer(dataclasses.replace(model.cfg, logits_bias=False))
    state = {k: v for k, v in model.state_dict().items() if k != "logits_bias"}
    slim.load_state_dict(state)
    return slim
