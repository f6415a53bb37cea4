"""`pipeline import [FAMILY] HF_DIR --out CHECKPOINT`: a model trained elsewhere, as one of our checkpoints, in
the same steps for every family (CTranslate2's `Converter.convert`: load, validate, transform, save).

The steps, in order (docs/import.md): open the directory (HfDir), pick the family (named, else config.json's
model_type through the registry, then its variant by the tokenizer's files), check that its files are there
and inside the directory, map config.json to our ModelConfig, check the weights' header against it, read the
generation defaults, build the tokenizer, and only then read, map and place the weights and save. Every check
that can fail runs before the model is built: a hostile config.json allocates nothing."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch

from model.atomic import is_special_file
from model.checkpoint import save_checkpoint
from model.config import ConfigError, ModelConfig
from pipeline.importers import registry
from pipeline.importers.family import Family
from pipeline.importers.hf_dir import CONFIG, HfDir
from pipeline.importers.hf_files import ImportRefused, allowed_roots, wrong_type
from pipeline.importers.hf_generation import generation
from pipeline.importers.marian_weights import build
from pipeline.textio import check_output_file, refuse_overwriting_inputs

log = logging.getLogger(__name__)


def import_checkpoint(hf_dir: Path, out: Path, force: bool = False, family: Family | None = None) -> dict[str, Any]:
    """Write `out`, one of our checkpoints, from a local save_pretrained directory of `family` (None: the one
    config.json's model_type names); returns a summary (the checkpoint, its SHA-256, the config, the decoding
    defaults, the family's name and, for a multilingual model, its languages)."""
    hf_dir, out = Path(hf_dir), Path(out)
    # the directory and, for a hub cache snapshot, the blobs its files link to: --force replaces neither
    refuse_overwriting_inputs([], [out], "checkpoint", input_dirs=[hf_dir, *allowed_roots(hf_dir)])
    if out.exists() and not force and not is_special_file(out):  # /dev/null or a pipe is written through
        raise ImportRefused(f"{out}: exists; pass --force to replace it")
    check_output_file(out, "--out", "a checkpoint")  # after the inputs' check: it writes a probe where `out` goes
    hf = HfDir.open(hf_dir, family.what if family is not None else registry.WHAT)
    named = hf.config().get("model_type") if family is not None else None
    if family is not None and named is not None and named != family.model_type:  # before its files are missed
        known = named in registry.families()
        raise ImportRefused(f"{hf_dir / CONFIG}: {wrong_type({'model_type': named}, family.model_type)}; " + (
            f"`pipeline import {hf_dir}` takes the family model_type names" if known
            else f"pipeline import knows {registry.known()}"))
    family = (family or registry.family_of(hf)).variant(hf)
    hf.require(family.what, family.required, family.optional)
    config = hf.config()
    cfg = family.model_config(config, hf_dir / CONFIG)
    # the sizes against the weights' header, before the tokenizer or the model builds anything of them
    family.check_weights(hf.header(), cfg, hf.located, hf_dir / CONFIG)
    defaults, suppress = generation(hf, config, cfg)
    tokenized = family.tokenizer(hf, cfg)
    tok = tokenized.tokenizer
    try:
        cfg = dataclasses.replace(cfg, unk_id=tok.unk_id, suppress_ids=suppress, **tokenized.config)
    except ConfigError as e:
        raise ImportRefused(f"{hf_dir / CONFIG}: {e}") from None
    cfg, mapped = _logits_bias(family, cfg, family.map_weights(hf.tensors(), cfg, hf.located), hf.weights)
    model = build(cfg, mapped, family.name)
    extra = {"decoding": defaults, "imported": hf.provenance(family.format), **tokenized.extra}
    try:  # without --force, never over what appeared at --out while this import ran
        sha = save_checkpoint(out, model.eval(), tok.model_bytes, extra=extra, replace=force)
    except FileExistsError:
        raise ImportRefused(f"{out}: appeared while this import ran; nothing was replaced: pass --force to replace "
                            "it, or choose another --out") from None
    log.info("imported %s (%s): %d parameters, vocabulary %d%s, decoding defaults %s -> %s", hf_dir, family.name,
             sum(p.numel() for p in model.parameters()), cfg.vocab_size,
             f", {len(cfg.languages)} languages" if cfg.languages else "", defaults, out)
    summary = {"checkpoint": str(out), "sha256": sha, "config": cfg.to_dict(), "decoding": defaults,
               "family": family.name}
    if cfg.languages:
        summary["languages"] = [code for code, _ in cfg.languages]
    pair = tokenized.extra.get("languages")  # a one-pair model's, as its tokenizer_config names them (Marian's)
    if isinstance(pair, dict):
        summary["pair"] = f"{pair['source']}-{pair['target']}"
    return summary


def _logits_bias(family: Family, cfg: ModelConfig, mapped: dict[str, torch.Tensor], weights: Path
                 ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The logits bias a family has, kept unless all zeros (no bias to add at every step); one a family has not
    must be zero."""
    bias = mapped.pop("logits_bias")
    if bool(bias.any()):
        if not family.logits_bias:
            raise ImportRefused(f"{weights}: final_logits_bias is not zero; {family.name} has no logits bias")
        return dataclasses.replace(cfg, logits_bias=True), {**mapped, "logits_bias": bias}
    return dataclasses.replace(cfg, logits_bias=False), mapped
