"""Give the C heap's free pages back to the system between batches (glibc's malloc_trim).

Each batch's cache buffers, step arrays and the engine's temporaries are freed when it ends, but
glibc keeps most freed memory resident in its heaps, so a long run's resident size ratchets up batch
after batch; trimming before each batch hands it back (docs/performance.md). A no-op where the C
library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any

_trim: Any = None


def release_free_memory() -> None:
    """malloc_trim(0): every heap's free pages returned (glibc 2.8+), at the cost of faulting them in again."""
    global _trim
    if _trim is None:
        _trim = False
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _trim = libc.malloc_trim
            _trim.argtypes, _trim.restype = [ctypes.c_size_t], ctypes.c_int
        except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim this way
            _trim = False
    if _trim:
        _trim(0)
