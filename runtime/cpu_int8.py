"""What this CPU offers for int8 GEMMs, and how ONNX Runtime should therefore run int8 graphs.

ONNX Runtime fuses qdq weights (DequantizeLinear -> MatMul) into MatMulNBits, whose accuracy
level 4 quantizes the activations too and runs int8 dot products. That is fast and accurate
where the CPU has 8-bit dot-product instructions (x86 VNNI or AMX, Arm's dot product); without
them (an AVX2-only x86 CPU) the int8 path measured far less accurate: on the trained test model
the worst candidate log-prob moved by 0.43 against fp32, against 0.30 with accuracy level 1
(weights dequantized to fp32, fp32 GEMM), which is the weight quantization alone. Export's
verification and the onnxruntime backend both take the level from here, so a model is verified
the way this machine serves it.

The rowwise flavour multiplies uint8 activations (zero-point 128) by 8-bit weights in
MatMulIntegerToFloat. With int8 weights, x86 CPUs without VNNI do that with VPMADDUBSW, which adds
pairs of u8 x s8 products into a saturating int16: 255 * 127 * 2 > 32767, and a single worst-case
1024-long dot product came out 16 million off (measured on an AVX2-only AMD EPYC; the rowwise
export failed verification, 0.92 against its 0.3 bound). So the export stores the weights unsigned,
w + 128 with zero-point 128 (unsigned_integer_weights), which ONNX Runtime's MLAS multiplies exactly
everywhere: where the CPU has int8 dot products (VNNI, AMX, Arm's) its u8 x u8 GEMM is the u8 x s8
kernel, the weights flipped back when packed; without them it is a kernel that widens both operands
to 16 bits. Measured on an AVX2-only EPYC (README, "Measured here"), that beat the earlier ways of
avoiding the saturation: each layer as an fp32 GEMM of its float input and the dequantized weights
(fp32 speed and memory, weights 4x larger) and an exact fp32 emulation of the integer GEMM (slower
still); rows quantized to 7 bits (which cannot saturate) ran faster but failed verification on a
sharp model (1.02 against 0.3), and halving the weights to 7 bits (ONNX Runtime's `reduce_range`)
rounds twice and measured less accurate. Rowwise dirs exported before the weights were stored
unsigned get them shifted when loaded on a CPU without int8 dot products (session_graph), which
costs load time and the peak memory of a second copy of the graph.
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
UNSIGNED_ZERO_POINT = 128  # rowwise weights: int8 w stored as uint8 w + 128
UNSIGNED_WEIGHT_ZERO_POINT = "u8_weight_zero_point"
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


def unsigned_integer_weights(model: Any) -> int:
    """Store the int8 weights of every MatMulIntegerToFloat of `model` (an onnx.ModelProto, in
    place) as uint8 with zero-point 128, so ONNX Runtime multiplies the uint8 rows by them with its
    u8 x u8 kernel, which widens both to 16 bits (VPMADDWD on AVX2): exact, unlike the u8 x s8 one
    without VNNI, and the same integers a VNNI CPU computes. The rowwise export calls it; so does
    session_graph, for rowwise graphs exported before. Returns how many nodes changed."""
    from onnx import TensorProto, numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    readers: dict[str, list[Any]] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)

    targets = [n for n in model.graph.node  # the rowwise pattern: int8 weights, no weight zero-point (0)
               if n.op_type == INTEGER_MATMUL and len(n.input) == 5 and n.input[1] in inits
               and inits[n.input[1]].data_type == TensorProto.INT8]
    target_ids = {id(n) for n in targets}
    shifted: dict[str, str] = {}  # int8 weight -> its uint8 copy
    for node in targets:
        weight = node.input[1]
        if weight not in shifted:
            # w + 128 as uint8 is w's two's-complement byte with its top bit flipped
            unsigned = numpy_helper.to_array(inits[weight]).view(np.uint8) ^ np.uint8(UNSIGNED_ZERO_POINT)
            if all(id(r) in target_ids for r in readers[weight]):  # in place: no second copy in memory
                shifted[weight] = weight
                inits[weight].CopyFrom(numpy_helper.from_array(unsigned, weight))
            else:
                shifted[weight] = f"{weight}_u8"
                model.graph.initializer.append(numpy_helper.from_array(unsigned, shifted[weight]))
        node.input[1] = shifted[weight]
        node.input.append(UNSIGNED_WEIGHT_ZERO_POINT)
    changed = len(targets)
    if changed:
        model.graph.initializer.append(
            numpy_helper.from_array(np.array(UNSIGNED_ZERO_POINT, np.uint8), UNSIGNED_WEIGHT_ZERO_POINT))
    return changed


def session_graph(path: str | Path, dot_product: bool | None = None) -> str | bytes:
    """What to give onnxruntime.InferenceSession for the graph at `path` on this CPU (or the one
    described): the path itself, or, without int8 dot products and where the graph has integer
    matmuls, the serialized graph with their weights unsigned (unsigned_integer_weights)."""
    if dot_product is None:
        dot_product = has_int8_dot_product()
    if dot_product:
        return str(path)
    import onnx

    model = onnx.load(str(path))
    return model.SerializeToString() if unsigned_integer_weights(model) else str(path)
