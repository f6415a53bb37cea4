"""TensorBoard event files beside metrics.jsonl (`tensorboard --logdir SAVE_DIR/tensorboard`),
written by rank 0 when the optional `tensorboard` package is installed."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

TENSORBOARD_DIR = "tensorboard"

# Which fields of which metrics.jsonl events become scalars, under `<event>/<field>`.
SCALARS = {
    "train": ("loss", "nll", "lr", "tokens_per_s", "grad_norm"),
    "valid": ("loss", "nll", "ppl", "bleu"),
}


class TensorBoardLog:
    """Scalars of train and valid events. On resume from step S (0: a fresh start) the writer purges the
    events after S that an interrupted run left, so each step appears once."""

    def __init__(self, save_dir: Path, enabled: bool, resumed_step: int | None):
        self.writer: Any = None
        if not enabled:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            log.info("tensorboard is not installed (pip install 'pipeline[tensorboard]'): event files "
                     "are skipped, metrics.jsonl has the same numbers")
            return
        # a fresh start purges too: a run killed before its first checkpoint left events its rerun writes again
        purge = (resumed_step or 0) + 1
        self.writer = SummaryWriter(log_dir=str(Path(save_dir) / TENSORBOARD_DIR), purge_step=purge)

    def write(self, event: str, step: int, fields: dict[str, Any]) -> None:
        if self.writer is None:
            return
        for name in SCALARS.get(event, ()):
            value = fields.get(name)
            if isinstance(value, (int, float)) and math.isfinite(value):
                self.writer.add_scalar(f"{event}/{name}", value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
