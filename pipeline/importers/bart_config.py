"""The shape fields of a BART-family config.json (Marian, M2M-100, NLLB), as our ModelConfig holds them.

Encoder and decoder may differ in depth, feed-forward width and head count: ModelConfig's n_heads and d_ff
are the decoder's (its caches and cross-attention use them), enc_heads and enc_d_ff the encoder's where they
differ. One vocabulary is shared by encoder, decoder and output projection (ModelConfig has one)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from model.config import ACTIVATIONS
from pipeline.importers.hf_files import ImportRefused, integer, number, show

ACTIVATION_NAMES = {"relu": "relu", "swish": "swish", "silu": "swish", "gelu": "gelu"}
MIN_POSITIONS = 32  # Marian and M2M-100 ship 512 or more
MAX_POSITIONS = 16384  # Marian and M2M-100 ship 512 or 1024; the sinusoid table is built whole at load
REQUIRED = ("vocab_size", "d_model", "encoder_attention_heads", "encoder_ffn_dim", "encoder_layers", "decoder_layers",
            "max_position_embeddings")
OPTIONAL = ("decoder_attention_heads", "decoder_ffn_dim")  # the encoder's when absent


def shape(config: dict[str, Any], path: Path, max_positions: int) -> dict[str, Any]:
    """ModelConfig's shape fields for `config` (refusing, with the field named, what our model cannot hold)."""
    sizes = {key: integer(config, key, path) for key in REQUIRED + OPTIONAL if key in REQUIRED or key in config}
    vocab = sizes["vocab_size"]
    dec_vocab = config.get("decoder_vocab_size")
    if dec_vocab is not None and dec_vocab != vocab:
        raise ImportRefused(f"{path}: decoder_vocab_size {show(dec_vocab)} differs from vocab_size {vocab}: separate "
                            "source and target vocabularies; our model has one embedding shared by encoder, decoder "
                            "and output projection (ModelConfig.vocab_size), so it cannot hold them")
    if config.get("share_encoder_decoder_embeddings", True) is not True:
        raise ImportRefused(f"{path}: share_encoder_decoder_embeddings is "
                            f"{show(config['share_encoder_decoder_embeddings'])} (separate vocabularies); our model "
                            "has one embedding shared by encoder, decoder and output projection, so it cannot hold "
                            "two")
    if sizes["max_position_embeddings"] > max_positions:
        raise ImportRefused(f"{path}: max_position_embeddings {sizes['max_position_embeddings']} is above "
                            f"{max_positions}; fix the value")
    if sizes["max_position_embeddings"] < MIN_POSITIONS:  # export's verification alone decodes 12 steps of 9 tokens
        raise ImportRefused(f"{path}: max_position_embeddings {sizes['max_position_embeddings']} is below "
                            f"{MIN_POSITIONS}: too few positions for a sentence; fix the value")
    d_model = sizes["d_model"]
    enc_heads = sizes["encoder_attention_heads"]
    dec_heads = sizes.get("decoder_attention_heads", enc_heads)
    for key, heads in (("encoder_attention_heads", enc_heads), ("decoder_attention_heads", dec_heads)):
        if d_model % heads or d_model % 2:
            raise ImportRefused(f"{path}: d_model {d_model} must be even and divisible by {key} {heads}")
    enc_ffn = sizes["encoder_ffn_dim"]
    dec_ffn = sizes.get("decoder_ffn_dim", enc_ffn)
    return dict(vocab_size=vocab, d_model=d_model, n_heads=dec_heads, enc_heads=None if enc_heads == dec_heads
                else enc_heads, d_ff=dec_ffn, enc_d_ff=None if enc_ffn == dec_ffn else enc_ffn,
                n_enc_layers=sizes["encoder_layers"], n_dec_layers=sizes["decoder_layers"],
                max_positions=sizes["max_position_embeddings"])


def activation_and_dropout(config: dict[str, Any], path: Path, default_activation: str | None) -> dict[str, Any]:
    """ModelConfig's activation and dropout from `activation_function` and `dropout`."""
    value = config.get("activation_function", default_activation)
    act = ACTIVATION_NAMES.get(value) if isinstance(value, str) else None
    if act not in ACTIVATIONS:
        raise ImportRefused(f"{path}: activation_function {show(value)} is not one of {', '.join(ACTIVATION_NAMES)}")
    dropout = number(config, "dropout", path, 0.1)
    if not 0.0 <= dropout < 1.0:
        raise ImportRefused(f"{path}: dropout {dropout} must be in [0, 1)")
    return dict(activation=act, dropout=dropout)


def check_tied(config: dict[str, Any], path: Path) -> None:
    """Refuse an untied output projection: our model ties it to the embedding (transformers would build a
    separate head, so the import would be another model)."""
    if config.get("tie_word_embeddings", True) is not True:
        raise ImportRefused(f"{path}: tie_word_embeddings is {show(config['tie_word_embeddings'])}; our model ties "
                            "its output projection to the embedding")
