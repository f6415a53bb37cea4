"""Helpers shared by the fault tests: the real CLI in a subprocess, a dead process id, and
a small tmpfs to fill (where this machine lets a test mount one)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--max-len-a", "0", "--max-len-b", "6", "--no-progress", "--threads", "1", "--backend", "onnxruntime"]


def cli_env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))


def pipeline_cmd(*args: object) -> list[str]:
    return [sys.executable, "-m", "pipeline", *map(str, args)]


def run_pipeline(*args: object, cwd: Path | None = None, timeout: float = 300) -> tuple[int, str]:
    """`pipeline ARGS` as a user runs it: (exit status, stderr)."""
    proc = subprocess.run(pipeline_cmd(*args), env=cli_env(), cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)
    return proc.returncode, proc.stderr


def assert_one_line_error(code: int, stderr: str, *needles: str) -> str:
    """A user-facing failure: non-zero exit, no traceback, exactly one `error:` line holding every needle."""
    assert code != 0, stderr
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def dead_pid() -> int:
    """The id of a process of ours that has exited (so its temps count as stale)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@contextmanager
def small_tmpfs(path: Path, size: str, readonly: bool = False) -> Iterator[Path]:
    """A tmpfs of `size` at `path` (a real full disk / read-only mount); skips the test
    where mounting is not allowed (not root, no CAP_SYS_ADMIN)."""
    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (",ro" if readonly else "")
    if subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
