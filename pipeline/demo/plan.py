"""What `pipeline demo` runs on this machine: a pure function of the doctor's facts.

On a CPU machine: train fp32 on the CPU, export without engines, serve and check parity
with torch and onnxruntime on the CPU (the demo as it always was). On a GPU: train on CUDA
with bf16 autocast (fp16 where the GPU has no bf16), build TensorRT engines when TensorRT
is usable, and check every backend that can run here on CUDA. A backend that cannot run
is listed with its reason, never silently left out.

torch is always parity's reference, and pipeline/evaluation/parity.py runs it in fp32 on the CPU
whatever the machine, so its runs say device "cpu"; the other backends run on `device`.
"""

from __future__ import annotations

from dataclasses import dataclass

from model.manifest import PRECISIONS  # every precision the demo exports
from runtime.machine import Facts
from runtime.registry import entry


@dataclass(frozen=True)
class Run:
    backend: str
    precision: str  # of the exported model dir it runs
    device: str


@dataclass(frozen=True)
class DemoPlan:
    device: str                     # training and backend device: "cuda" or "cpu"
    train_precision: str            # what train's --precision gets
    export_tensorrt: bool | None    # True: engines are required; None: built when possible (CPU: skipped)
    runs: tuple[Run, ...]
    skipped: tuple[tuple[str, str], ...]  # (backend, reason)
    gpu_memory_gib: float | None = None   # the training GPU's memory, for the report

    def backends(self, precision: str) -> list[str]:
        """The parity backends for the model dir of `precision` (torch first: it is the reference)."""
        return [r.backend for r in self.runs if r.precision == precision]


def plan_demo(facts: Facts, wanted: tuple[str, ...] | None = None) -> DemoPlan:
    """`wanted`: the user's --backends (None: every backend that can run here)."""
    gpu = facts.torch.has_gpu
    device = "cuda" if gpu else "cpu"
    skipped: list[tuple[str, str]] = []
    names = ["torch"]

    for name in ("onnxruntime", "tensorrt"):  # torch always runs: it is the reference
        why = entry(name).here(facts, device)
        if why:
            skipped.append((name, why))
        else:
            names.append(name)

    if wanted is not None:
        skipped = [(b, why) for b, why in skipped if b in wanted]
        names = [b for b in names if b in wanted]

    runs = tuple(Run(b, p, "cpu" if b == "torch" else device) for p in PRECISIONS for b in names)
    return DemoPlan(device=device,
                    train_precision=("bf16" if facts.torch.bf16 else "fp16") if gpu else "fp32",
                    export_tensorrt=True if "tensorrt" in names else None,
                    runs=runs, skipped=tuple(skipped),
                    gpu_memory_gib=facts.torch.gpus[0].memory_gib if gpu else None)


def format_plan(plan: DemoPlan) -> list[str]:
    """Report lines: what ran where, and each backend left out with its reason."""
    lines = [f"device: {plan.device}; training precision {plan.train_precision}"
             + (f"; GPU memory {plan.gpu_memory_gib:.1f} GiB" if plan.gpu_memory_gib is not None else "")]
    lines += [f"not run: {backend}: {reason}" for backend, reason in plan.skipped]
    return lines
