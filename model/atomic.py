"""Atomic file writes: every file this project writes goes through `atomic_write`.

Temp file in the same directory, fsync, rename over the target, fsync the directory:
a crash, a full disk or Ctrl-C leaves the old file (or none), never a truncated one
that a later run would take for the real thing, and the rename itself survives a
power cut. Model, export, runtime and pipeline all write files, so this lives in model/.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from model.renames import RENAME_NOREPLACE, exchange, renameat2

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


# Every temp file or dir we create is named .<target>.~pipeline-<pid>.<where>-<random><suffix>, so a
# later run can tell our leftovers from the user's files and from a live writer's. <where> names the host and
# PID namespace (a container) of the writer: another's process ids cannot be checked from here, so its temps are
# never judged stale (a run in another container writing to a shared volume lost its temp to ours). Temps named
# without it (older runs) are judged as this namespace's.
_TEMP = re.compile(r"^\.(?P<target>.+)\.~pipeline-(?P<pid>\d+)(?:\.(?P<where>[0-9a-f]{8}))?-(?P<kind>[^/]*)$")


def _where() -> str:
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = 0
    return hashlib.sha256(f"{os.uname().nodename}:{namespace}".encode()).hexdigest()[:8]


HERE = _where()


def temp_prefix(name: str) -> str:
    """The mkstemp/mkdtemp prefix for a temp file or dir that will become `name`."""
    return f".{name}.~pipeline-{os.getpid()}.{HERE}-"


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


def _dead(m: re.Match[str]) -> bool:
    """Whether the process that named a temp is known to be gone: one of this host and PID namespace that no
    longer runs (another's cannot be checked from here)."""
    return m["where"] in (None, HERE) and not _alive(int(m["pid"]))


def remove_stale_temps(directory: str | Path) -> list[Path]:
    """Delete the temp files and dirs that dead processes of ours left in `directory`
    (kill -9, power cut): full-size checkpoint or translation temps would otherwise pile
    up forever. Temps of live processes, of other hosts or containers (logged) and every other file are left
    alone. Returns what was removed; a missing directory has nothing to clean."""
    removed: list[Path] = []
    try:
        entries = list(Path(directory).iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return removed
    foreign = 0
    for entry in entries:
        m = _TEMP.match(entry.name)
        if m is None or not _dead(m):
            foreign += m is not None and m["where"] not in (None, HERE)
            continue
        if m["kind"].startswith("old-") and restore_replaced_dir(entry.parent / m["target"]):
            continue  # it held the only copy of its target: put back, not deleted
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
    if foreign:
        log.info("kept %d temp file(s)/dir(s) in %s of runs on another host or container (whether they still run "
                 "cannot be checked from here); delete them once none writes there", foreign, directory)
    return removed


FD_ALIAS = re.compile(r"/(?:proc/(self|thread-self|\d+)|dev)/fd/(\d+)")  # /dev/stdout -> /proc/self/fd/1


def _descriptor(path: str | Path) -> re.Match[str] | None:
    """The /proc/PID/fd/N or /dev/fd/N that `path`, or a symlink it goes through, names; else None."""
    here = os.path.abspath(path)
    for _ in range(40):  # the kernel's own limit on links followed
        found = FD_ALIAS.fullmatch(here)
        if found is not None:
            return found
        try:
            target = os.readlink(here)
        except OSError:
            return None
        here = os.path.normpath(os.path.join(os.path.dirname(here), target))
    return None


def descriptor_alias(path: str | Path) -> bool:
    """Whether `path` names an open file descriptor (/dev/stdout, /dev/fd/1, /proc/self/fd/1, or a link to one):
    whatever that descriptor is (a pipe, the file a shell redirected it to), the output is written into it; a
    renamed temp file would replace the link, or a file the shell holds open."""
    return _descriptor(path) is not None


def _open_descriptor(path: str | Path, mode: str, **kwargs: Any) -> IO[Any]:
    """A descriptor's name opened for writing: one of this process's own descriptors (-o /dev/stdout) through a
    duplicate of it, after Python's own streams are flushed, so that what the process prints there and this file
    share one offset (a second open of the file wrote over the table a command printed); another's by its name,
    appended to, as the shell opened it."""
    found = _descriptor(path)
    assert found is not None
    pid, fd = found.group(1), int(found.group(2))
    if pid in (None, "self", "thread-self", str(os.getpid())):
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        with contextlib.suppress(OSError):
            return open(os.dup(fd), mode, **kwargs)
    return open(path, mode.replace("w", "a"), **kwargs)


def is_special_file(path: str | Path) -> bool:
    """Whether `path` (its symlinks followed) is a device, FIFO or socket (/dev/null, a named pipe), or a file
    descriptor's name (/dev/stdout). Such an output is written through, not replaced by a renamed temp file."""
    if descriptor_alias(path):
        return True
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


@contextlib.contextmanager
def atomic_write(path: str | Path, mode: str = "wb", suffix: str = ".tmp", replace: bool = True
                 ) -> Iterator[IO[Any]]:
    """Yield a file to write; on success it replaces `path` (fsync'd, usual permissions). `replace=False`: `path`
    must not exist when the file is put there (a FileExistsError for one that appeared meanwhile: a hard link,
    which never replaces, where the file system has them).

    Text modes write UTF-8 with '\\n' newlines whatever the platform. If the body raises,
    the temp file is removed and `path` is left as it was.
    """
    if "w" not in mode:
        raise ValueError(f"atomic_write needs a write mode, got {mode!r}")
    path = Path(path)
    kwargs: dict[str, Any] = {} if "b" in mode else {"encoding": "utf-8", "newline": "\n"}
    if is_special_file(path):  # /dev/null, a FIFO, /dev/stdout: written through (a rename would replace it)
        with _open_descriptor(path, mode, **kwargs) if descriptor_alias(path) else open(path, mode, **kwargs) as f:
            yield f
        return
    if path.is_symlink():  # the file the link names is replaced, the link kept (it was replaced by a file)
        path = Path(os.path.realpath(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path.name), suffix=suffix, dir=path.parent)
    try:
        with open(fd, mode, **kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        try:  # a file replaced keeps its permissions (a private 0600 output stayed private); a new one gets
            os.chmod(tmp, stat.S_IMODE(os.stat(path).st_mode))  # open()'s
        except FileNotFoundError:
            usual_permissions(tmp)
        if replace:
            os.replace(tmp, path)
        else:
            _put_new(Path(tmp), path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        failure = write_failure(e, path)
        if failure is not None:
            raise failure from e
        raise
    fsync_dir(path.parent)


def write_failure(error: BaseException, path: str | Path) -> OSError | None:
    """The OSError, naming `path`, that a failed write of `path` really is; None when
    `error` is not a write failure. torch.save on a full disk raises a RuntimeError
    ("PytorchStreamWriter failed writing file ... unexpected pos ..."), and a flush or
    fsync raises ENOSPC without a file name: both must reach the user as "path: no
    space left on device", not as a traceback."""
    chain: list[BaseException] = []
    seen: BaseException | None = error
    while seen is not None:  # Ctrl-C that surfaced as the writer's error stays Ctrl-C
        if isinstance(seen, KeyboardInterrupt):
            return None
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    if isinstance(error, OSError):
        if error.filename2 is not None and error.errno is not None:  # os.replace(temp, path): name the user's path
            return OSError(error.errno, error.strerror, str(path))
        if error.filename is not None or error.errno is None:
            return None
        return OSError(error.errno, error.strerror, str(path))
    if isinstance(error, RuntimeError) and ("unexpected pos" in str(error) or "failed writing" in str(error)):
        # The OSError the writer hit, when torch kept it; else judge by the disk itself.
        code = next((c.errno for c in chain if isinstance(c, OSError) and c.errno), None)
        if code is None:
            code = errno.ENOSPC if disk_full(Path(path).parent) else errno.EIO
        return OSError(code, os.strerror(code), str(path))
    return None


def disk_full(directory: str | Path, slack: int = 1 << 20) -> bool:
    """Whether the file system holding `directory` has (almost) no space left."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < slack


def check_can_create_in(directory: str | Path, option: str) -> None:
    """Fail now, before minutes of work, if files cannot be created in `directory` (or in
    its nearest existing parent, where it will be made; nothing is created here). A real probe file, not
    os.access: root passes every access check, yet a read-only mount still refuses."""
    here = Path(directory).absolute()
    while not here.exists():
        here = here.parent
    if not here.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, f"not a directory ({option} needs a directory here)", str(here))
    probe = None
    try:  # write and sync a byte too: a full disk still lets us create an empty file
        fd, probe = tempfile.mkstemp(prefix=temp_prefix("write-check"), suffix=".tmp", dir=here)
        try:
            os.write(fd, b"probe\n")
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:  # name the directory, not our probe file
        why = "it takes no new files: a virtual file system such as /proc" if e.errno == errno.ENOENT else e.strerror
        raise OSError(e.errno, why, str(here)) from None  # (ENOENT of a directory that is there said "No such file")
    finally:
        if probe is not None:
            Path(probe).unlink(missing_ok=True)


# -- replacing a directory without a moment where it is missing ------------------------------

def _put_new(tmp: Path, path: Path) -> None:
    """The finished temp file at `path`, which must not exist (FileExistsError)."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise
    except OSError:  # no hard links here (FAT, some network file systems): a check, then a rename
        if os.path.lexists(path):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(path)) from None
        os.replace(tmp, path)
        return
    tmp.unlink()


def place_new(new: Path, target: Path) -> None:
    """Rename `new` to `target`, which must not exist: a FileExistsError when anything is there, even what appeared
    a moment before (RENAME_NOREPLACE; where the system cannot, a check, then a rename)."""
    if not renameat2(new, target, RENAME_NOREPLACE):
        if os.path.lexists(target):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(target))
        os.rename(new, target)
    fsync_dir(target.parent)


def replace_dir(new: Path, target: Path) -> None:
    """Put the finished dir `new` at `target`. An existing target is swapped out in one
    step where the system can; elsewhere it is parked in a `.<target>.~pipeline-PID-old-*`
    dir first, and `restore_replaced_dir` brings it back if we die between the renames."""
    new, target = Path(new), Path(target)
    if not target.exists():
        os.replace(new, target)
        fsync_dir(target.parent)
        return
    if exchange(new, target):
        fsync_dir(target.parent)
        shutil.rmtree(new, ignore_errors=True)  # `new` now holds the old target
        return
    backup = make_temp_dir(target.parent, target.name, "old")
    os.replace(target, backup / target.name)
    try:
        os.replace(new, target)
    except BaseException:
        os.replace(backup / target.name, target)
        shutil.rmtree(backup, ignore_errors=True)
        raise
    fsync_dir(target.parent)
    shutil.rmtree(backup, ignore_errors=True)


def restore_replaced_dir(target: str | Path) -> bool:
    """If a dead process parked `target` in its backup dir and died before the new one
    took its place, move the old one back (and say so). True when something was restored."""
    target = Path(target)
    if target.exists() or not target.parent.is_dir():
        return False
    for entry in sorted(target.parent.glob(f".{glob_escape(target.name)}.~pipeline-*-old-*")):
        m = _TEMP.match(entry.name)
        parked = entry / target.name
        if m is None or not _dead(m) or not parked.exists():
            continue
        os.replace(parked, target)
        fsync_dir(target.parent)
        shutil.rmtree(entry, ignore_errors=True)
        log.warning("%s: restored the previous directory that an interrupted replacement left in %s",
                    target, entry.name)
        return True
    return False


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_write(path, "wb") as f:
        f.write(data)


def atomic_write_text(path: str | Path, text: str) -> None:
    with atomic_write(path, "w") as f:
        f.write(text)


def check_writable_dir(directory: str | Path, option: str) -> Path:
    """Create `directory` if needed and prove a file can be written there (the same probe
    as check_can_create_in), so a read-only or full dir fails before minutes of work; `option`
    is what the user gave it as, for the message."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    check_can_create_in(directory, option)
    return directory
