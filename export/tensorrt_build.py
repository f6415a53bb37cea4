"""TensorRT engines from the exported ONNX graphs, on the TensorRT 10/11 Python API.

A chain of small steps, as Polygraphy does it: parse -> config (workspace limit,
timing cache) -> one optimization profile covering every dynamic input -> build ->
save the plan. `tensorrt` is imported lazily: it cannot be installed on CPU machines,
where export still writes and verifies the ONNX graphs and says engines were skipped.

Precision: TensorRT 11 builds strongly typed networks only (the FP16 builder flag is
gone) and takes every tensor's type from the ONNX graph, which is why --fp16 exports
half-precision graphs. TensorRT 10 also offers STRONGLY_TYPED and we use it when
present; only a TensorRT without it falls back to the FP16 builder flag.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import ModuleType
from typing import Any

from export.errors import ExportError, TensorRTUnavailable
from model import io_names
from model.config import ModelConfig
from model.files import atomic_write_bytes
from model.manifest import Limits  # the shape limits are one type, recorded in the manifest

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'pipeline[gpu]' on a machine with an NVIDIA GPU"
DEFAULT_WORKSPACE_GIB = 4.0

Shape = tuple[int, ...]
Profile = dict[str, tuple[Shape, Shape, Shape]]  # input name -> (min, opt, max)


def load_tensorrt() -> ModuleType:
    """Import tensorrt, or raise TensorRTUnavailable saying why and what to do."""
    try:
        import tensorrt
    except ImportError as e:
        raise TensorRTUnavailable(f"tensorrt is not installed ({INSTALL_HINT})") from e
    except Exception as e:  # noqa: BLE001 - a broken install (missing libnvinfer) is the same case
        raise TensorRTUnavailable(f"tensorrt cannot be imported: {type(e).__name__}: {e} "
                                  f"({INSTALL_HINT})") from e
    return tensorrt


def skip_message(reason: str) -> str:
    """The one line export prints when engines are not built."""
    return f"TensorRT engines skipped: {reason}; the ONNX graphs were written and verified."


# -- optimization profiles (pure, tested without TensorRT) --------------------------------

def _opt(max_value: int, typical: int) -> int:
    """A typical size inside [1, max]: tactics are tuned for it."""
    return max(1, min(max_value, typical))


def encoder_profile(cfg: ModelConfig, limits: Limits) -> Profile:
    """src_ids (batch, src_len): batch 1..max_batch, src_len 1..max_src_len."""
    opt = (_opt(limits.max_batch, (limits.max_batch + 1) // 2), _opt(limits.max_src_len, 32))
    return {io_names.SRC_IDS: ((1, 1), opt, (limits.max_batch, limits.max_src_len))}


def decoder_profile(cfg: ModelConfig, limits: Limits) -> Profile:
    """Every dynamic decoder input, with one (min, opt, max) per axis name, so inputs
    that share an axis get equal ranges: hyps (tokens, reorder), batch (cross K/V and
    src_bias, one row per sentence; the same range as the encoder's batch)."""
    h, dh = cfg.n_heads, cfg.d_head
    axis = {
        io_names.BATCH: (1, _opt(limits.max_batch, (limits.max_batch + 1) // 2), limits.max_batch),
        io_names.HYPS: (1, _opt(limits.max_hyps, (limits.max_hyps + 1) // 2), limits.max_hyps),
        io_names.PREV_HYPS: (1, _opt(limits.max_hyps, (limits.max_hyps + 1) // 2), limits.max_hyps),
        io_names.CACHE_LEN: (1, _opt(limits.max_cache_len, 24), limits.max_cache_len),
        io_names.SRC_LEN: (1, _opt(limits.max_src_len, 32), limits.max_src_len),
    }

    def shape(*dims: str | int) -> tuple[Shape, Shape, Shape]:
        return tuple(tuple(axis[d][i] if isinstance(d, str) else d for d in dims)  # type: ignore[return-value]
                     for i in range(3))

    n = cfg.n_dec_layers
    profile: Profile = {
        io_names.TOKENS: shape(io_names.HYPS),
        io_names.REORDER: shape(io_names.HYPS),
        io_names.SRC_BIAS: shape(io_names.BATCH, io_names.SRC_LEN),
    }
    for i in range(n):
        for name in (io_names.self_k(i), io_names.self_v(i)):
            profile[name] = shape(io_names.PREV_HYPS, h, io_names.CACHE_LEN, dh)
        for name in (io_names.cross_k(i), io_names.cross_v(i)):
            profile[name] = shape(io_names.BATCH, h, io_names.SRC_LEN, dh)
    return profile


def timing_cache_path(trt_version: str) -> Path:
    """Per-TensorRT-version timing cache in the user's cache dir, reused across builds."""
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "pipeline" / f"tensorrt-{trt_version}.timing-cache"


# -- the build chain (needs TensorRT and a GPU) ---------------------------------------------

def _parse(trt: ModuleType, logger: Any, builder: Any, onnx_path: Path) -> tuple[Any, Any, bool]:
    """Network from the ONNX file; on failure name each failing node and the parser's error."""
    flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    strongly_typed = flag is not None
    network = builder.create_network(1 << int(flag) if strongly_typed else 0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = []
        for i in range(parser.num_errors):
            err = parser.get_error(i)
            node = getattr(err, "node_name", lambda: "")() or f"#{err.node()}"
            op = getattr(err, "node_operator", lambda: "")()
            errors.append(f"node {node} ({op or '?'}): {err.desc()}")
        raise ExportError(f"TensorRT's ONNX parser rejected {onnx_path.name}: " + "; ".join(errors))
    return network, parser, strongly_typed


def _config(trt: ModuleType, builder: Any, profile: Profile, *, fp16: bool, strongly_typed: bool,
            workspace_bytes: int, timing_cache: Path) -> tuple[Any, Any]:
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    blob = timing_cache.read_bytes() if timing_cache.is_file() else b""
    cache = config.create_timing_cache(blob)
    config.set_timing_cache(cache, ignore_mismatch=False)
    opt_profile = builder.create_optimization_profile()
    for name, (lo, opt, hi) in profile.items():
        opt_profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(opt_profile)
    if fp16 and not strongly_typed:
        config.set_flag(trt.BuilderFlag.FP16)  # TensorRT 10 weakly typed path only
    return config, cache


def _save_timing_cache(config: Any, path: Path) -> None:
    """Atomically write the (grown) timing cache so the next build starts from it."""
    atomic_write_bytes(path, bytes(memoryview(config.get_timing_cache().serialize())))


def build_engine(trt: ModuleType, onnx_path: Path, plan_path: Path, profile: Profile, *, fp16: bool,
                 workspace_bytes: int, timing_cache: Path) -> None:
    """parse -> config -> build -> save one engine."""
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network, _parser, strongly_typed = _parse(trt, logger, builder, onnx_path)
    config, _cache = _config(trt, builder, profile, fp16=fp16, strongly_typed=strongly_typed,
                             workspace_bytes=workspace_bytes, timing_cache=timing_cache)
    log.info("building TensorRT engine %s (strongly typed: %s)", plan_path.name, strongly_typed)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise ExportError(f"TensorRT failed to build an engine from {onnx_path.name} "
                          "(see the TensorRT log above)")
    plan_path.write_bytes(bytes(memoryview(serialized)))
    _save_timing_cache(config, timing_cache)


def gpu_identity() -> dict[str, str]:
    """The GPU the engines are built for (engines only run on the same GPU model)."""
    import torch

    if not torch.cuda.is_available():
        raise TensorRTUnavailable("no CUDA GPU visible to PyTorch (TensorRT engines need one)")
    major, minor = torch.cuda.get_device_capability(0)
    return {"gpu": torch.cuda.get_device_name(0), "compute_capability": f"{major}.{minor}"}


def build_engines(model_dir: Path, cfg: ModelConfig, limits: Limits, *, fp16: bool,
                  workspace_gib: float = DEFAULT_WORKSPACE_GIB,
                  timing_cache: Path | None = None) -> dict[str, Any]:
    """encoder.plan and decoder.plan beside the ONNX graphs; returns the manifest entry."""
    trt = load_tensorrt()
    ident = gpu_identity()
    cache = timing_cache or timing_cache_path(trt.__version__)
    workspace = int(workspace_gib * (1 << 30))
    for onnx_name, plan_name, profile in (
            (io_names.ENCODER_FILE, io_names.ENCODER_ENGINE, encoder_profile(cfg, limits)),
            (io_names.DECODER_FILE, io_names.DECODER_ENGINE, decoder_profile(cfg, limits))):
        build_engine(trt, model_dir / onnx_name, model_dir / plan_name, profile, fp16=fp16,
                     workspace_bytes=workspace, timing_cache=cache)
    return {"version": trt.__version__, **ident, "precision": "fp16" if fp16 else "fp32",
            "workspace_gib": workspace_gib, "timing_cache": str(cache)}
