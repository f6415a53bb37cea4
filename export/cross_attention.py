"""The int8 decoder's cross-attention as ONNX Runtime's MultiHeadAttention (ONNX Runtime-only flavours).

Each decoder layer's cross-attention is exported as ten nodes between its query projection and the tensor its
out-projection quantizes: the query split into heads (Reshape, Transpose), scaled (Mul), scored against the
sentence's keys (Transpose of cross_k.i, MatMul), masked (Add of the source bias), Softmax, weighted over the
values (MatMul), and the heads merged (Transpose, Reshape). A sentence's hypotheses share its keys and values, so
the beam is the query length (model/transformer.py's cross_and_ffn). com.microsoft.MultiHeadAttention takes the
same arithmetic in one kernel per layer: query (sentences, beam, d_model), key and value already projected in
cross_k.i's layout (sentences, heads, src_len, d_head), the source bias expanded once per step to (sentences, 1,
beam, src_len). Measured on a CPU: batch 1 and long sources 0.97-0.98x the time, batch 32 about 1.01x
(benchmarks/README.md, "cross-attention-kernel").

`rewrite` replaces those nodes in the finished int8 decoder; the graph's inputs and outputs do not change, so
neither does the backend. Export verifies the rewritten graph against PyTorch as it verifies any (export/verify.py).
The graph's metadata says so (io_names.CROSS_ATTENTION).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from export.self_attention import describe_graph, prune_and_sort, rewrite_graph_file
from model import io_names
from model.config import ModelConfig

PREFIX = "mha/"
HEADS = (0, 2, 1, 3)  # (sentences, beam, heads, d_head) <-> (sentences, heads, beam, d_head)
KEYS_T = (0, 1, 3, 2)  # cross_k.i transposed for the scores' MatMul


def rewrite(proto: onnx.ModelProto, cfg: ModelConfig) -> bool:
    """Rewrite `proto` (the decoder) in place; False where it is rewritten already. A ValueError names the first
    layer whose cross-attention is not the exported pattern (the graph is then left as it was)."""
    g = proto.graph
    props = {m.key: m.value for m in proto.metadata_props}
    if props.get(io_names.CROSS_ATTENTION) == io_names.MULTI_HEAD:
        return False
    produced = {o: n for n in g.node for o in n.output}
    readers: dict[str, list[Any]] = {}
    for n in g.node:
        for x in n.input:
            readers.setdefault(x, []).append(n)
    constants = {x.name: numpy_helper.to_array(x) for x in g.initializer}
    constants.update({n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in g.node
                      if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"})
    layers = [_layer(i, produced, readers, constants, cfg) for i in range(cfg.n_dec_layers)]
    one = numpy_helper.from_array(np.array([1], np.int64), PREFIX + "one")
    nodes = [
        helper.make_node("Shape", [io_names.TOKENS], [PREFIX + "hyps"], name=PREFIX + "hyps"),
        helper.make_node("Shape", [io_names.SRC_BIAS], [PREFIX + "sentences"], start=0, end=1,
                         name=PREFIX + "sentences"),
        helper.make_node("Div", [PREFIX + "hyps", PREFIX + "sentences"], [PREFIX + "beam"], name=PREFIX + "beam"),
        helper.make_node("Concat", [one.name, one.name, PREFIX + "beam", one.name], [PREFIX + "bias_shape"], axis=0,
                         name=PREFIX + "bias_shape"),
    ]
    expanded: dict[str, str] = {}
    for i, (query, bias, scale, out) in enumerate(layers):
        if bias not in expanded:  # one (sentences, 1, beam, src_len) bias per distinct source bias
            expanded[bias] = f"{PREFIX}bias{len(expanded)}"
            nodes.append(helper.make_node("Expand", [bias, PREFIX + "bias_shape"], [expanded[bias]],
                                          name=expanded[bias]))
        nodes.append(helper.make_node(
            "MultiHeadAttention", [query, io_names.cross_k(i), io_names.cross_v(i), "", "", expanded[bias]], [out],
            domain="com.microsoft", name=f"{PREFIX}attention{i}", num_heads=cfg.n_heads, scale=scale))
    replaced = {out for _, _, _, out in layers}
    kept = [n for n in g.node if not set(n.output) & replaced]
    g.initializer.append(one)
    prune_and_sort(g, kept + nodes)
    helper.set_model_props(proto, {**props, io_names.CROSS_ATTENTION: io_names.MULTI_HEAD})
    if not any(o.domain == "com.microsoft" for o in proto.opset_import):
        proto.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return True


def _layer(i: int, produced: dict[str, Any], readers: dict[str, list[Any]], constants: dict[str, np.ndarray],
           cfg: ModelConfig) -> tuple[str, str, float, str]:
    """Layer i's (query, source bias, scale, attention output), found by following the exported pattern from
    cross_v.i: the probabilities x values MatMul, heads merged after it; the Softmax of scores + bias before it,
    the scores a MatMul of the scaled query heads and cross_k.i transposed."""
    def fail(what: str) -> ValueError:
        return ValueError(f"decoder layer {i}: its cross-attention is not the exported pattern: {what}")

    def only(x: str, op: str) -> Any:
        nodes = readers.get(x, [])
        if len(nodes) != 1 or nodes[0].op_type != op:
            raise fail(f"{x} read by {[n.op_type for n in nodes]}, not one {op}")
        return nodes[0]

    def made(x: str, op: str, perm: tuple[int, ...] | None = None) -> Any:
        node = produced.get(x)
        if node is None or node.op_type != op:
            raise fail(f"{x} not made by {op}")
        if perm is not None and tuple(helper.get_attribute_value(node.attribute[0])) != perm:
            raise fail(f"{node.name} transposes by another order than {perm}")
        return node

    weighted = only(io_names.cross_v(i), "MatMul")
    if list(weighted.input[1:]) != [io_names.cross_v(i)]:
        raise fail(f"{weighted.name} does not weight cross_v.{i}")
    merged = only(weighted.output[0], "Transpose")
    out = only(merged.output[0], "Reshape").output[0]
    add = made(made(weighted.input[0], "Softmax").input[0], "Add")
    scores_at = [j for j, x in enumerate(add.input) if x in produced and produced[x].op_type == "MatMul"]
    if len(scores_at) != 1:
        raise fail(f"{add.name} does not add a bias to one MatMul's scores")
    scores, bias = produced[add.input[scores_at[0]]], add.input[1 - scores_at[0]]
    keys = made(scores.input[1], "Transpose", KEYS_T)
    if keys.input[0] != io_names.cross_k(i):
        raise fail(f"{scores.name} scores against {keys.input[0]}, not cross_k.{i}")
    scale, heads = 1.0, scores.input[0]
    if heads in produced and produced[heads].op_type == "Mul":
        mul = produced[heads]
        factor = [x for x in mul.input if x in constants and constants[x].size == 1]
        if len(factor) != 1:
            raise fail(f"{mul.name} does not scale by one constant")
        scale = float(constants[factor[0]].reshape(()))
        heads = next(x for x in mul.input if x != factor[0])
    query = made(made(heads, "Transpose", HEADS).input[0], "Reshape").input[0]
    if not np.isclose(scale, cfg.d_head ** -0.5, rtol=1e-6):
        raise fail(f"the scores are scaled by {scale}, not 1 / sqrt(d_head)")
    return query, bias, scale, out


def rewrite_file(path: Path, cfg: ModelConfig) -> bool:
    """The decoder graph at `path` (weights inline, before they are externalised) rewritten in place. A decoder
    whose pattern is not found keeps its exported cross-attention, with a warning."""
    return rewrite_graph_file(path, cfg, rewrite, "cross-attention as MultiHeadAttention", "exported cross-attention")


def describe(path: Path) -> dict[str, str]:
    """The manifest's record of a decoder's cross-attention: one kernel per layer, or the exported nodes."""
    return describe_graph(path, io_names.CROSS_ATTENTION, io_names.MULTI_HEAD, "com.microsoft.MultiHeadAttention",
                          {"kind": "exported", "op": "MatMul + Softmax + MatMul over cross_k/cross_v"})
