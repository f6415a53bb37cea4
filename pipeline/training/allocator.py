"""Why CPU training spent a third of its time in the kernel, and the fix.

glibc serves blocks above its mmap threshold (at most 32 MiB) with fresh mmap()s and gives them
back with munmap() when freed. A training step allocates and frees the same large tensors every
time (the logits alone are tokens x vocab floats: 4000 x 8000 x 4 B = 128 MiB, plus their
gradients), so every step page-faults freshly zeroed pages in and unmaps them again: system time,
not arithmetic. Serving freed memory again from the heap, never returned to the kernel, removes
that (docs/training.md).
The same as running with MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1073741824; a user who sets
either variable keeps their own setting.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc malloc.h
_ENV = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_")


def keep_freed_memory() -> bool:
    """Make glibc reuse freed large blocks instead of unmapping them; True when applied."""
    if not sys.platform.startswith("linux") or any(name in os.environ for name in _ENV):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        applied = bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30))
    except (OSError, AttributeError):  # not glibc (musl, ...): nothing to tune
        return False
    log.debug("glibc malloc: large freed blocks are kept for reuse (%s)", applied)
    return applied
