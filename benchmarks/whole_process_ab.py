"""Two or more checkouts of the code, each running `pipeline serve-batch` on the same model dir and file as a
user would (a fresh process, start to exit), alternating: wall time and peak RSS per round, medians, and each
checkout's time over the first's (benchmarks/README.md, "cpu-overheads").

    git worktree add /tmp/before HEAD~2
    python benchmarks/whole_process_ab.py MODEL_DIR FILE /tmp/before . --rounds 16 [--json out.json] [-- ARGS]

ARGS after `--` go to every serve-batch (for instance `--parallel-batches 1`). One untimed round first (bytecode
compiled, files in the page cache); the order is reversed every other round. Wall and peak RSS are GNU time's
(%e, %M). The outputs are compared byte for byte: a checkout whose translations differ from the first's is
reported."""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def one(code: Path, model_dir: Path, src: Path, out: Path, extra: list[str]) -> tuple[float, float]:
    """serve-batch with `code`'s pipeline: (wall s, peak RSS MB)."""
    cmd = ["/usr/bin/time", "-f", "TIME %e %M", sys.executable, "-m", "pipeline", "serve-batch", str(model_dir),
           str(src), "-o", str(out), "--no-progress", *extra]
    done = subprocess.run(cmd, cwd=code, env={**os.environ, "PYTHONPATH": str(code)}, capture_output=True, text=True)
    found = re.search(r"TIME ([\d.]+) (\d+)", done.stderr)
    if done.returncode or found is None:
        raise SystemExit(f"{code}: serve-batch failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return float(found.group(1)), int(found.group(2)) / 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", type=Path)
    p.add_argument("src", type=Path)
    p.add_argument("codes", type=Path, nargs="+", help="checkouts, the first the baseline")
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--json", type=Path)
    args, extra = p.parse_known_args()
    extra = [a for a in extra if a != "--"]
    codes = [c.resolve() for c in args.codes]
    wall: dict[Path, list[float]] = {c: [] for c in codes}
    peak: dict[Path, list[float]] = {c: [] for c in codes}
    with tempfile.TemporaryDirectory() as tmp:
        outs = {c: Path(tmp) / f"out{i}.txt" for i, c in enumerate(codes)}
        for r in range(args.rounds + 1):  # round 0 untimed
            for code in codes if r % 2 == 0 else codes[::-1]:
                w, m = one(code, args.model_dir.resolve(), args.src.resolve(), outs[code], extra)
                if r:
                    wall[code].append(w)
                    peak[code].append(m)
        same = {str(c): filecmp.cmp(outs[codes[0]], outs[c], shallow=False) for c in codes}
    base = statistics.median(wall[codes[0]])
    for code in codes:
        ratio = statistics.median(wall[code]) / base
        wins = sum(a < b for a, b in zip(wall[code], wall[codes[0]]))
        print(f"{str(code):40s} wall median {statistics.median(wall[code]):6.2f} s ({ratio:.3f}x the first's, faster "
              f"in {wins}/{args.rounds} rounds), peak RSS median {statistics.median(peak[code]):5.0f} MB, "
              f"output {'the same' if same[str(code)] else 'DIFFERENT'}")
    if args.json:
        args.json.write_text(json.dumps({"model_dir": str(args.model_dir), "src": str(args.src),
                                         "serve_batch_args": extra, "rounds": args.rounds, "same_output": same,
                                         "wall_s": {str(c): wall[c] for c in codes},
                                         "peak_rss_mb": {str(c): peak[c] for c in codes}}, indent=1))


if __name__ == "__main__":
    main()
