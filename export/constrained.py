"""decoder_constrained.onnx: the decoder step that also returns the log-probs of ids the caller asks for.

Constrained beam search (glossaries) needs, at every step, each hypothesis's log-prob of a term's next
token, inside the step's top-K or not. decoder_constrained.onnx is the finished decoder.onnx (quantized
when the export is int8, its weights external) with one more input and one more output, made by graph
surgery rather than a second torch export:

    want_ids (hyps, n_want) int64 -> Max(want_ids, 0) -> GatherElements(log_probs, ., axis=1)
                                  -> Where(want_ids < 0, -inf, .) -> want_log_probs (hyps, n_want) float32

where log_probs is the step's log-softmax after the suppress-add, the very values the top-K is taken from
(found as the tensor the EOS column is gathered from). Every other node, input and output is decoder.onnx's,
so its outputs are bitwise decoder.onnx's (verification checks it: export/verify.py). Its initializers keep pointing at
decoder.data at the same offsets: the file is the graph's structure only, no copy of the weights. The
added ops (Max, Less, GatherElements, Where) are in TensorRT's parser's list (export/trt_compat.py).
The shortlisted step (decoder_shortlist.onnx) gets none: glossaries with --shortlist are refused.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from export.errors import ExportError
from model import io_names

log = logging.getLogger(__name__)

PREFIX = "constrained/"  # the added nodes' and constants' names

# what verification adds to its report's `how`
HOW = (f"; {io_names.DECODER_CONSTRAINED_FILE} beside the decoder on the same feeds (every shared output bitwise "
       f"equal), its {io_names.WANT_LOG_PROBS} at 1-3 ids per hypothesis (-1 among them) vs PyTorch's log-probs")
StepFn = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


def _log_probs(graph: onnx.GraphProto) -> str:
    """The step's (hyps, vocab) log-probs: the input of the Gather whose column is io_names.EOS_LOG_PROBS
    (through Identity and Cast nodes, if any), the very tensor the top-K is taken from (whole, or in two
    stages: export/topk_split.py)."""
    producers = {out: node for node in graph.node for out in node.output}
    name = io_names.EOS_LOG_PROBS
    while (node := producers.get(name)) is not None and node.op_type in ("Identity", "Cast"):
        name = node.input[0]
    if node is None or node.op_type != "Gather" or node.output[0] != name:
        raise ExportError(f"{io_names.DECODER_FILE}: {io_names.EOS_LOG_PROBS} is not a column of the log-probs "
                          f"(found {node.op_type if node else 'a graph input'}); cannot add {io_names.WANT_LOG_PROBS}")
    return node.input[0]


def add_want(proto: onnx.ModelProto) -> onnx.ModelProto:
    """`proto` (a decoder step graph, changed in place) with the want_ids input and want_log_probs output."""
    graph = proto.graph
    names = {i.name for i in graph.input} | {o.name for o in graph.output}
    if io_names.WANT_IDS in names or io_names.WANT_LOG_PROBS in names:
        raise ExportError(f"the decoder graph has {io_names.WANT_IDS} or {io_names.WANT_LOG_PROBS} already")
    source = _log_probs(graph)
    out_types = {o.name: o.type.tensor_type.elem_type for o in graph.output}
    if out_types.get(io_names.TOPK_LOG_PROBS) != TensorProto.FLOAT:  # TopK's values have its input's type
        cast = PREFIX + "log_probs_fp32"
        graph.node.append(helper.make_node("Cast", [source], [cast], name=cast, to=TensorProto.FLOAT))
        source = cast

    def const(name: str, value: np.ndarray) -> str:
        graph.node.append(helper.make_node("Constant", [], [PREFIX + name], name=PREFIX + name,
                                           value=numpy_helper.from_array(value, PREFIX + name)))
        return PREFIX + name

    zero = const("zero", np.array(0, dtype=np.int64))
    minus_inf = const("minus_inf", np.array(-np.inf, dtype=np.float32))
    p = PREFIX
    graph.node.extend([
        helper.make_node("Max", [io_names.WANT_IDS, zero], [p + "index"], name=p + "index"),
        helper.make_node("GatherElements", [source, p + "index"], [p + "gathered"], name=p + "gathered", axis=1),
        helper.make_node("Less", [io_names.WANT_IDS, zero], [p + "none"], name=p + "none"),
        helper.make_node("Where", [p + "none", minus_inf, p + "gathered"], [io_names.WANT_LOG_PROBS],
                         name=p + "want_log_probs"),
    ])
    axes = [io_names.HYPS, io_names.N_WANT]
    graph.input.append(helper.make_tensor_value_info(io_names.WANT_IDS, TensorProto.INT64, axes))
    graph.output.append(helper.make_tensor_value_info(io_names.WANT_LOG_PROBS, TensorProto.FLOAT, axes))
    return proto


def write_constrained(model_dir: Path) -> dict[str, Any]:
    """decoder_constrained.onnx beside the finished decoder.onnx of `model_dir` (its weights read from
    decoder.data, where decoder.onnx reads them), checked by onnx.checker; returns what the manifest
    records of it."""
    started = time.perf_counter()
    decoder, path = model_dir / io_names.DECODER_FILE, model_dir / io_names.DECODER_CONSTRAINED_FILE
    proto = onnx.load(str(decoder), load_external_data=False)  # initializers stay references into decoder.data
    inline = sum(t.ByteSize() for t in proto.graph.initializer
                 if t.data_location != TensorProto.EXTERNAL)
    add_want(proto)
    onnx.save(proto, str(path))  # references kept as they are: no weights written
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as e:  # noqa: BLE001 - checker raises ValidationError and friends
        raise ExportError(f"{path.name}: onnx.checker rejected the graph: {e}") from e
    size = path.stat().st_size
    if size > decoder.stat().st_size + 64 * 1024:
        raise ExportError(f"{path.name} is {size} bytes against {decoder.name}'s {decoder.stat().st_size}: "
                          "its weights were meant to stay in the shared weights file")
    seconds = time.perf_counter() - started
    log.info("%s: %.2f MB, weights read from %s; %.2f s", path.name, size / 1e6,
             io_names.weights_file(decoder.name), seconds)
    # no timing in the record: a manifest holds what was written and checked, the same bytes for the same export
    return {"file": path.name, "bytes": size, "inline_initializer_bytes": inline}


# -- verification (export/verify.py runs these) -------------------------------------------------

def want_ids(hyps: int, step: int, vocab: int) -> np.ndarray:
    """The ids verification asks a step's hypotheses for: 1 to 3 per row (the count changes between
    steps, as a glossary's do), across the whole vocabulary (mostly outside the top-K), some -1."""
    rng = np.random.default_rng(1000 + step)
    ids = rng.integers(0, vocab, (hyps, 1 + step % 3), dtype=np.int64)
    ids[rng.random(ids.shape) < 0.2] = -1
    ids[0, -1] = -1
    ids[-1, 0] = vocab - 1
    return ids


def with_want(decoder: StepFn, vocab: int) -> StepFn:
    """`decoder` fed want_ids (want_ids(hyps, step, vocab)) too at every step."""
    def run(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        want = want_ids(len(feeds[io_names.TOKENS]), int(feeds[io_names.STEP][0]), vocab)
        return decoder({**feeds, io_names.WANT_IDS: want})
    return run


def both_graphs(plain: StepFn, constrained: StepFn) -> StepFn:
    """decoder.onnx (`plain`) and decoder_constrained.onnx on the same feeds: every output they share must
    be bitwise equal; the constrained graph's outputs, want_log_probs included, are returned."""
    def run(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = plain({k: v for k, v in feeds.items() if k != io_names.WANT_IDS})
        got = constrained(feeds)
        for name, a in out.items():
            b = got.get(name)
            if b is None or a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
                raise ExportError(f"verification failed: {io_names.DECODER_CONSTRAINED_FILE}'s {name} differs from "
                                  f"{io_names.DECODER_FILE}'s at step {int(feeds[io_names.STEP][0])}; they must be "
                                  "bitwise equal")
        return got
    return run


def gathered(log_probs: Any, want: Any) -> Any:
    """The torch side: (N, V) log-probs at (N, W) ids, -inf where an id is -1 (what the graph computes)."""
    import torch

    values = log_probs.float().gather(1, want.clamp(min=0))
    return torch.where(want < 0, torch.full_like(values, float("-inf")), values)
