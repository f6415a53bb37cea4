"""Compatibility: the loading calls of before runtime/model_dir.py, in its terms.

`load_backend(dir, backend=..., ...)` is `load(ModelDir.open(dir), LoadOptions(...))` returned as a
(backend, tokenizer, manifest) tuple; the device and package helpers live in runtime/registry.py. New
code opens a ModelDir and calls `load`."""

from __future__ import annotations

from pathlib import Path

from model.manifest import Manifest
from runtime.backend import DEFAULT_TOPK, Backend
from runtime.model_dir import LoadOptions, load
from runtime.registry import (
    BACKENDS,
    TRAIN_EXTRA,
    backend_names,
    check_device,
    choose_backend,
    cuda_available,
    import_torch,
    installed,
    resolve_device,
)
from runtime.tokenizer import AnyTokenizer, load_tokenizer

__all__ = ["BACKENDS", "DEFAULT_TOPK", "TRAIN_EXTRA", "backend_names", "check_device", "choose_backend",
           "cuda_available", "import_torch", "installed", "load_backend", "load_torch_backend_from_checkpoint",
           "resolve_device"]


def load_backend(model_dir: str | Path, backend: str = "auto", device: str | None = None,
                 threads: int | None = None, dtype: str | None = None, shortlist: bool = False,
                 ) -> tuple[Backend, AnyTokenizer, Manifest]:
    """(backend, tokenizer, manifest) for a verified model dir: `load` with these LoadOptions."""
    loaded = load(model_dir, LoadOptions(backend=backend, device=device, threads=threads, precision=dtype,
                                         shortlist=shortlist))
    return loaded.backend, loaded.tokenizer, loaded.manifest


def load_torch_backend_from_checkpoint(path: str | Path, device: str | None = None,
                                       topk: int = DEFAULT_TOPK) -> tuple[Backend, AnyTokenizer]:
    """The PyTorch reference straight from a checkpoint file or a training save dir."""
    import_torch("a checkpoint")
    from model.checkpoint import load_model, resolve_checkpoint
    from runtime.torch_backend import TorchBackend

    ckpt = resolve_checkpoint(Path(path))
    model, spm_bytes, _ = load_model(ckpt, device="cpu")
    return TorchBackend(model, resolve_device(device), topk=topk), load_tokenizer(spm_bytes)
