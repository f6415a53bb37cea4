"""Static check that an ONNX graph stays parser-clean for TensorRT, without TensorRT.

TensorRT cannot be installed on CPU machines, so export (and CI) check the graphs
against what TensorRT's ONNX parser documents: the op list in trt_supported_ops.txt
(from onnx-tensorrt docs/operators.md) and the restrictions that bite transformers.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import onnx

OPS_FILE = Path(__file__).with_name("trt_supported_ops.txt")
MIN_OPSET = 17
FORBIDDEN = {"If", "Loop", "Scan"}  # data-dependent control flow: our design has none

# op -> input positions that TensorRT's parser needs as build-time constants.
CONSTANT_INPUTS = {
    "TopK": (1,),                 # K
    "Slice": (1, 2, 3, 4),        # starts, ends, axes, steps (axes required; rest kept static too)
    "Squeeze": (1,),              # axes
    "Unsqueeze": (1,),            # axes
    "CumSum": (1,),               # axis
    "Split": (1,),                # split sizes
}


def supported_ops(path: Path = OPS_FILE) -> set[str]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return {line for line in lines if line}


def iter_graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """The graph and every subgraph held in node attributes, recursively."""
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from iter_graphs(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from iter_graphs(g)


def _constants(graph: onnx.GraphProto) -> set[str]:
    names = {init.name for init in graph.initializer}
    names |= {out for node in graph.node if node.op_type == "Constant" for out in node.output}
    return names


def _static_shapes(model: onnx.ModelProto) -> dict[str, bool]:
    """Tensor name -> whether shape inference knows every dim (for Squeeze without axes)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    values = list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output)
    return {v.name: v.type.tensor_type.HasField("shape")
            and all(d.HasField("dim_value") for d in v.type.tensor_type.shape.dim) for v in values}


def check_model(model: onnx.ModelProto, ops_file: Path = OPS_FILE) -> list[str]:
    """Every TensorRT parser problem of `model` (empty list: parser-clean)."""
    problems: list[str] = []
    ops = supported_ops(ops_file)
    opset = {o.domain: o.version for o in model.opset_import}.get("", 0)
    if opset < MIN_OPSET:
        problems.append(f"opset {opset} < {MIN_OPSET}")
    for value in model.graph.input:
        if not value.type.tensor_type.HasField("shape"):
            problems.append(f"graph input {value.name} has no static rank")
    static = _static_shapes(model)
    for graph in iter_graphs(model.graph):
        consts = _constants(graph)
        for node in graph.node:
            where = f"{node.op_type} node {node.name or '?'}"
            if node.domain not in ("", "ai.onnx"):
                problems.append(f"{where}: custom domain {node.domain!r}")
            elif node.op_type in FORBIDDEN:
                problems.append(f"{where}: control flow is not allowed in these graphs")
            elif node.op_type not in ops:
                problems.append(f"{where}: not supported by TensorRT's ONNX parser")
            for pos in CONSTANT_INPUTS.get(node.op_type, ()):
                if pos < len(node.input) and node.input[pos] and node.input[pos] not in consts:
                    problems.append(f"{where}: input {pos} ({node.input[pos]}) must be a constant")
            if node.op_type == "Squeeze" and len(node.input) < 2 and not static.get(node.input[0], False):
                problems.append(f"{where}: Squeeze without axes on a dynamic shape")
    return problems
