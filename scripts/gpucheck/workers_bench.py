"""The GPU check's bench worker (a subprocess of `python scripts/gpu_check.py _worker bench`; torch is
imported inside it only), and its timed decoder steps and device ops per step (scripts/gpu_step_ab.py
uses them too)."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from gpucheck.util import _threads


def worker_bench(p: dict[str, Any]) -> dict[str, Any]:
    """pipeline bench's own measuring function (bench_backend) over the torch backend of each random
    checkpoint, per dtype and batch size, with torch.cuda.max_memory_allocated around each; then, for
    the roofline, one batch decoded twice with each decoder step timed (best of the two)."""
    import torch

    from model.checkpoint import load_model
    from pipeline.evaluation.bench import bench_backend, make_sources, peak_rss_mb, reset_peak_rss
    from runtime.decoding import PAPER
    from runtime.search import search
    from runtime.tokenizer import Tokenizer
    from runtime.torch_backend import TorchBackend
    from runtime.translate import pad_batch

    _threads(p)
    device = torch.device(p["device"])
    cuda = device.type == "cuda"
    dtypes = {"fp32": torch.float32, "fp16": torch.float16}
    decoding = PAPER.replace(beam_size=p["beam"], max_len_a=0.0, max_len_b=p["fixed_length"],
                             min_len=p["fixed_length"])
    rows, timings = [], []
    outputs: dict[tuple[str, str, int], list[list[int]]] = {}
    for preset, path in p["checkpoints"].items():
        model, spm_bytes, _ = load_model(Path(path), device="cpu")
        tokenizer = Tokenizer(spm_bytes)
        n = max(p["sentences"][str(b)] for b in p["batches"])
        sources = make_sources(tokenizer, None, n, 20, model.cfg.max_positions)
        for dtype, mode in ((d, m) for d in p["dtypes"] for m in p["step_modes"]):
            step_mode, _, k = mode.partition("-k")  # graph-k4: 4 beam search steps per replay, on the device
            backend = TorchBackend(model, device, dtypes[dtype], step_mode=step_mode, steps_per_replay=int(k or 1))
            weights_mib = torch.cuda.memory_allocated(device) / 2 ** 20 if cuda else None
            for bs in p["batches"]:
                first = [h[0].tokens for h in search(backend, pad_batch(sources[:bs]), decoding)]
                reference = outputs.setdefault((preset, dtype, bs), first)  # the first mode's (eager)
                if cuda:
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(device)
                reset_peak_rss()
                r = bench_backend(backend, sources[: p["sentences"][str(bs)]], bs, PAPER.replace(beam_size=p["beam"]),
                                  p["fixed_length"], dtype)
                row = dict(asdict(r), preset=preset, dtype=dtype, step_mode=mode, peak_rss_mb=peak_rss_mb(),
                           identical_to_first_mode=sum(a == b for a, b in zip(first, reference)),
                           identity_sentences=len(first),
                           graphs_captured=backend.static.captures if backend.static is not None else 0,
                           peak_gpu_mib=round(torch.cuda.max_memory_allocated(device) / 2 ** 20, 1) if cuda else None,
                           weights_gpu_mib=round(weights_mib, 1) if weights_mib is not None else None,
                           model_config=model.cfg.to_dict())
                rows.append(row)
                print(f"bench {preset} {dtype} {mode} batch {bs}: {r.target_tokens_per_s:.0f} tok/s, "
                      f"{r.latency_ms_per_sentence:.2f} ms/sentence, peak GPU {row['peak_gpu_mib']} MiB",
                      file=sys.stderr, flush=True)
            for bs in p["roofline_batches"] if backend.device_search is None else ():  # timed per step call
                best, steps, gpu = min(timed_steps(backend, sources[:bs], decoding) for _ in range(2))
                timings.append({"preset": preset, "dtype": dtype, "step_mode": mode, "batch_size": bs,
                                "beam": p["beam"], "src_len": 20, "steps": steps, "step_seconds": best,
                                "gpu_step_seconds": gpu, "model_config": model.cfg.to_dict(),
                                "device_ops_per_step": device_ops_per_step(backend, sources[:bs], decoding)
                                if cuda and mode == "eager" else None})
            del backend
            if cuda:
                torch.cuda.empty_cache()
        del model
    return {"rows": rows, "roofline_timings": timings, "device": str(device), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(device) if cuda else None,
            "how": "pipeline.evaluation.bench.bench_backend on runtime.torch_backend.TorchBackend(checkpoint model)"}


@contextlib.contextmanager
def step_calls_timed(backend: Any) -> Iterator[list[float]]:
    """Inside: each backend.step call timed, [seconds, calls] yielded and summed as they come."""
    real_step, spent = backend.step, [0.0, 0]

    def timed(*args: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        out = real_step(*args, **kw)
        spent[0] += time.perf_counter() - t0
        spent[1] += 1
        return out

    backend.step = timed
    try:
        yield spent
    finally:
        del backend.step  # the class's method again


def timed_steps(backend: Any, sources: list[list[int]], decoding: Any) -> tuple[float, int, float | None]:
    """Decode one batch with search as serving does, timing each backend.step call (the torch backend
    returns host arrays, so the device is synchronised): (seconds in steps, steps, and for CUDA graphs
    the seconds the device spent in the graphs, from CUDA events around each replay)."""
    from runtime.search import search
    from runtime.translate import pad_batch

    runner = getattr(backend, "static", None)
    graphs = runner is not None and runner.capture
    if graphs:
        runner.gpu_times = []
    with step_calls_timed(backend) as spent:
        search(backend, pad_batch(sources), decoding)
    gpu = None
    if graphs:
        gpu = sum(runner.gpu_times) if len(runner.gpu_times) == spent[1] else None  # None: a step was captured
        runner.gpu_times = None
    return spent[0], int(spent[1]), gpu


def device_ops_per_step(backend: Any, sources: list[list[int]], decoding: Any) -> dict[str, Any]:
    """What one eager decoder step launches on the device (kernels, copies), counted by torch.profiler
    over one batch and divided by its steps (the encoder's few included): what a CUDA graph replays."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            _, steps, _ = timed_steps(backend, sources, decoding)
        events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
        ops = sum(e.count for e in events)
        top = sorted(events, key=lambda e: e.device_time_total, reverse=True)[:8]
        return {"per_step": round(ops / steps, 1), "steps": steps,
                "top": [{"name": e.key[:80], "count": e.count, "device_us": round(e.device_time_total, 1)}
                        for e in top]}
    except Exception as e:  # noqa: BLE001 - a profiler that cannot run here must not fail the bench
        return {"error": f"{type(e).__name__}: {e}"[:300]}
