"""`pipeline doctor`: what this machine can run, and what can serve a given model dir here.

Facts are gathered once into plain dataclasses (`gather_facts`), so that what depends on
them (the model dir verdicts here, the demo plan in pipeline/demo/plan.py) are pure
functions that tests feed with fabricated machines. Every probe is guarded: a missing or
broken library is a fact with its reason, never an exception.
"""

from __future__ import annotations

import importlib
import logging
import os
import platform
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from export.errors import TensorRTUnavailable
from export.tensorrt_build import load_tensorrt
from model import io_names
from model.manifest import SPM_FILE, Manifest, read_manifest
from runtime.cpu_int8 import DOT_PRODUCT_FLAGS, cpu_flags
from runtime.ort_backend import CPU_EP, CUDA_EP
from runtime.registry import entry

log = logging.getLogger(__name__)

NOT_INSTALLED = "not installed"
# /proc/cpuinfo flag -> the name users know; the int8/bf16 GEMM paths of onnxruntime,
# CTranslate2 and oneDNN switch on these.
CPU_FEATURES = {"avx2": "AVX2", "avx512f": "AVX-512", "avx512_vnni": "AVX512-VNNI", "avx_vnni": "AVX-VNNI",
                "amx_tile": "AMX", "amx_bf16": "AMX-BF16", "amx_int8": "AMX-INT8"}


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


# -- probes ------------------------------------------------------------------------------------

def torch_facts() -> TorchFacts:
    try:
        import torch
    except ImportError:
        return TorchFacts(None, no_gpu_reason="PyTorch is not installed (deploy install; the torch backend, "
                                              "training and export need pip install -e \".[train]\")")

    cuda = torch.version.cuda
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    nccl = bool(torch.distributed.is_available() and torch.distributed.is_nccl_available())
    if cuda is None:
        return TorchFacts(torch.__version__, nccl=nccl,
                          no_gpu_reason="this PyTorch is a CPU-only build (install a CUDA build of torch)")
    if not torch.cuda.is_available():
        return TorchFacts(torch.__version__, cuda, cudnn, nccl=nccl,
                          no_gpu_reason="no CUDA device visible to PyTorch (driver, CUDA_VISIBLE_DEVICES?)")
    gpus = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        gpus.append(Gpu(i, props.name, round(props.total_memory / (1 << 30), 1), f"{props.major}.{props.minor}"))
    return TorchFacts(torch.__version__, cuda, cudnn, tuple(gpus), bool(torch.cuda.is_bf16_supported()), nccl)


def ort_facts() -> OrtFacts:
    try:
        ort = importlib.import_module("onnxruntime")
    except ImportError:
        return OrtFacts(None, reason=f"{NOT_INSTALLED} (pip install onnxruntime, or onnxruntime-gpu for CUDA)")
    return OrtFacts(ort.__version__, tuple(ort.get_available_providers()))


def trt_facts(torch_info: TorchFacts) -> TrtFacts:
    try:
        version = load_tensorrt().__version__
    except TensorRTUnavailable as e:
        return TrtFacts(None, reason=str(e))
    if not torch_info.has_gpu:
        return TrtFacts(version, reason=f"no CUDA GPU: {torch_info.no_gpu_reason}")
    return TrtFacts(version, usable=True)


def package_version(module: str) -> str:
    try:
        return str(getattr(importlib.import_module(module), "__version__", "unknown version"))
    except ImportError:
        return NOT_INSTALLED


def cpu_facts(cpuinfo: Path = Path("/proc/cpuinfo")) -> CpuFacts:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:  # not Linux: the model name only, instruction sets unknown
        return CpuFacts(platform.processor() or platform.machine(), cores,
                        {name: None for name in CPU_FEATURES.values()})
    model, flags = platform.machine(), cpu_flags(text)
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            model = value.strip()
            break
    return CpuFacts(model, cores, {name: flag in flags for flag, name in CPU_FEATURES.items()},
                    bool(flags & DOT_PRODUCT_FLAGS))


def gather_facts() -> Facts:
    torch_info = torch_facts()
    return Facts(python=sys.version.split()[0], platform=platform.platform(), torch=torch_info,
                 onnxruntime=ort_facts(), tensorrt=trt_facts(torch_info),
                 packages={m: package_version(m) for m in ("sentencepiece", "sacrebleu", "ctranslate2")},
                 cpu=cpu_facts())


# -- a model dir: which backend / precision / device can serve it here -------------------------
@dataclass(frozen=True)
class Verdict:
    backend: str
    precision: str
    device: str
    ok: bool
    reason: str = ""  # why not, when not ok


def _missing(files: set[str], backend: str) -> list[str]:
    return [f for f in entry(backend).files if f not in files]


def model_dir_verdicts(manifest: Manifest, facts: Facts) -> list[Verdict]:
    """Every (backend, precision, device) this model dir could be served with, and whether it can here."""
    files, precision = set(manifest.files), manifest.precision
    gpu = facts.torch.has_gpu
    no_gpu = f"no CUDA GPU: {facts.torch.no_gpu_reason}"
    out: list[Verdict] = []

    missing = _missing(files, "torch")
    torch_why = (f"the model dir has no {', '.join(missing)}" if missing else
                 "" if facts.torch.version else "PyTorch is not installed (pip install -e \".[train]\")")
    out.append(Verdict("torch", "fp32", "cpu", not torch_why, torch_why))
    for p in ("fp32", "fp16"):
        why = torch_why or ("" if gpu else no_gpu)
        out.append(Verdict("torch", p, "cuda", not why, why))

    missing = _missing(files, "onnxruntime")
    ort_why = (f"the model dir has no {', '.join(missing)} (re-run `pipeline export`)" if missing
               else facts.onnxruntime.reason or "")
    cpu_why = ort_why or ("" if CPU_EP in facts.onnxruntime.providers else f"this onnxruntime has no {CPU_EP}")
    out.append(Verdict("onnxruntime", precision, "cpu", not cpu_why, cpu_why))
    cuda_why = ort_why or ("" if CUDA_EP in facts.onnxruntime.providers else
                           f"this onnxruntime build has no {CUDA_EP} (install onnxruntime-gpu instead of "
                           "onnxruntime)") or ("" if gpu else no_gpu)
    out.append(Verdict("onnxruntime", precision, "cuda", not cuda_why, cuda_why))

    out.append(Verdict("tensorrt", precision, "cuda", *_trt_verdict(manifest, files, facts)))
    return out


def _trt_verdict(manifest: Manifest, files: set[str], facts: Facts) -> tuple[bool, str]:
    rebuild = "re-run `pipeline export CHECKPOINT --out DIR --tensorrt --force` on the serving machine"
    missing = [f for f in (io_names.ENCODER_ENGINE, io_names.DECODER_ENGINE) if f not in files]
    if missing:
        skipped = manifest.tensorrt_skipped
        why = f"export skipped them: {skipped}" if skipped else "export did not build them"
        return False, f"the model dir has no TensorRT engines ({why}); {rebuild}"
    if not facts.tensorrt.usable:
        return False, str(facts.tensorrt.reason)
    built = manifest.tensorrt
    if built is None or built.version != facts.tensorrt.version:
        was = built.version if built else "an unknown version"
        return False, f"engines built with TensorRT {was}, this is {facts.tensorrt.version}; {rebuild}"
    gpu = facts.torch.gpus[0].name
    if built.gpu != gpu:
        return False, f"engines built for {built.gpu}, this GPU is {gpu}; {rebuild}"
    return True, ""


def check_model_dir(model_dir: Path, facts: Facts) -> list[Verdict]:
    """Verdicts for a model dir on disk (its manifest verified: a tampered dir is a user error)."""
    return model_dir_verdicts(read_manifest(Path(model_dir), verify=True, need=(SPM_FILE,)), facts)


# -- report ------------------------------------------------------------------------------------

def _yes(value: bool | None) -> str:
    return "unknown" if value is None else ("yes" if value else "no")


def format_facts(facts: Facts) -> str:
    t, o, r, c = facts.torch, facts.onnxruntime, facts.tensorrt, facts.cpu
    lines = [f"python        {facts.python} ({facts.platform})",
             f"torch         {t.version}; CUDA {t.cuda or '-'}; cuDNN {t.cudnn or '-'}; NCCL {_yes(t.nccl)}"
             if t.version else "torch         not installed (deploy install)"]
    for g in t.gpus:
        lines.append(f"  gpu {g.index}       {g.name}, {g.memory_gib:.1f} GiB, compute {g.compute_capability}")
    lines.append(f"  bf16        {_yes(t.bf16)}" if t.gpus else f"  gpu         none: {t.no_gpu_reason}")
    lines.append(f"onnxruntime   {o.version}; providers {', '.join(o.providers)}" if o.version
                 else f"onnxruntime   {o.reason}")
    lines.append(f"tensorrt      {r.version}; usable" if r.usable
                 else f"tensorrt      {r.version + ': ' if r.version else ''}cannot be used: {r.reason}")
    lines += [f"{name:<13} {version}" for name, version in facts.packages.items()]
    lines.append(f"cpu           {c.model}; {c.cores} cores usable")
    lines.append("  features    " + ", ".join(f"{k} {_yes(v)}" for k, v in c.features.items()))
    if c.int8_dot_product is not None:
        lines.append("  int8        " + ("int8 GEMMs (dot-product instructions): --int8 model dirs run faster"
                                         if c.int8_dot_product else
                                         "no int8 dot-product instructions: rowwise --int8 model dirs run "
                                         "exact u8 x s8 integer GEMMs on pair-bounded weights (u8 x u8 "
                                         "for older full-range exports), qdq ones fp32 GEMMs"))
    return "\n".join(lines)


def format_verdicts(model_dir: Path, verdicts: list[Verdict]) -> str:
    lines = [f"model dir {model_dir}:"]
    for v in verdicts:
        head = f"  {v.backend:<12} {v.precision:<5} {v.device:<5}"
        lines.append(f"{head} yes" if v.ok else f"{head} no: {v.reason}")
    return "\n".join(lines)
