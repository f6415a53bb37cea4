"""Copy the installed `tensorrt-stubs` into a directory mypy can read, fixing what it cannot parse.

tensorrt-stubs 10.13.0.35.1 is generated from the pybind11 bindings and has a few lines that
are not Python: parameters named `in` (a keyword) and a parameter without a default after
defaulted ones. mypy stops at the first syntax error in any stub it reads, so the stubs as
installed would check nothing. This rewrites exactly those defects (keywords get a trailing
underscore, a non-default parameter after a default gets `= ...`) and leaves every other line,
so every call of ours is still checked against the real signatures.

    python scripts/tensorrt_stubs.py [OUT_DIR]      (default: .typings, mypy_path in pyproject)
"""

from __future__ import annotations

import keyword
import re
import sys
from importlib import metadata
from pathlib import Path

DIST = "tensorrt-stubs"
DEFAULT_OUT = Path(__file__).resolve().parents[1] / ".typings"


def _split_params(params: str) -> list[str]:
    """Split a parameter list on the commas at bracket depth 0."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(params):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(params[start:i])
            start = i + 1
    parts.append(params[start:])
    return parts


def fix_def(line: str) -> str:
    """One `def name(params) -> ret:` line made valid Python; other lines come back unchanged."""
    m = re.match(r"^(\s*def \w+\()(.*)(\)\s*(?:->.*)?:\s*)$", line)
    if not m:
        return line
    head, params, tail = m.groups()
    fixed, seen_default = [], False
    for raw in _split_params(params):
        p = raw.strip()
        name = re.match(r"\**(\w+)", p)
        if name and keyword.iskeyword(name.group(1)):
            p = p.replace(name.group(1), name.group(1) + "_", 1)
        if "=" in p:
            seen_default = True
        elif seen_default and p and not p.startswith("*") and p != "/":
            p += " = ..."
        fixed.append(p)
    return head + ", ".join(fixed) + tail


def write_stubs(out: Path) -> list[Path]:
    try:
        dist = metadata.distribution(DIST)
    except metadata.PackageNotFoundError:
        raise SystemExit(f"error: {DIST} is not installed: pip install --no-deps {DIST}==10.13.0.35.1") from None
    written = []
    for f in dist.files or []:
        if f.suffix != ".pyi":
            continue
        text = Path(str(dist.locate_file(f))).read_text(encoding="utf-8")
        target = out / str(f)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("".join(fix_def(line) for line in text.splitlines(keepends=True)), encoding="utf-8")
        written.append(target)
    return written


if __name__ == "__main__":
    out_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT
    files = write_stubs(out_dir)
    print(f"{len(files)} TensorRT stub files written to {out_dir}")
