"""What one ONNX Runtime node costs apart from its kernel's work, and what a batch-1 step of beam search spends
outside ONNX Runtime (benchmarks/README.md, "parallel-default").

    python benchmarks/node_cost_probe.py nodes            # chains of 1 and 200 Add / Reshape nodes on (4, 256)
    python benchmarks/node_cost_probe.py b1 MODEL_DIR N    # N Multi30k test lines, one at a time, beam 4
    python benchmarks/node_cost_probe.py trim MODEL_DIR N  # the same, heap trimmed before every batch or when worth it

`nodes`: one intra-op thread, graph optimisations off (so the chain stays), 2,000 runs each after 200 of warm-up.
`b1`: the onnxruntime backend on 1 thread; the time inside its session runs against the rest of each run.
`trim`: ms a sentence over 10 alternating rounds, runtime/heap.py's release_free_memory as it is (when the heaps
hold TRIM_LEAST free) against trimming before every batch."""

from __future__ import annotations

import gzip
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TEST = Path(__file__).resolve().parents[2] / "shared/corpora/multi30k/test_2016_flickr.de.gz"


def nodes() -> None:
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    for op in ("Add", "Reshape"):
        for n in (1, 200):
            chain, prev = [], "x"
            for i in range(n):
                chain.append(helper.make_node(op, [prev, "c" if op == "Add" else "s"], [f"y{i}"]))
                prev = f"y{i}"
            inits = [numpy_helper.from_array(np.ones((4, 256), np.float32), "c")] if op == "Add" else \
                [numpy_helper.from_array(np.array([4, 256], np.int64), "s")]
            graph = helper.make_graph(chain, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 256])],
                                      [helper.make_tensor_value_info(prev, TensorProto.FLOAT, None)], initializer=inits)
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = 1
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
            session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
            x = {"x": np.ones((4, 256), np.float32)}
            for _ in range(200):
                session.run(None, x)
            start = time.perf_counter()
            for _ in range(2000):
                session.run(None, x)
            print(f"{op:8s} x{n:<4d} {(time.perf_counter() - start) / 2000 * 1e6:8.1f} us a run")


def _one_at_a_time(model_dir: str, n: int) -> tuple[Any, list[Any]]:
    """The onnxruntime backend of MODEL_DIR on 1 thread, and the first n test lines as batches of one."""
    import sentencepiece as spm

    from runtime.model_dir import ModelDir
    from runtime.ort_backend import OrtBackend
    from runtime.translate import pad_batch

    opened = ModelDir.open(model_dir)
    backend = OrtBackend(opened.path, opened.manifest, threads=1)
    sp = spm.SentencePieceProcessor(model_file=str(opened.path / "spm.model"))
    with gzip.open(TEST, "rt", encoding="utf-8") as f:
        lines = [line.strip() for line in f][:n]
    return backend, [pad_batch([sp.encode(line) + [backend.cfg.eos_id]], backend.cfg.pad_id) for line in lines]


def b1(model_dir: str, n: int) -> None:
    from runtime.search import beam_search

    backend, batches = _one_at_a_time(model_dir, n)
    inside = {"s": 0.0, "runs": 0}
    run = backend._run

    def timed(*args: object) -> None:
        start = time.perf_counter()
        run(*args)  # type: ignore[arg-type]
        inside["s"] += time.perf_counter() - start
        inside["runs"] += 1

    backend._run = timed  # type: ignore[method-assign]
    for batch in batches[:30]:
        beam_search(backend, batch, beam_size=4)
    for _ in range(3):
        inside.update(s=0.0, runs=0)
        start = time.perf_counter()
        for batch in batches:
            beam_search(backend, batch, beam_size=4)
        total = time.perf_counter() - start
        runs = inside["runs"]
        print(f"{total / n * 1e3:.2f} ms a sentence; {runs / n:.1f} runs a sentence, {inside['s'] / runs * 1e6:.0f} us "
              f"inside each, {(total - inside['s']) / runs * 1e6:.0f} us outside")


def trim(model_dir: str, n: int) -> None:
    import runtime.ort_backend as ort_backend
    from runtime import heap
    from runtime.search import beam_search

    backend, batches = _one_at_a_time(model_dir, n)
    modes = {"every batch": lambda: heap.release_free_memory(least=0), "when worth it": heap.release_free_memory}
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for batch in batches[:20]:
        beam_search(backend, batch, beam_size=4)
    for _ in range(10):
        for mode, release in modes.items():
            ort_backend.release_free_memory = release  # type: ignore[assignment]
            start = time.perf_counter()
            for batch in batches:
                beam_search(backend, batch, beam_size=4)
            times[mode].append((time.perf_counter() - start) / n * 1e3)
    for mode, ms in times.items():
        print(f"{mode:14s} ms a sentence: {' '.join(f'{t:.2f}' for t in ms)}  median {np.median(ms):.2f}")
    faster = sum(a < b for a, b in zip(times["when worth it"], times["every batch"]))
    print(f"when worth it faster in {faster} of 10 rounds")


if __name__ == "__main__":
    if sys.argv[1:2] == ["nodes"]:
        nodes()
    elif sys.argv[1:2] in (["b1"], ["trim"]) and len(sys.argv) == 4:
        (b1 if sys.argv[1] == "b1" else trim)(sys.argv[2], int(sys.argv[3]))
    else:
        sys.exit(__doc__)
