"""Errors of the runtime that are the user's to fix (the CLI prints them as one line)."""

from __future__ import annotations

from model.errors import UserError


class RuntimeUserError(UserError, ValueError):
    """A backend that is not installed, a model dir it cannot use, options it cannot honour."""
