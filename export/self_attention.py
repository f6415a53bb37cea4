"""The int8 decoder's self-attention as ONNX Runtime's DecoderMaskedMultiHeadAttention (ONNX Runtime-only flavours).

In the exported decoder each layer's self-attention is about fifteen nodes: the gathers of every earlier key and
value by the ancestry index (model/cache.py), two one-row matmuls per head, the Softmax, the Slices and Concat
of the step's own key. On a CPU those are tiny GEMMs and copies, about 14% of an int8 step (the cpu-overheads
profile in benchmarks/README.md). ONNX Runtime's contrib op
com.microsoft.DecoderMaskedMultiHeadAttention does it in one kernel per layer, beam reordering included: it
reads each hypothesis' history through `cache_indirection` and, with past_present_share_buffer, writes the
step's key and value into a cache row per hypothesis in place (runtime/indirect_cache.py).

`rewrite` replaces, in the finished int8 decoder, each layer's self-attention between its fused q/k/v Split and
the tensor its out-projection quantizes with that node:

    DecoderMaskedMultiHeadAttention(q, k, v, past_key=self_k.i, past_value=self_v.i,
        past_sequence_length=Cast(step), beam_width=hyps / sentences, cache_indirection)

and the interface with it: inputs self_index and self_bias go, self_k.i / self_v.i become (hyps, heads, capacity,
d_head), cache_indirection (sentences, beam, capacity) int32 comes; outputs step_k.i / step_v.i go,
present_k.i / present_v.i come. Nodes that read the sentence count off self_k / self_v read it off cross_k.0.
The graph's metadata says so (io_names.SELF_ATTENTION). Export verifies the rewritten graph against PyTorch as
it verifies any (export/verify.py, through `indirect_runner`): what is served is what was verified.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from model import io_names
from model.config import ModelConfig

log = logging.getLogger(__name__)

# from self_v.i to the attention output, each node the only reader of the one before (model/attention.py's step)
VALUE_PATH = ("Reshape", "Gather", "Reshape", "MatMul", "Add", "Transpose", "Reshape")
REORDER = "_reorder"  # export/verify.py's feed for indirect_runner: no graph input has this name


def rewrite(proto: onnx.ModelProto, cfg: ModelConfig) -> bool:
    """Rewrite `proto` (the decoder, its weights external or not) in place; False where it is rewritten already."""
    g = proto.graph
    if io_names.CACHE_INDIRECTION in {x.name for x in g.input}:
        return False
    produced = {o: n for n in g.node for o in n.output}
    layers, h, dh = cfg.n_dec_layers, cfg.n_heads, cfg.d_head
    nodes = [
        helper.make_node("Cast", [io_names.STEP], ["dmmha/past"], to=TensorProto.INT32, name="dmmha/past"),
        helper.make_node("Shape", [io_names.TOKENS], ["dmmha/hyps"], name="dmmha/hyps"),
        helper.make_node("Shape", [io_names.SRC_BIAS], ["dmmha/sentences"], start=0, end=1, name="dmmha/sentences"),
        helper.make_node("Div", ["dmmha/hyps", "dmmha/sentences"], ["dmmha/beam64"], name="dmmha/beam64"),
        helper.make_node("Cast", ["dmmha/beam64"], ["dmmha/beam"], to=TensorProto.INT32, name="dmmha/beam"),
    ]
    renamed: dict[str, str] = {}
    for i in range(layers):
        q, k, v = _qkv(g, produced, i)
        attention = _attention_output(g, i)
        renamed[attention] = f"dmmha/out{i}"
        nodes.append(helper.make_node(
            "DecoderMaskedMultiHeadAttention",
            [q, k, v, "", "", io_names.self_k(i), io_names.self_v(i), "dmmha/past", "dmmha/beam",
             io_names.CACHE_INDIRECTION],
            [f"dmmha/out{i}", io_names.present_k(i), io_names.present_v(i)], domain="com.microsoft",
            name=f"dmmha/attention{i}", num_heads=h, past_present_share_buffer=1, scale=float(dh ** -0.5)))
    for n in g.node:
        n.input[:] = [renamed.get(x, x) for x in n.input]
        if n.op_type == "Shape" and n.input[0].startswith("self_"):  # the sentences, off axis 0
            n.input[0] = io_names.cross_k(0)
    cache: list[str | int | None] = ["hyps", h, "capacity", dh]
    outputs = [o for o in g.output if not o.name.startswith(("step_k.", "step_v."))]
    outputs += [helper.make_tensor_value_info(name(i), TensorProto.FLOAT, cache)
                for name in (io_names.present_k, io_names.present_v) for i in range(layers)]
    inputs = [x for x in g.input if x.name not in (io_names.SELF_INDEX, io_names.SELF_BIAS)]
    inputs = [helper.make_tensor_value_info(x.name, TensorProto.FLOAT, cache) if x.name.startswith("self_") else x
              for x in inputs]
    inputs.append(helper.make_tensor_value_info(io_names.CACHE_INDIRECTION, TensorProto.INT32,
                                                ["sentences", "beam", "capacity"]))
    del g.output[:], g.input[:]
    g.output.extend(outputs)
    g.input.extend(inputs)
    prune_and_sort(g, list(g.node) + nodes)
    props = {m.key: m.value for m in proto.metadata_props}
    helper.set_model_props(proto, {**props, io_names.SELF_ATTENTION: io_names.DECODER_MASKED})
    if not any(o.domain == "com.microsoft" for o in proto.opset_import):
        proto.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return True


def _qkv(g: Any, produced: dict[str, Any], i: int) -> tuple[str, str, str]:
    """Layer i's query, key and value of the step: the fused projection's Split, whose key output is reshaped
    into step_k.i."""
    writer = next((n for n in g.node if io_names.step_k(i) in n.output), None)
    split = produced.get(writer.input[0]) if writer is not None else None
    if split is None or split.op_type != "Split" or len(split.output) != 3:
        raise ValueError(f"decoder layer {i}: no fused q/k/v Split feeding {io_names.step_k(i)}")
    return split.output[0], split.output[1], split.output[2]


def _attention_output(g: Any, i: int) -> str:
    """The tensor layer i's self-attention hands its out-projection, found by following its value history: from
    the input self_v.i, each node the only reader of the last one's output, in exactly the exported order
    (view, the history gather, view, probabilities x values, + the step's own value, heads back, merged)."""
    readers: dict[str, list[Any]] = {}
    for n in g.node:
        for x in n.input:
            readers.setdefault(x, []).append(n)
    x = io_names.self_v(i)
    for op in VALUE_PATH:
        nodes = readers.get(x, [])
        if len(nodes) != 1 or nodes[0].op_type != op:
            raise ValueError(f"decoder layer {i}: {io_names.self_v(i)}'s path is not the exported self-attention's "
                             f"({' -> '.join(VALUE_PATH)}): {x} read by {[n.op_type for n in nodes]}")
        x = nodes[0].output[0]
    return x


def prune_and_sort(g: Any, nodes: list[Any]) -> None:
    """Keep the nodes the outputs need, each after its inputs; drop initializers nothing reads any more."""
    producer = {o: n for n in nodes for o in n.output}
    wanted, kept = [o.name for o in g.output], {}
    while wanted:
        node = producer.get(wanted.pop())
        if node is not None and id(node) not in kept:
            kept[id(node)] = node
            wanted.extend(x for x in node.input if x)
    ready = {x.name for x in g.input} | {x.name for x in g.initializer} | {""}
    ordered, pending = [], [n for n in nodes if id(n) in kept]
    while pending:
        later = []
        for n in pending:
            if all(x in ready for x in n.input):
                ordered.append(n)
                ready.update(n.output)
            else:
                later.append(n)
        if len(later) == len(pending):
            raise ValueError(f"the rewritten decoder has a cycle or a missing input: {[n.name for n in later[:3]]}")
        pending = later
    used = {x for n in ordered for x in n.input}
    initializers = [x for x in g.initializer if x.name in used]
    del g.node[:], g.initializer[:], g.value_info[:]
    g.node.extend(ordered)
    g.initializer.extend(initializers)


def rewrite_file(path: Path, cfg: ModelConfig) -> bool:
    """The decoder graph at `path` (weights inline, before they are externalised) rewritten in place. A decoder
    whose pattern is not found keeps its gathered cache, with a warning."""
    return rewrite_graph_file(path, cfg, rewrite, "self-attention as DecoderMaskedMultiHeadAttention",
                              "gathered self-attention cache")


def rewrite_graph_file(path: Path, cfg: ModelConfig, rewrite: Callable[[onnx.ModelProto, ModelConfig], bool],
                       done: str, kept: str) -> bool:
    """The graph at `path` rewritten in place by `rewrite` (False: rewritten already; ValueError: its pattern is
    not there, and the graph keeps `kept`, with a warning); `done` says what it became, in the log."""
    proto = onnx.load(str(path))
    try:
        if not rewrite(proto, cfg):
            return False
    except ValueError as e:
        log.warning("int8: the decoder keeps its %s: %s", kept, e)
        return False
    onnx.save(proto, str(path))
    log.info("%s: %s in %d layers", path.name, done, cfg.n_dec_layers)
    return True


def describe(path: Path) -> dict[str, str]:
    """The manifest's record of a decoder's self-attention: one kernel per layer, or the gathered cache."""
    return describe_graph(path, io_names.SELF_ATTENTION, io_names.DECODER_MASKED,
                          "com.microsoft.DecoderMaskedMultiHeadAttention",
                          {"kind": "gathered", "op": "Gather + MatMul + Softmax (model/cache.py's index)"})


def describe_graph(path: Path, key: str, kind: str, op: str, otherwise: dict[str, str]) -> dict[str, str]:
    """{"kind", "op"} where the graph's metadata `key` says `kind` (a rewrite ran), else `otherwise`."""
    props = {m.key: m.value for m in onnx.load(str(path), load_external_data=False).metadata_props}
    return {"kind": kind, "op": op} if props.get(key) == kind else otherwise


def indirect_runner(session: Any) -> Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]:
    """export/verify.py's step function over a rewritten decoder's ONNX Runtime session: fed what the gathered
    decoder is fed plus `REORDER` (the rows each hypothesis continues), it keeps its own IndirectCache, runs
    through IO binding as the backend does (present bound to past), and returns the step's keys and values read
    back from the cache as step_k.i / step_v.i, for the caller to compare as the gathered decoder's."""
    from runtime.indirect_cache import IndirectCache

    inputs = {i.name: i for i in session.get_inputs()}
    k0 = inputs[io_names.self_k(0)].shape  # (hyps, heads, capacity, d_head)
    layers = sum(name.startswith("self_k.") for name in inputs)
    cfg = ModelConfig(vocab_size=8, d_model=k0[1] * k0[3], n_heads=k0[1], d_ff=8, n_enc_layers=1, n_dec_layers=layers)
    state: dict[str, Any] = {}
    names = [o.name for o in session.get_outputs() if not o.name.startswith("present_")]

    def run(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        tokens, step = feeds[io_names.TOKENS], int(feeds[io_names.STEP][0])
        if step == 0:
            state["cache"] = IndirectCache(cfg, len(tokens), initial_capacity=4)
        cache = state["cache"]
        cache.advance(feeds[REORDER], feeds[io_names.cross_k(0)].shape[0])
        binding = session.io_binding()
        for name in inputs:
            if name in feeds and not name.startswith("self_"):
                binding.bind_cpu_input(name, np.ascontiguousarray(feeds[name]))
        alive = cache.bind(binding)  # the presents first
        for name in names:
            binding.bind_output(name, "cpu")
        session.run_with_iobinding(binding)
        del alive
        out = dict(zip(names, binding.copy_outputs_to_cpu()[-len(names):]))  # in the order bound
        n = len(tokens)
        for i in range(layers):
            out[io_names.step_k(i)] = cache.kv[i][:, :, step].reshape(n, -1).copy()
            out[io_names.step_v(i)] = cache.kv[layers + i][:, :, step].reshape(n, -1).copy()
        cache.wrote()
        return out

    return run
