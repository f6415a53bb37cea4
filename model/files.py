"""Atomic file writes: every file this project writes goes through `atomic_write`.

Temp file in the same directory, fsync, rename over the target, fsync the directory:
a crash, a full disk or Ctrl-C leaves the old file (or none), never a truncated one
that a later run would take for the real thing, and the rename itself survives a
power cut. Model, export, runtime and pipeline all write files, so this lives in model/.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import IO, Any

log = logging.getLogger(__name__)


def usual_permissions(path: str | Path) -> None:
    """Give `path` the mode a plain open() would (0666 / 0777 less the umask): mkstemp and
    mkdtemp, which every atomic write here goes through, create owner-only files."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, (0o777 if Path(path).is_dir() else 0o666) & ~umask)


def fsync_dir(path: str | Path) -> None:
    """Make a rename inside `path` durable; filesystems that cannot sync a directory
    (some network mounts) lose only that durability, so it is logged, not raised."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        log.debug("cannot open %s to fsync it: %s", path, e)
        return
    try:
        os.fsync(fd)
    except OSError as e:
        log.debug("cannot fsync directory %s: %s", path, e)
    finally:
        os.close(fd)


# Every temp file or dir we create is named .<target>.~pipeline-<pid>-<random><suffix>, so a
# later run can tell our leftovers from the user's files and from a live writer's.
_TEMP = re.compile(r"^\..+\.~pipeline-(\d+)-[^/]*$")


def temp_prefix(name: str) -> str:
    """The mkstemp/mkdtemp prefix for a temp file or dir that will become `name`."""
    return f".{name}.~pipeline-{os.getpid()}-"


def make_temp_dir(parent: str | Path, name: str, kind: str) -> Path:
    """A temp dir beside `parent/name` (kind: 'partial', 'old', ...), our naming pattern."""
    return Path(tempfile.mkdtemp(dir=parent, prefix=f"{temp_prefix(name)}{kind}-"))


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def remove_stale_temps(directory: str | Path) -> list[Path]:
    """Delete the temp files and dirs that dead processes of ours left in `directory`
    (kill -9, power cut): full-size checkpoint or translation temps would otherwise pile
    up forever. Temps of live processes and every other file are left alone. Returns
    what was removed; a missing directory has nothing to clean."""
    removed: list[Path] = []
    try:
        entries = list(Path(directory).iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return removed
    for entry in entries:
        m = _TEMP.match(entry.name)
        if m is None or _alive(int(m.group(1))):
            continue
        try:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        except OSError as e:
            log.warning("cannot remove stale temp %s: %s", entry, e)
            continue
        removed.append(entry)
    if removed:
        log.info("removed %d stale temp file(s)/dir(s) left by an interrupted run in %s", len(removed), directory)
    return removed


@contextlib.contextmanager
def atomic_write(path: str | Path, mode: str = "wb", suffix: str = ".tmp") -> Iterator[IO[Any]]:
    """Yield a file to write; on success it replaces `path` (fsync'd, usual permissions).

    Text modes write UTF-8 with '\\n' newlines whatever the platform. If the body raises,
    the temp file is removed and `path` is left as it was.
    """
    if "w" not in mode:
        raise ValueError(f"atomic_write needs a write mode, got {mode!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path.name), suffix=suffix, dir=path.parent)
    try:
        kwargs: dict[str, Any] = {} if "b" in mode else {"encoding": "utf-8", "newline": "\n"}
        with open(fd, mode, **kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        usual_permissions(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_write(path, "wb") as f:
        f.write(data)


def atomic_write_text(path: str | Path, text: str) -> None:
    with atomic_write(path, "w") as f:
        f.write(text)


@contextlib.contextmanager
def signals_deferred(signums: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> Iterator[None]:
    """Hold SIGINT/SIGTERM back while the body runs, then deliver them to the handlers
    that were in place, as if they had just arrived.

    For short writes that must not be torn: a KeyboardInterrupt inside torch.save's zip
    writer is replaced by the writer's own RuntimeError on the way out (a traceback, and
    a checkpoint half-written). Only the main thread receives signals in Python, so
    elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        pending.append(signum)  # each one: a second Ctrl-C must still mean "abort" afterwards
        log.warning("%s received while writing a file: acting on it once the write is complete",
                    signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, hold) for sig in signums}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in pending:  # the restored handlers run now, in order (StopFlag, KeyboardInterrupt...)
            signal.raise_signal(sig)


def check_writable_dir(directory: str | Path) -> Path:
    """Create `directory` if needed and prove a file can be written and removed there, so
    that a read-only or full save dir fails before minutes of work, not after.
    Raises OSError (its filename is the directory or the probe file)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fd, probe = tempfile.mkstemp(prefix=temp_prefix("write-probe"), suffix=".tmp", dir=directory)
    try:
        os.write(fd, b"probe\n")
        os.fsync(fd)
    finally:
        os.close(fd)
        Path(probe).unlink(missing_ok=True)
    return directory
