"""The rowwise int8 flavour (ONNX Runtime on CPU only: com.microsoft.MatMulIntegerToFloat): the weights as
export/quantize.py makes them, pair-bounded, and each linear layer's input quantized to 8 bits one row at a
time at run time, or with one calibrated constant scale (export/calibrate.py), whose GEMM then adds the
layer's bias itself (`fold_biases`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from export.quantize import (
    ORT_DYNAMIC,
    QDQ,
    QMAX,
    ROWWISE,
    QuantizedWeight,
    Rewriter,
    bias_free_gemm,
    quantize_file,
    quantize_file_ort_dynamic,
)

if TYPE_CHECKING:
    from export.calibrate import RangeTable


class RowwiseRewriter(Rewriter):
    """int8 weights as in qdq, and each linear layer's input quantized at run time one row
    (one token of one sentence) at a time: symmetric, scale = max|row| / 127, stored as
    uint8 with zero-point 128. The weights are int8 (zero-point 0) and pair-bounded
    (quantize_columns): ONNX Runtime's u8 x s8 kernel, its fastest, then computes the exact
    product on every CPU, with int8 dot products or, on AVX2 alone, with VPMADDUBSW's int16
    pairs, which full-range weights would saturate. The integer GEMM's int32 result is exact,
    then scaled by the row's and the column's scale: no value depends on another row, so a
    sentence translates the same in any batch."""

    pair_bounded = True  # exact on every CPU's u8 x s8 kernel, with or without int8 dot products

    def __init__(self, model: onnx.ModelProto, ranges: RangeTable | None = None):
        super().__init__(model)
        self.rows: dict[str, tuple[str, str]] = {}  # float input -> (its uint8 rows, their scales)
        # static activation scales (export/calibrate.py): float input -> (its uint8 form, its constant scale)
        self.ranges = ranges
        self.static: dict[str, tuple[str, str]] = {}
        self.static_gemms = self.dynamic_gemms = 0
        self.new_inits += [numpy_helper.from_array(np.array(1.0, np.float32), "rowq_one"),
                           numpy_helper.from_array(np.array(QMAX, np.float32), "rowq_qmax"),
                           numpy_helper.from_array(np.array(1e-30, np.float32), "rowq_tiny"),
                           numpy_helper.from_array(np.array(128, np.uint8), "rowq_zero_point"),
                           numpy_helper.from_array(np.array([-1], np.int64), "rowq_last_axis")]

    def _quantize_rows(self, x: str) -> tuple[list[onnx.NodeProto], str, str]:
        if x in self.rows:
            return [], *self.rows[x]
        absx, amax, floor, scale, scaled, qx = (self._name(f"{x}_{s}") for s in
                                                 ("abs", "amax", "floor", "row_scale", "scaled", "u8"))
        nodes = [
            helper.make_node("Abs", [x], [absx], name=absx),
            helper.make_node("ReduceMax", [absx, "rowq_last_axis"], [amax], keepdims=1, name=amax),
            helper.make_node("Max", [amax, "rowq_tiny"], [floor], name=floor),  # an all-zero row
            helper.make_node("Div", [floor, "rowq_qmax"], [scale], name=scale),
            helper.make_node("Div", [x, scale], [scaled], name=scaled),
            helper.make_node("QuantizeLinear", [scaled, "rowq_one", "rowq_zero_point"], [qx], name=qx),
        ]
        self.rows[x] = qx, scale
        return nodes, qx, scale

    def _int8_linear(self, node: onnx.NodeProto, qw: QuantizedWeight, w: np.ndarray) -> list[onnx.NodeProto]:
        return self._integer_gemm(node, qw.q, qw.scale, None if self.ranges is None else self.ranges.lookup(w))

    def _quantize_static(self, x: str, amax: float) -> tuple[list[onnx.NodeProto], str, str]:
        """x quantized with one constant scale (amax / 127, calibrated): values beyond the calibrated
        range saturate at the ends of uint8 (zero-point 128)."""
        if x in self.static:
            return [], *self.static[x]
        scale, qx = self._name(f"{x}_static_scale"), self._name(f"{x}_u8")
        self.new_inits.append(numpy_helper.from_array(np.array(max(amax, 1e-30) / QMAX, np.float32), scale))
        self.static[x] = qx, scale
        return [helper.make_node("QuantizeLinear", [x, scale, "rowq_zero_point"], [qx], name=qx)], qx, scale

    def _integer_gemm(self, node: onnx.NodeProto, b: str, b_scale: str,
                      amax: float | None = None) -> list[onnx.NodeProto]:
        """Nodes computing `node`'s output as its input, quantized per row, times the int8 (K, N) `b`,
        scaled by `b_scale` (N,) and by the rows' scales; with `amax` (a calibrated range), quantized with
        one constant scale instead, which the integer GEMM applies itself."""
        if amax is not None:
            self.static_gemms += 1
            nodes, qx, scale = self._quantize_static(node.input[0], amax)
            return nodes + [helper.make_node("MatMulIntegerToFloat", [qx, b, scale, b_scale, "rowq_zero_point"],
                                             list(node.output), name=node.name, domain="com.microsoft")]
        self.dynamic_gemms += 1
        nodes, qx, row_scale = self._quantize_rows(node.input[0])
        col = self._name(f"{node.name}_col_scaled")
        # ONNX Runtime's MatMulInteger -> Cast -> Mul(column scales) in one kernel (measured: 1.06x
        # the step time of the three standard ops); the row scales follow as one broadcast Mul.
        return nodes + [
            helper.make_node("MatMulIntegerToFloat", [qx, b, "rowq_one", b_scale, "rowq_zero_point"], [col],
                             name=col, domain="com.microsoft"),
            helper.make_node("Mul", [col, row_scale], list(node.output), name=node.name),
        ]

    def _gathered_projections(self) -> dict[str, onnx.NodeProto]:
        """The shortlist's projection (decoder_shortlist.onnx): a Gemm(x, table[candidates], transB=1)
        with no bias, the table a float initializer: it becomes an integer GEMM like the full
        vocabulary's, on the gathered int8 rows."""
        producer = {o: n for n in self.graph.node for o in n.output}
        found: dict[str, onnx.NodeProto] = {}
        for node in self.graph.node:
            attrs = bias_free_gemm(node)
            if attrs is None or attrs.get("transB", 0) != 1:
                continue
            gather = producer.get(node.input[1])
            if gather is not None and self._is_embedding(gather):
                found[node.name] = gather
        return found

    def _gathered_linear(self, node: onnx.NodeProto, gather: onnx.NodeProto) -> list[onnx.NodeProto]:
        """x @ table[ids]^T on int8: the ids' int8 rows and scales gathered, the rows transposed to (K, C),
        and the same integer GEMM as the full projection's. Each candidate's logit is the one the full
        vocabulary's int8 projection gives it, bit for bit (the same int32 sums and scales)."""
        q_rows, row_scale = self._table_rows(gather.input[0])
        ids = gather.input[1]
        rows, kc, scales = (self._name(f"{node.name}_{s}") for s in ("rows", "rows_kc", "col_scales"))
        return [
            helper.make_node("Gather", [q_rows, ids], [rows], axis=0, name=rows),  # (C, K) int8
            helper.make_node("Transpose", [rows], [kc], perm=[1, 0], name=kc),  # (K, C)
            helper.make_node("Gather", [row_scale, ids], [scales], axis=0, name=scales),  # (C,)
        ] + self._integer_gemm(node, kc, scales, None if self.ranges is None else self.ranges.output_projection())


def _graph_index(graph: onnx.GraphProto) -> tuple[dict[str, onnx.TensorProto], dict[str, list[onnx.NodeProto]],
                                                 set[str]]:
    """The graph's initializers by name, each tensor's reading nodes, and its output names."""
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    return {i.name: i for i in graph.initializer}, readers, {o.name for o in graph.output}


def _drop(graph: onnx.GraphProto, dropped: set[int]) -> int:
    """The nodes whose ids are in `dropped` removed, in place; how many."""
    kept = [n for n in graph.node if id(n) not in dropped]
    del graph.node[:]
    graph.node.extend(kept)
    return len(dropped)


def fold_biases(model: onnx.ModelProto) -> int:
    """Each bias Add after a statically scaled integer GEMM (MatMulIntegerToFloat with a constant input
    scale and no Mul after it) moved into the GEMM's own bias input, in place; returns how many. ONNX Runtime
    adds it in the GEMM's output pass instead of a second pass over the output: one node fewer per linear
    layer (benchmarks/README.md, "small-step-profile").
    Per-row GEMMs keep their Add: the row scales are applied after the GEMM, and the bias must not be scaled."""
    graph = model.graph
    inits, readers, outputs = _graph_index(graph)
    dropped: set[int] = set()
    for node in graph.node:
        if (node.op_type != "MatMulIntegerToFloat" or len(node.input) != 5 or node.input[2] not in inits
                or node.output[0] in outputs or len(readers.get(node.output[0], [])) != 1):
            continue
        add = readers[node.output[0]][0]
        if add.op_type != "Add" or len(add.input) != 2:
            continue
        bias = add.input[1] if add.input[0] == node.output[0] else add.input[0]
        weight, init = inits.get(node.input[1]), inits.get(bias)
        if (weight is None or init is None or init.data_type != TensorProto.FLOAT
                or list(init.dims) != [weight.dims[-1]] or add.input[0] == add.input[1]):
            continue
        node.input.extend(["", bias])  # no weight zero point (symmetric int8), then the bias
        node.output[0] = add.output[0]
        dropped.add(id(add))
    return _drop(graph, dropped)


RELU_ZERO_POINT = "rowq_zero_point_0"  # uint8 0: the zero point of a Relu's folded quantization
U8_LEVELS = 255  # uint8 0..255: a Relu's output, never negative, quantized over all of them


def fold_relus(model: onnx.ModelProto) -> int:
    """Each Relu read only by a statically scaled QuantizeLinear (zero point 128) folded into it, in place; returns
    how many. The Relu's input is quantized instead, with zero point 0 and the calibrated range over all 255 levels
    (amax / 255, not amax / 127): uint8 saturation maps every negative value to 0, which is the Relu, and its
    outputs get twice the resolution. The integer GEMMs reading it take the new scale and zero point. One pass
    over the FFN's hidden activations fewer per layer (benchmarks/README.md, "relu-folded")."""
    graph = model.graph
    inits, readers, outputs = _graph_index(graph)
    dropped: set[int] = set()
    for relu in graph.node:
        quant = readers.get(relu.output[0], [None])[0] if relu.op_type == "Relu" else None
        if (quant is None or len(readers[relu.output[0]]) != 1 or relu.output[0] in outputs
                or quant.op_type != "QuantizeLinear" or len(quant.input) != 3 or quant.input[1] not in inits
                or quant.input[2] != "rowq_zero_point"):
            continue
        gemms = readers.get(quant.output[0], [])
        if not gemms or quant.output[0] in outputs or not all(
                g.op_type == "MatMulIntegerToFloat" and g.input[0] == quant.output[0] and g.input[2] == quant.input[1]
                and g.input[4] == "rowq_zero_point" for g in gemms):
            continue
        scale = numpy_helper.to_array(inits[quant.input[1]])
        folded = f"{quant.input[1]}_relu"
        graph.initializer.append(numpy_helper.from_array((scale * QMAX / U8_LEVELS).astype(np.float32), folded))
        if RELU_ZERO_POINT not in inits:
            inits[RELU_ZERO_POINT] = numpy_helper.from_array(np.array(0, np.uint8), RELU_ZERO_POINT)
            graph.initializer.append(inits[RELU_ZERO_POINT])
        quant.input[:] = [relu.input[0], folded, RELU_ZERO_POINT]
        for g in gemms:
            g.input[2], g.input[4] = folded, RELU_ZERO_POINT
        dropped.add(id(relu))
    return _drop(graph, dropped)


def quantize_file_rowwise(path: str, ranges: RangeTable | None = None) -> tuple[int, int]:
    """The rowwise flavour (ONNX Runtime on CPU only: com.microsoft.MatMulIntegerToFloat), in place; with
    `ranges`, static activation scales where a layer was calibrated (their biases folded into the GEMMs, each
    FFN's Relu into its quantization). Returns (static, per-row) GEMMs."""
    model = onnx.load(path)
    rewriter = RowwiseRewriter(model, ranges)
    rewriter.rewrite()
    fold_biases(model)
    fold_relus(model)
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    onnx.save(model, path)
    return rewriter.static_gemms, rewriter.dynamic_gemms


def quantize_flavour(flavour: str, path: Path, ranges: RangeTable | None = None) -> tuple[int, int] | None:
    """The fp32 graph at `path` rewritten in place with int8 weights of `flavour` (QUANTIZATIONS); rowwise
    with `ranges` (calibrated): static activation scales. Returns rowwise's (static, per-row) GEMM counts.
    Every flavour's entry point lives here, since this module builds on quantize.py and not the reverse."""
    if flavour == ROWWISE:
        return quantize_file_rowwise(str(path), ranges)
    if ranges is not None:
        raise ValueError(f"static activation scales are for the rowwise flavour, not {flavour}")
    quantizers: dict[str, Callable[[str], object]] = {QDQ: quantize_file, ORT_DYNAMIC: quantize_file_ort_dynamic}
    quantizers[flavour](str(path))
    return None
