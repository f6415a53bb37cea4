"""What this CPU offers for int8 GEMMs, and how ONNX Runtime should therefore run int8 graphs.

qdq graphs: ONNX Runtime fuses DequantizeLinear -> MatMul into MatMulNBits, whose accuracy level 4
quantizes the activations and runs int8 dot products. That is accurate only where the CPU has
8-bit dot-product instructions (x86 VNNI or AMX, Arm's dot product); elsewhere level 1 (fp32 GEMM
on dequantized weights) keeps the error to the weight quantization alone. Export's verification
and the onnxruntime backend both take the level from here, so a model is verified the way this
machine serves it.

rowwise graphs multiply uint8 activations (zero-point 128) by 8-bit weights exactly in integers,
and the weights' form decides which MLAS kernel runs:
- int8 weights (zero-point 0): the u8 x s8 kernel, the fastest. With int8 dot products it is exact.
  Without them x86 runs it with VPMADDUBSW, which adds each adjacent pair of products into a
  saturating int16: full-range weights overflow it (255 * 127 * 2 > 32767). The export therefore
  stores pair-bounded weights (|w[2k]| + |w[2k+1]| <= 128, manifest `pair_bounded_weights`), whose
  pairs cannot overflow (255 * 128 = 32640): exact on every CPU, loaded as stored everywhere;
- uint8 weights w + 128 (zero-point 128): the u8 x u8 kernel, which widens both operands to 16 bits:
  exact on every CPU but slower. Rowwise dirs exported before the pair bound, with full-range int8
  weights, load flipped to this form on CPUs without dot products.
So each CPU loads a form it multiplies exactly, the fastest one (wants_unsigned_weights); session_graph
flips a graph stored in the other form into a temporary copy with its weights beside it. The
measurements behind each choice are in docs/int8.md. Some older rowwise dirs store unsigned weights
(manifest `unsigned_weights`); they load flipped to int8 on CPUs with dot products.
"""

from __future__ import annotations

import contextlib
import functools
import platform
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from runtime import graph_files

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


def integer_weights_as(model: Any, unsigned: bool) -> int:
    """Store the 8-bit weights of every rowwise MatMulIntegerToFloat of `model` (an
    onnx.ModelProto, changed in place) signed (int8 w, zero-point 0: the export's form and the fast
    u8 x s8 kernel, exact everywhere for pair-bounded weights and with int8 dot products for any) or
    unsigned (uint8 w + 128, zero-point 128: the exact u8 x u8 kernel, which widens both operands to
    16 bits, for full-range weights on CPUs without dot products). Either way the GEMM computes the
    same integers. A weight is flipped in place when integer matmuls are all
    that read it, else copied. Returns how many nodes changed (0: already in that form)."""
    from onnx import TensorProto, numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    readers: dict[str, list[Any]] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)

    def stored_unsigned(node: Any) -> bool:  # uint8 weight, its zero-point a 128 initializer
        zero_point = inits.get(node.input[5]) if len(node.input) == 6 else None
        return (inits[node.input[1]].data_type == TensorProto.UINT8 and zero_point is not None
                and numpy_helper.to_array(zero_point).tolist() == UNSIGNED_ZERO_POINT)

    def stored_signed(node: Any) -> bool:  # int8 weight, zero-point 0 (no input)
        return len(node.input) == 5 and inits[node.input[1]].data_type == TensorProto.INT8

    wanted_from = stored_signed if unsigned else stored_unsigned
    targets = [n for n in model.graph.node if n.op_type == INTEGER_MATMUL and len(n.input) >= 5
               and n.input[1] in inits and wanted_from(n)]
    target_ids = {id(n) for n in targets}
    flipped: dict[str, str] = {}  # weight -> its flipped copy
    dropped: set[str] = set()  # the unsigned weights' zero-points
    for node in targets:
        weight = node.input[1]
        if weight not in flipped:
            # w + 128 as uint8 is w's two's-complement byte with its top bit flipped, and back
            data = numpy_helper.to_array(inits[weight]).view(np.uint8) ^ np.uint8(UNSIGNED_ZERO_POINT)
            data = data if unsigned else data.view(np.int8)
            if all(id(r) in target_ids for r in readers[weight]):  # in place: no second copy in memory
                flipped[weight] = weight
                inits[weight].CopyFrom(numpy_helper.from_array(data, weight))
            else:
                flipped[weight] = f"{weight}_{'u8' if unsigned else 's8'}"
                model.graph.initializer.append(numpy_helper.from_array(data, flipped[weight]))
        node.input[1] = flipped[weight]
        if unsigned:
            node.input.append(UNSIGNED_WEIGHT_ZERO_POINT)
        else:
            dropped.add(node.input.pop(5))
    if targets and unsigned and UNSIGNED_WEIGHT_ZERO_POINT not in inits:
        model.graph.initializer.append(
            numpy_helper.from_array(np.array(UNSIGNED_ZERO_POINT, np.uint8), UNSIGNED_WEIGHT_ZERO_POINT))
    unread = dropped - {name for n in model.graph.node for name in n.input}  # zero-points no node reads
    if unread:
        kept = [i for i in model.graph.initializer if i.name not in unread]
        del model.graph.initializer[:]
        model.graph.initializer.extend(kept)
    return len(targets)


def wants_unsigned_weights(dot_product: bool | None = None, pair_bounded: bool = False) -> bool:
    """Whether this CPU (or the one described) should run rowwise GEMMs on unsigned weights:
    where it has no int8 dot products, unless the weights are pair-bounded (exact on u8 x s8)."""
    return not pair_bounded and not (has_int8_dot_product() if dot_product is None else dot_product)


@contextlib.contextmanager
def graph_as_is(path: str | Path) -> Iterator[str]:
    """The graph file itself: session_graph's counterpart where nothing is to be flipped."""
    yield str(path)


@contextlib.contextmanager
def session_graph(path: str | Path, dot_product: bool | None = None, pair_bounded: bool = False) -> Iterator[str]:
    """The graph file to give onnxruntime.InferenceSession for the graph at `path` on this CPU (or
    the one described), valid inside the `with`: the path itself where its integer-matmul weights
    (if any) are already in the form this CPU multiplies fastest and exactly (wants_unsigned_weights),
    else a temporary copy with them flipped (integer_weights_as), its weights beside it like an
    export's (runtime/graph_files.py). Create the session inside the `with`; the copy goes after it.

    Written out, not handed over as serialized bytes: ONNX Runtime then reads the flipped weights
    from their file instead of parsing a second copy of the graph. `base` rowwise int8 flipped to
    uint8, both sessions: 318 MB resident after loading (405 MB peak, while flipping), against 496 MB
    (570 MB peak) through bytes; unflipped 311 MB."""
    import onnx

    model = onnx.load(str(path))
    if not integer_weights_as(model, unsigned=wants_unsigned_weights(dot_product, pair_bounded)):
        del model
        yield str(path)
        return
    with tempfile.TemporaryDirectory(prefix="pipeline-flipped-") as tmp:
        flipped = graph_files.save_graph(model, Path(tmp) / Path(path).name)
        del model
        yield str(flipped)
