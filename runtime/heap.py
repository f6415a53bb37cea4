"""Give the C heap's free pages back to the system between batches (glibc's malloc_trim).

Each batch's cache buffers, step arrays and the engine's temporaries are freed when it ends, but
glibc keeps most freed memory resident in its heaps, so a long run's resident size ratchets up batch
after batch; trimming before each batch hands it back (docs/performance.md). Only where the heaps
hold enough free memory to matter: a batch of 32 leaves 40-60 MB of `small`, a batch of one sentence
1-2 MB, and trimming that costs more than it returns (4-7% of a sentence's time at batch 1:
docs/performance.md). A no-op where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any

TRIM_LEAST = 16 << 20  # free bytes in glibc's heaps worth a trim


class _Mallinfo2(ctypes.Structure):
    """glibc's struct mallinfo2 (2.33+): every field a size_t; `fordblks` is the free bytes of its heaps."""

    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


_trim: Any = None
_free_bytes: Any = None  # mallinfo2, or None where glibc is older (then every call trims)


def _load() -> None:
    global _trim, _free_bytes
    _trim = False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _trim = libc.malloc_trim
        _trim.argtypes, _trim.restype = [ctypes.c_size_t], ctypes.c_int
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim this way
        return
    try:
        _free_bytes = libc.mallinfo2
        _free_bytes.argtypes, _free_bytes.restype = [], _Mallinfo2
    except AttributeError:
        _free_bytes = None


def free_heap_bytes() -> int | None:
    """The free bytes glibc's heaps hold now, or None where that cannot be asked (not glibc 2.33+)."""
    if _trim is None:
        _load()
    return int(_free_bytes().fordblks) if _trim and _free_bytes is not None else None


def release_free_memory(least: int = TRIM_LEAST) -> bool:
    """malloc_trim(0) (every heap's free pages returned, at the cost of faulting them in again) when the heaps
    hold at least `least` free bytes, or always where that cannot be asked; whether it trimmed."""
    if _trim is None:
        _load()
    if not _trim:
        return False
    free = free_heap_bytes()
    if free is not None and free < least:
        return False
    _trim(0)
    return True
