"""Typed export errors. `export` may import only `model`, so these are not pipeline's
UserError; the CLI reports them the same way (one line, exit 2)."""

from __future__ import annotations


class ExportError(Exception):
    """The export cannot proceed or produced something unusable (bad options, exporter
    failure, a graph TensorRT or ONNX would reject)."""


class VerificationError(ExportError):
    """The exported graphs disagree with PyTorch beyond tolerance.

    Carries what was compared (`what`), where (`where`: graph, step) and how much
    (`diff` against `atol`), so the message names all three.
    """

    def __init__(self, what: str, where: str, diff: float, atol: float):
        self.what, self.where, self.diff, self.atol = what, where, diff, atol
        super().__init__(f"verification failed: {what} at {where}: max abs difference "
                         f"{diff:.3g} exceeds tolerance {atol:.3g}")


class TensorRTUnavailable(ExportError):
    """TensorRT engines were asked for but cannot be built on this machine."""
