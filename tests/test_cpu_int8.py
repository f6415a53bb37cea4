"""How each CPU runs the rowwise int8 GEMMs exactly: the CPU's flags, the pair-bounded weights that
ONNX Runtime's u8 x s8 kernel multiplies exactly with or without int8 dot products, and the older
full-range and unsigned weight forms, flipped at load where the CPU needs (runtime/cpu_int8.py)."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from export import quantize
from model import io_names
from model.manifest import read_manifest
from runtime import cpu_int8 as cpu
from runtime.model_dir import LoadOptions, load

GRAPHS = [io_names.ENCODER_FILE, io_names.DECODER_FILE]


@pytest.fixture()
def dirs(int8_dir, rowwise_dir) -> dict[str, Path]:
    """The random checkpoint exported int8 qdq and rowwise (conftest: once per session, read-only)."""
    return {"int8": int8_dir, "rowwise": rowwise_dir}


def _inits(proto):
    return {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}


def test_int8_compute_only_where_the_cpu_has_dot_product_instructions():
    """Accuracy level 4 (int8 activations) needs VNNI / AMX / Arm dot product; an AVX2-only CPU
    gets level 1 (fp32 GEMM on dequantized weights). Flags as /proc/cpuinfo writes them."""
    x86_avx2 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx fma avx2\n"
    x86_vnni = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_vnni\nprocessor\t: 1\nflags\t\t: fpu\n"
    arm = "processor\t: 0\nFeatures\t: fp asimd asimddp sha2\n"
    assert cpu.cpu_flags(x86_avx2) == {"fpu", "sse2", "avx", "fma", "avx2"}
    assert not cpu.cpu_flags(x86_avx2) & cpu.DOT_PRODUCT_FLAGS
    assert "avx512_vnni" in cpu.cpu_flags(x86_vnni) and "asimddp" in cpu.cpu_flags(arm)
    assert cpu.cpu_flags("") == set()
    assert cpu.int8_session_config(dot_product=True) == {cpu.ACCURACY_LEVEL: "4"}
    assert cpu.int8_session_config(dot_product=False) == {cpu.ACCURACY_LEVEL: "1"}
    assert cpu.int8_session_config() == cpu.int8_session_config(cpu.has_int8_dot_product())


def _integer_matmul(q: np.ndarray, w_scale: np.ndarray) -> onnx.ModelProto:
    """One rowwise-style MatMulIntegerToFloat: uint8 rows (zero-point 128) times int8 weights."""
    from onnx import TensorProto, helper

    k = q.shape[0]
    graph = helper.make_graph(
        [helper.make_node("MatMulIntegerToFloat", ["a", "w", "one", "w_scale", "zp"], ["y"], domain="com.microsoft")],
        "g", [helper.make_tensor_value_info("a", TensorProto.UINT8, ["m", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", q.shape[1]])],
        [numpy_helper.from_array(q, "w"), numpy_helper.from_array(np.array(1.0, np.float32), "one"),
         numpy_helper.from_array(w_scale, "w_scale"), numpy_helper.from_array(np.array(128, np.uint8), "zp")])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets)


@pytest.mark.parametrize("dot_product", [False, None], ids=["as-without-dot-products", "as-this-cpu"])
def test_integer_matmuls_run_exactly(tmp_path, dot_product):
    """Worst case for VPMADDUBSW (x86 without VNNI): activations at 255 and weights at +-127 make
    pairs of products far past int16. Loaded as a CPU without int8 dot products loads it (u8 x u8),
    and as this CPU loads it (whatever it is), the graph computes the exact integer product."""
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    q = rng.integers(-127, 128, size=(512, 8)).astype(np.int8)
    q[:, 0], q[:, 1] = 127, -127
    scale = rng.uniform(0.001, 0.01, size=8).astype(np.float32)
    path = tmp_path / "mm.onnx"
    onnx.save(_integer_matmul(q, scale), str(path))
    with cpu.session_graph(path, dot_product=True) as graph:
        assert graph == str(path)  # int8 dot products: the file as it is
    opts = ort.SessionOptions()
    for key, value in cpu.int8_session_config(dot_product=dot_product).items():
        opts.add_session_config_entry(key, value)
    with cpu.session_graph(path, dot_product=dot_product) as graph:
        # flipped: a temporary copy, its weights beside it as an export's are, gone after the `with`
        flipped = graph != str(path)
        assert flipped == cpu.wants_unsigned_weights(dot_product)
        assert Path(graph).with_name(io_names.weights_file(Path(graph).name)).is_file() or not flipped
        session = ort.InferenceSession(graph, opts, providers=["CPUExecutionProvider"])
    assert Path(graph).exists() == (graph == str(path))
    a = rng.integers(1, 256, size=(4, 512)).astype(np.uint8)
    a[0] = 255
    got = session.run(None, {"a": a})[0]
    exact = ((a.astype(np.int64) - 128) @ q.astype(np.int64)) * scale.astype(np.float64)
    np.testing.assert_allclose(got, exact, rtol=5e-5, atol=1e-3)  # fp32 rounding; saturation is off by ~1e6


def _integer_error(q: np.ndarray, a: np.ndarray) -> int:
    """The largest integer error of the u8 x s8 product of `a` and `q` as this CPU computes it,
    the weights loaded as stored."""
    import onnxruntime as ort

    session = ort.InferenceSession(_integer_matmul(q, np.ones(q.shape[1], np.float32)).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    exact = (a.astype(np.int64) - 128) @ q.astype(np.int64)
    return int(np.abs(session.run(None, {"a": a})[0].astype(np.int64) - exact).max())


@pytest.mark.parametrize("k", [7, 64, 513])
def test_pair_bounded_weights_multiply_exactly_as_stored(k):
    """The export's weights (quantize_columns with pair_bounded), loaded as stored on this CPU, give
    the exact integer product with activations at 255, the worst case for VPMADDUBSW. One column's
    pairs are 128 where the kernel pairs them (rows 2j, 2j+1) and 254 one row over, so the test
    also fails if the kernel paired rows otherwise. Without int8 dot products, full-range weights
    are wrong on the same activations (the reason for the bound)."""
    rng = np.random.default_rng(k)
    w = rng.standard_t(3, size=(k, 12)).astype(np.float32)  # heavy tails: large weights side by side
    w[:2, 1] = [7.0, -7.0]
    q, _ = quantize.quantize_columns(w, pair_bounded=True)
    q[:, 0] = np.resize([1, 127, 127, 1], k)  # aligned pairs 128, shifted ones 254
    assert quantize.pair_sums(q).max() <= quantize.PAIR_MAX
    for m in (1, 4, 33):
        a = rng.integers(1, 256, size=(m, k)).astype(np.uint8)
        a[0] = 255
        assert _integer_error(q, a) == 0
    if not cpu.has_int8_dot_product():
        full = np.full((k, 12), 127, np.int8)
        assert _integer_error(full, np.full((4, k), 255, np.uint8)) > 10_000


def test_exports_store_pair_bounded_weights(dirs):
    """Rowwise: every integer matmul's weight is pair-bounded and uses the range (some pair reaches
    127 or 128); the manifest says so. qdq (TensorRT's form) keeps full-range weights."""
    for graph in GRAPHS:
        proto = onnx.load(str(dirs["rowwise"] / graph))
        inits = _inits(proto)
        weights = [inits[n.input[1]] for n in proto.graph.node if n.op_type == cpu.INTEGER_MATMUL]
        assert weights and all(w.dtype == np.int8 for w in weights)
        for w in weights:
            sums = quantize.pair_sums(w).max(axis=0)
            assert sums.max() <= quantize.PAIR_MAX and sums[sums > 0].min() >= quantize.QMAX  # 0: padding
    assert read_manifest(dirs["rowwise"]).pair_bounded_weights
    assert not read_manifest(dirs["int8"]).pair_bounded_weights


def test_integer_weights_are_flipped_once_and_in_place_unless_something_else_reads_them():
    """Two integer matmuls sharing a weight get one uint8 copy in place of the int8 one; a
    weight that another node also reads keeps its int8 original for that node. Flipping back
    gives the int8 weights and the 5-input nodes again, and drops the unsigned zero-point."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(1)
    shared, other = (rng.integers(-127, 128, size=(16, 4)).astype(np.int8) for _ in range(2))
    inits = [numpy_helper.from_array(shared, "shared"), numpy_helper.from_array(other, "other"),
             numpy_helper.from_array(np.array(1.0, np.float32), "one"),
             numpy_helper.from_array(np.full(4, 0.5, np.float32), "w_scale"),
             numpy_helper.from_array(np.array(128, np.uint8), "zp")]
    nodes = [helper.make_node("MatMulIntegerToFloat", ["a", w, "one", "w_scale", "zp"], [y], name=y,
                              domain="com.microsoft") for w, y in (("shared", "y1"), ("shared", "y2"), ("other", "y3"))]
    nodes.append(helper.make_node("Cast", ["other"], ["other_float"], to=TensorProto.FLOAT))
    outputs = [helper.make_tensor_value_info(y, TensorProto.FLOAT, [2, 4]) for y in ("y1", "y2", "y3")]
    model = helper.make_model(helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("a", TensorProto.UINT8, [2, 16])],
        outputs + [helper.make_tensor_value_info("other_float", TensorProto.FLOAT, [16, 4])], inits))
    assert cpu.integer_weights_as(model, unsigned=False) == 0  # already int8
    assert cpu.integer_weights_as(model, unsigned=True) == 3
    after = _inits(model)
    assert [n.input[1] for n in model.graph.node[:3]] == ["shared", "shared", "other_u8"]
    assert all(list(n.input[5:]) == [cpu.UNSIGNED_WEIGHT_ZERO_POINT] for n in model.graph.node[:3])
    np.testing.assert_array_equal(after["shared"].astype(np.int16) - 128, shared)
    np.testing.assert_array_equal(after["other_u8"].astype(np.int16) - 128, other)
    assert after["other"].dtype == np.int8 and model.graph.node[3].input[0] == "other"
    assert after[cpu.UNSIGNED_WEIGHT_ZERO_POINT] == 128
    assert cpu.integer_weights_as(model, unsigned=True) == 0  # nothing int8 left to shift
    assert cpu.integer_weights_as(model, unsigned=False) == 3
    back = _inits(model)
    assert [list(n.input) for n in model.graph.node[:3]] == [
        ["a", w, "one", "w_scale", "zp"] for w in ("shared", "shared", "other_u8")]
    np.testing.assert_array_equal(back["shared"], shared)
    np.testing.assert_array_equal(back["other_u8"], other)  # read by the integer matmul alone: in place
    assert back["shared"].dtype == back["other_u8"].dtype == np.int8
    assert cpu.UNSIGNED_WEIGHT_ZERO_POINT not in back and back["zp"] == 128  # the activations' stays


def test_onnxruntime_keeps_the_rowwise_integer_kernel(dirs, tmp_path):
    """The rowwise weights are stored int8, so a CPU with int8 dot products loads the graph files
    as they are; ONNX Runtime keeps every integer matmul (no fp32 GEMM, no MatMulNBits)."""
    import onnxruntime as ort

    assert not read_manifest(dirs["rowwise"]).unsigned_weights
    decoder = dirs["rowwise"] / io_names.DECODER_FILE
    with cpu.session_graph(decoder, dot_product=True) as graph:
        assert graph == str(decoder)  # nothing to flip
    integer = [n for n in onnx.load(str(decoder)).graph.node if n.op_type == cpu.INTEGER_MATMUL]
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(decoder), opts, providers=["CPUExecutionProvider"])
    optimized = [n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx"), load_external_data=False).graph.node]
    assert optimized.count(cpu.INTEGER_MATMUL) == len(integer) > 0 and "MatMulNBits" not in optimized


def _legacy(model_dir, tmp_path, name, unsigned):
    """A copy of the rowwise dir as older exports wrote it: full-range int8 weights (before
    2026-11-26; the manifest without pair_bounded_weights), or uint8 w + 128 (2026-11-25)."""
    import dataclasses
    import shutil

    from model.manifest import write_manifest

    out = tmp_path / name
    shutil.copytree(model_dir, out)
    if unsigned:
        for graph in GRAPHS:
            model = onnx.load(str(out / graph))
            assert cpu.integer_weights_as(model, unsigned=True) > 0
            onnx.save(model, str(out / graph))
    write_manifest(out, dataclasses.replace(read_manifest(out, verify=False), unsigned_weights=unsigned,
                                            pair_bounded_weights=False))
    return out


@pytest.mark.parametrize("dot_product", [True, False], ids=["dot-products", "no-dot-products"])
def test_rowwise_dirs_load_in_the_form_the_cpu_multiplies_fastest(dirs, tmp_path, monkeypatch, caplog, dot_product):
    """Three rowwise dirs translate alike on either kind of CPU: pair-bounded int8 weights (exports
    now) load as stored on both; full-range int8 weights (before 2026-11-26) are flipped to uint8
    (the exact u8 x u8 kernel) only on a CPU without int8 dot products; uint8 weights (2026-11-25)
    are flipped to int8 (the fast u8 x s8 kernel) only on a CPU with them. A full-range dir loaded
    the slow way says how to get the fast one."""
    import logging

    from runtime.decoding import PAPER
    from runtime.search import search

    assert read_manifest(dirs["rowwise"]).pair_bounded_weights
    full_range = _legacy(dirs["rowwise"], tmp_path, "full-range", unsigned=False)
    unsigned = _legacy(dirs["rowwise"], tmp_path, "unsigned", unsigned=True)
    flipped = []
    real = cpu.session_graph
    monkeypatch.setattr("runtime.ort_backend.wants_unsigned_weights",
                        functools.partial(cpu.wants_unsigned_weights, dot_product))
    monkeypatch.setattr("runtime.ort_backend.session_graph",
                        lambda path, **kw: flipped.append(path) or real(path, dot_product=dot_product, **kw))
    cfg = read_manifest(unsigned).model_config
    sources = torch.tensor([[5, 9, 17, 33, cfg.eos_id], [40, 41, 42, cfg.eos_id, cfg.pad_id]])
    options = PAPER.replace(beam_size=2, max_len_a=0.0, max_len_b=10)
    got = {}
    for model_dir in (dirs["rowwise"], full_range, unsigned):
        with caplog.at_level(logging.INFO, logger="runtime.ort_backend"):
            caplog.clear()
            backend = load(model_dir, LoadOptions(backend="onnxruntime", threads=1)).backend
        assert ("export the model again" in caplog.text) == (model_dir == full_range and not dot_product)
        got[model_dir] = [[(h.tokens, round(h.score, 4)) for h in hyps] for hyps in search(backend, sources, options)]
    assert [p.parent for p in flipped] == [unsigned if dot_product else full_range] * 2
    assert [p.name for p in flipped] == GRAPHS
    assert got[dirs["rowwise"]] == got[full_range] == got[unsigned]
