#!/usr/bin/env python3
"""The one-command GPU check (docs/gpu.md): `bash scripts/gpu_check.sh OUT_DIR [--cpu]`.

Runs every stage a first GPU run needs, each in its own subprocess with its own time limit, and
keeps going when one fails: the failure, its stderr tail and the reason go into the report, and
stages that need its output are skipped with that reason (a failed CUDA training is replaced by a
short CPU training, so export, serving, parity and the peer still run). OUT_DIR/report.md and
OUT_DIR/report.json are rewritten after every stage, so a check cut off by a time limit still
leaves a report; every command's stdout and stderr are in OUT_DIR/logs/.

    1 doctor, nvidia-smi         pipeline doctor --json; nvidia-smi (SKIP where absent)
      distributed                a 1-rank NCCL (gloo with --cpu) process group under torchrun: all-reduce,
                                 object broadcast and a DDP step, since `torchrun --nproc-per-node 1`
                                 trains without a process group (pipeline/distributed.py: world > 1 only)
    2 train                      torchrun --standalone --nproc-per-node 1 -m pipeline train on the built-in
                                 corpus, --device cuda --precision bf16
    3 resume                     the same command again, SIGTERM mid-run (checkpoint, exit), rerun to resume,
                                 final weights against stage 2's uninterrupted run
    4 export-fp32, export-fp16   pipeline export --no-tensorrt [--fp16]
    5 serve-fp32, serve-fp16     pipeline serve-batch --backend torch --device cuda --dtype fp32|fp16, test split
    6 parity-*                   torch on CUDA against the fp32 CPU references recorded at export; onnxruntime
                                 (CPU) against torch (CPU, fp32) live; serve-batch's CUDA fp32/fp16 output
                                 against torch (CPU, fp32) with parity's gates
    7 random-checkpoints, bench-cli, bench
                                 random base and big; `pipeline bench` on the trained model dir; the same
                                 measuring function (pipeline.evaluation.bench.bench_backend) on base and big,
                                 batch 1/32/128, beam 4, 30 tokens, with peak GPU memory
    8 marian                     transformers' MarianMTModel on the same weights: token-identical greedy
                                 output, then generate() timed beside stage 7
    9 roofline                   bytes and FLOPs per decoder step (pipeline/evaluation/roofline.py) against
                                 a measured device copy and matmul

--cpu runs the same stages on the CPU at tiny sizes (tests/test_gpu_check.py), so that the script
cannot rot between GPU runs. The orchestrator imports nothing but the standard library; the
measurements run in `python scripts/gpu_check.py _worker NAME` subprocesses.

The parts are in scripts/gpucheck/ (each at most 400 lines, tests/test_gpu_check.py): modes.py (the
modes, the stages in order, a stage's record), check.py (Check: running a stage, its commands and the
report files), stages_train.py, stages_serve.py and stages_measure.py (the stages, as Check's methods),
report.py (report.md), util.py (the small utilities), and the workers: workers_train.py (ddp,
compare-checkpoints, compare-outputs), workers_bench.py (bench, its timed steps and device ops),
workers_marian.py and workers_roofline.py. This file is the entry point, for the check and its workers,
and names everything the parts define (scripts/gpu_step_ab.py and the tests import it as `gpu_check`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # run as a script it is there already; loaded from its path (the tests) it is not
    sys.path.insert(0, str(HERE))

from gpucheck.check import Check  # noqa: E402
from gpucheck.modes import CPU_TRAIN, FP16_MODE_AGREEMENT, MODES, STAGES, Mode, Stage  # noqa: E402
from gpucheck.report import render_markdown, stage_details  # noqa: E402
from gpucheck.util import (  # noqa: E402
    FAIL,
    LAUNCHER_ERRORS,
    NEEDED_MODULES,
    PASS,
    PENDING,
    PY,
    ROOT,
    SKIP,
    TAIL_LINES,
    Fail,
    Skip,
    atomic_write,
    failure_line,
    fmt,
    git_commit,
    importable,
    install_carried_wheels,
    keep_artifacts,
    last_logged_step,
    metrics_summary,
    read_json,
    tail,
)
from gpucheck.workers_bench import device_ops_per_step, timed_steps, worker_bench  # noqa: E402
from gpucheck.workers_marian import worker_generate_file, worker_marian  # noqa: E402
from gpucheck.workers_roofline import worker_roofline  # noqa: E402
from gpucheck.workers_train import nccl_version, worker_compare_checkpoints, worker_compare_outputs, worker_ddp  # noqa: E402

__all__ = [
    "CPU_TRAIN", "FAIL", "FP16_MODE_AGREEMENT", "LAUNCHER_ERRORS", "MODES", "NEEDED_MODULES", "PASS", "PENDING",
    "PY", "ROOT", "SKIP", "STAGES", "TAIL_LINES", "WORKERS", "Check", "Fail", "Mode", "Skip", "Stage",
    "atomic_write", "device_ops_per_step", "failure_line", "fmt", "git_commit", "importable",
    "install_carried_wheels", "keep_artifacts", "last_logged_step", "main", "metrics_summary", "nccl_version",
    "read_json", "render_markdown", "run_worker", "stage_details", "tail", "timed_steps", "worker_bench",
    "worker_compare_checkpoints", "worker_compare_outputs", "worker_ddp", "worker_generate_file", "worker_marian",
    "worker_roofline",
]


WORKERS = {"ddp": worker_ddp, "compare-checkpoints": worker_compare_checkpoints,
           "compare-outputs": worker_compare_outputs, "bench": worker_bench, "marian": worker_marian,
           "roofline": worker_roofline, "generate-file": worker_generate_file}


def run_worker(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check.py _worker")
    parser.add_argument("name", choices=sorted(WORKERS))
    parser.add_argument("--json", required=True, type=Path)
    parser.add_argument("--params", required=True)
    args = parser.parse_args(argv)
    result = WORKERS[args.name](json.loads(args.params))
    if int(os.environ.get("RANK", "0")) == 0:
        atomic_write(args.json, json.dumps(result, indent=2, default=str) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_worker"]:
        return run_worker(argv[1:])
    parser = argparse.ArgumentParser(description="The one-command GPU check (docs/gpu.md): every stage a first GPU "
                                                 "run needs, a report in OUT_DIR/report.md and report.json.")
    parser.add_argument("out_dir", type=Path, help="where report.md, report.json, logs/ and work/ go")
    parser.add_argument("--cpu", action="store_true", help="the same stages on the CPU at tiny sizes (CI)")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for the whole check (default: 540 on GPU, 600 with --cpu); later stages "
                             "are skipped once it is spent")
    parser.add_argument("--work", type=Path, default=None,
                        help="where checkpoints, model dirs and other large files go (default: a new temporary "
                             "directory, removed at the end unless --keep-work): OUT_DIR stays small enough to "
                             "come back from a device machine")
    parser.add_argument("--keep-work", action="store_true", help="keep the work directory")
    parser.add_argument("--only", default="", metavar="STAGE,...",
                        help="run only these stages (a rerun of what failed, within what device time is left); "
                             "the others are SKIP, and so are selected stages whose input is missing. Stages: "
                             + ", ".join(name for name, _ in STAGES))
    args = parser.parse_args(argv)
    only = {x.strip() for x in args.only.split(",") if x.strip()}
    unknown = only - {name for name, _ in STAGES}
    if unknown:
        parser.error(f"--only: unknown stage(s) {', '.join(sorted(unknown))}")
    mode = MODES["cpu" if args.cpu else "gpu"]
    out = args.out_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = args.work.resolve() if args.work else Path(tempfile.mkdtemp(prefix="gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    check = Check(out, mode, args.budget, work)
    check.only = only
    check.notes += [f"carried wheel {line}" for line in install_carried_wheels()]
    try:
        check.run_all()
    except BaseException as e:  # Ctrl-C, a kill by the caller's time limit: report what ran
        check.notes.append(f"the check stopped early: {type(e).__name__}: {e}")
        raise
    finally:
        for st in check.stages.values():
            if st.status in (PENDING, "RUNNING"):
                st.status, st.reason = SKIP, st.reason or "not reached (the check stopped before this stage)"
        try:
            check.artifacts = keep_artifacts(work, out)
        except OSError as e:
            check.notes.append(f"could not copy the small artifacts out of {work}: {e}")
        if args.keep_work:
            check.notes.append(f"work directory kept: {work}")
        check.write_report()
        if not args.keep_work:
            shutil.rmtree(work, ignore_errors=True)
        s = check.summary()
        print(f"[gpu-check] {s['counts']} in {s['wall_s']:.0f} s; report: {out / 'report.md'}", flush=True)
    return 0 if check.summary()["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
