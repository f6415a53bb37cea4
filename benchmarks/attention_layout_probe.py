"""One self-attention layer's history part in ONNX Runtime on one thread: gather K and V, scores, softmax,
values, heads merged. `small`'s shapes at batch 32 x beam 4, 15 positions.

- A: today's head-major cache, (rows of d_head) gathered by a (N, H, T) index (model/cache.py).
- B: a position-major cache, (rows of d_model) gathered by a (N, T) index, attended with block-diagonal
  queries (no transposes).
- C: the position-major cache gathered, then transposed to head-major for A's attention.

    python benchmarks/attention_layout_probe.py

Its figures are in benchmarks/2026-11-27_amd-epyc-avx2_parallel-batches.md."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

N, H, T, D, R = 128, 4, 15, 64, 32  # hypotheses, heads, positions, head width, buffer positions
DM = H * D
FLOAT, INT64 = TensorProto.FLOAT, TensorProto.INT64
INPUTS = [("kb", FLOAT), ("vb", FLOAT), ("idx", INT64), ("q", FLOAT)]


def session(nodes: list, inits: dict[str, np.ndarray]) -> ort.InferenceSession:
    graph = helper.make_graph(nodes, "attention", [helper.make_tensor_value_info(n, t, None) for n, t in INPUTS],
                              [helper.make_tensor_value_info("out", FLOAT, None)],
                              initializer=[numpy_helper.from_array(v, k) for k, v in inits.items()])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def head_major_attention(k: str, v: str) -> list:
    """q (N, d) over k, v (N, H, T, D) -> out (N, d)."""
    return [helper.make_node("Reshape", ["q", "s_q"], ["qh"]),
            helper.make_node("FusedMatMul", ["qh", k], ["s"], domain="com.microsoft", transB=1),
            helper.make_node("Softmax", ["s"], ["p"], axis=-1),
            helper.make_node("MatMul", ["p", v], ["o"]),
            helper.make_node("Transpose", ["o"], ["ot"], perm=[0, 2, 1, 3]),
            helper.make_node("Reshape", ["ot", "s_o"], ["out"])]


def gathers(k: str, v: str) -> list:
    return [helper.make_node("Gather", ["kb", "idx"], [k], axis=0),
            helper.make_node("Gather", ["vb", "idx"], [v], axis=0)]


def timed(run: Callable[[], object], n: int = 400) -> float:
    for _ in range(20):
        run()
    start = time.perf_counter()
    for _ in range(n):
        run()
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    rng = np.random.default_rng(0)
    ancestor = np.array([[n // 4 * 4 + rng.integers(4) for _ in range(T)] for n in range(N)])  # (N, T)
    idx_hm = np.array([[[(ancestor[n, t] * H + h) * R + t for t in range(T)] for h in range(H)] for n in range(N)])
    idx_pm = np.array([[ancestor[n, t] * R + t for t in range(T)] for n in range(N)])
    kb_hm, vb_hm = (rng.random((N * H * R, D), dtype=np.float32) for _ in range(2))
    kb_pm, vb_pm = (np.ascontiguousarray(b.reshape(N, H, R, D).transpose(0, 2, 1, 3).reshape(N * R, DM))
                    for b in (kb_hm, vb_hm))
    q = rng.random((N, DM), dtype=np.float32)
    block = np.zeros((DM, H), np.float32)
    for h in range(H):
        block[h * D:(h + 1) * D, h] = 1
    shapes = {"s_q": np.array([N, H, 1, D]), "s_o": np.array([N, DM])}
    a = session(gathers("k", "v") + head_major_attention("k", "v"), shapes)
    b = session(gathers("k", "v") + [  # k, v (N, T, d)
        helper.make_node("Unsqueeze", ["q", "ax2"], ["q3"]), helper.make_node("Mul", ["q3", "block"], ["qb"]),
        helper.make_node("MatMul", ["k", "qb"], ["s"]),  # (N, T, H)
        helper.make_node("Softmax", ["s"], ["p"], axis=1),
        helper.make_node("Transpose", ["p"], ["pt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["pt", "v"], ["o"]),  # (N, H, d): each head's values over all heads' columns
        helper.make_node("Mul", ["o", "blockT"], ["om"]),
        helper.make_node("ReduceSum", ["om", "ax1"], ["out"], keepdims=0)],
        {"ax2": np.array([2]), "ax1": np.array([1]), "block": block, "blockT": np.ascontiguousarray(block.T)})
    c = session(gathers("k0", "v0") + [
        helper.make_node("Reshape", ["k0", "s4"], ["k1"]),
        helper.make_node("Transpose", ["k1"], ["k"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["v0", "s4"], ["v1"]),
        helper.make_node("Transpose", ["v1"], ["v"], perm=[0, 2, 1, 3]),
        *head_major_attention("k", "v")], {**shapes, "s4": np.array([N, T, H, D])})
    feeds_hm = {"kb": kb_hm, "vb": vb_hm, "idx": idx_hm, "q": q}
    feeds_pm = {"kb": kb_pm, "vb": vb_pm, "idx": idx_pm, "q": q}
    ref = a.run(None, feeds_hm)[0]
    for name, s in (("B", b), ("C", c)):
        assert np.allclose(s.run(None, feeds_pm)[0], ref, atol=1e-5), name
    for _ in range(4):
        ta, tb, tc = (timed(lambda s=s, f=f: s.run(None, f)) for s, f in ((a, feeds_hm), (b, feeds_pm), (c, feeds_pm)))
        print(f"A head-major {ta:.0f} us; B position-major, block-diagonal {tb:.0f} us (x{ta / tb:.2f}); "
              f"C position-major, transposed {tc:.0f} us (x{ta / tc:.2f})")


if __name__ == "__main__":
    main()
