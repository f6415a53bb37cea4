"""What a run tells the outside: metrics.jsonl events, and the signals that ask it to stop."""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from pathlib import Path
from typing import Any

from model.errors import UserError
from pipeline.textio import atomic_output

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


class MetricsLog:
    """metrics.jsonl: one JSON object per event, appended by rank 0."""

    def __init__(self, path: Path, enabled: bool):
        self.path, self.enabled = path, enabled

    def truncate_after(self, step: int) -> None:
        """On resume, forget events logged after the checkpoint we resume from.

        A line that is not a JSON object (an append cut short by a full disk or a kill)
        is dropped with a warning that counts them, rather than blocking every resume."""
        if not self.enabled or not self.path.is_file():
            return
        keep, torn = [], 0
        for line in self.path.read_text(encoding="utf-8", errors="replace").splitlines():
            if not line.strip():
                continue
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                event = None
            if not isinstance(event, dict):
                torn += 1
                continue
            if event.get("step", 0) <= step:
                keep.append(line)
        if torn:
            log.warning("%s: dropped %d unreadable line(s), the remains of a write cut short (full disk "
                        "or kill)", self.path, torn)
        with atomic_output(self.path) as f:
            f.write("".join(line + "\n" for line in keep))

    def write(self, event: str, **fields: Any) -> None:
        if not self.enabled:
            return
        line = json.dumps({"event": event, "time": round(time.time(), 3), **fields}) + "\n"
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line)
        except OSError as e:
            raise UserError(f"{self.path}: cannot append a metrics event: {e.strerror or e}; the checkpoints "
                            "are intact, fix that and rerun the same command to resume") from None


class TrainingInterrupted(Exception):
    """SIGINT/SIGTERM stopped training after writing a checkpoint (exit 128 + signum); or,
    `aborted`, a second Ctrl-C stopped it at once, `checkpoint` being the latest complete one."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None, aborted: bool = False):
        self.signum, self.step, self.checkpoint, self.aborted = signum, step, checkpoint, aborted
        name = signal.Signals(signum).name
        if aborted:
            super().__init__(f"aborted by a second {name} at step {step}; the latest complete checkpoint is "
                             f"{checkpoint}; rerun the same command to resume from it")
        else:
            super().__init__(f"stopped by {name} at step {step}; checkpoint {checkpoint}; rerun the same "
                             "command to resume")


class StopFlag:
    """SIGINT/SIGTERM ask to stop after the current update; a second SIGINT aborts at once
    (KeyboardInterrupt), except inside a checkpoint write, which finishes first
    (model.signals.signals_deferred)."""

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
                if sig == signal.SIGINT and signal.getsignal(sig) == signal.SIG_IGN:  # started as a shell script's
                    continue  # `cmd &`: the terminal's Ctrl-C is not for it (it was obeyed once training began)
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
