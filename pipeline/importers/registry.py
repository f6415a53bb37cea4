"""The model families `pipeline import` knows, by config.json's `model_type` (CTranslate2's `register_loader`).

Each entry names the module attribute holding the family's `Family` (pipeline/importers/family.py), imported
only when a directory of that type is imported (M2M-100's tokenizer imports transformers). A new family is
one module and one line here; `pipeline import DIR` then takes it by its model_type."""

from __future__ import annotations

import importlib
from typing import Any

from pipeline.importers.family import Family
from pipeline.importers.hf_dir import CONFIG, HfDir
from pipeline.importers.hf_files import ImportRefused, show

FAMILIES = {  # config.json's model_type -> the module:attribute of its Family
    "marian": "pipeline.importers.marian:MARIAN",
    "m2m_100": "pipeline.importers.m2m100:M2M100",
}
COMMANDS = {  # `pipeline import NAME DIR`: the families by name (the form before `pipeline import DIR`)
    "marian": "marian",
    "m2m100": "m2m_100",
    "nllb": "m2m_100",  # NLLB-200: M2M-100's architecture with its own tokenizer (a variant of m2m_100)
}
WHAT = "a transformers save_pretrained directory"


def family(model_type: str) -> Family:
    """The family of `model_type` (one of FAMILIES)."""
    module, _, attr = FAMILIES[model_type].partition(":")
    found = getattr(importlib.import_module(module), attr)
    if not isinstance(found, Family) or found.model_type != model_type:
        raise RuntimeError(f"registry: {FAMILIES[model_type]} is not the Family of model_type {model_type!r}")
    return found


def families() -> dict[str, Family]:
    """Every family, by model_type."""
    return {model_type: family(model_type) for model_type in FAMILIES}


def known() -> str:
    """The families, as one line names them: "marian (Marian), m2m_100 (M2M-100, NLLB)"."""
    return ", ".join(f"{t} ({', '.join(f.name for f in (f, *f.variants))})" for t, f in families().items())


def family_of(hf: HfDir) -> Family:
    """The family config.json's model_type names; else one line naming the model_type and the families known."""
    config: dict[str, Any] = hf.config()
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        said = "no 'model_type'" if model_type is None else f"model_type {show(model_type)} is not a family " \
            "pipeline import knows"
        raise ImportRefused(f"{hf.dir / CONFIG}: {said}; it knows {known()}")
    return family(model_type)
