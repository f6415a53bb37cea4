"""The GPU check's small utilities (scripts/gpu_check.py): where the checkout is, the stage outcomes and
their exceptions, log tails and failure lines, JSON and metrics files, the modules the stages need and
the wheels carried for them, the artifacts kept beside the report, the commit, and number formatting."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.py"  # the entry point, which also runs the workers (`_worker NAME`)
PY = sys.executable
TAIL_LINES = 25
PASS, FAIL, SKIP, PENDING = "PASS", "FAIL", "SKIP", "PENDING"


class Skip(Exception):
    """The stage cannot run here or lacks an earlier stage's output: SKIP with this reason."""


class Fail(Exception):
    """The stage ran and did not do what it must: FAIL with this reason."""


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


# torchrun's own exceptions say only that the worker failed: the worker's line is the one to show
LAUNCHER_ERRORS = ("ChildFailedError", "SignalException")


def failure_line(stderr: str) -> str:
    """The line that says why a command failed: our CLI's one `error:` line; else the last exception
    line that is not torchrun's; else the last line with text in it."""
    lines = [x.strip() for x in stderr.splitlines() if x.strip()]
    ours = [x for x in lines if x.startswith("error:")]
    if ours:
        return ours[-1]
    raised = [x for x in lines if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b.*:", x)
              and not any(name in x for name in LAUNCHER_ERRORS)]
    if raised:
        return raised[-1]
    text = [x for x in lines if re.search(r"\w", x)]
    return text[-1] if text else "(no stderr)"


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def last_logged_step(metrics: Path) -> int:
    """The step of the last complete train event in a metrics.jsonl (0 when none)."""
    step = 0
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == "train":
            step = max(step, int(event.get("step", 0)))
    return step


def metrics_summary(metrics: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        keep = ("step", "loss", "tokens_per_s", "lr", "bleu", "ppl")
        values = {k: round(v, 4) if isinstance(v, float) else v for k, v in event.items() if k in keep}
        if event.get("event") == "train":
            out["last_train"] = values
        elif event.get("event") in ("valid", "validation"):
            out["last_valid"] = values
    return out


# What the stages import, and what fails without it (checked before anything runs, without importing).
NEEDED_MODULES = {
    "torch": "every stage but the report", "numpy": "every stage", "click": "every pipeline command",
    "sentencepiece": "training and every model dir", "sacrebleu": "training validation and parity",
    "tqdm": "pipeline train", "onnx": "pipeline export", "onnxscript": "pipeline export (torch.onnx dynamo export)",
    "onnxruntime": "export verification and onnxruntime parity", "transformers": "the marian stage",
    "tensorboard": "training's TensorBoard events (optional: training runs without them)",
}


def importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def install_carried_wheels(directory: Path = ROOT / ".whl") -> list[str]:
    """Wheels carried to a machine without network (docs/gpu.md): each one whose module cannot be
    imported here is installed from the directory, without an index and without dependencies (what is
    already installed is left alone). Returns one line per wheel, for the report's notes."""
    lines = []
    for wheel in sorted(directory.glob("*.whl")):
        module = wheel.name.split("-")[0]
        if importable(module):
            lines.append(f"{wheel.name}: {module} is already installed, left as it is")
            continue
        proc = subprocess.run([PY, "-m", "pip", "install", "--no-index", "--no-deps", "--quiet", str(wheel)],
                              capture_output=True, text=True, timeout=300)
        status = "installed" if proc.returncode == 0 else f"pip failed: {proc.stderr.strip()[-300:]}"
        lines.append(f"{wheel.name}: {status}")
    return lines


def keep_artifacts(work: Path, out: Path) -> list[str]:
    """The small files of the work dir worth keeping beside the report: JSON results, serve-batch
    outputs, training metrics."""
    dest = out / "artifacts"
    dest.mkdir(parents=True, exist_ok=True)
    kept = []
    for path in [*work.glob("*.json"), *work.glob("serve-*.txt"), *work.glob("train*/metrics.jsonl"),
                 *work.glob("parity-hyps/*/*.txt")]:
        if path.is_file() and path.stat().st_size < (4 << 20):
            name = str(path.relative_to(work)).replace(os.sep, "__")
            shutil.copyfile(path, dest / name)
            kept.append(name)
    return kept


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode:
        return None
    return out.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def fmt(x: Any, spec: str = ".1f") -> str:
    if x is None:
        return "-"
    try:
        return format(x, spec)
    except (TypeError, ValueError):
        return str(x)


def _threads(p: dict[str, Any]) -> None:
    if p.get("threads"):
        import torch

        torch.set_num_threads(int(p["threads"]))
