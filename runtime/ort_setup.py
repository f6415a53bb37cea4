"""What an ONNX Runtime session needs before the backend runs it: the package itself, the execution
providers this build and machine can use (and the device when none is named), the graph fusions left out on
the CPU, and one clear line for a graph file that cannot be loaded."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from runtime.errors import RuntimeUserError, first_line
from runtime.machine import CPU_EP, CUDA_EP, TRT_EP


def import_onnxruntime() -> ModuleType:
    try:
        import onnxruntime
    except ImportError:
        raise RuntimeUserError("onnxruntime is not installed: `pip install onnxruntime` (CPU) or "
                               "`pip install onnxruntime-gpu` (CUDA), or use the torch backend") from None
    return onnxruntime


# ONNX Runtime's graph fusions left out on the CPU, by their names: SkipLayerNormFusion rewrites one residual Add +
# LayerNormalization of the int8 decoder into a SkipLayerNormalization whose kernel took 172 us a step at batch 32
# against about 31 for the two nodes (the step 0.97x without it at batch 32, 0.98x at batch 1;
# benchmarks/README.md, "skip-layer-norm-unfused").
CPU_DISABLED_OPTIMIZERS = ("SkipLayerNormFusion",)


def disabled_optimizers(providers: list[str]) -> list[str]:
    """The graph optimizers a session on `providers` runs without (InferenceSession's disabled_optimizers)."""
    return list(CPU_DISABLED_OPTIMIZERS) if providers == [CPU_EP] else []


def tensorrt_loadable() -> bool:
    """Whether TensorRT's runtime library loads in this process. onnxruntime-gpu lists its TensorRT
    provider whether or not TensorRT is installed, and a session asked for it without the library
    prints an "EP Error" block and retries without it (seen on an H100 without TensorRT; docs/gpu.md)."""
    import ctypes
    import importlib.util

    if importlib.util.find_spec("tensorrt_libs") is not None:  # the pip wheel's libraries, preloaded on import
        try:
            importlib.import_module("tensorrt_libs")
        except Exception:  # a broken install: the CDLL probe below decides
            pass
    for name in ("libnvinfer.so.10", "libnvinfer.so"):
        try:
            ctypes.CDLL(name)
            return True
        except OSError:
            continue
    return False


# What ONNX Runtime raises for a graph file it cannot read or build a session from (its exception types
# derive from Exception alone); EPFail, an execution provider's own fault, is not the file's and keeps
# its traceback. onnx's DecodeError / ValueError come from session_graph, which parses rowwise graphs.
_DAMAGED = ("InvalidProtobuf", "InvalidGraph", "NoSuchFile", "NoModel")
_UNLOADABLE = _DAMAGED + ("Fail", "InvalidArgument", "RuntimeException", "NotImplemented")


@contextlib.contextmanager
def loading_graph(path: Path) -> Iterator[None]:
    """A graph (or its .data weights) that ONNX Runtime cannot load is one line naming the file, never
    onnxruntime's multi-line traceback; the manifest's checksums passing only means the files are the
    ones that were hashed."""
    from google.protobuf.message import DecodeError  # type: ignore[import-untyped]
    from onnxruntime.capi import onnxruntime_pybind11_state as state

    errors = tuple(getattr(state, name) for name in _UNLOADABLE if hasattr(state, name))
    try:
        yield
    except (*errors, DecodeError, ValueError) as e:
        message = first_line(e)
        weights = path.with_suffix(".data")
        where = weights if "external" in message.lower() and weights.exists() else path
        damaged = type(e).__name__ in _DAMAGED or isinstance(e, DecodeError) or where == weights
        fix = "damaged or not what export wrote; export the model again" if damaged else "export the model again"
        raise RuntimeUserError(f"{where}: ONNX Runtime cannot load it ({message}); {fix}") from None


def choose_providers(device: Any, available: list[str], use_tensorrt: bool = True) -> list[str]:
    """Execution providers for `device` from what this onnxruntime build offers, best first:
    TensorRT's only where `use_tensorrt` (OrtBackend passes tensorrt_loadable())."""
    if str(device) == "cpu":
        return [CPU_EP]
    if CUDA_EP not in available:
        raise RuntimeUserError(
            f"device {device} asked for, but this onnxruntime build has only {', '.join(available)}; "
            "install onnxruntime-gpu (and uninstall onnxruntime) or use --device cpu")
    providers = [TRT_EP] if use_tensorrt and TRT_EP in available else []
    return providers + [CUDA_EP, CPU_EP]


def default_device(device: Any) -> Any:
    """`device`, or where the backend runs when none is given: cuda with onnxruntime-gpu and a GPU, else cpu."""
    if device is not None:
        return device
    import_onnxruntime()
    import onnxruntime as ort

    return "cuda" if CUDA_EP in ort.get_available_providers() and _cuda_visible() else "cpu"


def _cuda_visible() -> bool:
    """Whether a CUDA GPU can be used: onnxruntime-gpu's CUDA buffers are torch tensors here."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def import_torch_for_cuda() -> Any:
    try:
        import torch
    except ImportError:
        raise RuntimeUserError("the onnxruntime backend on cuda keeps its device buffers in PyTorch tensors: "
                               "install torch, or use --device cpu") from None
    return torch
