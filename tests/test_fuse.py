"""Linear layers that read one input, fused into one GEMM in the exported graphs (export/fuse.py)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from export.fuse import fuse_shared_input_linears
from model import io_names


def _graph() -> onnx.ModelProto:
    """x -> three linears (Q, K, V widths 4, 4, 6) and one more MatMul on another input; y -> a
    linear whose output is also a graph output (not fusable: nothing to split it from)."""
    rng = np.random.default_rng(0)
    inits, nodes = [], []
    for name, width in (("q", 4), ("k", 4), ("v", 6)):
        inits += [numpy_helper.from_array(rng.standard_normal((8, width)).astype(np.float32), f"w_{name}"),
                  numpy_helper.from_array(rng.standard_normal(width).astype(np.float32), f"b_{name}")]
        nodes += [helper.make_node("MatMul", ["x", f"w_{name}"], [f"mm_{name}"]),
                  helper.make_node("Add", [f"mm_{name}", f"b_{name}"], [name])]
    inits.append(numpy_helper.from_array(rng.standard_normal((8, 3)).astype(np.float32), "w_other"))
    nodes += [helper.make_node("Relu", ["q"], ["q_relu"]),
              helper.make_node("MatMul", ["x", "w_other"], ["other"])]  # no bias: stays apart
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 5, w])
               for n, w in (("q_relu", 4), ("k", 4), ("v", 6), ("other", 3))]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5, 8])],
                              outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _run(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})


def test_linears_reading_one_input_become_one_gemm_and_compute_the_same():
    model = _graph()
    x = np.random.default_rng(1).standard_normal((2, 5, 8)).astype(np.float32)
    before = _run(model, x)
    assert fuse_shared_input_linears(model) == 2
    onnx.checker.check_model(model, full_check=True)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("MatMul") == 2 and ops.count("Add") == 1 and ops.count("Split") == 1
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    assert not {"w_q", "w_k", "w_v", "b_q", "b_k", "b_v"} & set(inits)  # nothing left unused
    fused = next(n for n in model.graph.node if n.op_type == "MatMul" and inits[n.input[1]].shape == (8, 14))
    assert fused.input[0] == "x"
    for got, want in zip(_run(model, x), before):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert fuse_shared_input_linears(model) == 0  # nothing left to fuse


def test_exported_graphs_run_each_shared_input_through_one_gemm(fp32_dir):
    """The decoder step projects Q/K/V with one GEMM per layer, the encoder every decoder layer's
    cross K/V with one GEMM in all; export verification passed on them (fp32 bound 1e-4)."""
    from model.manifest import read_manifest

    out = fp32_dir
    manifest = read_manifest(out)
    assert manifest.verification["onnxruntime_vs_torch_fp32"]["max_abs_diff"][io_names.TOPK_LOG_PROBS] <= 1e-4
    cfg = manifest.model_config
    for name in (io_names.ENCODER_FILE, io_names.DECODER_FILE):
        proto = onnx.load(str(out / name))
        inits = {i.name for i in proto.graph.initializer}
        readers: dict[str, int] = {}
        for node in proto.graph.node:
            if node.op_type == "MatMul" and node.input[1] in inits:
                readers[node.input[0]] = readers.get(node.input[0], 0) + 1
        assert max(readers.values()) == 1, name
        splits = [n for n in proto.graph.node if n.op_type == "Split"]
        widths = sorted(len(n.output) for n in splits)
        if name == io_names.DECODER_FILE:
            assert widths == [3] * cfg.n_dec_layers  # Q, K, V of each self-attention
        else:
            assert widths == [3] * cfg.n_enc_layers + [2 * cfg.n_dec_layers]
