"""The backends a model dir can be loaded on, declared once: what each needs of the dir and the machine,
and the function that opens it. `auto`, the loader (runtime/model_dir.py) and the backend lists of the
CLI read this table; adding a backend is one new module with an `open_model_dir` function plus one
entry here.

Nothing here imports a backend's module (PyTorch, TensorRT) until that backend is opened."""

from __future__ import annotations

import importlib
import importlib.util
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from model import io_names
from model.manifest import CHECKPOINT_FILE, ONNXRUNTIME_ONLY, SPM_FILE, Manifest
from runtime.errors import RuntimeUserError
from runtime.machine import CPU_EP, CUDA_EP, Facts, Verdict

TRAIN_EXTRA = 'pip install -e ".[train]"'


def installed(module: str) -> bool:
    """Importable with code in it: tensorrt-stubs alone leaves a code-less namespace package
    named tensorrt, which must not make `auto` pick TensorRT."""
    spec = importlib.util.find_spec(module)
    return spec is not None and spec.origin not in (None, "namespace")


def import_torch(why: str, instead: str = "an ONNX Runtime backend (onnxruntime)") -> Any:
    """torch, or a one-line error saying what needs it, how to install it, and what to use `instead`."""
    try:
        import torch
    except ImportError:
        raise RuntimeUserError(f"{why} needs PyTorch, which is not installed (a deploy-only install): "
                               f"{TRAIN_EXTRA}, or use {instead}") from None
    return torch


def cuda_available() -> bool:
    """A CUDA GPU usable through PyTorch (False without torch, which is then not imported)."""
    if not installed("torch"):
        return False
    import torch

    return bool(torch.cuda.is_available())


def check_device(device: str | None) -> None:
    """A bad --device is one line before anything is loaded, on any backend."""
    if device is None:
        return
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise RuntimeUserError(f"--device {device!r} is not a device; use cpu, cuda or cuda:N")
    if device != "cpu":
        resolve_device(device)


def resolve_device(device: str | None) -> Any:
    """The torch.device for the torch backend (imports torch)."""
    torch = import_torch(f"--device {device}", "--device cpu") if device and device != "cpu" else \
        import_torch("the torch backend")
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise RuntimeUserError(f"--device {device!r} is not a device; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeUserError(f"--device {device}: CUDA is not available here; use --device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise RuntimeUserError(f"--device {device}: this machine has {torch.cuda.device_count()} GPU(s); "
                               "use cuda:0 .. cuda:N-1")
    return dev


# -- why a backend cannot serve a model dir on this machine (pipeline doctor, the demo's plan) ---------


def _no_gpu(facts: Facts) -> str:
    return "" if facts.torch.has_gpu else f"no CUDA GPU: {facts.torch.no_gpu_reason}"


def _torch_here(facts: Facts, device: str) -> str:
    if not facts.torch.version:
        return 'PyTorch is not installed (pip install -e ".[train]")'
    return _no_gpu(facts) if device == "cuda" else ""


def _ort_here(facts: Facts, device: str) -> str:
    ort = facts.onnxruntime
    if ort.reason:
        return ort.reason
    if device == "cpu":
        return "" if CPU_EP in ort.providers else f"this onnxruntime has no {CPU_EP}"
    if CUDA_EP not in ort.providers:
        return f"this onnxruntime build has no {CUDA_EP} (install onnxruntime-gpu instead of onnxruntime)"
    return _no_gpu(facts)


def _trt_here(facts: Facts, device: str) -> str:
    return "" if facts.tensorrt.usable else str(facts.tensorrt.reason)


def rebuild_engines(manifest: Manifest) -> str:
    """The export that builds this model dir's engines again, at its precision (an int8 dir's TensorRT flavour
    is qdq: without the flags it would come back fp32)."""
    flags = {"fp16": " --fp16", "int8": " --int8 --int8-flavour qdq"}.get(manifest.precision, "")
    return f"re-run `pipeline export CHECKPOINT --out DIR --tensorrt{flags} --force` on the serving machine"


def _no_engines(manifest: Manifest, missing: list[str]) -> str:
    skipped = manifest.tensorrt_skipped
    why = f"export skipped them: {skipped}" if skipped else "export did not build them"
    return f"the model dir has no TensorRT engines ({why}); {rebuild_engines(manifest)}"


def _engines_match(manifest: Manifest, facts: Facts) -> str:
    """Engines run only with the TensorRT version and on the GPU model they were built with."""
    built = manifest.tensorrt
    if built is None or built.version != facts.tensorrt.version:
        was = built.version if built else "an unknown version"
        return f"engines built with TensorRT {was}, this is {facts.tensorrt.version}; {rebuild_engines(manifest)}"
    gpu = facts.torch.gpus[0].name
    return f"engines built for {built.gpu}, this GPU is {gpu}; {rebuild_engines(manifest)}" if built.gpu != gpu else ""


def _missing_files(redo: str = "") -> Callable[[Manifest, list[str]], str]:
    return lambda manifest, missing: f"the manifest lists no {', '.join(missing)}{redo}"


def _exported_precision(manifest: Manifest, devices: tuple[str, ...]) -> list[tuple[str, str]]:
    return [(manifest.precision, device) for device in devices]


# The LoadOptions fields only some backends take (BackendEntry.options), and what those backends do with one:
# runtime/model_dir.py's load refuses one set for another backend, in these words, and LoadOptions.for_backend
# leaves it out for a backend that does not take it (bench and parity, looping over backends).
ONLY_SOME = {"step": "chooses its decoder step", "steps_per_replay": "runs beam search on the device",
             "parallel_batches": "(on the CPU) decodes batches side by side",
             "precision": "runs in a precision of its own (the others run the exported graphs' or engines')"}


@dataclass(frozen=True)
class BackendEntry:
    """One backend: the files it runs, the package `auto` needs before picking it, the load options it
    takes, and its opener."""

    name: str
    files: tuple[str, ...]        # what the model dir must list
    package: str                  # importable, for `auto` to pick this backend
    opener: str                   # "module:function" taking (ModelDir, LoadOptions, Shortlist | None)
    options: tuple[str, ...] = ("device",)  # the LoadOptions fields it takes (the others are ignored or refused)
    checkpoint_weights: bool = False  # runs the dir's fp32 model.pt, whatever precision the graphs were exported in
    torch_memory: bool = False    # its device memory is PyTorch's allocator's (bench reads the GPU peak there)
    shortlist_files: tuple[str, ...] | None = None  # more files a shortlisted decode runs; None: cannot
    no_shortlist: str = ""        # why it cannot decode over a shortlist
    runs_integer_matmuls: bool = True  # int8 flavours with integer matmuls (ONNXRUNTIME_ONLY)
    cuda_only: bool = False
    needs_torch: bool = False     # its module imports PyTorch: a deploy install gets one line, not an ImportError
    # why it cannot run on this machine's `device` ("" when it can), and what it needs of a dir beyond its files
    here: Callable[[Facts, str], str] = _torch_here
    missing: Callable[[Manifest, list[str]], str] = _missing_files()
    matches: Callable[[Manifest, Facts], str] = lambda manifest, facts: ""
    # the (precision, device) pairs it could serve a dir with
    runs: Callable[[Manifest], list[tuple[str, str]]] = lambda manifest: _exported_precision(manifest, ("cpu",))

    def why_not(self, manifest: Manifest, facts: Facts, device: str) -> str:
        """Why it cannot serve this dir on this machine's `device`; "" when it can."""
        missing = [name for name in self.files if name not in manifest.files]
        if missing:
            return self.missing(manifest, missing)
        return self.here(facts, device) or self.matches(manifest, facts)

    def needs(self, manifest: Manifest, shortlist: bool, where: object) -> tuple[str, ...]:
        """The files this backend reads from the dir; a one-line error when it cannot run the dir at all."""
        if not self.runs_integer_matmuls and manifest.quantization in ONNXRUNTIME_ONLY:
            raise RuntimeUserError(f"{where}: int8 flavour {manifest.quantization} (integer matmuls) runs on "
                                   "ONNX Runtime only; use the onnxruntime backend, or export with --int8-flavour qdq "
                                   "for TensorRT")
        if not shortlist:
            return self.files
        if self.shortlist_files is None:
            raise RuntimeUserError(self.no_shortlist)
        return self.files + self.shortlist_files

    def auto_ok(self, manifest: Manifest) -> bool:
        """Whether `auto` may pick it for this dir on this machine."""
        return manifest.lists(*self.files) and installed(self.package) and (not self.cuda_only or cuda_available())



ENTRIES = (
    BackendEntry("torch", (CHECKPOINT_FILE, SPM_FILE), "torch", "runtime.torch_backend:open_model_dir",
                 options=("device", "threads", "precision", "shortlist", "step", "steps_per_replay"),
                 checkpoint_weights=True,
                 torch_memory=True, shortlist_files=(io_names.SHORTLIST_FILE,), needs_torch=True,
                 missing=_missing_files(" (re-run `pipeline export`)"),
                 runs=lambda manifest: [("fp32", "cpu"), ("fp32", "cuda"), ("fp16", "cuda")]),  # model.pt is fp32
    BackendEntry("onnxruntime", (io_names.ENCODER_FILE, io_names.DECODER_FILE, SPM_FILE), "onnxruntime",
                 "runtime.ort_backend:open_model_dir", options=("device", "threads", "shortlist", "parallel_batches"),
                 shortlist_files=(io_names.SHORTLIST_FILE, io_names.DECODER_SHORTLIST_FILE), here=_ort_here,
                 missing=_missing_files(" (re-run `pipeline export`)"),
                 runs=lambda manifest: _exported_precision(manifest, ("cpu", "cuda"))),
    BackendEntry("tensorrt", (io_names.ENCODER_ENGINE, io_names.DECODER_ENGINE, SPM_FILE), "tensorrt",
                 "runtime.trt_backend:open_model_dir", runs_integer_matmuls=False, cuda_only=True, needs_torch=True,
                 no_shortlist="--shortlist runs on the torch and onnxruntime backends; no TensorRT engine is built "
                              "from decoder_shortlist.onnx yet: use the onnxruntime backend",
                 here=_trt_here, missing=_no_engines, matches=_engines_match,
                 runs=lambda manifest: _exported_precision(manifest, ("cuda",))),
)
AUTO_ORDER = ("tensorrt", "onnxruntime")  # tried in this order; torch otherwise
BACKENDS = ("auto", *(e.name for e in ENTRIES))


def entry(name: str) -> BackendEntry:
    return next(e for e in ENTRIES if e.name == name)


def takers(option: str) -> tuple[str, ...]:
    """The backends that take a load option (ONLY_SOME's: step -> torch)."""
    return tuple(e.name for e in ENTRIES if option in e.options)


def not_taken(chosen: BackendEntry, given: dict[str, Any], flag: Callable[[str], str]) -> str:
    """Why `chosen` cannot load with the ONLY_SOME options `given` (name -> value, the defaults left out), each
    named as `flag` phrases it; "" when it takes them all."""
    for name, value in given.items():
        if name in ONLY_SOME and name not in chosen.options:
            who = takers(name)
            return (f"{flag(name)} {value}: only the {' and '.join(who)} backend {ONLY_SOME[name]}, and the backend "
                    f"here is {chosen.name}; add {flag('backend')} {who[0]} or leave {flag(name)} out")
    return ""


def backend_names() -> tuple[str, ...]:
    """The concrete backends a model dir can be opened with ("auto" picks one of them)."""
    return tuple(e.name for e in ENTRIES)


def choose_backend(manifest: Manifest) -> str:
    """auto: TensorRT when engines are present, tensorrt imports and CUDA is there; else
    ONNX Runtime when installed and the graphs are present; else PyTorch."""
    return next((name for name in AUTO_ORDER if entry(name).auto_ok(manifest)), "torch")


def verdicts(manifest: Manifest, facts: Facts) -> list[Verdict]:
    """Every (backend, precision, device) this model dir could be served with, and whether it can here."""
    return [Verdict(e.name, precision, device, not why, why)
            for e in ENTRIES for precision, device in e.runs(manifest)
            for why in (e.why_not(manifest, facts, device),)]
