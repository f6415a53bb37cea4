"""TensorRT engines from the exported ONNX graphs, on the TensorRT 10/11 Python API.

A chain of small steps, as Polygraphy does it: parse -> config (workspace limit,
timing cache) -> one optimization profile covering every dynamic input -> build ->
save the plan. `tensorrt` is imported lazily: it cannot be installed on CPU machines,
where export still writes and verifies the ONNX graphs and says engines were skipped.

Precision: TensorRT 11 builds strongly typed networks only (the FP16 builder flag is
gone, STRONGLY_TYPED is ignored) and takes every tensor's type from the ONNX graph, which
is why --fp16 exports half-precision graphs. On TensorRT 10 we ask for STRONGLY_TYPED, so
both versions build the same engines; the version branch is explicit so mypy checks each
side against the TensorRT stubs (`tensorrt` is only a type here; see `load_tensorrt`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

from export.errors import ExportError, TensorRTUnavailable
from model import io_names
from model.atomic import atomic_write_bytes
from model.config import ModelConfig
from model.manifest import Limits  # the shape limits are one type, recorded in the manifest

if TYPE_CHECKING:  # for annotations only: at run time each step imports tensorrt once load_tensorrt()
    import tensorrt as trt  # has vouched for it, so mypy checks every call against the stubs

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'pipeline[gpu]' on a machine with an NVIDIA GPU"
DEFAULT_WORKSPACE_GIB = 4.0

Shape = tuple[int, ...]
Profile = dict[str, tuple[Shape, Shape, Shape]]  # input name -> (min, opt, max)


MIN_MAJOR = 10


def is_stub_only(module: ModuleType) -> bool:
    """True for the namespace package that `tensorrt-stubs` alone leaves importable: it has
    no code (no __file__, no Builder), so it must count as "not installed"."""
    return getattr(module, "__file__", None) is None or not hasattr(module, "Builder")


def major_version(version: str) -> int:
    return int(version.split(".")[0])


def load_tensorrt() -> ModuleType:
    """Import tensorrt, or raise TensorRTUnavailable saying why and what to do."""
    try:
        import tensorrt
    except ImportError as e:
        raise TensorRTUnavailable(f"tensorrt is not installed ({INSTALL_HINT})") from e
    except Exception as e:  # noqa: BLE001 - a broken install (missing libnvinfer) is the same case
        raise TensorRTUnavailable(f"tensorrt cannot be imported: {type(e).__name__}: {e} "
                                  f"({INSTALL_HINT})") from e
    if is_stub_only(tensorrt):
        raise TensorRTUnavailable(f"tensorrt is not installed (only its type stubs are) ({INSTALL_HINT})")
    if major_version(tensorrt.__version__) < MIN_MAJOR:
        raise TensorRTUnavailable(f"TensorRT {tensorrt.__version__} is too old: TensorRT >= {MIN_MAJOR} is "
                                  f"needed ({INSTALL_HINT})")
    return tensorrt


def installed() -> bool:
    """Whether the real TensorRT library imports here (its type stubs alone do not count)."""
    try:
        load_tensorrt()
    except TensorRTUnavailable:
        return False
    return True


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
    that share an axis get equal ranges: hyps (tokens, self_bias), batch (cache buffers,
    cross K/V and src_bias, one row per sentence; the same range as the encoder's batch),
    past (self_index and self_bias: earlier steps, up to max_tgt_len), cache_rows (cache
    buffers: capacity x rows, up to max_tgt_len x max_beam)."""
    h, dh = cfg.n_heads, cfg.d_head
    axis = {
        io_names.BATCH: (1, _opt(limits.max_batch, (limits.max_batch + 1) // 2), limits.max_batch),
        io_names.HYPS: (1, _opt(limits.max_hyps, (limits.max_hyps + 1) // 2), limits.max_hyps),
        io_names.PAST: (1, _opt(limits.max_tgt_len, 24), limits.max_tgt_len),
        io_names.CACHE_ROWS: (1, _opt(limits.max_cache_rows, 32 * limits.max_beam), limits.max_cache_rows),
        io_names.SRC_LEN: (1, _opt(limits.max_src_len, 32), limits.max_src_len),
    }

    def shape(*dims: str | int) -> tuple[Shape, Shape, Shape]:
        return tuple(tuple(axis[d][i] if isinstance(d, str) else d for d in dims)  # type: ignore[return-value]
                     for i in range(3))

    n = cfg.n_dec_layers
    profile: Profile = {
        io_names.TOKENS: shape(io_names.HYPS),
        io_names.SELF_INDEX: shape(io_names.HYPS, h, io_names.PAST),
        io_names.SELF_BIAS: shape(io_names.HYPS, io_names.PAST),
        io_names.SRC_BIAS: shape(io_names.BATCH, io_names.SRC_LEN),
    }
    for i in range(n):
        for name in (io_names.self_k(i), io_names.self_v(i)):
            profile[name] = shape(io_names.BATCH, h, io_names.CACHE_ROWS, dh)
        for name in (io_names.cross_k(i), io_names.cross_v(i)):
            profile[name] = shape(io_names.BATCH, h, io_names.SRC_LEN, dh)
    return profile


def timing_cache_path(trt_version: str) -> Path:
    """Per-TensorRT-version timing cache in the user's cache dir, reused across builds."""
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "pipeline" / f"tensorrt-{trt_version}.timing-cache"


# -- the build chain (needs TensorRT and a GPU) ---------------------------------------------

def _network_flags(trt_version: str) -> int:
    """TensorRT 11 networks are always strongly typed (the flag is deprecated and ignored);
    TensorRT 10 only when asked (weakly typed, it would choose layer precisions itself)."""
    import tensorrt as trt

    if major_version(trt_version) >= 11:
        return 0
    return 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)


def _parse(logger: trt.ILogger, builder: trt.Builder, onnx_path: Path
           ) -> tuple[trt.INetworkDefinition, trt.OnnxParser]:
    """Network from the ONNX file; on failure name each failing node and the parser's error."""
    import tensorrt as trt

    network = builder.create_network(_network_flags(trt.__version__))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = []
        for i in range(parser.num_errors):
            # the stubs leave get_error's return untyped; it is a ParserError
            err = cast(trt.ParserError, parser.get_error(i))
            node = err.node_name() or f"#{err.node()}"
            errors.append(f"node {node} ({err.node_operator() or '?'}): {err.desc()}")
        raise ExportError(f"TensorRT's ONNX parser rejected {onnx_path.name}: " + "; ".join(errors))
    return network, parser


def _config(builder: trt.Builder, profile: Profile, *, workspace_bytes: int, timing_cache: Path
            ) -> tuple[trt.IBuilderConfig, trt.ITimingCache]:
    import tensorrt as trt

    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    blob = timing_cache.read_bytes() if timing_cache.is_file() else b""
    cache = config.create_timing_cache(blob)
    config.set_timing_cache(cache, ignore_mismatch=False)
    opt_profile = builder.create_optimization_profile()
    for name, (lo, opt, hi) in profile.items():
        opt_profile.set_shape(name, trt.Dims(list(lo)), trt.Dims(list(opt)), trt.Dims(list(hi)))
    config.add_optimization_profile(opt_profile)
    return config, cache


def _save_timing_cache(config: trt.IBuilderConfig, path: Path) -> None:
    """Atomically write the (grown) timing cache so the next build starts from it."""
    atomic_write_bytes(path, bytes(config.get_timing_cache().serialize()))


def build_engine(onnx_path: Path, plan_path: Path, profile: Profile, *, workspace_bytes: int,
                 timing_cache: Path) -> None:
    """parse -> config -> build -> save one engine (precision comes from the graph's types).
    Call after load_tensorrt() has said the real library is here."""
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network, _parser = _parse(logger, builder, onnx_path)
    config, _cache = _config(builder, profile, workspace_bytes=workspace_bytes, timing_cache=timing_cache)
    log.info("building TensorRT %s engine %s", trt.__version__, plan_path.name)
    serialized: trt.IHostMemory | None = builder.build_serialized_network(network, config)
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
    version = load_tensorrt().__version__
    ident = gpu_identity()
    cache = timing_cache or timing_cache_path(version)
    workspace = int(workspace_gib * (1 << 30))
    for onnx_name, plan_name, profile in (
            (io_names.ENCODER_FILE, io_names.ENCODER_ENGINE, encoder_profile(cfg, limits)),
            (io_names.DECODER_FILE, io_names.DECODER_ENGINE, decoder_profile(cfg, limits))):
        build_engine(model_dir / onnx_name, model_dir / plan_name, profile, workspace_bytes=workspace,
                     timing_cache=cache)
    return {"version": version, **ident, "precision": "fp16" if fp16 else "fp32",
            "workspace_gib": workspace_gib, "timing_cache": str(cache)}
