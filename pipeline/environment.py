"""`pipeline doctor`: what this machine can run, and what can serve a given model dir here.

Facts are gathered once into plain dataclasses (`gather_facts`), so that what depends on
them (the model dir verdicts here, the demo plan in pipeline/demo/plan.py) are pure
functions that tests feed with fabricated machines. Every probe is guarded: a missing or
broken library is a fact with its reason, never an exception.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

from export.errors import TensorRTUnavailable
from export.tensorrt_build import load_tensorrt
from model.manifest import Manifest
from runtime.cpu_int8 import DOT_PRODUCT_FLAGS, cpu_flags
from runtime.fields import Checked, opt
from runtime.machine import CpuFacts, Facts, Gpu, OrtFacts, TorchFacts, TrtFacts, Verdict, usable_cores
from runtime.model_dir import ModelDir
from runtime.registry import verdicts

log = logging.getLogger(__name__)

NOT_INSTALLED = "not installed"
# /proc/cpuinfo flag -> the name users know; the int8/bf16 GEMM paths of onnxruntime,
# CTranslate2 and oneDNN switch on these.
CPU_FEATURES = {"avx2": "AVX2", "avx512f": "AVX-512", "avx512_vnni": "AVX512-VNNI", "avx_vnni": "AVX-VNNI",
                "amx_tile": "AMX", "amx_bf16": "AMX-BF16", "amx_int8": "AMX-INT8"}


# -- probes ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DoctorOptions(Checked):
    """`pipeline doctor`'s options (its command line is generated from these fields)."""

    as_json: bool = opt(False, "Print the facts (and verdicts) as one JSON object on standard output (a flag: "
                               "`pipeline doctor DIR --json > facts.json` writes a file).", flag="--json")


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
    cores = usable_cores()
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
def model_dir_verdicts(manifest: Manifest, facts: Facts) -> list[Verdict]:
    """Every (backend, precision, device) this model dir could be served with, and whether it can here
    (each backend's reasons are its registry entry's: runtime/registry.py)."""
    return verdicts(manifest, facts)


def check_model_dir(model_dir: Path, facts: Facts) -> list[Verdict]:
    """Verdicts for a model dir on disk (its manifest verified: a tampered dir is a user error); each backend,
    precision and device that could serve it here is loaded and translates a line with the dir's own decoding
    defaults, or is a no with what failed (a graph that loads but is another model's, a beam its top-K cannot
    feed: the manifest alone said yes, and serve-batch then failed)."""
    opened = ModelDir.open(model_dir)
    return [_translates(opened, v) if v.ok else v for v in model_dir_verdicts(opened.manifest, facts)]


def _translates(opened: ModelDir, verdict: Verdict) -> Verdict:
    from runtime.decoding import PAPER
    from runtime.model_dir import LoadOptions, load
    from runtime.translate import translate_lines

    precision = verdict.precision if verdict.backend == "torch" else None
    try:
        loaded = load(opened, LoadOptions(backend=verdict.backend, device=verdict.device, threads=1,
                                          precision=precision), PAPER)
        translate_lines(loaded.backend, loaded.tokenizer, ["warm up"], loaded.decoding)
    except Exception as e:  # noqa: BLE001 - what a user would meet, in one line, whatever it is
        said = str(e).splitlines()[0][:200] if str(e) else ""
        return dataclasses.replace(verdict, ok=False, reason=f"cannot translate a line: {type(e).__name__}: {said}")
    return verdict


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
