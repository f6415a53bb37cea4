"""runtime/heap.py: the C heap's free pages go back to the system between batches."""

from __future__ import annotations

import ctypes.util
import platform

import numpy as np
import pytest

from runtime.heap import free_heap_bytes, release_free_memory


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


@pytest.mark.skipif(platform.system() != "Linux" or "libc" not in str(ctypes.util.find_library("c")),
                    reason="glibc only")
def test_freed_heap_memory_is_handed_back():
    """Blocks under glibc's mmap threshold come from its heap and stay resident when freed while a
    later block pins the heap's top; the trim hands their pages back."""
    blocks = [np.ones(8 * 1024, dtype=np.float64) for _ in range(2000)]  # 64 KiB each: 125 MiB
    pin = np.ones(8 * 1024, dtype=np.float64)
    del blocks
    before = _rss_mb()
    assert release_free_memory()
    after = _rss_mb()
    assert before - after > 60, (before, after)
    assert pin.sum() == 8 * 1024
    release_free_memory()  # again: harmless


@pytest.mark.skipif(platform.system() != "Linux" or "libc" not in str(ctypes.util.find_library("c")),
                    reason="glibc only")
def test_a_heap_with_little_free_memory_is_left_alone():
    """A batch of one sentence leaves a megabyte or two free: trimming it would cost more than it returns."""
    free = free_heap_bytes()
    if free is None:
        pytest.skip("glibc older than 2.33: no mallinfo2, every call trims")
    assert not release_free_memory(least=free + (64 << 20))
    blocks = [np.ones(8 * 1024, dtype=np.float64) for _ in range(1000)]  # 64 KiB each: 62 MiB
    pin = np.ones(8 * 1024, dtype=np.float64)
    del blocks
    assert free_heap_bytes() >= 32 << 20
    assert release_free_memory(least=32 << 20)
    assert pin.sum() == 8 * 1024
