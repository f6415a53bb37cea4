#!/usr/bin/env python
"""A/B benchmark of two exported decoder-step graphs under ONNX Runtime on the CPU.

Measures ratios, not absolute speeds: the two graphs run alternately, round after round,
in one process with the same thread count, so a busy machine slows both alike. Each
round decodes a fixed number of steps for `batch` sentences x `beam` rows with a
beam-like random `reorder` (each row continues a row of its own sentence) and keeps the
cache as serving does. Graphs of every interface so far are fed as they expect, so an
export made by older code can be compared with a new one: the beam cache of model/cache.py
(`self_index` input: buffers written in place, the graph returns the step's K/V), and the
older graphs that gathered the cache by `reorder` and returned it grown, with
per-sentence cross K/V (cross_k.i axis 0 named "batch") or per-hypothesis copies ("hyps").

    # one graph per code version, same random weights (seed), e.g. old code in /tmp/old:
    python scripts/bench_decoder_step.py export --preset base --out /tmp/new-base
    python /tmp/old/scripts/bench_decoder_step.py export --preset base --out /tmp/old-base
    python scripts/bench_decoder_step.py run /tmp/old-base /tmp/new-base --batch 32 --beam 4 \
        --steps 30 --threads 2 --rounds 10

`overhead` splits beam search through the onnxruntime backend into its parts per decoder step
(the engine's run, binding, the beam cache, search's bookkeeping; then our code alone, the same search
with every engine run a no-op and no timers), for one or more checkouts of the code, each round a fresh
process per checkout and model dir, alternating:

    git worktree add /tmp/base HEAD~1
    python scripts/bench_decoder_step.py overhead models/small-fp32 --code /tmp/base --code . \
        --batch 1 --beam 4 --length 30 --threads 2 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

log = logging.getLogger("bench_decoder_step")


def export(preset_name: str, vocab: int | None, out: Path, topk: int, seed: int) -> None:
    import torch

    from export.onnx_export import export_decoder, inference_copy
    from model import build_model, preset

    vocab = vocab or {"small": 8000, "base": 32000}.get(preset_name, 8000)
    torch.manual_seed(seed)
    model = inference_copy(build_model(preset(preset_name, vocab_size=vocab)), fp16=False)
    out.mkdir(parents=True, exist_ok=True)
    export_decoder(model, out / "decoder.onnx", opset=18, topk=topk)
    log.info("wrote %s", out / "decoder.onnx")


class StepRunner:
    """One decoder.onnx session, fed by IO binding with ORT-owned outputs fed back."""

    def __init__(self, path: Path, threads: int):
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        opts.log_severity_level = 3
        self.ort = ort
        self.session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        self.inputs = {i.name: i for i in self.session.get_inputs()}
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.n_layers = sum(1 for n in self.inputs if n.startswith("self_k."))
        cross = self.inputs["cross_k.0"]
        self.per_sentence = cross.shape[0] == "batch"
        self.beam_cache = "self_index" in self.inputs
        self.n_heads, self.d_head = int(cross.shape[1]), int(cross.shape[3])

    def decode(self, batch: int, beam: int, steps: int, src_len: int, rng: np.random.Generator
               ) -> tuple[float, float]:
        """(wall, CPU) seconds for `steps` decoder steps of batch x beam rows."""
        from model.cache import BeamCache
        from model.config import ModelConfig

        ort, n = self.ort, batch * beam
        cross_rows = batch if self.per_sentence else n
        h, dh = self.n_heads, self.d_head
        cross = {f"cross_{kv}.{i}": rng.standard_normal((cross_rows, h, src_len, dh), dtype=np.float32)
                 for kv in "kv" for i in range(self.n_layers)}
        bias = np.zeros((cross_rows, src_len), dtype=np.float32)
        bias[::3, -4:] = -1e4  # some padded sources
        fixed = {k: ort.OrtValue.ortvalue_from_numpy(v) for k, v in cross.items()}
        fixed["src_bias"] = ort.OrtValue.ortvalue_from_numpy(bias)
        cache = {f"self_{kv}.{i}": ort.OrtValue.ortvalue_from_numpy(np.zeros((n, h, 1, dh), np.float32))
                 for kv in "kv" for i in range(self.n_layers)}
        cfg = ModelConfig(vocab_size=8, d_model=h * dh, n_heads=h, n_enc_layers=1, n_dec_layers=self.n_layers,
                          d_ff=8)
        beam_cache = BeamCache(cfg, n, max_steps=steps + 1)
        vocab_hi = 1000
        start, cpu_start = time.perf_counter(), time.process_time()
        for t in range(steps):
            tokens = rng.integers(4, vocab_hi, n, dtype=np.int64)
            parent = rng.integers(0, beam, n) if t else np.arange(n) % beam
            reorder = (np.arange(n) // beam * beam + parent).astype(np.int64)
            binding = self.session.io_binding()
            binding.bind_cpu_input("tokens", tokens)
            binding.bind_cpu_input("step", np.array([t], dtype=np.int64))
            if self.beam_cache:
                feeds = beam_cache.advance(reorder, batch)  # numpy arrays, referenced until the run
                for name, array in feeds.items():
                    binding.bind_input(name, "cpu", 0, array.dtype.type, list(array.shape), array.ctypes.data)
            else:
                binding.bind_cpu_input("reorder", reorder)
                for name, value in cache.items():
                    binding.bind_ortvalue_input(name, value)
            for name, value in fixed.items():
                binding.bind_ortvalue_input(name, value)
            for name in self.outputs:
                binding.bind_output(name, "cpu")
            self.session.run_with_iobinding(binding)
            out: dict[str, Any] = dict(zip(self.outputs, binding.get_outputs()))
            out["topk_log_probs"].numpy()  # what search reads each step
            if self.beam_cache:
                beam_cache.append(*([out[f"step_{kv}.{i}"].numpy() for i in range(self.n_layers)]
                                    for kv in "kv"))
            else:
                cache = {f"self_{kv}.{i}": out[f"new_self_{kv}.{i}"] for kv in "kv" for i in range(self.n_layers)}
        return time.perf_counter() - start, time.process_time() - cpu_start


def run(dirs: list[Path], batch: int, beam: int, steps: int, threads: int, rounds: int, src_len: int) -> None:
    runners = [StepRunner(d / "decoder.onnx", threads) for d in dirs]
    rng = np.random.default_rng(0)
    for r in runners:  # warm-up (allocator, kernels)
        r.decode(batch, beam, 3, src_len, rng)
    wall: list[list[float]] = [[] for _ in runners]
    cpu: list[list[float]] = [[] for _ in runners]
    for k in range(rounds):
        order = range(len(runners)) if k % 2 == 0 else reversed(range(len(runners)))
        for i in order:
            w, c = runners[i].decode(batch, beam, steps, src_len, np.random.default_rng(k))
            wall[i].append(w)
            cpu[i].append(c)
    # CPU time (all threads, no spinning) is what a loaded machine distorts least.
    for d, r, ws, cs in zip(dirs, runners, wall, cpu):
        kind = ("beam cache" if r.beam_cache else "reorder, per-sentence cross K/V" if r.per_sentence
                else "reorder, per-hypothesis cross K/V")
        print(f"{d} ({kind}): "
              f"median per {steps}-step decode {statistics.median(ws) * 1000:.1f} ms wall, "
              f"{statistics.median(cs) * 1000:.1f} ms CPU; speed-up vs first: "
              f"wall {_paired(wall[0], ws)}, CPU {_paired(cpu[0], cs)}")


def _paired(base: list[float], other: list[float]) -> str:
    ratios = sorted(a / b for a, b in zip(base, other))
    return f"{statistics.median(ratios):.3f} (min {ratios[0]:.3f}, max {ratios[-1]:.3f})"


PARTS = ("run", "bind", "cache", "search")


def overhead_once(model_dir: Path, batch: int, beam: int, length: int, sentences: int, threads: int,
                  src_len: int, src: Path | None = None) -> dict[str, float]:
    """Beam search of `sentences` sources (random ones, or `src`'s lines sorted by length as serve-batch batches
    them), `length` tokens each (0: as long as the model makes them), in batches of `batch`: ms per sentence,
    and per decoder step the microseconds of each part (encoding excluded)."""
    from model.cache import BeamCache
    from pipeline.evaluation.bench import make_sources
    from runtime.decoding import PAPER
    from runtime.indirect_cache import IndirectCache
    from runtime.model_dir import LoadOptions, load
    from runtime.search import search
    from runtime.translate import pad_batch

    loaded = load(model_dir, LoadOptions(backend="onnxruntime", device="cpu", threads=threads))
    backend, tokenizer = loaded.backend, loaded.tokenizer
    spent: dict[str, float] = {}
    calls: dict[str, int] = {}

    def timed(key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed_call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] = spent.get(key, 0.0) + time.perf_counter() - start
                calls[key] = calls.get(key, 0) + 1
        return timed_call

    untimed = (backend.step, backend.encode, BeamCache.advance, BeamCache.append, IndirectCache.advance,
               IndirectCache.wrote)
    backend.decoder.run_with_iobinding = timed("run", backend.decoder.run_with_iobinding)
    backend.step = timed("step", backend.step)
    backend.encode = timed("encode", backend.encode)
    BeamCache.advance = timed("advance", BeamCache.advance)  # type: ignore[method-assign]
    BeamCache.append = timed("append", BeamCache.append)  # type: ignore[method-assign]
    # a decoder with DecoderMaskedMultiHeadAttention keeps a cache per hypothesis (runtime/indirect_cache.py)
    IndirectCache.advance = timed("advance", IndirectCache.advance)  # type: ignore[method-assign]
    IndirectCache.wrote = timed("append", IndirectCache.wrote)  # type: ignore[method-assign]
    decoding = PAPER.replace(beam_size=beam, max_len_a=0.0, max_len_b=length, min_len=length) if length else \
        PAPER.replace(beam_size=beam)
    sources = make_sources(tokenizer, src, sentences, src_len, backend.max_src_len)
    if src is not None:
        sources.sort(key=len)
    batches = [pad_batch(sources[i:i + batch], backend.cfg.pad_id) for i in range(0, sentences, batch)]
    search(backend, batches[0], decoding)  # warm-up
    spent.clear()
    calls.clear()
    start = time.perf_counter()
    for src in batches:
        search(backend, src, decoding)
    total = time.perf_counter() - start
    cache = spent.get("advance", 0.0) + spent.get("append", 0.0)
    parts = {"run": spent["run"], "bind": spent["step"] - spent["run"] - cache, "cache": cache,
             "search": total - spent["step"] - spent["encode"]}
    steps = calls["step"]
    result = {"ms_per_sentence": total * 1000 / sentences, "steps_per_batch": steps / len(batches),
              **{k: v * 1e6 / steps for k, v in parts.items()}}
    if not length:  # natural lengths: no-op runs would not end where real ones do
        return result
    # The same searches with no timers and every engine run a no-op (the same steps: the length is forced): what
    # our own code costs per step, without the timers' share that the parts above carry.
    (backend.step, backend.encode, BeamCache.advance, BeamCache.append, IndirectCache.advance,
     IndirectCache.wrote) = untimed  # type: ignore[method-assign]
    backend.decoder.run_with_iobinding = backend.encoder.run_with_iobinding = lambda *args, **kwargs: None
    start = time.perf_counter()
    for src in batches:
        search(backend, src, decoding)
    ours = time.perf_counter() - start
    return {**result, "ours_untimed": ours * 1e6 / steps}


def overhead(dirs: list[Path], codes: list[Path], rounds: int, args: list[str]) -> None:
    """Each round, one fresh process per (checkout, model dir), the order reversed every other round."""
    runs = [(code, d) for d in dirs for code in codes]
    got: dict[tuple[Path, Path], list[dict[str, float]]] = {run: [] for run in runs}
    for k in range(rounds):
        for code, d in runs if k % 2 == 0 else reversed(runs):
            out = subprocess.run([sys.executable, __file__, "overhead-once", str(d), "--code", str(code), *args],
                                 check=True, capture_output=True, text=True).stdout
            got[(code, d)].append(json.loads(out.splitlines()[-1]))
    print(f"{'model dir':<24} {'code':<16} {'ms/sent':>8} " + " ".join(f"{p + ' us':>10}" for p in PARTS)
          + f" {'not run us':>10} {'untimed us':>10}  (per step, medians of {rounds}; untimed: our code alone, "
          "every run a no-op, no timers)")
    for (code, d), results in got.items():
        med = {key: statistics.median(r[key] for r in results) for key in results[0]}
        print(f"{d.name:<24} {str(code)[-16:]:<16} {med['ms_per_sentence']:>8.2f} "
              + " ".join(f"{med[p]:>10.0f}" for p in PARTS) + f" {sum(med[p] for p in PARTS[1:]):>10.0f}"
              + f" {med.get('ours_untimed', float('nan')):>10.0f}")
    print(json.dumps({f"{d.name} {code}": results for (code, d), results in got.items()}))


def ort_profile(model_dir: Path, batch: int, beam: int, length: int, sentences: int, threads: int,
                src_len: int, shortlist: bool = False, src: Path | None = None, nodes_shown: int = 0) -> None:
    """ONNX Runtime's own profile of the decoder step in beam search: per step, the run against the
    sum of its kernels (the rest is the executor's per-node cost), and the kernels by operator; with
    `nodes_shown`, also the costliest nodes by name. `shortlist`: the step over the model dir's
    vocabulary shortlist (decoder_shortlist.onnx), with sentences from `src` for real candidates."""
    from collections import Counter

    import onnxruntime as ort

    from model.manifest import ROWWISE, read_manifest
    from pipeline.evaluation.bench import make_sources
    from runtime.cpu_int8 import graph_as_is, session_graph, wants_unsigned_weights
    from runtime.decoding import PAPER
    from runtime.model_dir import LoadOptions, load
    from runtime.ort_backend import session_config
    from runtime.ort_setup import disabled_optimizers
    from runtime.search import search
    from runtime.translate import pad_batch

    loaded = load(model_dir, LoadOptions(backend="onnxruntime", device="cpu", threads=threads, shortlist=shortlist))
    backend, tokenizer = loaded.backend, loaded.tokenizer
    manifest = read_manifest(model_dir, verify=False)
    opts = ort.SessionOptions()  # as OrtBackend's, with the profiler on
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    for key, value in session_config(manifest).items():
        opts.add_session_config_entry(key, value)
    opts.enable_profiling = True
    opts.profile_file_prefix = str(Path(tempfile.mkdtemp(prefix="ort-profile-")) / "decoder")
    flip = (manifest.quantization == ROWWISE
            and manifest.unsigned_weights != wants_unsigned_weights(pair_bounded=manifest.pair_bounded_weights))
    decoder_file = "decoder_shortlist.onnx" if shortlist else "decoder.onnx"
    with (session_graph if flip else graph_as_is)(model_dir / decoder_file) as graph:
        backend.decoder = ort.InferenceSession(graph, opts, providers=["CPUExecutionProvider"],
                                               disabled_optimizers=disabled_optimizers(["CPUExecutionProvider"]))
    decoding = PAPER.replace(beam_size=beam, max_len_a=0.0, max_len_b=length, min_len=length)
    sources = make_sources(tokenizer, src, sentences, src_len, backend.max_src_len)
    for i in range(0, sentences, batch):
        search(backend, pad_batch(sources[i:i + batch], backend.cfg.pad_id), decoding)
    profile = Path(backend.decoder.end_profiling())
    events = json.loads(profile.read_text())
    shutil.rmtree(profile.parent)
    runs = sum(1 for e in events if e.get("name") == "model_run")
    nodes = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    run_us = sum(e["dur"] for e in events if e.get("name") == "model_run") / runs
    kernel_us, count = Counter[str](), Counter[str]()
    for e in nodes:
        kernel_us[e["args"]["op_name"]] += e["dur"]
        count[e["args"]["op_name"]] += 1
    print(f"{model_dir.name}: {runs} steps; per step: run {run_us:.0f} us, kernels "
          f"{sum(kernel_us.values()) / runs:.0f} us, {len(nodes) / runs:.0f} nodes")
    for op, us in kernel_us.most_common():
        print(f"  {op:<24} {count[op] / runs:6.1f} nodes {us / runs:8.1f} us {us / count[op]:7.1f} us/node")
    if nodes_shown:
        by_node = Counter[tuple[str, str]]()
        for e in nodes:
            by_node[e["name"].removesuffix("_kernel_time"), e["args"]["op_name"]] += e["dur"]
        print(f"the {nodes_shown} costliest nodes, us per step:")
        for (node, op), us in by_node.most_common(nodes_shown):
            print(f"  {us / runs:8.1f}  {op:<22} {node}")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export", help="export a random-weight decoder step graph")
    e.add_argument("--preset", default="small")
    e.add_argument("--vocab", type=int, default=None, help="default: small 8000, base 32000")
    e.add_argument("--out", type=Path, required=True)
    e.add_argument("--topk", type=int, default=16)
    e.add_argument("--seed", type=int, default=0)
    r = sub.add_parser("run", help="time decoder graphs alternately; ratios against the first")
    r.add_argument("dirs", type=Path, nargs="+")
    r.add_argument("--batch", type=int, default=32)
    r.add_argument("--beam", type=int, default=4)
    r.add_argument("--steps", type=int, default=30)
    r.add_argument("--threads", type=int, default=2)
    r.add_argument("--rounds", type=int, default=10)
    r.add_argument("--src-len", type=int, default=24)
    helps = {"overhead": "per decoder step: engine run, binding, cache, search (onnxruntime, CPU)",
             "overhead-once": argparse.SUPPRESS, "profile": "ONNX Runtime's profile of the decoder step in search"}
    for name, help_text in helps.items():
        o = sub.add_parser(name, help=help_text)
        o.add_argument("dirs", type=Path, nargs="+", help="exported model dirs")
        o.add_argument("--code", type=Path, action="append", help="a checkout whose code runs (repeat to A/B)")
        o.add_argument("--batch", type=int, default=1)
        o.add_argument("--beam", type=int, default=4)
        o.add_argument("--length", type=int, default=30,
                       help="tokens per hypothesis (EOS forced there); overhead: 0 for the model's own lengths")
        o.add_argument("--sentences", type=int, default=32)
        o.add_argument("--threads", type=int, default=2)
        o.add_argument("--src-len", type=int, default=20)
        o.add_argument("--src", type=Path, help="source sentences (default: random ones of --src-len)")
        if name == "overhead":
            o.add_argument("--rounds", type=int, default=5)
        if name == "profile":
            o.add_argument("--shortlist", action="store_true", help="the step over the vocabulary shortlist")
            o.add_argument("--nodes", type=int, default=0, help="also list the N costliest nodes by name")
    a = p.parse_args()
    if a.cmd == "profile":
        for d in a.dirs:
            ort_profile(d, a.batch, a.beam, a.length, a.sentences, a.threads, a.src_len, a.shortlist, a.src, a.nodes)
    elif a.cmd == "overhead-once":
        sys.path.insert(0, str(a.code[0].resolve()))
        print(json.dumps(overhead_once(a.dirs[0], a.batch, a.beam, a.length, a.sentences, a.threads, a.src_len,
                                       a.src)))
    elif a.cmd == "overhead":
        passed = [f"--{k.replace('_', '-')}={getattr(a, k)}" for k in
                  ("batch", "beam", "length", "sentences", "threads", "src_len")]
        passed += [f"--src={a.src.resolve()}"] if a.src else []
        overhead(a.dirs, a.code or [ROOT], a.rounds, passed)
    elif a.cmd == "export":
        export(a.preset, a.vocab, a.out, a.topk, a.seed)
    else:
        run(a.dirs, a.batch, a.beam, a.steps, a.threads, a.rounds, a.src_len)


if __name__ == "__main__":
    main()
