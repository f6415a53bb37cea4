"""What this CPU offers for int8 GEMMs, and how ONNX Runtime should therefore run int8 graphs.

ONNX Runtime fuses qdq weights (DequantizeLinear -> MatMul) into MatMulNBits, whose accuracy
level 4 quantizes the activations too and runs int8 dot products. That is fast and accurate
where the CPU has 8-bit dot-product instructions (x86 VNNI or AMX, Arm's dot product); without
them (an AVX2-only x86 CPU) the int8 path measured far less accurate: on the trained test model
the worst candidate log-prob moved by 0.43 against fp32, against 0.30 with accuracy level 1
(weights dequantized to fp32, fp32 GEMM), which is the weight quantization alone. Export's
verification and the onnxruntime backend both take the level from here, so a model is verified
the way this machine serves it. (The integer flavours avoid the problem in the graph instead:
7-bit weights, export/quantize.py.)
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

ACCURACY_LEVEL = "session.qdq_matmulnbits_accuracy_level"
INT8_COMPUTE = "4"  # activations quantized, int8 dot products
FP32_COMPUTE = "1"  # weights dequantized, fp32 GEMM
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
