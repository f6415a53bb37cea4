"""Probe (issue 46): the decoder step's cache-history Gathers taken out of the graph and done with numpy's
`take` instead, which alone copies the same rows in about half of ONNX Runtime's Gather time.

    python benchmarks/history_gather_probe.py MODEL_DIR PARALLEL_BATCHES ROUNDS

Loads MODEL_DIR twice (onnxruntime, --shortlist, 2 threads split over PARALLEL_BATCHES): once as served, once
with the decoder graph's Gathers of self_k.i / self_v.i replaced by graph inputs that the step fills with
`np.take` from the same cache buffers. Checks that both decode 256 random sentences identically (tokens and
scores), then times both over ROUNDS alternating rounds (batch 32, beam 4, 30 tokens each).
Result: benchmarks/2026-11-28_amd-epyc-avx2_history-gather-numpy.md (slower; not built).
"""

from __future__ import annotations

import concurrent.futures as cf
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from model import io_names
from pipeline.evaluation.bench import make_sources
from runtime import ort_backend, ort_binding
from runtime.decoding import PAPER
from runtime.model_dir import LoadOptions, ModelDir, load
from runtime.search import search
from runtime.translate import pad_batch

BATCH, LENGTH, SENTENCES = 32, 30, 256


def without_history_gathers(src: Path, dst: Path, d_head: int) -> None:
    """The graph at `src` with each Gather of a cache buffer replaced by an input `hist_<buffer>`."""
    model = onnx.load(str(src))
    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output}
    hist = {}
    for node in graph.node:
        reshape = producer.get(node.input[0]) if node.op_type == "Gather" else None
        if reshape is not None and reshape.op_type == "Reshape" and reshape.input[0].startswith(("self_k.", "self_v.")):
            hist[node.output[0]] = "hist_" + reshape.input[0]
    nodes = [n for n in graph.node if n.output[0] not in hist]
    for node in nodes:
        for i, name in enumerate(node.input):
            node.input[i] = hist.get(name, name)
    outputs = {o.name for o in graph.output}
    while True:  # drop what fed only the removed Gathers
        used = {x for n in nodes for x in n.input} | outputs
        alive = [n for n in nodes if any(o in used for o in n.output)]
        if len(alive) == len(nodes):
            break
        nodes = alive
    del graph.node[:]
    graph.node.extend(nodes)
    for name in sorted(hist.values()):
        graph.input.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, ["hist_rows", d_head]))
    used = {x for n in graph.node for x in n.input}
    inputs = [i for i in graph.input if i.name in used]
    del graph.input[:]
    graph.input.extend(inputs)
    onnx.save(model, str(dst), save_as_external_data=True, location=dst.name + ".data")


def numpy_step(self: Any, state: Any, tokens: Any, step: int, cache: Any, reorder: Any) -> Any:
    """OrtBackend.step, with the histories taken by numpy into reused arrays and bound as inputs."""
    n, d_head = len(tokens), self.cfg.d_head
    feeds = cache.advance(reorder, state.n_rows)
    bound = state.bound
    if not isinstance(bound, ort_binding.StepBinding) or bound.n != n:
        bound = state.bound = self._step_binding(state, n)
        bound.hist = {}
    self._fill(bound.tokens, np.asarray(tokens, np.int64))
    self._fill(bound.step, np.array([step], dtype=np.int64))
    index = feeds.pop(io_names.SELF_INDEX).reshape(-1)
    keep = {}
    for name, value in feeds.items():
        if not name.startswith(("self_k.", "self_v.")):
            keep[name] = self._bind_changed(bound, name, value)
            continue
        buf = bound.hist.get(name)
        if buf is None or buf.shape[0] < index.shape[0]:
            rows = max(index.shape[0], 2 * (0 if buf is None else buf.shape[0]))
            buf = bound.hist[name] = np.empty((rows, d_head), np.float32)
        out = buf[:index.shape[0]]
        np.take(value.reshape(-1, d_head), index, axis=0, out=out, mode="clip")
        bound.binding.bind_input("hist_" + name, "cpu", 0, np.float32, list(out.shape), out.ctypes.data)
        keep[name] = out
    self._run(self.decoder, bound.binding)
    cache.append(bound.step_k, bound.step_v)
    return ort_backend.StepOutput(np.array(bound.top_lp), np.array(bound.top_ids), np.array(bound.eos_lp)), cache


def main() -> None:
    model_dir, parallel, rounds = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    opened = ModelDir.open(model_dir)
    sources = make_sources(opened.tokenizer, None, SENTENCES, 20, 512)
    options = LoadOptions(backend="onnxruntime", threads=2, shortlist=True, parallel_batches=parallel)
    loaded = load(opened, options, PAPER.replace(beam_size=4))
    served = loaded.backend
    probe = load(opened, options, PAPER.replace(beam_size=4)).backend
    work = Path(tempfile.mkdtemp(prefix="history-gather-"))
    without_history_gathers(model_dir / io_names.DECODER_SHORTLIST_FILE, work / "decoder.onnx", served.cfg.d_head)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads, opts.inter_op_num_threads = 2 // parallel, 1
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    probe.decoder = ort.InferenceSession(str(work / "decoder.onnx"), opts, providers=["CPUExecutionProvider"])
    probe.step = types.MethodType(numpy_step, probe)  # type: ignore[method-assign]
    decoding = loaded.decoding.replace(max_len_a=0.0, max_len_b=LENGTH, min_len=LENGTH)
    chunks = [sources[i:i + BATCH] for i in range(0, len(sources), BATCH)]

    def decode(backend: Any) -> tuple[float, list[Any]]:
        def run(batch: list[list[int]]) -> Any:
            return search(backend, pad_batch(batch, backend.cfg.pad_id), decoding)

        start = time.perf_counter()
        with cf.ThreadPoolExecutor(parallel) as pool:
            out = [h for result in pool.map(run, chunks) for h in result]
        return time.perf_counter() - start, out

    (_, ref), (_, got) = decode(served), decode(probe)
    same = sum(a[0].tokens == b[0].tokens and a[0].score == b[0].score for a, b in zip(ref, got))
    print("identical", same, "of", len(ref))
    times: dict[str, list[float]] = {"served": [], "numpy": []}
    for r in range(rounds):
        order = [("served", served), ("numpy", probe)]
        for name, backend in order if r % 2 == 0 else order[::-1]:
            times[name].append(decode(backend)[0])
    print({k: [round(x, 3) for x in v] for k, v in times.items()})
    print("numpy / served speed: %.3f" % (np.median(times["served"]) / np.median(times["numpy"])))


if __name__ == "__main__":
    main()
