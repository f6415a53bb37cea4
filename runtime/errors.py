"""Errors of the runtime that are the user's to fix (the CLI prints them as one line).

The runtime does not import pipeline/, so it raises its own class; pipeline/cli.py lists
it among the user errors."""

from __future__ import annotations


class RuntimeUserError(ValueError):
    """A backend that is not installed, a model dir it cannot use, options it cannot honour."""
