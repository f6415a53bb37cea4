"""--max-time: a wall-clock budget for a whole run, counted from process start (data
preparation included) and added up over resumes through the checkpoints' `elapsed_s`."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field


def process_start_time() -> float:
    """When this process started (epoch seconds), so that imports and data preparation
    count against the budget; the time of the first call where /proc is unavailable."""
    try:
        with open(f"/proc/{os.getpid()}/stat") as f:
            # Field 22 (after the parenthesised command name) is the start time in clock ticks
            # since boot.
            ticks = float(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        started = time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
        return min(started, time.time())
    except (OSError, ValueError, IndexError):
        return _FIRST_CALL


_FIRST_CALL = time.time()


@dataclass
class TimeBudget:
    """Seconds spent by this run and the runs it resumes; `limit_s` None = no budget."""

    limit_s: float | None
    used_before_s: float = 0.0  # recorded by the checkpoint this run resumed from
    started: float = field(default_factory=process_start_time)

    def elapsed(self) -> float:
        return self.used_before_s + (time.time() - self.started)

    def exhausted(self, reserve_s: float = 0.0) -> bool:
        """Spent, or with less than `reserve_s` seconds left (kept for work after the last update)."""
        return self.limit_s is not None and self.elapsed() + reserve_s >= self.limit_s


def steps_within(step: int, elapsed_s: float, budget_s: float, seconds_per_step: float) -> int:
    """The step a budget of `budget_s` seconds ends at, from `step` after `elapsed_s`, at
    `seconds_per_step` (at least `step + 1`)."""
    return step + max(1, int((budget_s - elapsed_s) / max(seconds_per_step, 1e-9)))
