"""Linear layers that read the same input, fused into one GEMM in the exported graphs.

A self-attention layer projects one input three times (Q, K and V), and the encoder projects
its output once per decoder layer into cross-attention K and V. In the exported graph each of
these is `MatMul(x, W_i) -> Add(b_i)`. fuse_shared_input_linears puts the weights side by side,
`MatMul(x, [W_1 .. W_n]) -> Add([b_1 .. b_n]) -> Split`, so the engine runs one wider GEMM (and,
in the int8 flavours, one quantized GEMM) instead of n narrow ones, as CTranslate2 does.

Every output column is the same dot product as before, so the values are the same up to the GEMM
kernel's blocking; the PyTorch model is untouched (the fusion exists in the graphs only, where
export verification checks it like everything else).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx
from onnx import helper, numpy_helper


def _linears(model: onnx.ModelProto) -> dict[str, list[tuple[onnx.NodeProto, onnx.NodeProto]]]:
    """(MatMul, bias Add) pairs grouped by the MatMul's input: a constant 2-D weight, an output
    read only by an Add of a constant 1-D bias of the weight's width, and the same dtype."""
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    readers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for node in graph.node:
        for name in node.input:
            readers[name].append(node)
    outputs = {o.name for o in graph.output}
    groups: dict[str, list[tuple[onnx.NodeProto, onnx.NodeProto]]] = defaultdict(list)
    for node in graph.node:
        if node.op_type != "MatMul" or node.input[1] not in inits or len(inits[node.input[1]].dims) != 2:
            continue
        weight = inits[node.input[1]]
        after = readers[node.output[0]]
        if len(after) != 1 or after[0].op_type != "Add" or node.output[0] in outputs:
            continue
        add = after[0]
        bias = [b for b in add.input if b != node.output[0]]
        if (len(bias) != 1 or bias[0] not in inits or list(inits[bias[0]].dims) != [weight.dims[1]]
                or inits[bias[0]].data_type != weight.data_type):
            continue
        groups[node.input[0]].append((node, add))
    return {x: pairs for x, pairs in groups.items() if len(pairs) > 1}


def fuse_shared_input_linears(model: onnx.ModelProto) -> int:
    """Fuse every group of linear layers that read one input (in place); returns how many
    MatMuls were folded away."""
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    groups = _linears(model)
    replaced: dict[int, list[onnx.NodeProto]] = {}  # id(first MatMul of a group) -> its new nodes
    dropped: set[int] = set()
    new_inits: list[onnx.TensorProto] = []
    folded = 0
    for n_group, (x, pairs) in enumerate(groups.items()):
        weights = [numpy_helper.to_array(inits[mm.input[1]]) for mm, _ in pairs]  # one K and dtype: one x
        biases = [numpy_helper.to_array(inits[next(b for b in add.input if b != mm.output[0])])
                  for mm, add in pairs]
        base = f"fused_linear_{n_group}"
        names = (f"{base}_weight", f"{base}_bias", f"{base}_split", f"{base}_matmul", f"{base}_add")
        new_inits += [numpy_helper.from_array(np.concatenate(weights, axis=1), names[0]),
                      numpy_helper.from_array(np.concatenate(biases), names[1]),
                      numpy_helper.from_array(np.array([w.shape[1] for w in weights], np.int64), names[2])]
        replaced[id(pairs[0][0])] = [
            helper.make_node("MatMul", [x, names[0]], [names[3]], name=names[3]),
            helper.make_node("Add", [names[3], names[1]], [names[4]], name=names[4]),
            helper.make_node("Split", [names[4], names[2]], [add.output[0] for _, add in pairs], axis=-1,
                             name=f"{base}_split_node"),
        ]
        dropped |= {id(node) for pair in pairs for node in pair}
        folded += len(pairs) - 1
    if not folded:
        return 0
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        nodes += replaced.get(id(node), [] if id(node) in dropped else [node])
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(new_inits)
    used = {name for node in graph.node for name in node.input}
    kept = [i for i in graph.initializer if i.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    return folded
