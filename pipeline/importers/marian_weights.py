"""BART-family tensors (Marian, M2M-100, NLLB) in our model: their names mapped to ours, checked against
config.json on the weights file's header before anything is read, then read and placed
(every family's default: pipeline/importers/family.py). The families share their per-layer names; a
pre-LN model (ModelConfig.pre_norm) adds one final LayerNorm per stack, and its LayerNorms sit before the
sublayers, where our Residual blocks apply them too."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from model.config import ModelConfig
from model.transformer import Transformer, sinusoidal_positions
from pipeline.importers.hf_files import ImportRefused as MarianImportError
from pipeline.importers.hf_files import TensorInfo, Weights

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
FINAL_NORMS = {"model.encoder.layer_norm": "enc_norm", "model.decoder.layer_norm": "dec_norm"}  # pre-LN stacks
LAYER = re.compile(r"model\.(encoder|decoder)\.layers\.(\d{1,9})\.(.+)\.(weight|bias)")


def _layer_parts(marian_name: str) -> tuple[str, int, str, str] | None:
    """(side, layer index, module, leaf) of a Marian per-layer tensor name; None when it is not one."""
    match = LAYER.fullmatch(marian_name)
    if match is None:
        return None
    side, index, module, leaf = match.groups()
    return side, int(index), module, leaf


def layer_name(marian_name: str) -> str | None:
    """Our state-dict name of a Marian per-layer tensor; None when it is not one."""
    parts = _layer_parts(marian_name)
    if parts is None:
        return None
    side, index, module, leaf = parts
    table = ENCODER_LAYER if side == "encoder" else DECODER_LAYER
    return f"{side}.{index}.{table[module]}.{leaf}" if module in table else None


def marian_shape(name: str, cfg: ModelConfig) -> tuple[tuple[int, ...], str] | None:
    """The shape config.json gives a Marian tensor, and the fields it follows from; None: no such tensor."""
    d, v = cfg.d_model, cfg.vocab_size
    if name in EMBEDDINGS:
        return (v, d), f"vocab_size {v}, d_model {d}"
    if name in POSITIONS:
        rows = cfg.max_positions + cfg.position_offset
        return (rows, d), f"max_position_embeddings {cfg.max_positions} (+ {cfg.position_offset}), d_model {d}"
    if cfg.pre_norm and name.rpartition(".")[0] in FINAL_NORMS:
        return (d,), f"d_model {d}"
    if name == LOGITS_BIAS:
        return (1, v), f"vocab_size {v}"
    parts = _layer_parts(name)
    if parts is None or layer_name(name) is None:
        return None
    side, _, module, leaf = parts
    width = cfg.encoder_d_ff if side == "encoder" else cfg.d_ff
    ffn = f"{side}_ffn_dim {width}"
    if module in ("fc1", "fc2"):
        if leaf == "bias":
            return ((width,), ffn) if module == "fc1" else ((d,), f"d_model {d}")
        return ((width, d) if module == "fc1" else (d, width)), f"{ffn}, d_model {d}"
    return ((d, d) if module.endswith("_proj") and leaf == "weight" else (d,)), f"d_model {d}"


def expected_names(cfg: ModelConfig) -> set[str]:
    """The per-layer tensors (and a pre-LN model's final LayerNorms) config.json says the weights hold."""
    layers = {f"model.{side}.layers.{i}.{module}.{leaf}"
              for side, table, count in (("encoder", ENCODER_LAYER, cfg.n_enc_layers),
                                         ("decoder", DECODER_LAYER, cfg.n_dec_layers))
              for i in range(count) for module in table for leaf in ("weight", "bias")}
    norms = {f"{name}.{leaf}" for name in FINAL_NORMS for leaf in ("weight", "bias")} if cfg.pre_norm else set()
    return layers | norms


def _check_layers(infos: dict[str, TensorInfo], cfg: ModelConfig, path: Weights, config_path: Path) -> None:
    """The weights hold exactly config.json's layers (so that a huge layer count is refused unbuilt)."""
    for side, count in (("encoder", cfg.n_enc_layers), ("decoder", cfg.n_dec_layers)):
        held = {name: parts[1] for name in infos if (parts := _layer_parts(name)) and parts[0] == side}
        beyond = sorted((i, name) for name, i in held.items() if i >= count)
        if beyond:
            i, name = beyond[0]
            raise MarianImportError(f"{path.of(name)}: tensor {name!r} is of {side} layer {i}, but "
                                    f"{config_path.name} says {side}_layers {count}")
        if len(set(held.values())) < count:
            raise MarianImportError(f"{config_path}: {side}_layers {count}, but {path.name} holds "
                                    f"{len(set(held.values()))} {side} layers; fix the value")


def check_weights(infos: dict[str, TensorInfo], cfg: ModelConfig, path: Weights, config_path: Path) -> None:
    """Every tensor of the weights file placed, floating-point and of the shape config.json gives it,
    and none missing: checked on the header, before anything of the model's size is allocated."""
    present = [k for k in EMBEDDINGS if k in infos]
    if not present:
        raise MarianImportError(f"{path}: no embedding ({' / '.join(EMBEDDINGS)})")
    shape = infos[present[0]].shape
    if shape != (cfg.vocab_size, cfg.d_model):
        raise MarianImportError(f"{config_path}: vocab_size {cfg.vocab_size}, d_model {cfg.d_model} disagree with "
                                f"{path.name}, whose {present[0]} has shape {shape}; fix the values")
    _check_layers(infos, cfg, path, config_path)
    for name, info in infos.items():
        expected = marian_shape(name, cfg)
        if expected is None:
            raise MarianImportError(f"{path.of(name)}: tensor {name!r} has no place in our model (not a layout this "
                                    "importer knows)")
        if not info.floating:
            raise MarianImportError(f"{path.of(name)}: {name} holds {info.dtype}, not floating-point weights")
        want, fields = expected
        if info.shape != want and not (name == LOGITS_BIAS and info.shape == (cfg.vocab_size,)):
            raise MarianImportError(f"{path.of(name)}: {name} has shape {info.shape}, but {config_path.name} "
                                    f"({fields}) implies {want}")
    missing = sorted(expected_names(cfg) - set(infos))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise MarianImportError(f"{path}: no tensor {missing[0]!r}{more}, which {config_path.name} implies")


def map_weights(state: dict[str, torch.Tensor], cfg: ModelConfig, path: Weights) -> dict[str, torch.Tensor]:
    """Our state dict from Marian's (checked by check_weights): the tied embedding, the logits bias,
    the per-layer tensors; the sinusoid tables must be Marian's."""
    state = {k: v.float() for k, v in state.items()}
    for key, tensor in state.items():  # a damaged file: export would only fail its verification, naming neither
        bad = int((~torch.isfinite(tensor)).sum())
        if bad:
            raise MarianImportError(f"{path.of(key)}: {key} holds {bad} NaN or infinite value(s); the weights are "
                                    "damaged")
    present = [k for k in EMBEDDINGS if k in state]
    emb = state[present[0]]
    for k in present[1:]:
        if not torch.equal(state[k], emb):
            raise MarianImportError(f"{path.of(k)}: {k} differs from {present[0]}: the model does not tie its "
                                    "embeddings and output projection, which our model requires")
    ours: dict[str, torch.Tensor] = {"embed.weight": emb}
    bias = state.get(LOGITS_BIAS)
    ours["logits_bias"] = torch.zeros(cfg.vocab_size) if bias is None else bias.reshape(-1)
    if any(k in state for k in POSITIONS):
        table = sinusoidal_positions(cfg.max_positions, cfg.d_model, cfg.positions, cfg.position_offset)
        for k in POSITIONS:
            if k in state and not torch.allclose(state[k][cfg.position_offset:], table, atol=1e-4):
                raise MarianImportError(f"{path.of(k)}: {k} is not the {cfg.positions} sinusoidal table")
    for k, v in state.items():
        name = layer_name(k)
        if name is not None:
            ours[name] = v
        elif cfg.pre_norm and k.rpartition(".")[0] in FINAL_NORMS:
            module, _, leaf = k.rpartition(".")
            ours[f"{FINAL_NORMS[module]}.{leaf}"] = v
    return ours


def build(cfg: ModelConfig, mapped: dict[str, torch.Tensor], family: str) -> Transformer:
    """Our model holding the mapped weights (check_weights' mapping and the model must agree: a bug if not)."""
    model = Transformer(cfg)
    wanted = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if {k: tuple(v.shape) for k, v in mapped.items()} != wanted:
        raise RuntimeError(f"the {family} mapping disagrees with the model: {sorted(set(mapped) ^ set(wanted))[:4]}")
    model.load_state_dict(mapped)
    return model
