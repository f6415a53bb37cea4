"""A model family as the import takes it (CTranslate2's `register_loader` entries): everything one `model_type`
differs in, as data and a few functions, while the steps and their order are written once
(pipeline/importers/convert.py) and the table of families is pipeline/importers/registry.py.

A BART-family model (its tensors named as Marian's and M2M-100's: pipeline/importers/marian_weights.py) is
one short module defining a `Family` (its files, its config.json mapping, its tokenizer) and one entry in
the registry; docs/import.md says how."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from model.config import ModelConfig
from pipeline.importers import marian_weights
from pipeline.importers.hf_dir import HfDir
from pipeline.importers.hf_files import TensorInfo, Weights
from runtime.tokenizer import VocabTokenizer


@dataclass(frozen=True)
class Tokenized:
    """What a family's tokenizer step gives the import: the tokenizer stored in the checkpoint, the ModelConfig
    fields it decides besides unk_id (a multilingual model's `languages`), and entries of the checkpoint's
    `extra` (Marian's language pair)."""

    tokenizer: VocabTokenizer
    config: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Family:
    """One model family (one `model_type` of config.json, or a variant of one: NLLB is M2M-100 with its own
    tokenizer). The import runs its functions in this order: model_config, check_weights (on the header),
    tokenizer, map_weights."""

    model_type: str  # config.json's model_type
    name: str  # what the summary line and errors call it: "Marian", "M2M-100", "NLLB"
    format: str  # recorded as the checkpoint's extra.imported.format: "marian", "m2m100", "nllb"
    what: str  # the directory it reads, for "missing" errors: "a MarianMTModel.save_pretrained directory"
    required: tuple[str, ...]  # the files besides the weights it needs
    optional: tuple[str, ...]  # the files it reads when present
    # config.json -> our ModelConfig (sizes, ids, activation...), refusing with the field named what ours cannot hold
    model_config: Callable[[dict[str, Any], Path], ModelConfig]
    # the tokenizer, checked against the ModelConfig (sizes already checked against the weights' header)
    tokenizer: Callable[[HfDir, ModelConfig], Tokenized]
    # whether it has a final_logits_bias (kept unless all zeros); without one, a non-zero bias is refused
    logits_bias: bool
    # the weights' header against the ModelConfig (before anything of its sizes is allocated), then the mapping
    check_weights: Callable[[dict[str, TensorInfo], ModelConfig, Weights, Path], None] = marian_weights.check_weights
    map_weights: Callable[[dict[str, torch.Tensor], ModelConfig, Weights], dict[str, torch.Tensor]] = \
        marian_weights.map_weights
    # variants of the same model_type told apart by the directory's files (detect), the first that matches wins
    variants: tuple[Family, ...] = ()
    detect: Callable[[HfDir], bool] | None = None

    @property
    def reads(self) -> tuple[str, ...]:
        """Every file besides the weights that it or a variant of it may read: all are checked to lie inside the
        directory before any is opened."""
        names = [*self.required, *self.optional, *(n for v in self.variants for n in v.reads)]
        return tuple(dict.fromkeys(names))

    def variant(self, hf: HfDir) -> Family:
        """The variant the directory holds (itself when none matches); every file any of them reads is checked to
        lie inside the directory first."""
        hf.inside(self.reads)
        return next((v for v in self.variants if v.detect is not None and v.detect(hf)), self)
