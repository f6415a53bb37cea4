"""The GPU check's first stages, as methods of Check (check.py): doctor, nvidia-smi, distributed, train
(with its CPU fallback) and resume."""

from __future__ import annotations

import json
import re
import shutil
import signal
import time
from pathlib import Path
from typing import Any

from gpucheck.modes import Stage
from gpucheck.util import NEEDED_MODULES, PASS, PY, Fail, Skip, importable, last_logged_step, metrics_summary, tail


class TrainStages:
    """Check's stages up to a trained model (self is the Check: its mode, work dir, cmd, worker...)."""

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
