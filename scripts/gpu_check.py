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
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
TAIL_LINES = 25
PASS, FAIL, SKIP, PENDING = "PASS", "FAIL", "SKIP", "PENDING"


class Skip(Exception):
    """The stage cannot run here or lacks an earlier stage's output: SKIP with this reason."""


class Fail(Exception):
    """The stage ran and did not do what it must: FAIL with this reason."""


# -- what each mode runs ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Mode:
    name: str                      # "gpu" or "cpu"
    device: str
    precision: str                 # training autocast
    train: tuple[str, ...]         # pipeline train options (besides --save-dir, --device, --precision)
    max_steps: int
    signal_at: int                 # SIGTERM once metrics.jsonl logs this step
    fallback_train: tuple[str, ...]
    export: tuple[str, ...]
    serve_threads: tuple[str, ...]
    decode: tuple[str, ...]        # serve-batch and live parity decoding options (the same for both)
    test_lines: int                # serve-batch and live parity translate the test split's first lines
    bench_presets: tuple[str, ...]
    bench_vocab: int
    bench_batches: tuple[int, ...]
    bench_sentences: dict[int, int]
    bench_dtypes: tuple[str, ...]
    roofline_batches: tuple[int, ...]
    step_modes: tuple[str, ...]  # the torch backend's decoder step (runtime/static_step.py), the first the reference
    cli_batches: tuple[int, ...]
    copy_bytes: int
    matmul_n: int
    matmul_dtypes: tuple[str, ...]
    threads: int | None
    budget_s: float
    timeouts: dict[str, float]


FP16_MODE_AGREEMENT = 0.9  # share of fp16 translations that must not change with the decoder step mode

CPU_TRAIN = ("--preset", "tiny", "--builtin-pairs", "1000", "--vocab-size", "200", "--max-steps", "60",
             "--warmup", "20", "--save-every", "30", "--valid-every", "60", "--valid-max-sentences", "20",
             "--log-every", "1", "--threads", "1", "--no-tensorboard", "--no-progress", "--seed", "1")

MODES = {
    "gpu": Mode(
        name="gpu", device="cuda", precision="bf16",
        # the built-in corpus' own defaults (preset demo, 3000-token batches, warmup 300, vocab 600, 30000
        # pairs: a high validation BLEU in 1200 steps), so that parity gates a model that has learnt
        train=("--max-steps", "1200", "--save-every", "400", "--valid-every", "1200", "--valid-max-sentences", "200",
               "--log-every", "10", "--no-progress", "--seed", "1"),
        max_steps=1200, signal_at=500, fallback_train=CPU_TRAIN, export=(),
        serve_threads=(), decode=(), test_lines=200,
        bench_presets=("base", "big"), bench_vocab=32000, bench_batches=(1, 32, 128),
        bench_sentences={1: 8, 32: 128, 128: 256}, bench_dtypes=("fp32", "fp16"), roofline_batches=(32, 128),
        step_modes=("eager", "graph"),
        cli_batches=(1, 32), copy_bytes=1 << 30, matmul_n=8192, matmul_dtypes=("fp32", "fp16", "bf16"),
        threads=None, budget_s=460.0,
        timeouts={"doctor": 60, "nvidia-smi": 30, "distributed": 120, "train": 180, "resume": 300,
                  "export-fp32": 200, "export-fp16": 200, "serve-fp32": 90, "serve-fp16": 90,
                  "parity-torch-recorded": 120, "parity-onnxruntime-fp32": 150, "parity-onnxruntime-fp16": 150,
                  "parity-serve": 60, "random-checkpoints": 200, "bench-cli": 90, "bench": 200, "marian": 200,
                  "roofline": 90, "onnxruntime-cuda": 240},
    ),
    "cpu": Mode(
        name="cpu", device="cpu", precision="fp32", train=CPU_TRAIN, max_steps=60, signal_at=25,
        fallback_train=CPU_TRAIN, export=("--reference-lines", "10"), serve_threads=("--threads", "2"),
        decode=("--max-len-a", "0", "--max-len-b", "12"),  # the untrained tiny model never ends by itself
        test_lines=50,
        bench_presets=("tiny", "demo"), bench_vocab=256, bench_batches=(1, 4), bench_sentences={1: 4, 4: 8},
        bench_dtypes=("fp32",), roofline_batches=(4,), step_modes=("eager", "static"),
        cli_batches=(1, 4), copy_bytes=64 << 20, matmul_n=512,
        matmul_dtypes=("fp32",), threads=2, budget_s=600.0,
        timeouts={"doctor": 60, "nvidia-smi": 30, "distributed": 90, "train": 120, "resume": 240,
                  "export-fp32": 180, "export-fp16": 180, "serve-fp32": 90, "serve-fp16": 90,
                  "parity-torch-recorded": 90, "parity-onnxruntime-fp32": 120, "parity-onnxruntime-fp16": 120,
                  "parity-serve": 60, "random-checkpoints": 120, "bench-cli": 90, "bench": 120, "marian": 120,
                  "roofline": 60, "onnxruntime-cuda": 60},
    ),
}

STAGES = [
    ("doctor", "pipeline doctor --json"),
    ("nvidia-smi", "nvidia-smi"),
    ("distributed", "1-rank process group under torchrun (all-reduce, broadcast, DDP step)"),
    ("train", "torchrun -m pipeline train (built-in corpus)"),
    ("resume", "SIGTERM mid-run, resume, compare with the uninterrupted run"),
    ("export-fp32", "pipeline export --no-tensorrt"),
    ("export-fp16", "pipeline export --fp16 --no-tensorrt"),
    ("serve-fp32", "pipeline serve-batch --backend torch --dtype fp32"),
    ("serve-fp16", "pipeline serve-batch --backend torch --dtype fp16"),
    ("parity-torch-recorded", "pipeline parity (torch on the device vs fp32 CPU references recorded at export)"),
    ("parity-onnxruntime-fp32", "pipeline parity --backends onnxruntime (CPU) vs torch (CPU, fp32), fp32 dir"),
    ("parity-onnxruntime-fp16", "pipeline parity --backends onnxruntime (CPU) vs torch (CPU, fp32), fp16 dir"),
    ("parity-serve", "serve-batch's torch output on the device (fp32, fp16) vs torch (CPU, fp32)"),
    ("random-checkpoints", "pipeline random-checkpoint (bench shapes)"),
    ("bench-cli", "pipeline bench --backends torch on the trained model dir"),
    ("bench", "torch backend on the device: bench shapes, batch sizes, peak memory"),
    ("marian", "transformers MarianMTModel on the same weights: greedy agreement, generate() timing"),
    ("roofline", "bytes and FLOPs per decoder step vs measured copy bandwidth and matmul rate"),
    ("onnxruntime-cuda", "onnxruntime's CUDA provider (onnxruntime-gpu carried in parts): parity and bench"),
]


# -- bookkeeping -----------------------------------------------------------------------------------


@dataclass
class Stage:
    name: str
    title: str
    status: str = PENDING
    reason: str = ""
    seconds: float = 0.0
    commands: list[dict[str, Any]] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    stderr_tail: str = ""


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


class Check:
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
        argv = [*head, str(Path(__file__).resolve()), "_worker", name, "--json", str(result),
                "--params", json.dumps(params)]
        self.cmd(st, argv, deadline, label=name)
        data = read_json(result)
        if data is None:
            raise Fail(f"the {name} worker wrote no result ({result})")
        return data

    # -- the stages ------------------------------------------------------------------------------

    def doctor(self, st: Stage, deadline: float) -> str:
        missing = {m: why for m, why in NEEDED_MODULES.items() if not importable(m)}
        st.data["missing_modules"] = missing
        for module, why in missing.items():
            self.notes.append(f"Python module {module} is not installed here: {why} (docs/gpu.md: carrying wheels)")
        facts = json.loads(self.cmd(st, self.pipeline("doctor", "--json"), deadline))
        st.data["facts"] = facts
        torch = facts.get("torch") or {}
        gpus = torch.get("gpus") or []
        if self.mode.name == "gpu" and not gpus:
            raise Fail(f"no GPU usable by PyTorch: {torch.get('no_gpu_reason')}")
        names = ", ".join(f"{g.get('name')} ({g.get('memory_gib')} GiB, sm {g.get('compute_capability')})"
                          for g in gpus)
        return (f"torch {torch.get('version')} CUDA {torch.get('cuda')}; GPUs: {names or 'none'}; bf16 "
                f"{torch.get('bf16')}; NCCL {torch.get('nccl')}; onnxruntime providers "
                f"{(facts.get('onnxruntime') or {}).get('providers')}"
                + (f"; missing modules: {', '.join(missing)}" if missing else ""))

    def nvidia_smi(self, st: Stage, deadline: float) -> str:
        if self.mode.name == "cpu":
            raise Skip("--cpu: no GPU to query (nvidia-smi needs an NVIDIA driver)")
        exe = shutil.which("nvidia-smi")
        if exe is None:
            raise Skip("nvidia-smi is not on PATH on this machine")
        out = self.cmd(st, [exe], deadline)
        st.data["nvidia_smi"] = out
        query = self.cmd(st, [exe, "--query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit",
                              "--format=csv,noheader"], deadline, label="query")
        st.data["query"] = query.strip()
        return query.strip().splitlines()[0] if query.strip() else "ran"

    def distributed(self, st: Stage, deadline: float) -> str:
        backend = "nccl" if self.mode.name == "gpu" else "gloo"
        data = self.worker(st, "ddp", {"device": self.mode.device, "backend": backend,
                                       "precision": self.mode.precision}, deadline, torchrun=True)
        st.data.update(data)
        if not data.get("ok"):
            raise Fail(data.get("problem", "the DDP worker reported a problem"))
        return (f"{backend}: all-reduce, object broadcast and a DDP step with {self.mode.precision} autocast on "
                f"{data.get('device')}; DDP gradients equal to the plain model's (max |diff| "
                f"{data.get('grad_max_abs_diff'):.3g})")

    def train_argv(self, save_dir: Path) -> list[str]:
        return [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m", "pipeline",
                "train", "--save-dir", str(save_dir), *self.mode.train, "--device", self.mode.device,
                "--precision", self.mode.precision]

    def check_trained(self, st: Stage, save_dir: Path, label: str) -> dict[str, Any]:
        summary = metrics_summary(save_dir / "metrics.jsonl")
        step = last_logged_step(save_dir / "metrics.jsonl")
        checkpoints = sorted(save_dir.glob("checkpoint_0*.pt"))
        summary["checkpoints"] = [p.name for p in checkpoints]
        if not checkpoints or not checkpoints[-1].name.endswith(f"{self.mode.max_steps:08d}.pt"):
            raise Fail(f"{label}: no checkpoint of step {self.mode.max_steps} in {save_dir} (last logged step {step})")
        return summary

    def train(self, st: Stage, deadline: float) -> str:
        shutil.rmtree(self.save_dir, ignore_errors=True)
        try:
            self.cmd(st, self.train_argv(self.save_dir), deadline)
            st.data.update(self.check_trained(st, self.save_dir, "train"))
        except Fail:
            self.fallback(st, deadline)
            raise
        err = Path(st.commands[-1]["stderr"]).read_text(errors="replace")
        where = re.search(r"precision (\w+) on (\S+)", err)
        st.data["precision_device"] = where.group(0) if where else None
        if not where or where.group(1) != self.mode.precision or not where.group(2).startswith(self.mode.device):
            raise Fail(f"the trainer did not report precision {self.mode.precision} on {self.mode.device} "
                       f"(it said: {where.group(0) if where else 'nothing'})")
        speed = (st.data.get("last_train") or {}).get("tokens_per_s")
        return (f"{self.mode.max_steps} steps, {where.group(0)}, last loss "
                f"{(st.data.get('last_train') or {}).get('loss', float('nan')):.3f}, {speed} tokens/s; "
                f"last validation {st.data.get('last_valid')}")

    def fallback(self, st: Stage, deadline: float) -> None:
        """CUDA training failed: train briefly on the CPU so the later stages still have a model."""
        fallback = self.work / "train-fallback"
        shutil.rmtree(fallback, ignore_errors=True)
        argv = self.pipeline("train", "--save-dir", fallback, *self.mode.fallback_train, "--device", "cpu",
                             "--precision", "fp32")
        until = min(max(deadline, time.monotonic() + 120), self.deadline - 5)  # within the check's budget
        if until - time.monotonic() < 30:
            self.notes.append("training failed and no time is left for a CPU fallback training; later stages skip")
            return
        try:
            self.cmd(st, argv, until, label="fallback-cpu")
        except Fail as e:
            self.notes.append(f"the CPU fallback training failed too ({e}); later stages skip")
            return
        self.save_dir = fallback
        note = (f"training failed: later stages use {fallback}, trained on the CPU in fp32 "
                f"({' '.join(self.mode.fallback_train[:6])} ...)")
        self.notes.append(note)
        st.data["fallback"] = str(fallback)

    def need_trained(self) -> Path:
        if not sorted(self.save_dir.glob("checkpoint_0*.pt")):
            raise Skip(f"no trained checkpoint in {self.save_dir} (stage train: {self.stages['train'].status})")
        return self.save_dir

    def resume(self, st: Stage, deadline: float) -> str:
        if self.stages["train"].status != PASS:
            raise Skip(f"needs stage train's uninterrupted run to compare with (train: {self.stages['train'].status})")
        run = self.work / "train-resumed"
        shutil.rmtree(run, ignore_errors=True)
        argv = self.train_argv(run)
        proc, record = self.start(st, argv, "interrupted")
        signalled_at = None
        while proc.poll() is None:
            if time.monotonic() > deadline:
                self.kill(proc)
                raise Fail("the interrupted run reached the stage's time limit before the SIGTERM step")
            step = last_logged_step(run / "metrics.jsonl")
            if step >= self.mode.signal_at:
                proc.send_signal(signal.SIGTERM)  # to torchrun, as a scheduler would; it forwards to the worker
                signalled_at = step
                break
            time.sleep(0.02)
        rc = self.finish(proc, record, deadline)
        err = Path(record["stderr"]).read_text(errors="replace")
        stopped = re.search(r"stopped by SIGTERM at step (\d+); checkpoint (\S+);", err)
        st.data["interrupted"] = {"signalled_at_logged_step": signalled_at, "torchrun_exit": rc,
                                  "message": stopped.group(0) if stopped else None}
        if signalled_at is None:
            raise Fail(f"the run ended (exit {rc}) before step {self.mode.signal_at} was logged: raise --max-steps")
        if not stopped:
            st.stderr_tail = tail(Path(record["stderr"]))
            raise Fail(f"no 'stopped by SIGTERM at step N; checkpoint ...' line after the SIGTERM (exit {rc})")
        stop_step = int(stopped.group(1))
        if stop_step >= self.mode.max_steps:
            raise Fail(f"the SIGTERM landed at the last step ({stop_step}): nothing left to resume")
        self.cmd(st, argv, deadline, label="resumed")
        st.data["resumed"] = self.check_trained(st, run, "resumed run")
        cmp = self.worker(st, "compare-checkpoints", {"a": str(self.save_dir), "b": str(run)}, deadline)
        st.data["comparison"] = cmp
        if not cmp["state_equal"]:
            raise Fail(f"the resumed run's training state differs from the uninterrupted run's: {cmp['state_diffs']}")
        head = f"SIGTERM at step {stop_step} (torchrun exit {rc}), resumed to {self.mode.max_steps}"
        if cmp["identical"]:
            return f"{head}: weights, optimizer state and RNG bit-identical to the uninterrupted run"
        if self.mode.name == "cpu":
            raise Fail(f"{head}: weights differ from the uninterrupted run on the CPU, where a resume is exact "
                       f"(max |diff| {cmp['max_abs']:.3g})")
        # On the GPU: measure how far two uninterrupted runs of the same command drift apart.
        again = self.work / "train-again"
        shutil.rmtree(again, ignore_errors=True)
        self.cmd(st, self.train_argv(again), deadline, label="uninterrupted-again")
        noise = self.worker(st, "compare-checkpoints", {"a": str(self.save_dir), "b": str(again)}, deadline)
        st.data["run_to_run"] = noise
        tolerance = 10 * noise["max_abs"]
        st.data["tolerance"] = tolerance
        if noise["identical"]:
            raise Fail(f"{head}: two uninterrupted runs are bit-identical but the resumed one differs (max |diff| "
                       f"{cmp['max_abs']:.3g}): the resume does not replay the run")
        if cmp["max_abs"] > tolerance:
            raise Fail(f"{head}: max |diff| {cmp['max_abs']:.3g} against the uninterrupted run exceeds 10 x the "
                       f"run-to-run spread of two uninterrupted runs ({noise['max_abs']:.3g})")
        return (f"{head}: training state identical; weights within tolerance: max |diff| {cmp['max_abs']:.3g} "
                f"(rel L2 {cmp['rel_l2']:.3g}) vs run-to-run {noise['max_abs']:.3g} (rel L2 {noise['rel_l2']:.3g}) "
                f"of two uninterrupted runs; tolerance 10 x that")

    def export(self, precision: str) -> Any:
        def stage(st: Stage, deadline: float) -> str:
            save_dir = self.need_trained()
            out = self.model_dirs[precision]
            extra = ["--fp16"] if precision == "fp16" else []
            stdout = self.cmd(st, self.pipeline("export", save_dir, "--out", out, "--no-tensorrt", "--force",
                                                *extra, *self.mode.export), deadline)
            manifest = read_json(out / "manifest.json") or {}
            st.data["manifest_precision"] = manifest.get("precision")
            st.data["verification"] = manifest.get("verification")
            return stdout.strip().splitlines()[-1] if stdout.strip() else "exported"
        return stage

    def test_split(self) -> tuple[Path, Path]:
        """The first test_lines pairs of the built-in corpus' test split (SAVE_DIR/data/test.*)."""
        src, ref = self.save_dir / "data" / "test.src", self.save_dir / "data" / "test.tgt"
        if not src.is_file():
            raise Skip(f"no test split at {src} (written by pipeline train for the built-in corpus)")
        with self.lock:
            out = []
            for path in (src, ref):
                head = self.work / f"test-head{path.suffix}"
                if not head.is_file():
                    lines = path.read_bytes().splitlines(keepends=True)[: self.mode.test_lines]
                    atomic_write(head, b"".join(lines).decode("utf-8"))
                out.append(head)
        return out[0], out[1]

    def need_model_dir(self, precision: str) -> Path:
        path = self.model_dirs[precision]
        if not (path / "manifest.json").is_file():
            raise Skip(f"no {precision} model dir (export-{precision}: {self.stages['export-' + precision].status})")
        return path

    def serve(self, precision: str) -> Any:
        def stage(st: Stage, deadline: float) -> str:
            model_dir = self.need_model_dir(precision)
            src, _ = self.test_split()
            out = self.work / f"serve-{precision}.txt"
            out.unlink(missing_ok=True)
            self.cmd(st, self.pipeline("serve-batch", model_dir, src, "-o", out, "--backend", "torch", "--device",
                                       self.mode.device, "--dtype", precision, "--no-progress",
                                       *self.mode.serve_threads, *self.mode.decode), deadline)
            n_in, n_out = len(src.read_bytes().splitlines()), len(out.read_bytes().splitlines())
            st.data.update({"output": str(out), "lines_in": n_in, "lines_out": n_out})
            if n_in != n_out:
                raise Fail(f"{n_out} output lines for {n_in} input lines")
            err = Path(st.commands[-1]["stderr"]).read_text(errors="replace").strip().splitlines()
            st.data["summary"] = err[-1] if err else ""
            # the batch budget: the GPU's own default (DecodingOptions.for_device), logged when it applies
            budget = next((m for m in map(re.compile(r"batch budget (\d+) on (\S+)").search, err) if m), None)
            st.data["batch_tokens"] = int(budget.group(1)) if budget else None
            if (budget is not None) != (self.mode.device == "cuda"):
                raise Fail(f"serve-batch on {self.mode.device} logged the batch budget "
                           f"{budget.group(0) if budget else '(none)'}: the GPU default applies on CUDA only")
            note = " (the CPU runs torch in fp32: fp16 only on a GPU)" if precision == "fp16" and \
                self.mode.device == "cpu" else ""
            if budget is not None:  # the same file at the CPU's budget: what the GPU's default buys
                from runtime.decoding import PAPER  # this checkout is on PYTHONPATH (gpu_check.sh)

                cpu_budget = str(PAPER.batch_tokens)
                again = self.work / f"serve-{precision}-budget{cpu_budget}.txt"
                self.cmd(st, self.pipeline("serve-batch", model_dir, src, "-o", again, "--backend", "torch",
                                           "--device", self.mode.device, "--dtype", precision, "--no-progress",
                                           "--batch-tokens", cpu_budget, *self.mode.decode), deadline)
                err2 = Path(st.commands[-1]["stderr"]).read_text(errors="replace").strip().splitlines()
                rates = [re.search(r"([\d.]+) target tokens/s", x[-1] if x else "") for x in (err, err2)]
                same = sum(a == b for a, b in zip(out.read_bytes().splitlines(), again.read_bytes().splitlines()))
                st.data.update({"cpu_budget_summary": err2[-1] if err2 else "", "cpu_budget_same_lines": same})
                note += (f"; at --batch-tokens {cpu_budget}: " + (f"{rates[1].group(1)} tok/s" if rates[1] else "?")
                         + f", {same}/{n_out} lines the same")
            return f"{n_out} lines; {st.data['summary']}{note}" + (f"; {budget.group(0)}" if budget else "")
        return stage

    def parity_recorded(self, st: Stage, deadline: float) -> str:
        model_dir = self.need_model_dir("fp32")
        report = self.work / "parity-torch-recorded.json"
        self.cmd(st, self.pipeline("parity", model_dir, "--backends", "torch", "--device", self.mode.device,
                                   "--json", report), deadline)
        return self.parity_summary(st, report)

    def parity_summary(self, st: Stage, report: Path) -> str:
        data = read_json(report)
        if data is None:
            raise Fail(f"parity wrote no JSON at {report}")
        st.data["parity"] = data
        rows = [f"{r['backend']} {r['precision']} on {r['device']}: identical {r['identical']:.1%}, "
                f"dBLEU {r['bleu_delta']:+.2f}, {'PASS' if r['passed'] else 'FAIL ' + '; '.join(r['failures'])}"
                for r in data["results"]]
        if not data.get("passed"):
            raise Fail("; ".join(rows))
        return f"{data['sentences']} sentences: " + "; ".join(rows)

    def parity_live(self, precision: str) -> Any:
        def stage(st: Stage, deadline: float) -> str:
            model_dir = self.need_model_dir(precision)
            src, ref = self.test_split()
            report = self.work / f"parity-onnxruntime-{precision}.json"
            hyps = self.hyps / precision
            hyps.mkdir(parents=True, exist_ok=True)
            # torch is parity's reference (CPU, fp32); listing it saves its translation for parity-serve
            self.cmd(st, self.pipeline("parity", model_dir, "--src", src, "--ref", ref, "--backends",
                                       "torch,onnxruntime", "--device", "cpu", "--json", report, "--save-hyps", hyps,
                                       *self.mode.decode), deadline)
            return self.parity_summary(st, report)
        return stage

    def parity_serve(self, st: Stage, deadline: float) -> str:
        _, ref = self.test_split()
        reference = next((p for p in (self.hyps / "fp32" / "torch.fp32.txt", self.hyps / "fp16" / "torch.fp32.txt")
                          if p.is_file()), None)
        if reference is None:
            raise Skip("no torch (CPU, fp32) translation of the test split: stages parity-onnxruntime-* "
                       "write it with --save-hyps")
        runs = [{"name": f"torch-{self.mode.device}", "precision": p, "path": str(self.work / f"serve-{p}.txt")}
                for p in ("fp32", "fp16") if (self.work / f"serve-{p}.txt").is_file()]
        if not runs:
            raise Skip("no serve-batch output (stages serve-fp32, serve-fp16)")
        data = self.worker(st, "compare-outputs", {"reference": str(reference), "ref": str(ref), "runs": runs},
                           deadline)
        st.data.update(data)
        rows = [f"{r['name']} {r['precision']}: identical {r['identical']:.1%}, dBLEU {r['bleu_delta']:+.2f} "
                f"({'PASS' if r['passed'] else 'FAIL ' + '; '.join(r['failures'])})" for r in data["results"]]
        if not all(r["passed"] for r in data["results"]):
            raise Fail("; ".join(rows))
        return "; ".join(rows)

    def random_checkpoints(self, st: Stage, deadline: float) -> str:
        made = []
        for preset, path in self.checkpoints.items():
            self.cmd(st, self.pipeline("random-checkpoint", path, "--preset", preset, "--vocab-size",
                                       self.mode.bench_vocab, "--force"), deadline, label=preset)
            made.append(f"{preset} ({path.stat().st_size / 2 ** 20:.0f} MiB)")
        return "random weights, vocab " + str(self.mode.bench_vocab) + ": " + ", ".join(made)

    def bench_cli(self, st: Stage, deadline: float) -> str:
        model_dir = self.need_model_dir("fp32")
        report = self.work / "bench-cli.json"
        batches = [a for b in self.mode.cli_batches for a in ("--batch-size", str(b))]
        threads = ["--threads", str(self.mode.threads)] if self.mode.threads else []
        stdout = self.cmd(st, self.pipeline("bench", model_dir, "--backends", "torch", "--device", self.mode.device,
                                            *batches, "--beam-size", "4", "--fixed-length", "30", "--sentences",
                                            str(max(self.mode.cli_batches) * 2), *threads, "--json", report),
                          deadline)
        data = read_json(report)
        st.data["bench"] = data
        st.data["table"] = stdout.strip()
        rows = (data or {}).get("results") or []
        if not rows:
            raise Fail("pipeline bench wrote no result rows")
        return "; ".join(f"batch {r['batch_size']}: {r['target_tokens_per_s']:.0f} tok/s on {r['device']}"
                         + (f", peak GPU {r['peak_gpu_mb']:.0f} MB" if r.get("peak_gpu_mb") is not None else "")
                         for r in rows)

    def need_checkpoints(self) -> dict[str, str]:
        missing = [p for p, path in self.checkpoints.items() if not path.is_file()]
        if missing:
            raise Skip(f"no random checkpoint for {', '.join(missing)} (random-checkpoints: "
                       f"{self.stages['random-checkpoints'].status})")
        return {p: str(path) for p, path in self.checkpoints.items()}

    def bench(self, st: Stage, deadline: float) -> str:
        m = self.mode
        data = self.worker(st, "bench", {
            "device": m.device, "checkpoints": self.need_checkpoints(), "batches": list(m.bench_batches),
            "sentences": {str(k): v for k, v in m.bench_sentences.items()}, "beam": 4, "fixed_length": 30,
            "dtypes": list(m.bench_dtypes), "roofline_batches": list(m.roofline_batches), "threads": m.threads,
            "step_modes": list(m.step_modes),
        }, deadline)
        st.data.update(data)
        if not data.get("rows"):
            raise Fail("no bench rows")
        # fp32: token-identical. fp16: the graph's attention sums run over masked padding, whose rounding can
        # flip a near-tie (random weights have many: 123/128 on the first H100 run); at most 1 in 10 may.
        differ = [r for r in data["rows"] if r["identical_to_first_mode"] < r["identity_sentences"] * (
            1.0 if r["dtype"] == "fp32" else FP16_MODE_AGREEMENT)]
        if differ:
            raise Fail("the decoder step modes translate differently: " + "; ".join(
                f"{r['preset']} {r['dtype']} {r['step_mode']} batch {r['batch_size']}: {r['identical_to_first_mode']}"
                f"/{r['identity_sentences']} identical to {m.step_modes[0]}" for r in differ))
        same = sum(r["identical_to_first_mode"] for r in data["rows"])
        total = sum(r["identity_sentences"] for r in data["rows"])
        return f"{len(data['rows'])} rows ({', '.join(m.bench_presets)} x {', '.join(m.bench_dtypes)} x batch " \
               f"{', '.join(map(str, m.bench_batches))} x step {', '.join(m.step_modes)}), beam 4, 30 tokens; " \
               f"{same}/{total} first-batch translations identical across step modes (fp32: all must be)"

    def marian(self, st: Stage, deadline: float) -> str:
        m = self.mode
        checkpoints = self.need_checkpoints() if all(p.is_file() for p in self.checkpoints.values()) else {}
        try:
            trained: str | None = str(self.need_trained())
            src, ref = map(str, self.test_split())
        except Skip as e:
            if not checkpoints:
                raise Skip(f"{e}; and no random checkpoints either") from None
            trained = src = ref = None
            self.notes.append(f"marian: {e}, so the agreement ran on the random {next(iter(checkpoints))} weights")
        if not checkpoints:
            self.notes.append("marian: no random checkpoints, so only the agreement ran (no timing)")
        data = self.worker(st, "marian", {
            "device": m.device, "trained": trained, "src": src, "ref": ref,
            "agree_sentences": 16, "checkpoints": checkpoints, "batches": list(m.bench_batches),
            "sentences": {str(k): v for k, v in m.bench_sentences.items()}, "beam": 4, "new_tokens": 30,
            "dtypes": list(m.bench_dtypes), "threads": m.threads,
        }, deadline)
        st.data.update(data)
        agree = data["agreement"]
        if agree["identical"] != agree["sentences"]:
            raise Fail(f"greedy output token-identical on {agree['identical']} of {agree['sentences']} sentences "
                       f"only; first difference {agree['first_difference']}")
        if data["teacher_forced_gap"] > 1e-3:
            raise Fail(f"teacher-forced log-probs differ by up to {data['teacher_forced_gap']:.3g} (> 1e-3)")
        return (f"greedy token-identical on {agree['identical']}/{agree['sentences']} sentences "
                f"({data['agreement_on']}, {m.device}, fp32), teacher-forced max |d log-prob| "
                f"{data['teacher_forced_gap']:.2g}"
                f"; transformers {data.get('transformers')}; {len(data.get('rows', []))} timing rows")

    def roofline(self, st: Stage, deadline: float) -> str:
        m = self.mode
        bench = self.stages["bench"].data.get("roofline_timings") or []
        data = self.worker(st, "roofline", {"device": m.device, "copy_bytes": m.copy_bytes, "matmul_n": m.matmul_n,
                                            "dtypes": list(m.matmul_dtypes), "timings": bench}, deadline)
        st.data.update(data)
        machine = data["machine"]
        head = (f"copy {machine['copy']['bytes_per_s'] / 1e9:.0f} GB/s, matmul "
                + ", ".join(f"{k} {v['flops_per_s'] / 1e12:.1f} TFLOP/s" for k, v in machine["matmul"].items()))
        if not data["rows"]:
            why = f"{head}; no step timings from stage bench ({self.stages['bench'].status}) to place on it"
            raise (Fail(why) if self.stages["bench"].status == PASS else Skip(why))
        rows = "; ".join(f"{r['preset']} {r['dtype']} {r.get('step_mode') or 'eager'} batch {r['batch_size']}: "
                         f"{r['achieved']['roofline_pct']:.0f}% of roofline" for r in data["rows"])
        return f"{head}; {rows}"

    def onnxruntime_cuda(self, st: Stage, deadline: float) -> str:
        """The exported dirs on onnxruntime's CUDA provider: parity against torch fp32 on the CPU, then bench
        beside the torch backend on CUDA. Needs onnxruntime-gpu, which travels in parts (docs/gpu.md)."""
        providers = ((self.stages["doctor"].data.get("facts") or {}).get("onnxruntime") or {}).get("providers") or []
        if self.mode.name != "gpu" or "CUDAExecutionProvider" not in providers:
            raise Skip(f"onnxruntime here has no CUDAExecutionProvider (providers {providers}): onnxruntime-gpu "
                       "did not travel (docs/gpu.md, scripts/ort_gpu_parts.sh)")
        src, ref = self.test_split()
        results = []
        for precision in ("fp32", "fp16"):
            model_dir = self.need_model_dir(precision)
            report = self.work / f"onnxruntime-cuda-parity-{precision}.json"
            self.cmd(st, self.pipeline("parity", model_dir, "--src", src, "--ref", ref, "--backends", "onnxruntime",
                                       "--device", "cuda", "--json", report, *self.mode.decode), deadline,
                     label=f"parity-{precision}")
            results.append(self.parity_summary(st, report))
            st.data[f"parity_{precision}"] = st.data.pop("parity")
            bench = self.work / f"onnxruntime-cuda-bench-{precision}.json"
            batches = [a for b in self.mode.cli_batches for a in ("--batch-size", str(b))]
            st.data[f"table_{precision}"] = self.cmd(
                st, self.pipeline("bench", model_dir, "--backends", "onnxruntime,torch", "--device", "cuda", *batches,
                                  "--beam-size", "4", "--fixed-length", "30", "--sentences",
                                  str(max(self.mode.cli_batches) * 2), "--json", bench), deadline,
                label=f"bench-{precision}").strip()
            data = read_json(bench) or {}
            st.data[f"bench_{precision}"] = data
            results.append("; ".join(f"{r['backend']} {precision} batch {r['batch_size']}: "
                                     f"{r['target_tokens_per_s']:.0f} tok/s" for r in data.get("results") or []))
        return " | ".join(results)

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


# -- markdown --------------------------------------------------------------------------------------


def fmt(x: Any, spec: str = ".1f") -> str:
    if x is None:
        return "-"
    try:
        return format(x, spec)
    except (TypeError, ValueError):
        return str(x)


def render_markdown(report: dict[str, Any], mode: Mode) -> str:
    host = report["host"]
    counts = ", ".join(f"{v} {k}" for k, v in report["counts"].items() if v)
    lines = [f"# GPU check: {report['card']} ({report['mode']} mode)", "",
             f"- **Date:** {report['started']}; {report['wall_s']:.0f} s of a {report['budget_s']} s budget.",
             f"- **Machine:** {report['card']}; CPU {host['cpu']}; {host['platform']}.",
             f"- **Software:** Python {host['python']}, torch {host['torch']} (CUDA {host['cuda']}), "
             f"onnxruntime {host.get('onnxruntime')}, transformers {host.get('transformers')}.",
             f"- **Commit:** {host['commit']}.",
             f"- **Command:** `bash scripts/gpu_check.sh OUT_DIR{' --cpu' if mode.name == 'cpu' else ''}` "
             "(docs/gpu.md); every command's output is in OUT_DIR/logs/, small results in OUT_DIR/artifacts/.",
             f"- **Stages:** {counts}.", ""]
    for note in report["notes"]:
        lines.append(f"Note: {note}")
    lines += ["", "| stage | status | seconds | result or reason |", "| --- | --- | ---: | --- |"]
    for st in report["stages"]:
        reason = st["reason"].replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {st['name']} | {st['status']} | {st['seconds']:.0f} | {reason} |")

    rows = report.get("bench") or []
    marian_rows = {(r["preset"], r["dtype"], r["batch_size"]): r for r in (report.get("marian") or {}).get("rows", [])}
    if rows:
        lines += ["", "## Decoding speed: our torch backend and MarianMTModel.generate on the same weights", "",
                  "Beam 4, exactly 30 target tokens per sentence (ours: `--fixed-length 30`, 31 decoder steps with "
                  "the forced EOS; generate: min_new_tokens = max_new_tokens = 30), random sources of 20 tokens, "
                  "random weights. Peak memory: torch.cuda.max_memory_allocated during the measurement, "
                  "weights included (on the CPU: the process's peak RSS).", "",
                  "Ours in each decoder step mode (runtime/static_step.py: `eager` launches each kernel from "
                  "Python; `graph` replays the step as a CUDA graph on fixed shapes; `static` is that without "
                  "capture); 'same tokens' counts the first batch's translations identical to the first mode's.", "",
                  "| shape | dtype | batch | step | ours tok/s | ours ms/sent | ours peak MiB | same tokens | "
                  "Marian tok/s | Marian ms/sent | Marian peak MiB | ours / Marian |",
                  "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in rows:
            peer = marian_rows.get((r["preset"], r["dtype"], r["batch_size"])) or {}
            speed = peer.get("target_tokens_per_s")
            ratio = r["target_tokens_per_s"] / speed if speed else None
            peak = r.get("peak_gpu_mib") if r.get("peak_gpu_mib") is not None else r.get("peak_rss_mb")
            same = f"{r.get('identical_to_first_mode')}/{r.get('identity_sentences')}"
            cells = [r["preset"], r["dtype"], r["batch_size"], r.get("step_mode", "eager"),
                     fmt(r["target_tokens_per_s"], ".0f"), fmt(r["latency_ms_per_sentence"], ".2f"), fmt(peak, ".0f"),
                     same, fmt(speed, ".0f"),
                     fmt(peer.get("latency_ms_per_sentence"), ".2f"), fmt(peer.get("peak_gpu_mib"), ".0f"),
                     fmt(ratio, ".2f")]
            lines.append("| " + " | ".join(map(str, cells)) + " |")
    marian = report.get("marian") or {}
    if marian.get("agreement"):
        a, ra = marian["agreement"], marian.get("random_agreement") or {}
        lines += ["", f"Marian mapping (transformers {marian.get('transformers')}, attention "
                      f"{marian.get('attn_implementation')}): greedy output token-identical to our torch backend on "
                      f"{a['identical']}/{a['sentences']} sentences ({marian.get('agreement_on')}); teacher-forced max "
                      f"|d log-prob| {fmt(marian.get('teacher_forced_gap'), '.2g')}; on the random "
                      f"{marian.get('random_shape')} weights: greedy {fmt(ra.get('identical'), 'd')}"
                      f"/{fmt(ra.get('sentences'), 'd')}, teacher-forced "
                      f"{fmt(marian.get('random_teacher_forced_gap'), '.2g')}."]

    roof = report.get("roofline") or {}
    if roof.get("machine"):
        mach = roof["machine"]
        lines += ["", "## Roofline of one decoder step", "",
                  f"Measured: device copy {mach['copy']['bytes_per_s'] / 1e9:.0f} GB/s (bytes read + written, "
                  f"{mach['copy']['bytes'] / 2 ** 30:.2f} GiB moved); matmul "
                  + ", ".join(f"{k} {v['flops_per_s'] / 1e12:.2f} TFLOP/s (n={v['n']:.0f})"
                              for k, v in mach["matmul"].items())
                  + ". Bytes and FLOPs from the shape (pipeline/evaluation/roofline.py): decoder weights incl. the "
                    "output projection, self K/V of t earlier positions per hypothesis, cross K/V once per sentence, "
                    "the fp32 log-probs written and read once; summed over the 31 steps of a batch and divided by "
                    "the measured time of those steps (search's host work included).", "",
                  "The step ms is the host's wall time of each step (upload, replay or launches, downloads); GPU "
                  "ms is the device's time in the graph (CUDA events around each replay); device ops counts "
                  "what one eager step launches (torch.profiler), which the graph replays.", "",
                  "| shape | dtype | step | batch x beam | MB/step | GFLOP/step | step ms | GPU ms | device ops | "
                  "GB/s | % copy BW | TFLOP/s | % matmul | % roofline |",
                  "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in roof.get("rows", []):
            a, c, steps = r["achieved"], r["cost"], r["steps"]
            cells = [r["preset"], r["dtype"], r.get("step_mode") or "eager", f"{r['batch_size']} x {r['beam']}",
                     f"{c['bytes'] / steps / 1e6:.1f}",
                     f"{c['flops'] / steps / 1e9:.2f}", f"{1000 * a['seconds'] / steps:.2f}",
                     fmt(1000 * r["gpu_step_seconds"] / steps if r.get("gpu_step_seconds") else None, ".2f"),
                     fmt((r.get("device_ops_per_step") or {}).get("per_step"), ".0f"),
                     f"{a['bytes_per_s'] / 1e9:.0f}", f"{a['bandwidth_pct']:.1f}", f"{a['flops_per_s'] / 1e12:.2f}",
                     f"{a['flops_pct']:.1f}", f"{a['roofline_pct']:.1f}"]
            lines.append("| " + " | ".join(cells) + " |")

    lines += ["", "## Stage details", ""]
    for st in report["stages"]:
        lines += [f"### {st['name']}: {st['status']}", "", st["title"] + ".", ""]
        if st["reason"]:
            lines += [st["reason"], ""]
        for c in st["commands"]:
            argv = " ".join(c["argv"])
            argv = argv.replace(str(ROOT) + "/", "").replace(PY, "python")
            lines.append(f"- `{argv[:400]}` -> exit {c.get('rc')} in {fmt(c.get('seconds'))} s "
                         f"(logs/{Path(c['stdout']).stem}.out/.err)")
        extra = stage_details(st)
        if extra:
            lines += ["", *extra]
        if st["status"] == FAIL and st["stderr_tail"]:
            lines += ["", "stderr tail:", "", "```", st["stderr_tail"][-3000:], "```"]
        lines.append("")
    lines += ["## Not covered by this check", "",
              "TensorRT (cannot be installed on these machines: export runs with --no-tensorrt) and onnxruntime-gpu "
              "(the GPU machine has the CPU onnxruntime; its CUDA execution provider runs only if onnxruntime-gpu "
              "travels with the command). With one GPU, training runs one process, which uses no process group: "
              "the `distributed` stage checks NCCL and DDP on their own. `pipeline parity` always runs torch as its "
              "fp32 reference, so torch in fp16 on the GPU is gated here through serve-batch's output "
              "(parity-serve) with parity's own gates.", ""]
    return "\n".join(lines)


def stage_details(st: dict[str, Any]) -> list[str]:
    d = st["data"]
    out: list[str] = []
    if st["name"] == "resume" and d.get("comparison"):
        c = d["comparison"]
        out.append(f"Uninterrupted vs interrupted+resumed: step {c['steps']}, identical {c['identical']}, max |diff| "
                   f"{fmt(c['max_abs'], '.3g')}, rel L2 {fmt(c['rel_l2'], '.3g')}, optimizer max |diff| "
                   f"{fmt(c['optimizer_max_abs'], '.3g')}, RNG states equal {c['rng_equal']}; interrupted: "
                   f"{d.get('interrupted')}.")
        if d.get("run_to_run"):
            n = d["run_to_run"]
            out.append(f"Two uninterrupted runs of the same command: identical {n['identical']}, max |diff| "
                       f"{fmt(n['max_abs'], '.3g')}, rel L2 {fmt(n['rel_l2'], '.3g')}. Tolerance: 10 x that max |diff| "
                       f"({fmt(d.get('tolerance'), '.3g')}). Why: bf16 autocast and CUDA kernels that sum with "
                       "atomics (the memory-efficient attention backward, embedding/index backward) make two "
                       "uninterrupted runs differ in the last bits, and the differences grow over the steps; a "
                       "correct resume differs from the uninterrupted run by that much and no more, while the "
                       "training state that must replay exactly (step, data position, token count) is compared "
                       "exactly.")
    if st["name"] == "train" and d.get("last_train"):
        out.append(f"Last train event {d.get('last_train')}; last validation {d.get('last_valid')}; "
                   f"checkpoints {d.get('checkpoints')}.")
    if st["name"] == "nvidia-smi" and d.get("nvidia_smi"):
        out += ["```", d["nvidia_smi"].strip()[:4000], "```"]
    if st["name"] == "bench-cli" and d.get("table"):
        out += ["```", d["table"][-3000:], "```"]
    if st["name"].startswith("export") and d.get("verification"):
        out.append(f"Verification: {json.dumps(d['verification'])[:1500]}")
    return out


# -- workers (subprocesses: torch is imported here only) -------------------------------------------


def worker_ddp(p: dict[str, Any]) -> dict[str, Any]:
    """A 1-rank process group (nccl / gloo) as torchrun sets it up: all-reduce, an object broadcast
    and one DDP step of a tiny Transformer with the training autocast, against the plain model."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from model import build_model, preset

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(p["device"], local_rank) if p["device"] == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend=p["backend"])
    try:
        x = torch.full((4,), float(dist.get_rank() + 1), device=device)
        dist.all_reduce(x)
        obj = [{"hello": dist.get_rank()}]
        dist.broadcast_object_list(obj, src=0, device=device if device.type == "cuda" else None)
        torch.manual_seed(0)
        model = build_model(preset("tiny", vocab_size=64)).to(device)
        plain = copy.deepcopy(model)
        ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        src = torch.randint(4, 64, (3, 7), device=device)
        tgt = torch.randint(4, 64, (3, 6), device=device)
        dtype = torch.bfloat16 if p["precision"] == "bf16" else torch.float16 if p["precision"] == "fp16" else None

        def loss_of(net: Any) -> Any:
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                return net(src, tgt).float().logsumexp(-1).mean()

        loss_of(ddp).backward()
        loss_of(plain).backward()
        diff = max(float((a.grad - b.grad).abs().max()) for a, b in zip(model.parameters(), plain.parameters())
                   if a.grad is not None)
        ok = bool(x.eq(float(dist.get_world_size())).all()) and obj[0] == {"hello": 0}
        problem = None if ok else "all-reduce or object broadcast gave a wrong value"
        if ok and diff > 1e-2:
            ok, problem = False, f"DDP gradients differ from the plain model's by {diff:.3g}"
        return {"ok": ok, "problem": problem, "backend": dist.get_backend(), "world_size": dist.get_world_size(),
                "device": str(device), "grad_max_abs_diff": diff, "torch": torch.__version__,
                "nccl": nccl_version(torch) if device.type == "cuda" else None}
    finally:
        dist.destroy_process_group()


def nccl_version(torch: Any) -> str:
    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, (tuple, list)) else str(version)


def worker_compare_checkpoints(p: dict[str, Any]) -> dict[str, Any]:
    """The last step checkpoints of two save dirs: training state (exact), weights, optimizer, RNG."""
    import torch

    from model.checkpoint import read_checkpoint, step_checkpoints

    a = read_checkpoint(step_checkpoints(Path(p["a"]))[-1])
    b = read_checkpoint(step_checkpoints(Path(p["b"]))[-1])
    ta, tb = a["train_state"], b["train_state"]
    diffs = {k: [ta.get(k), tb.get(k)] for k in ("step", "data", "tokens", "world_size") if ta.get(k) != tb.get(k)}
    max_abs, num, den = 0.0, 0.0, 0.0
    for name, x in a["model"].items():
        d = x.double() - b["model"][name].double()
        max_abs = max(max_abs, float(d.abs().max()))
        num += float(d.pow(2).sum())
        den += float(x.double().pow(2).sum())

    def tensors(state: Any) -> list[Any]:
        out = []
        for s in state["state"].values():
            out += [v for v in s.values() if torch.is_tensor(v)]
        return out

    opt = max((float((x.double() - y.double()).abs().max())
               for x, y in zip(tensors(ta["optimizer"]), tensors(tb["optimizer"]))), default=0.0)

    def rng_equal(x: Any, y: Any) -> bool:
        if isinstance(x, dict):
            return x.keys() == y.keys() and all(rng_equal(x[k], y[k]) for k in x)
        if isinstance(x, (list, tuple)):
            return len(x) == len(y) and all(rng_equal(u, v) for u, v in zip(x, y))
        if torch.is_tensor(x):
            return torch.equal(x, y)
        if hasattr(x, "shape"):
            return bool((x == y).all())
        return x == y

    rng = rng_equal(ta["rng"], tb["rng"])
    return {"steps": [ta["step"], tb["step"]], "state_equal": not diffs, "state_diffs": diffs,
            "identical": max_abs == 0.0 and opt == 0.0 and rng, "weights_identical": max_abs == 0.0,
            "max_abs": max_abs, "rel_l2": (num / den) ** 0.5 if den else 0.0, "optimizer_max_abs": opt,
            "rng_equal": rng}


def worker_compare_outputs(p: dict[str, Any]) -> dict[str, Any]:
    """serve-batch outputs against the torch (CPU, fp32) translation of the same lines, with parity's gates."""
    import sacrebleu

    from pipeline.evaluation.parity import DEFAULT_GATES
    from pipeline.textio import read_lines

    reference = read_lines(Path(p["reference"]))
    refs = read_lines(Path(p["ref"]))
    bleu = sacrebleu.BLEU()
    base = bleu.corpus_score(reference, [refs]).score
    results = []
    for run in p["runs"]:
        lines = read_lines(Path(run["path"]))
        if len(lines) != len(reference):
            results.append({**run, "identical": 0.0, "bleu": None, "bleu_delta": float("nan"), "passed": False,
                            "failures": [f"{len(lines)} lines, the reference has {len(reference)}"]})
            continue
        same = sum(a == b for a, b in zip(lines, reference)) / max(len(lines), 1)
        score = bleu.corpus_score(lines, [refs]).score
        gate = DEFAULT_GATES[run["precision"]]
        failures = []
        if gate.min_identical is not None and same < gate.min_identical:
            failures.append(f"identical {same:.1%} < {gate.min_identical:.1%}")
        if gate.max_bleu_delta is not None and abs(score - base) > gate.max_bleu_delta:
            failures.append(f"|dBLEU| {abs(score - base):.2f} > {gate.max_bleu_delta}")
        results.append({**run, "identical": same, "bleu": round(score, 2), "bleu_torch_cpu": round(base, 2),
                        "bleu_delta": round(score - base, 2), "passed": not failures, "failures": failures,
                        "gate": {"min_identical": gate.min_identical, "max_bleu_delta": gate.max_bleu_delta}})
    return {"reference": p["reference"], "results": results,
            "note": "line-identical output text (what serve-batch writes), parity's gates per precision"}


def _threads(p: dict[str, Any]) -> None:
    if p.get("threads"):
        import torch

        torch.set_num_threads(int(p["threads"]))


def worker_bench(p: dict[str, Any]) -> dict[str, Any]:
    """pipeline bench's own measuring function (bench_backend) over the torch backend of each random
    checkpoint, per dtype and batch size, with torch.cuda.max_memory_allocated around each; then, for
    the roofline, one batch decoded twice with each decoder step timed (best of the two)."""
    import torch

    from model.checkpoint import load_model
    from pipeline.evaluation.bench import bench_backend, make_sources, peak_rss_mb, reset_peak_rss
    from runtime.decoding import PAPER
    from runtime.search import search
    from runtime.tokenizer import Tokenizer
    from runtime.torch_backend import TorchBackend
    from runtime.translate import pad_batch

    _threads(p)
    device = torch.device(p["device"])
    cuda = device.type == "cuda"
    dtypes = {"fp32": torch.float32, "fp16": torch.float16}
    decoding = PAPER.replace(beam_size=p["beam"], max_len_a=0.0, max_len_b=p["fixed_length"],
                             min_len=p["fixed_length"])
    rows, timings = [], []
    outputs: dict[tuple[str, str, int], list[list[int]]] = {}
    for preset, path in p["checkpoints"].items():
        model, spm_bytes, _ = load_model(Path(path), device="cpu")
        tokenizer = Tokenizer(spm_bytes)
        n = max(p["sentences"][str(b)] for b in p["batches"])
        sources = make_sources(tokenizer, None, n, 20, model.cfg.max_positions)
        for dtype, mode in ((d, m) for d in p["dtypes"] for m in p["step_modes"]):
            backend = TorchBackend(model, device, dtypes[dtype], step_mode=mode)
            weights_mib = torch.cuda.memory_allocated(device) / 2 ** 20 if cuda else None
            for bs in p["batches"]:
                first = [h[0].tokens for h in search(backend, pad_batch(sources[:bs]), decoding)]
                reference = outputs.setdefault((preset, dtype, bs), first)  # the first mode's (eager)
                if cuda:
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(device)
                reset_peak_rss()
                r = bench_backend(backend, sources[: p["sentences"][str(bs)]], bs, PAPER.replace(beam_size=p["beam"]),
                                  p["fixed_length"], dtype)
                row = dict(asdict(r), preset=preset, dtype=dtype, step_mode=mode, peak_rss_mb=peak_rss_mb(),
                           identical_to_first_mode=sum(a == b for a, b in zip(first, reference)),
                           identity_sentences=len(first),
                           graphs_captured=backend.static.captures if backend.static is not None else 0,
                           peak_gpu_mib=round(torch.cuda.max_memory_allocated(device) / 2 ** 20, 1) if cuda else None,
                           weights_gpu_mib=round(weights_mib, 1) if weights_mib is not None else None,
                           model_config=model.cfg.to_dict())
                rows.append(row)
                print(f"bench {preset} {dtype} {mode} batch {bs}: {r.target_tokens_per_s:.0f} tok/s, "
                      f"{r.latency_ms_per_sentence:.2f} ms/sentence, peak GPU {row['peak_gpu_mib']} MiB",
                      file=sys.stderr, flush=True)
            for bs in p["roofline_batches"]:
                best, steps, gpu = min(timed_steps(backend, sources[:bs], decoding) for _ in range(2))
                timings.append({"preset": preset, "dtype": dtype, "step_mode": mode, "batch_size": bs,
                                "beam": p["beam"], "src_len": 20, "steps": steps, "step_seconds": best,
                                "gpu_step_seconds": gpu, "model_config": model.cfg.to_dict(),
                                "device_ops_per_step": device_ops_per_step(backend, sources[:bs], decoding)
                                if cuda and mode == "eager" else None})
            del backend
            if cuda:
                torch.cuda.empty_cache()
        del model
    return {"rows": rows, "roofline_timings": timings, "device": str(device), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(device) if cuda else None,
            "how": "pipeline.evaluation.bench.bench_backend on runtime.torch_backend.TorchBackend(checkpoint model)"}


def timed_steps(backend: Any, sources: list[list[int]], decoding: Any) -> tuple[float, int, float | None]:
    """Decode one batch with search as serving does, timing each backend.step call (the torch backend
    returns host arrays, so the device is synchronised): (seconds in steps, steps, and for CUDA graphs
    the seconds the device spent in the graphs, from CUDA events around each replay)."""
    from runtime.search import search
    from runtime.translate import pad_batch

    real_step, spent = backend.step, [0.0, 0]
    runner = getattr(backend, "static", None)
    graphs = runner is not None and runner.capture
    if graphs:
        runner.gpu_times = []

    def timed(*args: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        out = real_step(*args, **kw)
        spent[0] += time.perf_counter() - t0
        spent[1] += 1
        return out

    backend.step = timed
    try:
        search(backend, pad_batch(sources), decoding)
    finally:
        del backend.step  # the class's method again
    gpu = None
    if graphs:
        gpu = sum(runner.gpu_times) if len(runner.gpu_times) == spent[1] else None  # None: a step was captured
        runner.gpu_times = None
    return spent[0], int(spent[1]), gpu


def device_ops_per_step(backend: Any, sources: list[list[int]], decoding: Any) -> dict[str, Any]:
    """What one eager decoder step launches on the device (kernels, copies), counted by torch.profiler
    over one batch and divided by its steps (the encoder's few included): what a CUDA graph replays."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            _, steps, _ = timed_steps(backend, sources, decoding)
        events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
        ops = sum(e.count for e in events)
        top = sorted(events, key=lambda e: e.device_time_total, reverse=True)[:8]
        return {"per_step": round(ops / steps, 1), "steps": steps,
                "top": [{"name": e.key[:80], "count": e.count, "device_us": round(e.device_time_total, 1)}
                        for e in top]}
    except Exception as e:  # noqa: BLE001 - a profiler that cannot run here must not fail the bench
        return {"error": f"{type(e).__name__}: {e}"[:300]}


def worker_marian(p: dict[str, Any]) -> dict[str, Any]:
    import torch
    import transformers

    from model.checkpoint import load_model, resolve_checkpoint
    from pipeline.evaluation import marian_peer
    from pipeline.evaluation.bench import make_sources
    from pipeline.textio import read_lines
    from runtime.tokenizer import Tokenizer
    from runtime.translate import encode_sources

    _threads(p)
    device = torch.device(p["device"])
    cuda = device.type == "cuda"
    if p["trained"] is not None:
        model, spm_bytes, _ = load_model(resolve_checkpoint(Path(p["trained"])), device="cpu")
        tokenizer = Tokenizer(spm_bytes)
        lines = [x for x in read_lines(Path(p["src"])) if x.strip()][: p["agree_sentences"]]
        refs = [x for x in read_lines(Path(p["ref"])) if x.strip()][: p["agree_sentences"]]
        sources = encode_sources(tokenizer, lines, model.cfg.max_positions, origin=p["src"]).ids
        targets = tokenizer.encode(refs)
        agreement_on = "test sentences of the trained model"
    else:  # no trained model (a rerun with --only, or training failed): the first random checkpoint
        preset, path = next(iter(p["checkpoints"].items()))
        model, spm_bytes, _ = load_model(Path(path), device="cpu")
        sources = make_sources(Tokenizer(spm_bytes), None, 8, 20, model.cfg.max_positions, seed=1)
        targets = [s[:-1] for s in sources]
        agreement_on = f"random sources, random {preset} weights"
    marian = marian_peer.to_marian(model).to(device)
    out: dict[str, Any] = {"transformers": transformers.__version__, "device": str(device),
                           "attn_implementation": getattr(marian.config, "_attn_implementation", None),
                           "agreement_on": agreement_on}
    out["agreement"] = marian_peer.greedy_agreement(model, marian, sources, max_len=40, device=device)
    out["teacher_forced_gap"] = marian_peer.teacher_forced_gap(model, marian, sources, targets, device=device)
    del marian
    rows = []
    for i, (preset, path) in enumerate(p["checkpoints"].items()):
        big, spm, _ = load_model(Path(path), device="cpu")
        n = max(p["sentences"][str(b)] for b in p["batches"])
        srcs = make_sources(Tokenizer(spm), None, n, 20, big.cfg.max_positions)
        peer = marian_peer.to_marian(big).to(device)
        if i == 0:  # the mapping on a paper-sized shape too (random weights: near-ties can flip a token)
            out["random_shape"] = preset
            out["random_agreement"] = marian_peer.greedy_agreement(big, peer, srcs[:4], max_len=20, device=device)
            out["random_teacher_forced_gap"] = marian_peer.teacher_forced_gap(big, peer, srcs[:4],
                                                                               [s[:-1] for s in srcs[:4]], device)
        del big
        for dtype in p["dtypes"]:
            peer = peer.to(torch.float16 if dtype == "fp16" else torch.float32)
            for bs in p["batches"]:
                if cuda:
                    torch.cuda.empty_cache()
                row = marian_peer.time_generate(peer, srcs[: p["sentences"][str(bs)]], bs, p["beam"], p["new_tokens"])
                row.update(preset=preset, dtype=dtype)
                rows.append(row)
                print(f"marian {preset} {dtype} batch {bs}: {row['target_tokens_per_s']:.0f} tok/s, "
                      f"{row['latency_ms_per_sentence']:.2f} ms/sentence, peak GPU {row['peak_gpu_mib']} MiB",
                      file=sys.stderr, flush=True)
        del peer
        if cuda:
            torch.cuda.empty_cache()
    out["rows"] = rows
    return out


def worker_roofline(p: dict[str, Any]) -> dict[str, Any]:
    from pipeline.evaluation import roofline

    _threads(p)
    copy = roofline.measure_copy_bandwidth(p["device"], int(p["copy_bytes"]))
    matmul = {dt: roofline.measure_matmul_rate(p["device"], dt, int(p["matmul_n"])) for dt in p["dtypes"]}
    rows = []
    for t in p["timings"]:
        shape = roofline.Shape.of(_Cfg(t["model_config"]))
        width = 2 if t["dtype"] in ("fp16", "bf16") else 4
        cost = roofline.decode_cost(shape, t["batch_size"], t["beam"], t["steps"], t["src_len"], weight_bytes=width)
        rate = matmul.get(t["dtype"], matmul.get("fp32"))
        rows.append({**{k: t.get(k) for k in ("preset", "dtype", "step_mode", "batch_size", "beam", "steps",
                                              "src_len", "gpu_step_seconds", "device_ops_per_step")},
                     "cost": cost.to_dict(),
                     "per_step_at_t15": roofline.step_cost(shape, t["batch_size"], t["beam"], 15, t["src_len"],
                                                           weight_bytes=width).to_dict(),
                     "achieved": roofline.achieved(cost, t["step_seconds"], copy["bytes_per_s"], rate["flops_per_s"])})
    return {"machine": {"device": p["device"], "copy": copy, "matmul": matmul}, "rows": rows}


class _Cfg:
    def __init__(self, d: dict[str, Any]):
        self.__dict__.update(d)


WORKERS = {"ddp": worker_ddp, "compare-checkpoints": worker_compare_checkpoints,
           "compare-outputs": worker_compare_outputs, "bench": worker_bench, "marian": worker_marian,
           "roofline": worker_roofline}


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
                        help="seconds for the whole check (default: 460 on GPU, 600 with --cpu); later stages "
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
