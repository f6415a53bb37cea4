"""Errors of the runtime that are the user's to fix (the CLI prints them as one line)."""

from __future__ import annotations

from model.errors import UserError


class RuntimeUserError(UserError, ValueError):
    """A backend that is not installed, a model dir it cannot use, options it cannot honour."""


def first_line(e: BaseException, limit: int = 200) -> str:
    """A library's error as a clause of our one-line message: its first line, cut at `limit` characters
    (SentencePiece's and ONNX Runtime's own messages run over many lines)."""
    lines = str(e).strip().splitlines()
    text = lines[0].strip() if lines else type(e).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."
