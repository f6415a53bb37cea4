"""int8 weights for the exported fp32 graphs (`pipeline export --int8`), in three flavours.

qdq: every linear layer (a MatMul whose B is a constant, and the tied output projection, a
Gemm with transB) gets an int8 weight initializer, symmetric (zero-point 0), with one
float scale per output channel, read through `DequantizeLinear(axis = output channel)`
into the unchanged MatMul. That is the form TensorRT's parser takes (int8 QDQ weights,
zero-point 0) and the one ONNX Runtime fuses into its 8-bit MatMulNBits kernel at load time
(runtime/cpu_int8.py). On CPU ONNX Runtime it runs at about fp32 speed, so rowwise is the fast
CPU form (docs/int8.md). LayerNorm, softmax and log-softmax are untouched and stay fp32.

rowwise: int8 weights scaled so that each adjacent pair along K sums to at most 128 in
absolute value (pair-bounded), and each linear layer's input quantized at run time one
row (one position of one hypothesis) at a time, so the GEMM runs on int8 x int8 in ONNX
Runtime's integer kernels, exactly on every x86 CPU; no row's result depends on any other
row (export/rowwise.py).
ort-dynamic: ONNX Runtime's own quantize_dynamic, one activation scale per whole batch.

The tied embedding / pre-softmax weight E (vocab, d_model): the projection needs it as
B = E^T (d_model, vocab) with one scale per vocab entry. The embedding lookup reads the
same int8 values and scales, stored row-major (Gather rows, Cast, times the gathered
per-row scales), so embedding and projection still share one quantized weight. It is
held twice (as E^T and E, int8) because ONNX Runtime fuses a DequantizeLinear into
MatMulNBits only when its int8 weight and scales have no other consumer (a shared one stays
an unfused DequantizeLinear of the whole table every step); two int8 copies are still half
the fp32 table. An embedding with no projection (the encoder's) is quantized per row the same way.
The vocabulary shortlist's step (decoder_shortlist.onnx) projects onto gathered rows of the table:
rowwise runs that as the full projection's integer GEMM on the gathered int8 rows; qdq dequantizes them.

Written with onnx.helper and numpy only, so the transformation can be read and tested.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from model.manifest import ORT_DYNAMIC as ORT_DYNAMIC  # the flavour names, re-exported for export/
from model.manifest import QDQ as QDQ
from model.manifest import ROWWISE as ROWWISE

QMAX = 127  # symmetric int8: -127..127 keeps the range symmetric around zero-point 0
PAIR_MAX = 128  # pair-bounded weights: |q[2j]| + |q[2j+1]| (quantize_columns)
# `--int8-flavour auto`, the default: rowwise, the fastest CPU form and, unlike ort-dynamic (one
# activation scale per batch), independent of batching; qdq whenever TensorRT engines are built,
# since TensorRT parses only qdq (docs/int8.md).
AUTO = "auto"


@dataclass(frozen=True)
class QuantizedWeight:
    """Names of an int8 (K, N) weight, its per-column (N,) scales and zero-points."""

    q: str
    scale: str
    zero_point: str


def pair_sums(a: np.ndarray) -> np.ndarray:
    """|a[2j]| + |a[2j+1]| along axis 0 (a last unpaired row alone): the pairs VPMADDUBSW adds."""
    a = np.abs(a.astype(np.float32))
    if a.shape[0] % 2:
        a = np.concatenate([a, np.zeros_like(a[:1])])
    return a[0::2] + a[1::2]


def quantize_columns(w: np.ndarray, pair_bounded: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(int8 q, float32 scale) with w ~= q * scale[None, :]: one scale per column (axis 1).

    pair_bounded: the scale makes |q[2j]| + |q[2j+1]| <= PAIR_MAX in every column, so a u8 x s8
    kernel built on VPMADDUBSW (x86 without int8 dot products) adds each pair of products into
    int16 without saturating: 255 * 128 = 32640 <= 32767. Each pair sum is at most 127 before
    rounding and each rounding adds at most 0.5, hence at most 128 after."""
    amax = (pair_sums(w) if pair_bounded else np.abs(w.astype(np.float32))).max(axis=0)
    scale = np.where(amax > 0, amax / QMAX, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale[None, :]), -QMAX, QMAX).astype(np.int8)
    return q, scale


class Rewriter:
    """One pass over a graph: replaces float weights by int8 + DequantizeLinear."""

    pair_bounded = False  # quantize_columns

    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.graph = model.graph
        self.inits = {i.name: i for i in self.graph.initializer}
        self.done: dict[str, QuantizedWeight] = {}  # float initializer -> its int8 (K, N) form
        self.values: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # ... and its (q, scale) arrays
        self.new_inits: list[TensorProto] = []
        self.counter = 0

    def _name(self, base: str) -> str:
        self.counter += 1
        return f"{base}_q{self.counter}"

    def _float_matrix(self, name: str) -> np.ndarray | None:
        init = self.inits.get(name)
        if init is None or init.data_type != TensorProto.FLOAT or len(init.dims) != 2:
            return None
        return numpy_helper.to_array(init)

    def _quantized(self, name: str, kn: np.ndarray) -> QuantizedWeight:
        """The int8 (K, N) form of initializer `name` (given as its (K, N) float matrix), made once."""
        if name not in self.done:
            q, scale = quantize_columns(kn, self.pair_bounded)
            qw = QuantizedWeight(f"{name}_int8", f"{name}_scale", f"{name}_zero_point")
            self.new_inits += [numpy_helper.from_array(q, qw.q), numpy_helper.from_array(scale, qw.scale),
                               numpy_helper.from_array(np.zeros_like(q[0]), qw.zero_point)]
            self.done[name] = qw
            self.values[name] = q, scale
        return self.done[name]

    def _dequantize(self, qw: QuantizedWeight) -> tuple[onnx.NodeProto, str]:
        out = self._name(f"{qw.q}_dq")
        return helper.make_node("DequantizeLinear", [qw.q, qw.scale, qw.zero_point], [out], axis=1,
                                name=out), out

    def rewrite(self) -> None:
        nodes: list[onnx.NodeProto] = []
        # Projections first, so a table shared with an embedding is already in its (K, N) form.
        projections = [n for n in self.graph.node if self._is_linear(n)]
        gathered = self._gathered_projections()
        read_elsewhere = {i for n in self.graph.node if n.name not in gathered for i in n.input}
        for node in self.graph.node:
            if node in projections:
                nodes += self._linear(node)
            elif node.name in gathered:
                nodes += self._gathered_linear(node, gathered[node.name])
            elif self._is_embedding(node):
                if any(o in read_elsewhere for o in node.output):  # else only gathered projections read it
                    nodes += self._embedding(node)
            else:
                nodes.append(node)
        del self.graph.node[:]
        self.graph.node.extend(nodes)
        used = {i for n in nodes for i in n.input}  # initializers nothing reads (old or new) are dropped
        kept = [i for i in self.graph.initializer if i.name in used]
        del self.graph.initializer[:]
        self.graph.initializer.extend(kept + [i for i in self.new_inits if i.name in used])

    def _is_linear(self, node: onnx.NodeProto) -> bool:
        if node.op_type == "MatMul":
            return self._float_matrix(node.input[1]) is not None
        return bias_free_gemm(node) is not None and self._float_matrix(node.input[1]) is not None

    def _kn_weight(self, node: onnx.NodeProto) -> np.ndarray:
        """A linear node's float weight as (K, N): a Gemm with transB stores it (N, K)."""
        w = self._float_matrix(node.input[1])
        assert w is not None
        transb = {a.name: helper.get_attribute_value(a) for a in node.attribute}.get("transB", 0)
        return w.T if node.op_type == "Gemm" and transb else w

    def _linear(self, node: onnx.NodeProto) -> list[onnx.NodeProto]:
        w = self._kn_weight(node)
        return self._int8_linear(node, self._quantized(node.input[1], w), w)

    def _int8_linear(self, node: onnx.NodeProto, qw: QuantizedWeight, w: np.ndarray) -> list[onnx.NodeProto]:
        """Nodes computing `node`'s output from its float input and the int8 weight `qw` (of the float `w`)."""
        dq, deq = self._dequantize(qw)
        # A Gemm without bias is a MatMul; MatMul is what ORT's DQ fusion matches.
        matmul = helper.make_node("MatMul", [node.input[0], deq], list(node.output), name=node.name)
        return [dq, matmul]

    def _is_embedding(self, node: onnx.NodeProto) -> bool:
        axis = {a.name: helper.get_attribute_value(a) for a in node.attribute}.get("axis", 0)
        return (node.op_type == "Gather" and axis == 0 and self._float_matrix(node.input[0]) is not None
                and node.input[1] not in self.inits)

    def _gathered_projections(self) -> dict[str, onnx.NodeProto]:
        """{name of a projection onto gathered table rows: its embedding Gather} for flavours that rewrite
        them (export/rowwise.py); the others dequantize the gathered rows (_embedding) into a float Gemm."""
        return {}

    def _gathered_linear(self, node: onnx.NodeProto, gather: onnx.NodeProto) -> list[onnx.NodeProto]:
        raise NotImplementedError  # only called for what _gathered_projections() returned

    def _table_rows(self, table: str) -> tuple[str, str]:
        """(int8 rows, their scales): the names of `table`'s int8 row-major (vocab, d) form and its
        (vocab,) scales, the same values as its (K, N) projection weight."""
        if table not in self.values:  # no projection shares it: quantize per row
            matrix = self._float_matrix(table)
            assert matrix is not None
            self._quantized(table, matrix.T)  # its unused (K, N) form is dropped by rewrite()
        q, scale = self.values[table]
        q_rows, row_scale = f"{table}_int8_rows", f"{table}_row_scale"
        if q_rows not in {i.name for i in self.new_inits}:
            self.new_inits += [numpy_helper.from_array(np.ascontiguousarray(q.T), q_rows),
                               numpy_helper.from_array(scale, row_scale)]
        return q_rows, row_scale

    def _embedding(self, node: onnx.NodeProto) -> list[onnx.NodeProto]:
        """table[ids] from int8 rows: Gather rows and their scales, Cast, multiply."""
        table, ids = node.input[0], node.input[1]
        q_rows, row_scale = self._table_rows(table)
        rows, values, scales, unsq, axes = (self._name(f"{node.name}_{s}") for s in
                                            ("rows", "float", "scales", "scale_col", "axes"))
        self.new_inits.append(numpy_helper.from_array(np.array([-1], dtype=np.int64), axes))
        return [
            helper.make_node("Gather", [q_rows, ids], [rows], axis=0, name=rows),  # (*ids, d)
            helper.make_node("Cast", [rows], [values], to=TensorProto.FLOAT, name=values),
            helper.make_node("Gather", [row_scale, ids], [scales], axis=0, name=scales),  # (*ids)
            helper.make_node("Unsqueeze", [scales, axes], [unsq], name=unsq),
            helper.make_node("Mul", [values, unsq], list(node.output), name=node.name),
        ]


def bias_free_gemm(node: onnx.NodeProto) -> dict[str, object] | None:
    """The attributes of a Gemm that is a plain matmul (A not transposed, alpha 1, no bias), else None."""
    if node.op_type != "Gemm":
        return None
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    plain = (attrs.get("transA", 0) == 0 and attrs.get("alpha", 1.0) == 1.0
             and (len(node.input) < 3 or not node.input[2] or attrs.get("beta", 1.0) == 0.0))
    return attrs if plain else None


def quantize_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with int8 QDQ weights for every linear layer and embedding (changed in place)."""
    Rewriter(model).rewrite()
    return model


def quantize_file(path: str, out: str | None = None) -> onnx.ModelProto:
    """Quantize the ONNX file at `path`, writing it to `out` (default: in place)."""
    model = quantize_model(onnx.load(path))
    onnx.save(model, out or path)
    return model


def untie_projection(model: onnx.ModelProto) -> onnx.ModelProto:
    """Give each bias-free Gemm (the tied output projection) its own (K, N) MatMul weight, so
    a quantizer that rewrites initializers cannot change the embedding table it shares."""
    rewriter = Rewriter(model)
    for i, node in enumerate(model.graph.node):
        if node.op_type == "Gemm" and rewriter._is_linear(node):
            name = f"{node.input[1]}_kn"
            model.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(rewriter._kn_weight(node)),
                                                                   name))
            model.graph.node[i].CopyFrom(helper.make_node("MatMul", [node.input[0], name], list(node.output),
                                                          name=node.name))
    return model


def quantize_file_ort_dynamic(path: str) -> None:
    """ONNX Runtime's own dynamic quantization, in place (the CPU-only "ort-dynamic" flavour):
    int8 per-channel weights, activations quantized at run time (DynamicQuantizeLinear ->
    MatMulInteger). Only weight MatMuls are quantized; the embedding Gather stays fp32."""
    import tempfile

    from onnxruntime.quantization import QuantType, quantize_dynamic  # type: ignore[import-untyped]

    with tempfile.TemporaryDirectory(prefix="ort-dynamic-") as tmp:
        untied = f"{tmp}/untied.onnx"
        onnx.save(untie_projection(onnx.load(path)), untied)
        # reduce_range: 7-bit weights, whose u8 x s8 products cannot saturate on CPUs without VNNI
        # (runtime/cpu_int8.py); rowwise keeps 8 bits and runs them unsigned there (exact u8 x u8) instead.
        quantize_dynamic(untied, path, weight_type=QuantType.QInt8, per_channel=True, reduce_range=True,
                         op_types_to_quantize=["MatMul"])
