"""ONNX export of the two graphs with the torch.export-based (dynamo) exporter.

torch 2.13's supported exporter is the dynamo one (`dynamo=True`, passed explicitly
because the default changed in torch 2.9). It names dynamic axes itself (e.g.
"cache_len + 1"), so after export every graph input/output gets the axis names of
model/io_names.py, and ONNX shape inference must still agree with them.

The shipped graphs keep their weights beside them (runtime/graph_files.py).

fp16: the exporter traces whatever dtype the module holds, so a half copy of the model
gives a graph whose precision is carried by the graph itself (fp16 weights, MatMuls and
caches; LayerNorm, the residual sum, softmax and log-softmax in fp32 because the model
computes them in fp32), with no post-hoc float16 conversion pass.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import onnx
import torch
from torch import nn

from export import graphs
from export.errors import ExportError
from export.fuse import fuse_shared_input_linears
from model import io_names
from model.transformer import Transformer

log = logging.getLogger(__name__)

MIN_OPSET = 17  # LayerNormalization; also TensorRT's floor for this design
MAX_OPSET = 23  # newest opset the exporter (onnxscript) and ONNX Runtime 1.31 both run


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """The exporter warns about every shared axis name and missing torchvision ops; those
    are expected here, so keep them out of the user's terminal (still at DEBUG in logs)."""
    names = ("torch.onnx", "torch.export", "torch._export", "onnx_ir", "onnxscript")
    exporter_loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in exporter_loggers]
    try:
        for lg in exporter_loggers:
            lg.setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(exporter_loggers, levels):
            lg.setLevel(level)


def inference_copy(model: Transformer, fp16: bool) -> Transformer:
    """An eval-mode copy on CPU in the export precision (the caller's model is untouched)."""
    m = copy.deepcopy(model).to("cpu").eval()
    return m.half() if fp16 else m.float()


def _export(module: nn.Module, args: tuple[Any, ...], dynamic_shapes: Any, input_names: list[str],
            output_names: list[str], opset: int, path: Path) -> None:
    module.eval()
    try:
        with _quiet_exporter(), torch.no_grad():
            program = torch.onnx.export(
                module, args, dynamo=True, dynamic_shapes=dynamic_shapes,
                input_names=input_names, output_names=output_names,
                opset_version=opset, optimize=True, verbose=False, external_data=False)
    except Exception as e:  # noqa: BLE001 - the exporter raises many types; report one
        raise ExportError(f"torch.onnx.export of {path.name} failed: {type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}") from e
    program.save(str(path), external_data=False)


def name_axes(proto: onnx.ModelProto, axes: dict[str, list[str | int | None]]) -> onnx.ModelProto:
    """Give every graph input/output the shared axis names of io_names.

    Static dims must match what the exporter traced; a dim the exporter left symbolic
    must be named here (a dynamic axis we did not plan for is an error, not a surprise
    for TensorRT's profiles later).
    """
    for value in list(proto.graph.input) + list(proto.graph.output):
        if value.name not in axes:
            raise ExportError(f"graph {value.name!r} is not an io_names tensor")
        want = axes[value.name]
        dims = value.type.tensor_type.shape.dim
        if len(dims) != len(want):
            raise ExportError(f"{value.name}: rank {len(dims)}, expected {len(want)}")
        for i, (dim, name) in enumerate(zip(dims, want)):
            if name is None:
                if not dim.HasField("dim_value"):
                    raise ExportError(f"{value.name} axis {i} is dynamic ({dim.dim_param!r}); "
                                      "expected a static size")
                continue
            dim.ClearField("dim_value")
            dim.dim_param = name
    return proto


def check_shape_inference(proto: onnx.ModelProto) -> None:
    """Strict ONNX shape inference over the renamed graph: it must find no conflict."""
    try:
        onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=True, data_prop=True)
    except Exception as e:  # noqa: BLE001 - onnx raises InferenceError and friends
        raise ExportError(f"ONNX shape inference disagrees with the graph: {e}") from e


def _finish(path: Path, axes: dict[str, list[str | int | None]]) -> None:
    proto = onnx.load(str(path))
    name_axes(proto, axes)
    fuse_shared_input_linears(proto)  # Q/K/V, and the cross K/V of every layer: one GEMM each
    # Value infos carry the exporter's own symbol names ("s12", "cache_len + 1");
    # drop them so the only names in the file are ours; shape inference recomputes them.
    del proto.graph.value_info[:]
    check_shape_inference(proto)
    proto.producer_name = "pipeline"
    onnx.save(proto, str(path))


def export_encoder(model: Transformer, path: Path, opset: int) -> Path:
    """Write the encoder graph (io_names.encoder_inputs -> encoder_outputs) to `path`."""
    n = model.cfg.n_dec_layers
    _export(graphs.EncoderGraph(model), graphs.encoder_example(model),
            graphs.encoder_dynamic_shapes(), io_names.encoder_inputs(),
            io_names.encoder_outputs(n), opset, path)
    _finish(path, graphs.encoder_axes(n))
    return path


def export_decoder(model: Transformer, path: Path, opset: int, topk: int, shortlist: bool = False) -> Path:
    """Write the decoder-step graph (io_names.decoder_inputs -> decoder_outputs) to `path`; with
    `shortlist`, the step over candidate ids (io_names.decoder_shortlist_inputs)."""
    n = model.cfg.n_dec_layers
    if shortlist:
        _export(graphs.DecoderStepGraph(model, topk, shortlist=True), graphs.decoder_shortlist_example(model, topk),
                graphs.decoder_shortlist_dynamic_shapes(n), io_names.decoder_shortlist_inputs(n),
                io_names.decoder_outputs(n), opset, path)
        _finish(path, graphs.decoder_shortlist_axes(n))
        return path
    _export(graphs.DecoderStepGraph(model, topk), graphs.decoder_example(model),
            graphs.decoder_dynamic_shapes(n),
            io_names.decoder_inputs(n), io_names.decoder_outputs(n), opset, path)
    _finish(path, graphs.decoder_axes(n))
    return path
