"""User errors: reported as one clear line and a non-zero exit, never a traceback."""

from __future__ import annotations


class UserError(Exception):
    """A problem with what the user asked for or gave us (files, options, model dirs)."""
