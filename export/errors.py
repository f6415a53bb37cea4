"""Typed export errors: user errors (model.errors.UserError), reported by the CLI as one line."""

from __future__ import annotations

from model.errors import UserError


class ExportError(UserError):
    """The export cannot proceed or produced something unusable (bad options, exporter
    failure, a graph TensorRT or ONNX would reject)."""


class VerificationError(ExportError):
    """The exported graphs disagree with PyTorch beyond tolerance.

    Carries what was compared (`what`), where (`where`: graph, step) and how much
    (`diff` against `bound` = atol + rtol * |reference| at that element), so the message
    names all three.
    """

    def __init__(self, what: str, where: str, diff: float, bound: float, atol: float, rtol: float = 0.0,
                 fix: str = ""):
        self.what, self.where, self.diff, self.bound, self.atol, self.rtol = what, where, diff, bound, atol, rtol
        rel = f" + {rtol:.3g} x |reference| = {bound:.3g} there" if rtol else ""
        super().__init__(f"verification failed: {what} at {where}: abs difference {diff:.3g} exceeds "
                         f"tolerance {atol:.3g}{rel}{fix}")


class TensorRTUnavailable(ExportError):
    """TensorRT engines were asked for but cannot be built on this machine."""
