"""Where a backend's translation first leaves the reference's, and how close the call was there.

For a sentence that differs, the first target position where the two token sequences part, and (when
the PyTorch model is at hand) how much more that model preferred its own token over the backend's at
that step: fp16 noise shows as tiny gaps on near-ties, a bug (or a shortlist leaving a token out) as
large ones. Used by `pipeline parity` (parity.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Divergence:
    line: int           # 1-based input line
    step: int           # first target position where the outputs differ
    torch_token: int    # what PyTorch chose there (the EOS id if it ended)
    backend_token: int
    # PyTorch's log p(torch_token) - log p(backend_token) at that step (None: no PyTorch model at hand)
    log_prob_gap: float | None


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """First position where two token sequences (EOS implied at the end) differ."""
    if a == b:
        return None
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def divergence_gaps(model: Any, sources: list[list[int]], ref: list[list[int]], other: list[list[int]],
                    lines: list[int], eos: int) -> list[Divergence]:
    """For each differing pair, teacher-force the PyTorch model on the common prefix and
    measure how much more it preferred its own token over the backend's (no gap where no
    PyTorch model is at hand: the step is still reported)."""
    if model is None:
        out = []
        for i in lines:
            a, b = ref[i], other[i]
            d = first_divergence(a, b)
            if d is not None:
                out.append(Divergence(i + 1, d, a[d] if d < len(a) else eos, b[d] if d < len(b) else eos, None))
        return out
    import torch

    with torch.inference_mode():
        return _gaps(model, sources, ref, other, lines)


def _gaps(model: Any, sources: list[list[int]], ref: list[list[int]], other: list[list[int]],
          lines: list[int]) -> list[Divergence]:
    import torch

    out = []
    for i in lines:
        a, b = ref[i], other[i]
        d = first_divergence(a, b)
        if d is None:
            continue
        src = torch.tensor([sources[i]], dtype=torch.long)
        tgt_in = torch.tensor([[model.cfg.bos_id] + a[:d]], dtype=torch.long)
        log_probs = model(src, tgt_in)[0, d].log_softmax(-1)
        ta = a[d] if d < len(a) else model.cfg.eos_id
        tb = b[d] if d < len(b) else model.cfg.eos_id
        out.append(Divergence(i + 1, d, ta, tb, float(log_probs[ta] - log_probs[tb])))
    return out


class ModelOnDemand:
    """The PyTorch model for log-prob gaps, loaded only if some sentence differs (None: no PyTorch)."""

    def __init__(self, checkpoint: Path | None):
        self.checkpoint = checkpoint
        self.model: Any = None

    def get(self) -> Any:
        if self.model is None and self.checkpoint is not None:
            from model.checkpoint import load_model

            self.model = load_model(self.checkpoint)[0]
        return self.model
