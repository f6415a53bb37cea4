"""TensorRT readiness without TensorRT: the graphs stay parser-clean, the optimization
profiles are consistent, and a missing TensorRT is one clear message."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from export import api, tensorrt_build, trt_compat
from export.errors import ExportError, TensorRTUnavailable
from model import io_names, preset
from model.manifest import read_manifest

HAVE_TRT = tensorrt_build.installed()  # find_spec would also find tensorrt-stubs alone
LIMITS = tensorrt_build.Limits(max_batch=4, max_src_len=32, max_tgt_len=40, max_beam=2)


@pytest.fixture(params=["fp32", "fp16", "int8"])
def model_dir(request, fp32_dir, fp16_dir, int8_dir) -> Path:
    """The random checkpoint exported in each precision (int8: qdq, the flavour TensorRT parses):
    conftest's fp32_dir, fp16_dir and int8_dir, built once per session and shared."""
    return {"fp32": fp32_dir, "fp16": fp16_dir, "int8": int8_dir}[request.param]


# -- the graphs ------------------------------------------------------------------------------

@pytest.mark.parametrize("graph", [io_names.ENCODER_FILE, io_names.DECODER_FILE])
def test_graphs_are_parser_clean(model_dir, graph):
    proto = onnx.load(str(model_dir / graph))
    assert trt_compat.check_model(proto) == []
    ops = trt_compat.supported_ops()
    nodes = [n for g in trt_compat.iter_graphs(proto.graph) for n in g.node]
    assert nodes and {n.op_type for n in nodes} <= ops
    assert not {"If", "Loop", "Scan"} & {n.op_type for n in nodes}
    assert {o.domain: o.version for o in proto.opset_import}[""] >= 17
    for value in proto.graph.input:
        assert value.type.tensor_type.HasField("shape") and value.type.tensor_type.shape.dim
    if read_manifest(model_dir).precision == "int8":  # weights as TensorRT takes them: int8, zero-point 0
        inits = {i.name: i for i in proto.graph.initializer}
        dqs = [n for n in nodes if n.op_type == "DequantizeLinear"]
        assert dqs and all(inits[n.input[0]].data_type == TensorProto.INT8 for n in dqs)
        assert all(not onnx.numpy_helper.to_array(inits[n.input[2]]).any() for n in dqs)
    if graph == io_names.DECODER_FILE:
        consts = {i.name for i in proto.graph.initializer}
        topk = [n for n in proto.graph.node if n.op_type == "TopK"]
        assert len(topk) == 1 and topk[0].input[1] in consts


def test_ops_file_names_its_source_and_known_ops():
    text = trt_compat.OPS_FILE.read_text()
    assert "onnx-tensorrt" in text and "operators.md" in text
    ops = trt_compat.supported_ops()
    assert {"MatMul", "LayerNormalization", "TopK", "Softmax", "LogSoftmax", "Gather"} <= ops
    assert "NonMaxSuppression" not in ops and "SequenceAt" not in ops


def _model(nodes, inputs, outputs, initializers=(), opset=18):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def test_checker_catches_what_the_parser_rejects():
    """Each rule must fire on a graph that breaks it (else the clean verdict means nothing)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])
    k_in = helper.make_tensor_value_info("k", TensorProto.INT64, [1])
    axes_in = helper.make_tensor_value_info("axes", TensorProto.INT64, [1])
    vals = helper.make_tensor_value_info("vals", TensorProto.FLOAT, None)
    idx = helper.make_tensor_value_info("idx", TensorProto.INT64, None)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    norank = helper.make_tensor_value_info("free", TensorProto.FLOAT, None)
    starts = helper.make_tensor("starts", TensorProto.INT64, [1], [0])
    ends = helper.make_tensor("ends", TensorProto.INT64, [1], [4])
    nodes = [
        helper.make_node("TopK", ["x", "k"], ["vals", "idx"], name="dyn_topk"),
        helper.make_node("Slice", ["x", "starts", "ends", "axes"], ["s"], name="dyn_slice"),
        helper.make_node("Unsqueeze", ["s", "axes"], ["u"], name="dyn_unsqueeze"),
        helper.make_node("NonZero", ["u"], ["nz"], name="nonzero"),
        helper.make_node("Hardmax", ["x"], ["y"], name="hardmax"),
    ]
    proto = _model(nodes, [x, k_in, axes_in, norank], [vals, idx, y], [starts, ends], opset=16)
    problems = "\n".join(trt_compat.check_model(proto))
    for fragment in ("opset 16 < 17", "graph input free has no static rank",
                     "TopK node dyn_topk: input 1 (k) must be a constant",
                     "Slice node dyn_slice: input 3 (axes) must be a constant",
                     "Unsqueeze node dyn_unsqueeze: input 1 (axes) must be a constant",
                     "NonZero node nonzero: not supported", "Hardmax node hardmax: not supported"):
        assert fragment in problems, fragment
    assert "Slice node dyn_slice: input 1" not in problems  # starts is an initializer


def test_checker_recurses_into_subgraphs_and_rejects_control_flow():
    cond = helper.make_tensor_value_info("c", TensorProto.BOOL, [])
    out = helper.make_tensor_value_info("o", TensorProto.FLOAT, [1])
    inner_out = helper.make_tensor_value_info("t", TensorProto.FLOAT, [1])
    then = helper.make_graph([helper.make_node("Hardmax", ["z"], ["t"], name="inner_hardmax")], "then", [],
                             [inner_out], initializer=[helper.make_tensor("z", TensorProto.FLOAT, [1], [1.0])])
    orelse = helper.make_graph([helper.make_node("Identity", ["z2"], ["t"])], "else", [], [inner_out],
                               initializer=[helper.make_tensor("z2", TensorProto.FLOAT, [1], [0.0])])
    node = helper.make_node("If", ["c"], ["o"], name="branch", then_branch=then, else_branch=orelse)
    problems = "\n".join(trt_compat.check_model(_model([node], [cond], [out])))
    assert "If node branch: control flow is not allowed" in problems
    assert "Hardmax node inner_hardmax: not supported" in problems


# -- optimization profiles ---------------------------------------------------------------------

def _graph_inputs(path: Path) -> dict[str, list[str | int]]:
    proto = onnx.load(str(path))
    return {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in proto.graph.input}


def test_profiles_cover_every_dynamic_input_consistently(model_dir):
    cfg = read_manifest(model_dir).model_config
    for profile, path in ((tensorrt_build.encoder_profile(cfg, LIMITS), model_dir / io_names.ENCODER_FILE),
                          (tensorrt_build.decoder_profile(cfg, LIMITS), model_dir / io_names.DECODER_FILE)):
        inputs = _graph_inputs(path)
        dynamic = {name for name, dims in inputs.items() if any(isinstance(d, str) for d in dims)}
        assert set(profile) == dynamic
        ranges: dict[str, set[tuple[int, int, int]]] = {}
        for name, (lo, opt, hi) in profile.items():
            dims = inputs[name]
            assert len(lo) == len(opt) == len(hi) == len(dims)
            for axis, dim in enumerate(dims):
                triple = (lo[axis], opt[axis], hi[axis])
                if isinstance(dim, int):
                    assert triple == (dim, dim, dim), (name, axis)
                else:
                    assert triple[0] == 1 and triple[0] <= triple[1] <= triple[2], (name, axis)
                    ranges.setdefault(dim, set()).add(triple)
        # One range per axis name: related inputs can never disagree.
        assert all(len(r) == 1 for r in ranges.values()), ranges
        maxima = {axis: next(iter(r))[2] for axis, r in ranges.items()}
        expected = {io_names.BATCH: 4, io_names.SRC_LEN: 32, io_names.HYPS: 8, io_names.PAST: 40,
                    io_names.CACHE_ROWS: 80}
        assert maxima == {k: v for k, v in expected.items() if k in maxima}


def test_opt_sizes_stay_inside_small_limits():
    cfg = preset("tiny", vocab_size=64)
    tiny = tensorrt_build.Limits(max_batch=1, max_src_len=3, max_tgt_len=2, max_beam=1)
    for lo, opt, hi in tensorrt_build.decoder_profile(cfg, tiny).values():
        assert all(a <= b <= c for a, b, c in zip(lo, opt, hi))


def test_timing_cache_is_per_version_in_user_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = tensorrt_build.timing_cache_path("10.9.0")
    assert path == tmp_path / "pipeline" / "tensorrt-10.9.0.timing-cache"


# -- TensorRT missing ----------------------------------------------------------------------------

@pytest.mark.skipif(HAVE_TRT, reason="TensorRT is installed here")
def test_missing_tensorrt_is_one_clear_message(random_checkpoint, tmp_path):
    with pytest.raises(TensorRTUnavailable, match="tensorrt is not installed"):
        tensorrt_build.load_tensorrt()
    line = tensorrt_build.skip_message("tensorrt is not installed (x)")
    assert line.startswith("TensorRT engines skipped: tensorrt is not installed") and "\n" not in line
    out = tmp_path / "m"
    with pytest.raises(ExportError, match="--tensorrt was asked for but tensorrt is not installed"):
        api.export_model(random_checkpoint, out, tensorrt=True, max_batch=2, max_src_len=8,
                         max_tgt_len=8, max_beam=1, topk=2)
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
