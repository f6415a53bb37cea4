"""The TensorRT backend: encoder.plan and decoder.plan, on the TensorRT 10/11 Python API.

Buffers are torch CUDA tensors: inputs are bound by address, outputs are allocated by
torch at the shapes TensorRT infers after `set_input_shape`, and both engines run with
`execute_async_v3` on torch's current stream, so torch ops (search, select) and the
engines are ordered on one stream without host synchronisation. Caches stay on the GPU,
written in place and never reordered (model/cache.py).

`tensorrt` is imported lazily: on machines without it the rest of the runtime works and
asking for this backend says what to install.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from model import io_names
from model.cache import BeamCache, step_outputs
from model.manifest import Manifest
from runtime.backend import EncoderState, ExportedGraphBackend, StepOutput, host
from runtime.errors import RuntimeUserError

if TYPE_CHECKING:  # for annotations only: at run time tensorrt is imported once import_tensorrt() vouched
    import tensorrt as trt  # for it, so mypy checks every engine/context/runtime call against the stubs

    from runtime.model_dir import LoadOptions, ModelDir
    from runtime.shortlist import Shortlist

log = logging.getLogger(__name__)

REBUILD = "re-run `pipeline export CHECKPOINT --out DIR --tensorrt --force` on this machine"


MISSING = ("tensorrt is not installed (pip install 'pipeline[gpu]' on a machine with an NVIDIA GPU); "
           "or use the onnxruntime or torch backend")


def import_tensorrt() -> ModuleType:
    """The tensorrt module, or a RuntimeUserError saying what to install instead."""
    try:
        import tensorrt
    except ImportError:
        raise RuntimeUserError(MISSING) from None
    # `tensorrt-stubs` alone leaves an importable namespace package with no code in it
    if getattr(tensorrt, "__file__", None) is None or not hasattr(tensorrt, "Runtime"):
        raise RuntimeUserError(MISSING.replace("is not installed", "is not installed (only its type stubs are)"))
    return tensorrt


def _torch_dtype(dtype: trt.DataType) -> torch.dtype:
    import tensorrt as trt

    table = {trt.DataType.FLOAT: torch.float32, trt.DataType.HALF: torch.float16,
             trt.DataType.INT64: torch.int64, trt.DataType.INT32: torch.int32}
    if dtype not in table:
        raise RuntimeUserError(f"engine uses tensor type {dtype}, which this runtime does not handle; "
                               f"{REBUILD}")
    return table[dtype]


def check_engine_identity(manifest: Manifest, trt_version: str, gpu: str) -> None:
    """Engines only run on the TensorRT version and GPU model they were built with."""
    built = manifest.tensorrt
    if built is None:
        raise RuntimeUserError(f"the model dir has no TensorRT engines; {REBUILD}")
    if built.version != trt_version:
        raise RuntimeUserError(f"engines were built with TensorRT {built.version}, this is "
                               f"TensorRT {trt_version}; {REBUILD}")
    if built.gpu != gpu:
        raise RuntimeUserError(f"engines were built for {built.gpu}, this GPU is {gpu}; {REBUILD}")


class _Engine:
    """One deserialised engine + execution context; runs with torch tensors as buffers."""

    def __init__(self, runtime: trt.Runtime, path: Path):
        import tensorrt as trt

        engine: trt.ICudaEngine | None = runtime.deserialize_cuda_engine(path.read_bytes())
        if engine is None:
            raise RuntimeUserError(f"{path}: TensorRT could not load this engine; {REBUILD}")
        self.engine = engine
        self.context = engine.create_execution_context()
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        self.inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        self.dtypes = {n: _torch_dtype(engine.get_tensor_dtype(n)) for n in names}
        # An input TensorRT needs at shape-inference time lives in host memory.
        self.host_inputs = {n for n in self.inputs if engine.is_shape_inference_io(n)}

    def run(self, feeds: dict[str, Tensor], device: torch.device) -> dict[str, Tensor]:
        ctx = self.context
        alive: list[Tensor] = []  # inputs stay referenced until the engine has read them
        for name in self.inputs:
            t = feeds[name]
            t = t.to("cpu" if name in self.host_inputs else device, self.dtypes[name]).contiguous()
            alive.append(t)
            ctx.set_input_shape(name, tuple(t.shape))
            ctx.set_tensor_address(name, t.data_ptr())
        outs: dict[str, Tensor] = {}
        for name in self.outputs:
            dims = ctx.get_tensor_shape(name)
            shape = tuple(dims[i] for i in range(len(dims)))
            if any(d < 0 for d in shape):
                raise RuntimeError(f"TensorRT could not infer the shape of {name}: {shape}")
            outs[name] = torch.empty(shape, dtype=self.dtypes[name], device=device)
            ctx.set_tensor_address(name, outs[name].data_ptr())
        stream = torch.cuda.current_stream(device)
        if not ctx.execute_async_v3(stream.cuda_stream):
            raise RuntimeError("TensorRT execute_async_v3 failed (see the TensorRT log above)")
        if self.host_inputs:
            stream.synchronize()  # host inputs must outlive the enqueued work
        return outs


class TrtBackend(ExportedGraphBackend):
    """TensorRT engines with torch CUDA tensors as device buffers."""

    name = "tensorrt"
    # no decoder_constrained.plan yet: its engine would be built like decoder.plan from decoder_constrained.onnx,
    # with a profile for want_ids' (hyps, n_want)
    gathers = False

    def __init__(self, model_dir: Path, manifest: Manifest, device: str | torch.device | None = None):
        import_tensorrt()
        import tensorrt as trt

        if not torch.cuda.is_available():
            raise RuntimeUserError("the tensorrt backend needs a CUDA GPU visible to PyTorch; "
                                   "use the onnxruntime or torch backend")
        self.device = torch.device(device or "cuda")
        if self.device.type != "cuda":
            raise RuntimeUserError(f"--device {self.device}: the tensorrt backend runs on cuda only")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(self.device)
        check_engine_identity(manifest, trt.__version__, torch.cuda.get_device_name(self.device))
        self.cfg, self.precision = manifest.model_config, manifest.precision
        self.topk = manifest.topk
        self.max_src_len = manifest.limits.max_src_len
        self.max_tgt_len = manifest.limits.max_tgt_len
        self.max_batch = manifest.limits.max_batch
        self.max_hyps = manifest.limits.max_hyps
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        model_dir = Path(model_dir)
        self.encoder = _Engine(self._runtime, model_dir / io_names.ENCODER_ENGINE)
        self.decoder = _Engine(self._runtime, model_dir / io_names.DECODER_ENGINE)
        self.check_decoder_inputs(self.decoder.inputs, model_dir / io_names.DECODER_ENGINE)
        self.cache_dtype = self.decoder.dtypes[io_names.self_k(0)]
        log.info("TensorRT %s on %s", trt.__version__, torch.cuda.get_device_name(self.device))

    @torch.inference_mode()
    def encode(self, src_ids: Any) -> EncoderState:
        src_ids = torch.as_tensor(src_ids, dtype=torch.int64)
        out = self.encoder.run({io_names.SRC_IDS: src_ids}, self.device)
        return EncoderState(out, int(src_ids.shape[0]))

    @torch.inference_mode()
    def step(self, state: EncoderState, tokens: Any, step: int, cache: BeamCache,
             reorder: Any, want: Any = None) -> tuple[StepOutput, BeamCache]:
        if want is not None:
            raise RuntimeUserError("glossaries need the log-probs of a term's tokens at every step, which the "
                                   "tensorrt backend's engines do not return yet: use the onnxruntime or torch "
                                   "backend for a glossary")
        n_layers = self.cfg.n_dec_layers
        if self.max_hyps is not None and tokens.shape[0] > self.max_hyps:
            raise RuntimeUserError(f"{tokens.shape[0]} hypotheses exceed the engine's limit of "
                                   f"{self.max_hyps} (max batch x max beam); lower --beam-size or {REBUILD} "
                                   "with larger --max-batch / --max-beam")
        feeds = {io_names.TOKENS: torch.as_tensor(tokens, dtype=torch.int64),
                 io_names.STEP: torch.tensor([step], dtype=torch.int64),
                 **state.tensors, **cache.advance(reorder, state.n_rows)}
        out = self.decoder.run(feeds, self.device)
        cache.append(*step_outputs(out, n_layers))
        return StepOutput(host(out[io_names.TOPK_LOG_PROBS], np.float32), host(out[io_names.TOPK_IDS], np.int64),
                          host(out[io_names.EOS_LOG_PROBS], np.float32)), cache


def open_model_dir(model_dir: ModelDir, options: LoadOptions, shortlist: Shortlist | None) -> TrtBackend:
    """The registry's opener (runtime/registry.py): the dir's engines on options.device (the registry
    refuses a shortlist for TensorRT before this is called)."""
    return TrtBackend(model_dir.path, model_dir.manifest, device=options.device)
