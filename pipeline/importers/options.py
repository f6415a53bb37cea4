"""What every `pipeline import` command takes besides HF_DIR (its command line is generated from these fields).
Imports neither PyTorch nor transformers, so `pipeline import --help` and a deploy install's one-line refusal come
before either is needed."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from model.errors import UserError
from runtime.fields import Checked, opt


@dataclass(frozen=True)
class ImportOptions(Checked):
    """Where the checkpoint goes, and whether it may replace one there."""

    error = UserError

    out: Path = opt(help="Checkpoint file to write (atomically, with its SHA-256).")
    force: bool = opt(False, "Replace OUT if it exists.")
