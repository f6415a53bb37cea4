"""The onnxruntime backend's constrained step: decoder_constrained.onnx, for glossaries.

Constrained search (runtime/constrained.py) asks a step for the log-probs of given ids per hypothesis
(`want`), inside the top-K or not. decoder_constrained.onnx (export/constrained.py) is decoder.onnx with
one more input (want_ids) and output (want_log_probs), reading the same decoder.data. Its session is
opened on the first step given `want`, with the decoder's session options and providers, so serving
without glossaries pays nothing for it (no load, no memory). A model dir exported before it, or one served
with a shortlist (the shortlisted step scores its candidates only), does not gather: asking says why.

The step's IO binding is the decoder's kind (ort_binding.StepBinding) made on this session, plus a
want_ids buffer filled every step and a want_log_probs output, both bound again only when the number of
ids per hypothesis changes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from model import io_names
from model.manifest import Manifest
from runtime.errors import RuntimeUserError

if TYPE_CHECKING:
    import onnxruntime as ort


def why_not(model_dir: Path, manifest: Manifest, shortlisted: bool) -> str | None:
    """Why this model dir's onnxruntime steps cannot take `want`, or None when they can."""
    if shortlisted:
        return ("glossaries need the log-probs of a term's tokens over the whole vocabulary, which the shortlisted "
                "step (--shortlist) does not compute: serve without --shortlist to use a glossary")
    if not manifest.lists(io_names.DECODER_CONSTRAINED_FILE) or not (
            model_dir / io_names.DECODER_CONSTRAINED_FILE).is_file():
        return (f"{model_dir} has no {io_names.DECODER_CONSTRAINED_FILE} (exported before glossaries were "
                "supported): export the model again with `pipeline export` to use a glossary")
    return None


class ConstrainedDecoder:
    """decoder_constrained.onnx's session, opened once, on first use (by whichever batch asks first)."""

    def __init__(self, open_session: Callable[[], ort.InferenceSession], why_not: str | None):
        self._open = open_session
        self.why_not = why_not
        self._session: ort.InferenceSession | None = None
        self._lock = threading.Lock()

    @property
    def gathers(self) -> bool:
        return self.why_not is None

    def session(self) -> ort.InferenceSession:
        """The session (opened now if it is the first call); RuntimeUserError saying why when it cannot be."""
        if self.why_not is not None:
            raise RuntimeUserError(self.why_not)
        with self._lock:
            if self._session is None:
                session = self._open()
                names = {i.name for i in session.get_inputs()}
                if io_names.WANT_IDS not in names:
                    raise RuntimeUserError(f"{io_names.DECODER_CONSTRAINED_FILE} has no {io_names.WANT_IDS} input; "
                                           "export the model again with `pipeline export`")
                self._session = session
            return self._session


def want_array(want: Any, n: int, vocab_size: int) -> np.ndarray:
    """`want` as the (n, W) int64 host array the step binds; ValueError for another shape or an id outside
    the vocabulary (-1 is 'none')."""
    a = np.ascontiguousarray(np.asarray(want), dtype=np.int64)
    if a.ndim != 2 or a.shape[0] != n:
        raise ValueError(f"want must be (hypotheses, ids) = ({n}, W), got shape {a.shape}")
    if a.size and (int(a.min()) < -1 or int(a.max()) >= vocab_size):
        raise ValueError(f"want holds ids outside [-1, {vocab_size}): {int(a.min())}..{int(a.max())}")
    return a
