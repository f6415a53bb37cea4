"""Linux renameat2 through ctypes: swap two paths in one step (RENAME_EXCHANGE), or rename only where nothing is
(RENAME_NOREPLACE). Where the system or file system has no renameat2, the callers (model/atomic.py) fall back."""

from __future__ import annotations

import ctypes
import errno
import os
from pathlib import Path

RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2  # linux/fs.h
_AT_FDCWD = -100


def renameat2(a: Path, b: Path, flags: int) -> bool:
    """Linux renameat2(a, b, flags); False where the system or file system cannot (the caller falls back), an
    OSError (FileExistsError for RENAME_NOREPLACE) where it refuses."""
    try:
        call = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    call.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if call(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), flags) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (RENAME_EXCHANGE); False where the system or file system cannot, so the caller
    falls back to two renames."""
    return renameat2(a, b, RENAME_EXCHANGE)
