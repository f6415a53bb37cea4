"""The root of every error that is the user's to fix.

Each layer subclasses it (model: ConfigError, CheckpointError, ModelDirError; export:
ExportError; runtime: RuntimeUserError), and the CLI reports any of them as one line and
exit status 2, never a traceback. It lives on the ground floor so every layer can use it."""

from __future__ import annotations


class UserError(Exception):
    """A problem with what the user asked for or gave us (files, options, model dirs)."""
