"""The command line this process runs, as one would type it again: a JSON report records it, so a figure keeps
the command that produced it (`pipeline bench --json`, `pipeline parity --json`)."""

from __future__ import annotations

import shlex
import sys

_argv: list[str] | None = None


def record(argv: list[str]) -> None:
    """What `pipeline` was given (pipeline/cli.py main, before the command runs)."""
    global _argv
    _argv = list(argv)


def command_line() -> str:
    """`pipeline ARGS`, quoted for a POSIX shell."""
    return shlex.join(["pipeline", *(sys.argv[1:] if _argv is None else _argv)])
