"""What a machine has, as plain data: PyTorch and its GPUs, ONNX Runtime and its execution providers,
TensorRT, the CPU. pipeline/environment.py probes them (`gather_facts`); the backend registry
(runtime/registry.py) says from them which backend can serve a model dir here, for `pipeline doctor` and
the demo's plan, and tests feed it fabricated machines."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

# ONNX Runtime's execution providers, by the names it lists them under
TRT_EP = "TensorrtExecutionProvider"
CUDA_EP = "CUDAExecutionProvider"
CPU_EP = "CPUExecutionProvider"


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def thread_problem(threads: int | None, flag: str) -> str | None:
    """Why `threads` cannot be used here (None: it can): fewer than 1, or more than 4 per usable core (at least 64
    in all), where threads only add switching and each engine's pool would start thousands of them."""
    if threads is None:
        return None
    if threads < 1:
        return f"{flag} must be at least 1 (got {threads})"
    cores = usable_cores()
    limit = max(64, 4 * cores)
    if threads > limit:
        return (f"{flag} {threads} is more than this machine takes ({limit}: 4 per usable core of its {cores}, or "
                f"64); more threads than cores only add switching: leave it out to use every core")
    return None


DEFAULT_PARALLEL_BATCHES = 2  # a file's batches side by side on a CPU (benchmarks/README.md, "parallel-default")


def default_parallel_batches(threads: int | None) -> int:
    """Batches at once for files of many batches on a CPU when --parallel-batches is not given: two where there
    are two threads for them (--threads, else every usable core), else one."""
    return DEFAULT_PARALLEL_BATCHES if (threads or usable_cores()) >= DEFAULT_PARALLEL_BATCHES else 1


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    memory_gib: float
    compute_capability: str


@dataclass(frozen=True)
class TorchFacts:
    version: str | None              # None: PyTorch is not installed (a deploy-only install)
    cuda: str | None = None          # CUDA version this torch was built for; None: CPU-only build
    cudnn: int | None = None
    gpus: tuple[Gpu, ...] = ()
    bf16: bool = False               # bf16 on the first GPU (training autocast)
    nccl: bool = False
    no_gpu_reason: str | None = None  # why no GPU can be used; None when one can

    @property
    def has_gpu(self) -> bool:
        return bool(self.gpus)


@dataclass(frozen=True)
class OrtFacts:
    version: str | None
    providers: tuple[str, ...] = ()
    reason: str | None = None        # why onnxruntime cannot be used at all


@dataclass(frozen=True)
class TrtFacts:
    version: str | None
    usable: bool = False
    reason: str | None = None        # why TensorRT cannot build or run engines here


@dataclass(frozen=True)
class CpuFacts:
    model: str
    cores: int
    features: dict[str, bool | None] = field(default_factory=dict)  # None: unknown on this OS
    int8_dot_product: bool | None = None  # VNNI / AMX / Arm dot product (runtime/cpu_int8.py)


@dataclass(frozen=True)
class Facts:
    python: str
    platform: str
    torch: TorchFacts
    onnxruntime: OrtFacts
    tensorrt: TrtFacts
    packages: dict[str, str]         # sentencepiece, sacrebleu, ctranslate2: version or "not installed"
    cpu: CpuFacts

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Verdict:
    backend: str
    precision: str
    device: str
    ok: bool
    reason: str = ""  # why not, when not ok
