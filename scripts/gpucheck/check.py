"""The GPU check's orchestrator (scripts/gpu_check.py): runs each stage with its own time limit, each
command in its own process group with its logs, keeps going when a stage fails, and rewrites the report
after every stage. The stages themselves are the methods of the mixins in stages_*.py."""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import signal
import subprocess
import threading
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any

from gpucheck.modes import STAGES, Mode, Stage
from gpucheck.report import render_markdown
from gpucheck.stages_file import FileStages
from gpucheck.stages_measure import MeasureStages
from gpucheck.stages_serve import ServeStages
from gpucheck.stages_train import TrainStages
from gpucheck.util import (
    FAIL,
    PASS,
    PENDING,
    PY,
    ROOT,
    SCRIPT,
    SKIP,
    Fail,
    Skip,
    atomic_write,
    failure_line,
    git_commit,
    read_json,
    tail,
)


class Check(TrainStages, ServeStages, MeasureStages, FileStages):
    def __init__(self, out: Path, mode: Mode, budget_s: float | None, work: Path):
        self.out = out
        self.mode = mode
        self.logs = out / "logs"
        self.work = work
        self.logs.mkdir(parents=True, exist_ok=True)
        self.work.mkdir(parents=True, exist_ok=True)
        self.started = time.time()
        self.t0 = time.monotonic()
        self.deadline = self.t0 + (budget_s or mode.budget_s)
        self.stages = {name: Stage(name, title) for name, title in STAGES}
        self.lock = threading.RLock()
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(
            os.pathsep) if p])
        self.env["PYTHONUNBUFFERED"] = "1"
        if mode.name == "cpu":
            self.env["OMP_NUM_THREADS"] = "1"
        self.save_dir = self.work / "train"  # replaced by the fallback when CUDA training fails
        self.model_dirs = {"fp32": self.work / "model-fp32", "fp16": self.work / "model-fp16"}
        self.hyps = self.work / "parity-hyps"
        self.checkpoints = {p: self.work / f"random-{p}.pt" for p in mode.bench_presets}
        self.notes: list[str] = []
        self.artifacts: list[str] = []
        self.only: set[str] = set()
        self.commit = git_commit()

    # -- running one stage -----------------------------------------------------------------------

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, name: str, fn: Any) -> Stage:
        st = self.stages[name]
        limit = min(self.mode.timeouts.get(name, 120), self.remaining() - 5)
        print(f"[gpu-check] {name}: start ({limit:.0f} s limit)", flush=True)
        t0 = time.monotonic()
        if self.only and name not in self.only and name != "doctor":  # doctor names the machine
            st.status, st.reason = SKIP, "not selected (--only)"
        elif limit < 5:
            st.status, st.reason = SKIP, f"the check's time budget was spent before this stage ({self.elapsed():.0f} s)"
        else:
            st.status = "RUNNING"
            try:
                note = fn(st, time.monotonic() + limit)
                st.status, st.reason = PASS, note or st.reason
            except Skip as e:
                st.status, st.reason = SKIP, str(e)
            except Fail as e:
                st.status, st.reason = FAIL, str(e)
            except Exception as e:  # a bug of this script: recorded, and the next stage runs
                st.status, st.reason = FAIL, f"{type(e).__name__}: {e}"
                st.stderr_tail = traceback.format_exc()[-4000:]
        st.seconds = round(time.monotonic() - t0, 1)
        if st.status == FAIL and not st.stderr_tail and st.commands:
            st.stderr_tail = tail(Path(st.commands[-1]["stderr"]))
        print(f"[gpu-check] {name}: {st.status} in {st.seconds:.0f} s{': ' + st.reason if st.reason else ''}",
              flush=True)
        self.write_report()
        return st

    def background(self, name: str, fn: Any) -> threading.Thread:
        thread = threading.Thread(target=self.run, args=(name, fn), name=name, daemon=True)
        thread.start()
        return thread

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def start(self, st: Stage, argv: list[str], label: str = "") -> tuple[subprocess.Popen, dict[str, Any]]:
        n = len(st.commands)
        stem = f"{st.name}{'-' + label if label else ''}" + (f"-{n}" if not label and n else "")
        record: dict[str, Any] = {"argv": [str(a) for a in argv], "label": label,
                                  "stdout": str(self.logs / f"{stem}.out"), "stderr": str(self.logs / f"{stem}.err")}
        st.commands.append(record)
        out = open(record["stdout"], "w")
        err = open(record["stderr"], "w")
        try:
            proc = subprocess.Popen(record["argv"], cwd=ROOT, env=self.env, stdout=out, stderr=err,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            out.close()
            err.close()
        record["_t0"] = time.monotonic()
        return proc, record

    def finish(self, proc: subprocess.Popen, record: dict[str, Any], deadline: float) -> int:
        try:
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill(proc)
            record["rc"], record["seconds"] = None, round(time.monotonic() - record.pop("_t0"), 1)
            raise Fail(f"timed out after {record['seconds']:.0f} s (the stage's limit): "
                       f"{' '.join(record['argv'][2:8])} ...") from None
        record["rc"], record["seconds"] = rc, round(time.monotonic() - record.pop("_t0"), 1)
        return rc

    @staticmethod
    def kill(proc: subprocess.Popen) -> None:
        """The command and everything it started (its own session), by its process group id."""
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def cmd(self, st: Stage, argv: list[str], deadline: float, label: str = "", ok: tuple[int, ...] = (0,)) -> str:
        """Run argv to the end; Fail unless its exit status is in `ok`. Returns its stdout."""
        proc, record = self.start(st, argv, label)
        rc = self.finish(proc, record, deadline)
        if rc not in ok:
            text = Path(record["stderr"]).read_text(errors="replace")
            line = failure_line(text)
            st.stderr_tail = tail(Path(record["stderr"]))
            if line not in st.stderr_tail:
                st.stderr_tail = f"{line}\n...\n{st.stderr_tail}"
            raise Fail(f"exit status {rc}: {line[:300]}")
        return Path(record["stdout"]).read_text(errors="replace")

    def pipeline(self, *args: Any) -> list[str]:
        return [PY, "-m", "pipeline", *map(str, args)]

    def worker(self, st: Stage, name: str, params: dict[str, Any], deadline: float,
               torchrun: bool = False) -> dict[str, Any]:
        result = self.work / f"{st.name}-{name}.json"
        result.unlink(missing_ok=True)
        head = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"] if torchrun else [PY]
        argv = [*head, str(SCRIPT), "_worker", name, "--json", str(result), "--params", json.dumps(params)]
        self.cmd(st, argv, deadline, label=name)
        data = read_json(result)
        if data is None:
            raise Fail(f"the {name} worker wrote no result ({result})")
        return data

    # -- all of it -------------------------------------------------------------------------------

    def run_all(self) -> None:
        self.run("doctor", self.doctor)
        self.run("nvidia-smi", self.nvidia_smi)
        # CPU-bound and independent of training: made while the GPU trains
        randoms = self.background("random-checkpoints", self.random_checkpoints)
        dist = self.background("distributed", self.distributed)
        self.run("train", self.train)
        resume = self.background("resume", self.resume)
        exports = [self.background("export-fp32", self.export("fp32")),
                   self.background("export-fp16", self.export("fp16"))]
        for thread in exports:
            thread.join()
        self.run("serve-fp32", self.serve("fp32"))
        self.run("serve-fp16", self.serve("fp16"))
        self.run("parity-torch-recorded", self.parity_recorded)
        self.run("parity-onnxruntime-fp32", self.parity_live("fp32"))
        self.run("parity-onnxruntime-fp16", self.parity_live("fp16"))
        self.run("parity-serve", self.parity_serve)
        self.run("bench-cli", self.bench_cli)
        # the timed stages run alone on the device
        for thread in (resume, randoms, dist):
            thread.join()
        self.run("bench", self.bench)
        self.run("file", self.file)
        self.run("marian", self.marian)
        self.run("roofline", self.roofline)
        self.run("onnxruntime-cuda", self.onnxruntime_cuda)

    # -- the report ------------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        facts = self.stages["doctor"].data.get("facts") or {}
        gpus = (facts.get("torch") or {}).get("gpus") or []
        card = gpus[0]["name"] if gpus else ("cpu-" + ((facts.get("cpu") or {}).get("model") or platform.machine()))
        slug = re.sub(r"[^a-z0-9]+", "-", str(card).lower()).strip("-") or "unknown"
        date = datetime.date.fromtimestamp(self.started).isoformat()
        counts = {s: sum(st.status == s for st in self.stages.values()) for s in (PASS, FAIL, SKIP, PENDING)}
        return {
            "mode": self.mode.name,
            "started": datetime.datetime.fromtimestamp(self.started).isoformat(timespec="seconds"),
            "wall_s": round(self.elapsed(), 1), "budget_s": round(self.deadline - self.t0),
            "card": card, "suggested_benchmark_file": f"benchmarks/{date}_{slug}_gpu-check.md",
            "host": {"python": platform.python_version(), "platform": platform.platform(),
                     "torch": (facts.get("torch") or {}).get("version"), "cuda": (facts.get("torch") or {}).get("cuda"),
                     "onnxruntime": (facts.get("onnxruntime") or {}).get("version"),
                     "transformers": self.stages["marian"].data.get("transformers"),
                     "cpu": (facts.get("cpu") or {}).get("model"), "commit": self.commit},
            "counts": counts, "passed": counts[FAIL] == 0 and counts[PENDING] == 0,
            "notes": list(self.notes), "artifacts": list(self.artifacts), "work_dir": str(self.work),
        }

    def write_report(self) -> None:
        with self.lock:
            stages = [dict(asdict(st)) for st in self.stages.values()]
            for st in stages:
                for c in st["commands"]:
                    c.pop("_t0", None)
            report = {**self.summary(), "stages": stages,
                      "bench": self.stages["bench"].data.get("rows", []),
                      "bench_cli": (self.stages["bench-cli"].data.get("bench") or {}).get("results", []),
                      "marian": {k: v for k, v in self.stages["marian"].data.items()},
                      "roofline": self.stages["roofline"].data}
            atomic_write(self.out / "report.json", json.dumps(report, indent=2, default=str) + "\n")
            atomic_write(self.out / "report.md", render_markdown(report, self.mode))
