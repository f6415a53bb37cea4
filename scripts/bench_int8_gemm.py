#!/usr/bin/env python
"""One linear layer's GEMM in ONNX Runtime on this CPU, in the forms the rowwise int8 flavour can take.

fp32 MatMul; MatMulIntegerToFloat on uint8 rows (zero-point 128) times pair-bounded int8 weights
(u8 x s8, the export's form); the same weights flipped to uint8 (u8 x u8, how a CPU without int8
dot products ran full-range weights); and int8 rows without a zero-point (s8 x s8). Each integer
form is first checked exact against numpy on activations at 255, the worst case for VPMADDUBSW;
then the forms alternate, round after round, at the same thread count; medians are printed.

    python scripts/bench_int8_gemm.py --shape 128x512x2048 --shape 4x512x2048 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from export.quantize import quantize_columns
from runtime.cpu_int8 import cpu_flags, integer_weights_as

FORMS = ("fp32", "u8s8", "u8u8", "s8s8")


def session(form: str, w: np.ndarray, q: np.ndarray, threads: int) -> Any:
    import onnxruntime as ort

    k, n = w.shape
    if form == "fp32":
        nodes = [helper.make_node("MatMul", ["x", "w"], ["y"])]
        inits = [numpy_helper.from_array(w, "w")]
        x_type = TensorProto.FLOAT
    else:
        signed = form == "s8s8"
        inputs = ["x", "w", "one", "w_scale"] + ([] if signed else ["zp"])
        nodes = [helper.make_node("MatMulIntegerToFloat", inputs, ["y"], domain="com.microsoft")]
        inits = [numpy_helper.from_array(q, "w"), numpy_helper.from_array(np.array(1.0, np.float32), "one"),
                 numpy_helper.from_array(np.ones(n, np.float32), "w_scale")]
        inits += [] if signed else [numpy_helper.from_array(np.array(128, np.uint8), "zp")]
        x_type = TensorProto.INT8 if signed else TensorProto.UINT8
    graph = helper.make_graph(nodes, "gemm", [helper.make_tensor_value_info("x", x_type, ["m", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])], inits)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    if form == "u8u8":
        integer_weights_as(model, unsigned=True)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def feeds(form: str, signed_rows: np.ndarray, rng: np.random.Generator) -> dict[str, np.ndarray]:
    if form == "fp32":
        return {"x": rng.standard_normal(signed_rows.shape, dtype=np.float32)}
    if form == "s8s8":
        return {"x": signed_rows}
    return {"x": (signed_rows.astype(np.int16) + 128).astype(np.uint8)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", action="append", help="MxKxN (rows x in x out); repeat", required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    flags = cpu_flags()
    print("CPU flags:", " ".join(f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8") if f in flags))
    rng = np.random.default_rng(0)
    for shape in args.shape:
        m, k, n = (int(v) for v in shape.split("x"))
        w = rng.standard_t(5, size=(k, n)).astype(np.float32)
        q, _ = quantize_columns(w, pair_bounded=True)
        sessions = {form: session(form, w, q, args.threads) for form in FORMS}
        rows = rng.integers(-127, 128, size=(m, k)).astype(np.int8)
        rows[0] = 127  # uint8 255
        exact = rows.astype(np.int64) @ q.astype(np.int64)
        errors = {form: float(np.abs(sessions[form].run(None, feeds(form, rows, rng))[0] - exact).max())
                  for form in FORMS[1:]}
        inputs = {form: feeds(form, rows, rng) for form in FORMS}
        reps = max(3, int(2e9 / (2 * m * k * n)))
        times: dict[str, list[float]] = {form: [] for form in FORMS}
        for _ in range(args.rounds):
            for form in FORMS:
                start = time.perf_counter()
                for _ in range(reps):
                    sessions[form].run(None, inputs[form])
                times[form].append((time.perf_counter() - start) / reps)
        median = {form: statistics.median(t) for form, t in times.items()}
        print(f"M={m} K={k} N={n}: " + ", ".join(
            f"{form} {median[form] * 1e6:.0f} us ({2 * m * k * n / median[form] / 1e9:.0f} GOP/s)" for form in FORMS)
            + f"; u8s8 x u8u8 {median['u8u8'] / median['u8s8']:.2f}; max integer error "
            + ", ".join(f"{form} {e:.0f}" for form, e in errors.items()))


if __name__ == "__main__":
    main()
