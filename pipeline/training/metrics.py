"""What a run tells the outside: metrics.jsonl events, and the signals that ask it to stop."""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from pathlib import Path
from typing import Any

from pipeline.textio import atomic_output

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


class MetricsLog:
    """metrics.jsonl: one JSON object per event, appended by rank 0."""

    def __init__(self, path: Path, enabled: bool):
        self.path, self.enabled = path, enabled

    def truncate_after(self, step: int) -> None:
        """On resume, forget events logged after the checkpoint we resume from."""
        if not self.enabled or not self.path.is_file():
            return
        keep = [line for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= step]
        with atomic_output(self.path) as f:
            f.write("".join(line + "\n" for line in keep))

    def write(self, event: str, **fields: Any) -> None:
        if self.enabled:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"event": event, "time": round(time.time(), 3), **fields}) + "\n")


class TrainingInterrupted(Exception):
    """SIGINT/SIGTERM stopped training after writing a checkpoint (exit 128 + signum)."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        super().__init__(f"stopped by {signal.Signals(signum).name} at step {step}; checkpoint "
                         f"{checkpoint}; rerun the same command to resume")


class StopFlag:
    """SIGINT/SIGTERM ask to stop after the current update; a second SIGINT aborts at once."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum
        log.warning("%s received: finishing this update, writing a checkpoint, then exiting "
                    "(Ctrl-C again to abort without a checkpoint)", signal.Signals(signum).name)

    def __enter__(self) -> StopFlag:
        # Python only lets the main thread install handlers (tests may train in a thread).
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
