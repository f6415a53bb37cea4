"""The decoder step's top-K over the whole vocabulary, in two stages, for the ONNX Runtime-only int8 graphs.

ONNX Runtime's CPU TopK over the whole vocabulary was a sixth of a 128-row decoder step
(benchmarks/README.md, "batch-sentences"). The K best of a row lie in the K blocks
of BLOCK ids whose maxima are the K largest (any other block's maximum is at most the K-th of those, so each
of its ids has K ids at least as large), so

    TopK(log_probs, K)  ->  Pad to a multiple of BLOCK with -inf -> Reshape (hyps, blocks, BLOCK)
                            -> ReduceMax over BLOCK -> TopK(K) of the blocks -> their BLOCK ids each
                            -> GatherElements of those K x BLOCK log-probs -> TopK(K) of them -> the ids back

gives the same values in the same order and the same ids (ties between equal log-probs aside) from one
pass of ReduceMax over the vocabulary and two small TopKs, a third less time for that tail. Only
the graphs TensorRT never parses get it (rowwise and ort-dynamic int8, the CPU's default): their
other ops are the same, their verification against PyTorch the same.

K follows the beam there: search reads 2 x beam candidates a row (runtime/search.py), so the graph takes
min(--topk, 2 x hyps / sentences) of them, the beam read off its inputs' shapes (tokens: hyps, src_bias:
sentences), instead of --topk always. At beam 4 of the default 16 that is 8: the tail's two TopKs and the
GatherElements then cost about a quarter less (benchmarks/README.md, "topk-follows-beam"). The graph says so in
its metadata (io_names.TOPK_FOLLOWS_BEAM), which the onnxruntime backend reads to bind outputs of that width.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from export.errors import ExportError
from model import io_names

BLOCK = 16
PREFIX = "topk_split/"


def _opset(proto: onnx.ModelProto) -> int:
    return next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)


def split_topk(proto: onnx.ModelProto, vocab_size: int, k: int, block: int = BLOCK) -> bool:
    """Rewrite, in place, the TopK node whose values are io_names.TOPK_LOG_PROBS into the two-stage top-K
    (module docstring); False (graph unchanged) when the vocabulary holds fewer than k blocks or there is
    no such node."""
    graph = proto.graph
    blocks = -(-vocab_size // block)
    if blocks < k:
        return False
    at = next((i for i, n in enumerate(graph.node) if n.op_type == "TopK" and n.output[0] == io_names.TOPK_LOG_PROBS
               and len(n.output) == 2), None)
    if at is None:
        return False
    old = graph.node[at]
    log_probs, k_input = old.input[0], old.input[1]
    axis = next((a.i for a in old.attribute if a.name == "axis"), -1)
    if axis not in (-1, 1):
        return False
    p = PREFIX

    def const(name: str, value: np.ndarray) -> str:
        graph.initializer.append(numpy_helper.from_array(value, p + name))
        return p + name

    nodes = []
    padded = log_probs
    if blocks * block != vocab_size:
        pads = const("pads", np.array([0, 0, 0, blocks * block - vocab_size], dtype=np.int64))
        minus_inf = const("minus_inf", np.array(-np.inf, dtype=np.float32))
        nodes.append(helper.make_node("Pad", [log_probs, pads, minus_inf], [p + "padded"], name=p + "pad"))
        padded = p + "padded"
    follows = {io_names.TOKENS, io_names.SRC_BIAS} <= {i.name for i in graph.input}  # a decoder step's inputs
    if follows:
        nodes += _beam_k(const, k_input, p + "k")
        k_input = p + "k"
    shape = const("block_shape", np.array([0, blocks, block], dtype=np.int64))
    nodes.append(helper.make_node("Reshape", [padded, shape], [p + "blocks"], name=p + "blocks"))
    if _opset(proto) >= 18:
        nodes.append(helper.make_node("ReduceMax", [p + "blocks", const("axis2", np.array([2], dtype=np.int64))],
                                      [p + "block_max"], name=p + "block_max", keepdims=0))
    else:
        nodes.append(helper.make_node("ReduceMax", [p + "blocks"], [p + "block_max"], name=p + "block_max",
                                      axes=[2], keepdims=0))
    nodes += [
        helper.make_node("TopK", [p + "block_max", k_input], [p + "best_max", p + "best_blocks"], name=p + "best",
                         axis=-1, largest=1, sorted=1),
        helper.make_node("Unsqueeze", [p + "best_blocks", const("axes2", np.array([2], dtype=np.int64))],
                         [p + "best_blocks_3d"], name=p + "best_blocks_3d"),
        # ids of the chosen blocks' members: block * BLOCK + offset, (hyps, K, BLOCK), flattened to (hyps, K x BLOCK)
        helper.make_node("Mul", [p + "best_blocks_3d", const("block", np.array(block, dtype=np.int64))],
                         [p + "first_ids"], name=p + "first_ids"),
        helper.make_node("Add", [p + "first_ids", const("offsets", np.arange(block, dtype=np.int64))],
                         [p + "member_ids_3d"], name=p + "member_ids_3d"),
        helper.make_node("Reshape", [p + "member_ids_3d", const("flat_shape", np.array([0, -1], dtype=np.int64))],
                         [p + "member_ids"], name=p + "member_ids"),
        helper.make_node("GatherElements", [padded, p + "member_ids"], [p + "members"], name=p + "members", axis=1),
        helper.make_node("TopK", [p + "members", k_input], [io_names.TOPK_LOG_PROBS, p + "positions"],
                         name=p + "top", axis=-1, largest=1, sorted=1),
        helper.make_node("GatherElements", [p + "member_ids", p + "positions"], [old.output[1]], name=p + "ids",
                         axis=1),
    ]
    del graph.node[at]
    for i, node in enumerate(nodes):
        graph.node.insert(at + i, node)
    if follows:  # the outputs' width is no longer --topk: a symbolic axis
        for out in graph.output:
            if out.name in (io_names.TOPK_LOG_PROBS, io_names.TOPK_IDS) and len(out.type.tensor_type.shape.dim) == 2:
                out.type.tensor_type.shape.dim[1].dim_param = "candidates"
        props = {m.key: m.value for m in proto.metadata_props}
        helper.set_model_props(proto, {**props, io_names.TOPK_FOLLOWS_BEAM: "1"})
    return True


def _beam_k(const: Callable[[str, np.ndarray], str], most: str, out: str) -> list[onnx.NodeProto]:
    """Nodes computing `out` = min(`most`, 2 x hyps / sentences) as a (1,) int64: the candidates search reads."""
    p = PREFIX
    return [
        helper.make_node("Shape", [io_names.TOKENS], [p + "hyps"], name=p + "hyps"),
        helper.make_node("Shape", [io_names.SRC_BIAS], [p + "src_shape"], name=p + "src_shape"),
        helper.make_node("Slice", [p + "src_shape", const("zero", np.array([0], dtype=np.int64)),
                                   const("one", np.array([1], dtype=np.int64))], [p + "sentences"],
                         name=p + "sentences"),
        helper.make_node("Div", [p + "hyps", p + "sentences"], [p + "beam"], name=p + "beam"),
        helper.make_node("Mul", [p + "beam", const("two", np.array([2], dtype=np.int64))], [p + "two_beam"],
                         name=p + "two_beam"),
        helper.make_node("Min", [p + "two_beam", most], [out], name=out),
    ]


def topk_nodes(proto: onnx.ModelProto) -> int:
    """How many TopK nodes the graph has (2 once split, 1 before)."""
    return sum(n.op_type == "TopK" for n in proto.graph.node)


def as_wide(ref: dict[str, np.ndarray], out: dict[str, np.ndarray], beam: int, where: str) -> dict[str, np.ndarray]:
    """The reference's candidates cut to the graph's, where the graph's top-K follows the beam
    (export/topk_split.py): min(topk, 2 x beam) of them, which it must return exactly."""
    width, topk = out[io_names.TOPK_IDS].shape[1], ref[io_names.TOPK_IDS].shape[1]
    if width == topk:
        return ref
    if width != min(topk, 2 * beam):
        raise ExportError(f"verification failed: {io_names.TOPK_IDS} at {where} has {width} candidates a row, "
                          f"neither top-{topk} nor 2 x the beam of {beam}")
    return {**ref, io_names.TOPK_LOG_PROBS: ref[io_names.TOPK_LOG_PROBS][:, :width],
            io_names.TOPK_IDS: ref[io_names.TOPK_IDS][:, :width]}
