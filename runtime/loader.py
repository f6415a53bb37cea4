"""Open a model directory (what `pipeline export` wrote) as a backend + tokenizer.

The manifest is verified first (every file's SHA-256), so a tampered or half-copied
directory is refused with the file named and the command that rebuilds it, rather than
translating with the wrong weights.

PyTorch is imported only for the torch and tensorrt backends (and CUDA devices): opening a
model dir with onnxruntime on the CPU, as `pip install pipeline[deploy]` does, never needs it."""

from __future__ import annotations

import importlib.util
import logging
import re
from pathlib import Path
from typing import Any

from model import io_names
from model.atomic import restore_replaced_dir
from model.manifest import CHECKPOINT_FILE, ONNXRUNTIME_ONLY, ORT_DYNAMIC, SPM_FILE, Manifest, read_manifest
from runtime.errors import RuntimeUserError
from runtime.tokenizer import AnyTokenizer, load_tokenizer, tokenizer_from_file

DEFAULT_TOPK = 16  # candidates per step of a torch backend made from a checkpoint (2 x a beam of 8)
TRAIN_EXTRA = 'pip install -e ".[train]"'

log = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "onnxruntime", "tensorrt")
NEEDS = {
    "torch": (CHECKPOINT_FILE, SPM_FILE),
    "onnxruntime": (io_names.ENCODER_FILE, io_names.DECODER_FILE, SPM_FILE),
    "tensorrt": (io_names.ENCODER_ENGINE, io_names.DECODER_ENGINE, SPM_FILE),
}


def backend_names() -> tuple[str, ...]:
    """The concrete backends a model dir can be opened with ("auto" picks one of them)."""
    return tuple(NEEDS)


def installed(module: str) -> bool:
    """Importable with code in it: tensorrt-stubs alone leaves a code-less namespace package
    named tensorrt, which must not make `auto` pick TensorRT."""
    spec = importlib.util.find_spec(module)
    return spec is not None and spec.origin not in (None, "namespace")


def import_torch(why: str) -> Any:
    """torch, or a one-line error saying what needs it and how to install it."""
    try:
        import torch
    except ImportError:
        raise RuntimeUserError(f"{why} needs PyTorch, which is not installed (a deploy-only install): "
                               f"{TRAIN_EXTRA}, or use --backend onnxruntime") from None
    return torch


def cuda_available() -> bool:
    """A CUDA GPU usable through PyTorch (False without torch, which is then not imported)."""
    if not installed("torch"):
        return False
    import torch

    return bool(torch.cuda.is_available())


def choose_backend(manifest: Manifest) -> str:
    """auto: TensorRT when engines are present, tensorrt imports and CUDA is there; else
    ONNX Runtime when installed and the graphs are present; else PyTorch."""
    if manifest.lists(*NEEDS["tensorrt"]) and installed("tensorrt") and cuda_available():
        return "tensorrt"
    if manifest.lists(*NEEDS["onnxruntime"]) and installed("onnxruntime"):
        return "onnxruntime"
    return "torch"


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
    torch = import_torch(f"--device {device}" if device and device != "cpu" else "the torch backend")
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


def torch_dtype(precision: str | None, device: Any) -> Any:
    """fp16 only on a GPU (CPU half matmuls are slow and not what the graphs compute)."""
    import torch

    if precision == "fp16" and device.type == "cuda":
        return torch.float16
    if precision == "fp16":
        log.warning("fp16 asked for on %s: running the PyTorch model in fp32", device)
    if precision == "int8":
        log.warning("int8 model dir on the torch backend: running the fp32 weights of %s "
                    "(the int8 weights are in the ONNX graphs)", CHECKPOINT_FILE)
    return torch.float32


def load_backend(model_dir: str | Path, backend: str = "auto", device: str | None = None,
                 threads: int | None = None, dtype: str | None = None, shortlist: bool = False,
                 ) -> tuple[Any, AnyTokenizer, Manifest]:
    """(backend, tokenizer, manifest) for a verified model dir. `dtype` ("fp32"/"fp16")
    overrides the manifest's precision for the torch backend; `threads` sets intra-op
    threads (torch and onnxruntime); `shortlist`: decode over the model dir's vocabulary shortlist
    (runtime/shortlist.py; torch and onnxruntime)."""
    if backend not in BACKENDS:
        raise RuntimeUserError(f"--backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    model_dir = Path(model_dir)
    check_device(device)
    restore_replaced_dir(model_dir)  # an export --force killed between its two renames
    manifest = read_manifest(model_dir, verify=False)  # readable at all?
    name = choose_backend(manifest) if backend == "auto" else backend
    if name == "tensorrt" and manifest.quantization in ONNXRUNTIME_ONLY:
        raise RuntimeUserError(f"{model_dir}: int8 flavour {manifest.quantization} (integer matmuls) runs on "
                               "ONNX Runtime only; use --backend onnxruntime, or export with --int8-flavour qdq "
                               "for TensorRT")
    need = NEEDS[name]
    if shortlist:
        if name == "tensorrt":
            raise RuntimeUserError("--shortlist runs on the torch and onnxruntime backends; no TensorRT engine is "
                                   "built from decoder_shortlist.onnx yet: use --backend onnxruntime")
        if manifest.shortlist is None:
            raise RuntimeUserError(f"{model_dir}: exported without a vocabulary shortlist; export it again with "
                                   "--shortlist-src and --shortlist-tgt (a parallel corpus), or leave out --shortlist")
        need = need + (io_names.SHORTLIST_FILE,) + ((io_names.DECODER_SHORTLIST_FILE,) if name == "onnxruntime" else ())
    manifest = read_manifest(model_dir, verify=True, need=need)
    table = None
    if shortlist:
        from runtime.shortlist import Shortlist

        table = Shortlist.load(model_dir / io_names.SHORTLIST_FILE)
    if name == "onnxruntime" and manifest.quantization == ORT_DYNAMIC:
        log.warning("%s: int8 flavour ort-dynamic quantizes activations per batch, so a sentence's translation "
                    "can depend on the sentences batched with it (docs/int8.md); use the rowwise or qdq flavour "
                    "where outputs must not depend on batching", model_dir)
    tokenizer = tokenizer_from_file(model_dir / SPM_FILE)
    if name == "torch":
        torch = import_torch("the torch backend")
        from model.checkpoint import load_model
        from runtime.torch_backend import TorchBackend

        dev = resolve_device(device)
        if threads:
            torch.set_num_threads(threads)
        model, _, _ = load_model(model_dir / CHECKPOINT_FILE, device="cpu")
        impl: Any = TorchBackend(model, dev, torch_dtype(dtype or manifest.precision, dev), topk=manifest.topk,
                                 max_src_len=manifest.limits.max_src_len,
                                 max_tgt_len=manifest.limits.max_tgt_len, shortlist=table)
    elif name == "onnxruntime":
        from runtime.ort_backend import OrtBackend
        impl = OrtBackend(model_dir, manifest, device=device, threads=threads, shortlist=table)
    else:
        from runtime.trt_backend import TrtBackend
        impl = TrtBackend(model_dir, manifest, device=device)
    if tokenizer.vocab_size != impl.cfg.vocab_size:
        raise RuntimeUserError(f"{model_dir / SPM_FILE}: {tokenizer.vocab_size} pieces but the model has "
                               f"{impl.cfg.vocab_size}; re-run `pipeline export` for this checkpoint")
    log.info("backend %s on %s", impl.name, impl.device)
    return impl, tokenizer, manifest


def load_torch_backend_from_checkpoint(path: str | Path, device: str | None = None,
                                       topk: int = DEFAULT_TOPK) -> tuple[Any, AnyTokenizer]:
    """The PyTorch reference straight from a checkpoint file or a training save dir."""
    import_torch("a checkpoint")
    from model.checkpoint import load_model, resolve_checkpoint
    from runtime.torch_backend import TorchBackend

    ckpt = resolve_checkpoint(Path(path))
    model, spm_bytes, _ = load_model(ckpt, device="cpu")
    return TorchBackend(model, resolve_device(device), topk=topk), load_tokenizer(spm_bytes)
