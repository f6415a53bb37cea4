"""What this CPU offers for int8 GEMMs, and how ONNX Runtime should therefore run int8 graphs.

ONNX Runtime fuses qdq weights (DequantizeLinear -> MatMul) into MatMulNBits, whose accuracy
level 4 quantizes the activations too and runs int8 dot products. That is fast and accurate
where the CPU has 8-bit dot-product instructions (x86 VNNI or AMX, Arm's dot product); without
them (an AVX2-only x86 CPU) the int8 path measured far less accurate: on the trained test model
the worst candidate log-prob moved by 0.43 against fp32, against 0.30 with accuracy level 1
(weights dequantized to fp32, fp32 GEMM), which is the weight quantization alone. Export's
verification and the onnxruntime backend both take the level from here, so a model is verified
the way this machine serves it.

The rowwise flavour multiplies uint8 activations (zero-point 128) by int8 weights in
MatMulIntegerToFloat. Without VNNI, x86 CPUs do that with VPMADDUBSW, which adds pairs of u8 x s8
products into a saturating int16: 255 * 127 * 2 > 32767, and a single worst-case 1024-long dot
product came out 16 million off (measured on an AVX2-only AMD EPYC; the rowwise export failed
verification, 0.92 against its 0.3 bound). On such a CPU the graph is loaded with each linear layer
as an fp32 GEMM of its float input and the 8-bit weights dequantized once
(dequantize_integer_matmuls): no saturation, only the weights' rounding, and fp32 speed and memory.
Whether an int8 GEMM would be faster there depends on the CPU: on one AVX2-only EPYC the saturating
kernel ran 479 target tokens/s against fp32's 519 (small, batch 32, beam 4); on a faster one, rows
quantized to 7 bits (which cannot saturate) ran 1.28-1.33x the fp32 step but failed verification on
a sharp model (1.02 against 0.3), so they are not used (README, "Measured here"). Emulating the
int8 activations as well (an exact fp32 GEMM of the quantized rows) cost 7-10% of the decoder step
in per-row quantize ops for a less accurate result; halving the weights to 7 bits (ONNX Runtime's
`reduce_range`) rounds twice and measured less accurate. The model dir stays the one VNNI machines
serve with int8 GEMMs.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path
from typing import Any

import numpy as np

ACCURACY_LEVEL = "session.qdq_matmulnbits_accuracy_level"
INT8_COMPUTE = "4"  # activations quantized, int8 dot products
FP32_COMPUTE = "1"  # weights dequantized, fp32 GEMM
INTEGER_MATMUL = "MatMulIntegerToFloat"  # the rowwise flavour's GEMM (com.microsoft)
# /proc/cpuinfo flags (x86 "flags", Arm "Features") of 8-bit dot-product instructions
DOT_PRODUCT_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8", "asimddp"})


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The first processor's feature flags (Linux); empty where /proc/cpuinfo is not readable."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


@functools.cache
def has_int8_dot_product() -> bool:
    """VNNI / AMX / Arm dot product here (Apple silicon has it; elsewhere unknown means no)."""
    if platform.system() == "Darwin" and platform.machine() == "arm64":
        return True
    return bool(cpu_flags() & DOT_PRODUCT_FLAGS)


def int8_session_config(dot_product: bool | None = None) -> dict[str, str]:
    """ONNX Runtime session config entries for int8 graphs on this CPU (or the one described)."""
    if dot_product is None:
        dot_product = has_int8_dot_product()
    return {ACCURACY_LEVEL: INT8_COMPUTE if dot_product else FP32_COMPUTE}


def dequantize_integer_matmuls(model: Any) -> int:
    """Rewrite every MatMulIntegerToFloat of `model` (an onnx.ModelProto, in place) into an fp32
    MatMul on its int8 weights dequantized once, here, into a float initializer (read through
    DequantizeLinear instead, ONNX Runtime fuses them back into the integer kernel, or into
    MatMulNBits, which measured 6x slower at batch 1). Returns how many nodes changed.

    A rowwise linear layer (its input quantized per row by Div(row scale) -> QuantizeLinear, its
    output times the same row scales) becomes one MatMul of the float input itself: the per-row
    quantize ops and the row-scale Mul go, so only the weights' 8-bit rounding is left, which is
    more accurate than the integer GEMM and faster than emulating it (README, "Measured here").
    Any other integer matmul is computed exactly: its quantized activations cast to float, minus
    the zero-point, times the scale (integers of at most 8 bits multiply exactly in fp32)."""
    from onnx import TensorProto, helper, numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    producer = {out: n for n in model.graph.node for out in n.output}
    consumers: dict[str, list[Any]] = {}
    for n in model.graph.node:
        for name in n.input:
            consumers.setdefault(name, []).append(n)
    nodes, changed, added, dropped = [], 0, set(), set()

    def floats(name: str, scale: str | None = None) -> str:
        """Initializer `name` as fp32 (times `scale`, per column), added once."""
        out = f"{name}_fp32"
        if out not in added:
            value = numpy_helper.to_array(inits[name]).astype(np.float32)
            if scale is not None:
                value = value * numpy_helper.to_array(inits[scale]).astype(np.float32)
            added.add(out)
            model.graph.initializer.append(numpy_helper.from_array(value, out))
        return out

    def rowwise_input(node: Any) -> tuple[str, Any] | None:
        """(the float input, the row-scale Mul after the node) where `node` is a rowwise linear."""
        quantize = producer.get(node.input[0])
        divide = producer.get(quantize.input[0]) if quantize is not None else None
        after = consumers.get(node.output[0], [])
        if (quantize is None or quantize.op_type != "QuantizeLinear" or divide is None
                or divide.op_type != "Div" or len(after) != 1 or after[0].op_type != "Mul"):
            return None
        row_scale = divide.input[1]
        return (divide.input[0], after[0]) if list(after[0].input) == [node.output[0], row_scale] else None

    for node in model.graph.node:
        if id(node) in dropped:
            continue
        if (node.op_type != INTEGER_MATMUL or len(node.input) != 5
                or not all(name in inits for name in node.input[1:])):
            nodes.append(node)
            continue
        qx, w, a_scale, w_scale, a_zero_point = node.input
        weight = floats(w, scale=w_scale)
        changed += 1
        rowwise = rowwise_input(node)
        if rowwise is not None:
            x, mul = rowwise
            dropped.add(id(mul))
            nodes.append(helper.make_node("MatMul", [x, weight], list(mul.output), name=mul.name))
            continue
        zero = floats(a_zero_point)
        cast, centred, x = f"{node.name}_x_cast", f"{node.name}_x_centred", f"{node.name}_x_fp32"
        nodes += [helper.make_node("Cast", [qx], [cast], to=TensorProto.FLOAT, name=cast),
                  helper.make_node("Sub", [cast, zero], [centred], name=centred),
                  helper.make_node("Mul", [centred, a_scale], [x], name=x),
                  helper.make_node("MatMul", [x, weight], list(node.output), name=node.name)]
    nodes = _live(nodes, {o.name for o in model.graph.output})  # the per-row quantize ops nothing reads now
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    used = {name for n in nodes for name in n.input}
    kept = [i for i in model.graph.initializer if i.name in used]  # the int8 copies are not needed
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    return changed


def _live(nodes: list[Any], outputs: set[str]) -> list[Any]:
    """`nodes` (in topological order) less those whose results nothing reads."""
    needed, kept = set(outputs), []
    for node in reversed(nodes):
        if any(out in needed for out in node.output):
            kept.append(node)
            needed.update(node.input)
    return kept[::-1]


def session_graph(path: str | Path, dot_product: bool | None = None) -> str | bytes:
    """What to give onnxruntime.InferenceSession for the graph at `path` on this CPU (or the one
    described): the path itself, or, without int8 dot products and where the graph has integer
    matmuls, the serialized graph with them in floating point (dequantize_integer_matmuls)."""
    if dot_product is None:
        dot_product = has_int8_dot_product()
    if dot_product:
        return str(path)
    import onnx

    model = onnx.load(str(path))
    return model.SerializeToString() if dequantize_integer_matmuls(model) else str(path)
