"""Checkpoint files: one self-contained `.pt` holding config, weights, tokenizer, state.

A checkpoint file carries the model config and the SentencePiece model bytes, so a
single file is enough to export or translate. Writes are atomic (temp file + rename):
a crash never leaves a file that a later run would mistake for a valid checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from model.config import ModelConfig
from model.files import atomic_write
from model.transformer import Transformer

FORMAT = "pipeline-checkpoint-v1"


class CheckpointError(ValueError):
    """A path that is not a usable checkpoint."""


def atomic_torch_save(obj: Any, path: Path) -> None:
    """torch.save that replaces `path` only once the whole file is on disk (model.files)."""
    with atomic_write(path, "wb") as f:
        torch.save(obj, f)


def save_checkpoint(path: Path, model: Transformer, spm_model: bytes,
                    train_state: dict[str, Any] | None = None,
                    extra: dict[str, Any] | None = None) -> None:
    payload = {
        "format": FORMAT,
        "model_config": model.cfg.to_dict(),
        "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "spm_model": spm_model,
        "train_state": train_state,
        "extra": extra or {},
    }
    atomic_torch_save(payload, path)


def read_checkpoint(path: Path) -> dict[str, Any]:
    """Load a checkpoint file's payload, with a clear error for anything else."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same user error
        raise CheckpointError(f"{path}: not a pipeline checkpoint ({type(e).__name__}: {e})") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a pipeline checkpoint (expected format {FORMAT})")
    return payload


def load_model(path: Path, device: str | torch.device = "cpu") -> tuple[Transformer, bytes, dict[str, Any]]:
    """(model in eval mode, SentencePiece model bytes, full payload) from a checkpoint file."""
    payload = read_checkpoint(path)
    cfg = ModelConfig.from_dict(payload["model_config"])
    model = Transformer(cfg)
    model.load_state_dict(payload["model"])
    model.to(device).eval()
    return model, payload["spm_model"], payload


# A save dir's step checkpoints: written by training, found here; the name is defined once.
STEP_PREFIX, STEP_SUFFIX = "checkpoint_", ".pt"


def step_checkpoint_path(save_dir: Path, step: int) -> Path:
    """save_dir/checkpoint_<step:08d>.pt (zero-padded so names sort like steps)."""
    return Path(save_dir) / f"{STEP_PREFIX}{step:08d}{STEP_SUFFIX}"


def checkpoint_step(path: Path) -> int | None:
    """The step in a `checkpoint_<step>.pt` name, or None for any other file name."""
    name = Path(path).name
    if not (name.startswith(STEP_PREFIX) and name.endswith(STEP_SUFFIX)):
        return None
    digits = name[len(STEP_PREFIX):-len(STEP_SUFFIX)]
    return int(digits) if digits.isdigit() else None


def step_checkpoints(save_dir: Path) -> list[Path]:
    """The save dir's `checkpoint_<step>.pt` files, oldest step first."""
    found = []
    for p in Path(save_dir).glob(f"{STEP_PREFIX}*{STEP_SUFFIX}"):
        step = checkpoint_step(p)
        if step is not None:
            found.append((step, p))
    return [p for _, p in sorted(found)]


AVERAGED = "averaged.pt"
BEST = "checkpoint_best.pt"  # the best validation BLEU so far; not a step checkpoint, never pruned


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint file, or from a save dir: `averaged.pt` when it is at least as new as
    the latest step checkpoint, else the latest step checkpoint."""
    path = Path(path)
    if path.is_file():
        return path
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint file or save directory")
    steps = step_checkpoints(path)
    averaged = path / AVERAGED
    if averaged.is_file() and (not steps or averaged.stat().st_mtime >= steps[-1].stat().st_mtime):
        return averaged
    if not steps:
        raise CheckpointError(f"{path}: no checkpoint_<step>.pt or {AVERAGED} in this directory; "
                              "is it a `pipeline train --save-dir`?")
    return steps[-1]
