"""The onnxruntime backend's decoder binding, kept across the steps of one encoder state (runtime/ort_backend.py)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import onnxruntime as ort


@dataclass
class StepBinding:
    """The decoder's IO binding kept across the steps of one encoder state (runtime/ort_backend.py)."""

    binding: ort.IOBinding
    session: ort.InferenceSession  # the decoder's, or decoder_constrained.onnx's (runtime/ort_constrained.py)
    n: int                      # hypotheses
    tokens: Any                 # (n,) int64, bound; filled each step
    step: Any                   # (1,) int64, bound; filled each step
    alive: dict[str, Any]       # what the binding points into, referenced as long as it
    top_lp: Any                 # outputs, bound once
    top_ids: Any
    eos_lp: Any
    step_k: list[Any]
    step_v: list[Any]
    step_kv: Any = None         # on the CPU, (2 x layers, n, d_model): step_k + step_v are views of its rows
    feeds: dict[str, weakref.ref[Any] | None] = field(default_factory=dict)  # cache feeds bound now
    want: Any = None            # the constrained step's (n, W) want_ids, bound; filled each step
    want_lp: Any = None         # and its (n, W) want_log_probs output
