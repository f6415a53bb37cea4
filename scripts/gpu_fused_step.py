"""Issue 44's GPU command: the torch backend's decoder step modes side by side, one process, one card.

For each shape (base, big) and precision (fp32, fp16), at each batch (1, 32, 128 sentences x beam 4,
exactly `--tokens` target tokens, random sources of 20 tokens, random weights), the step modes of
runtime/torch_backend.py alternate round by round:
  eager     each kernel launched from Python;
  graph     the fixed-shape step replayed as a CUDA graph (runtime/static_step.py);
  compiled  that step through torch.compile (inductor), then captured as a CUDA graph;
  compiled-plain   the same without scaled_dot_product_attention (the explicit matmuls and softmax);
  compiled-combo   with inductor's combo kernels (independent kernels launched as one);
  compiled-autotune  with inductor's GEMM autotuning (Triton templates with fused epilogues).
Per row: host ms per step (search included, the best round), GPU ms per step (CUDA events around each
replay), kernels per step (the captured graph's kernel nodes, counted through cuda.bindings; eager: the
profiler's kernels over one search), the first batch's translations against eager's, the compilation's
seconds (once per bucket), and the step's share of the roofline (bytes and FLOPs from the shape against
this card's measured copy bandwidth and matmul rate, pipeline/evaluation/roofline.py) by GPU time and by
host time. Then MarianMTModel.generate on the same weights (`--marian`).

Rows go in priority order (base fp16 first) and each is written to `--json` as soon as it is measured;
a row that no longer fits `--budget` seconds is skipped with that reason, so a run cut short still
reports what it measured.

    python scripts/gpu_fused_step.py --json OUT.json --md OUT.md --budget 420          # a GPU
    python scripts/gpu_fused_step.py --device cpu --presets tiny --dtypes fp32 --batches 1,4 \\
        --variants eager,static,compiled --vocab 256 --tokens 12                          # the CPU (tests)
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import torch  # noqa: E402
from gpucheck.workers_bench import step_calls_timed  # noqa: E402

from model.config import EOS_ID, preset  # noqa: E402
from model.transformer import build_model  # noqa: E402
from pipeline.evaluation import roofline  # noqa: E402
from runtime.decoding import PAPER  # noqa: E402
from runtime.search import search  # noqa: E402
from runtime.static_step import compile_body, mark_compiled  # noqa: E402
from runtime.torch_backend import TorchBackend  # noqa: E402
from runtime.translate import pad_batch  # noqa: E402

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
SRC_TOKENS = 20
VARIANT_OPTIONS = {"combo": {"combo_kernels": True}, "autotune": {"max_autotune_gemm": True}}


def make_backend(model: Any, device: torch.device, dtype: torch.dtype, variant: str) -> TorchBackend:
    """A step mode, or compiled-<flavour> (the docstring's list); a last part kN: N steps per replay."""
    parts = variant.split("-")
    steps = int(parts.pop()[1:]) if len(parts) > 1 and parts[-1][:1] == "k" and parts[-1][1:].isdigit() else 1
    mode, flavour = parts[0], "-".join(parts[1:])
    backend = TorchBackend(model, device, dtype, step_mode=mode, steps_per_replay=steps)
    if flavour == "plain":
        mark_compiled(backend.model, sdpa=False)
    elif flavour:
        backend.static.body = compile_body(VARIANT_OPTIONS[flavour])  # type: ignore[union-attr]
    if backend.static is not None:
        backend.static.keep_graphs = True
    return backend


def graph_kernels(backend: TorchBackend) -> dict[str, Any] | None:
    """The node kinds of the largest-capacity graph the backend captured, per step (a replay runs
    steps_per_replay steps)."""
    runner = backend.static
    if runner is None or not runner.capture:
        return None
    if backend.device_search is not None:
        graphs = [(s.capacity, s.graph) for s in backend.device_search.stores.values() if s.graph is not None]
    else:
        graphs = [(cap, s.graph) for b in runner.batches.values() for cap, s in b.capacities.items()
                  if s.graph is not None]
    if not graphs:
        return None
    try:
        from cuda.bindings import runtime as rt

        raw = max(graphs, key=lambda g: g[0])[1].raw_cuda_graph()
        handle = rt.cudaGraph_t(init_value=raw)
        err, _, count = rt.cudaGraphGetNodes(handle, 0)
        err, nodes, count = rt.cudaGraphGetNodes(handle, count)
        kinds = collections.Counter(rt.cudaGraphNodeGetType(n)[1].name.replace("cudaGraphNodeType", "")
                                    for n in nodes)
        k = backend.steps_per_replay
        return {"nodes": int(count), "kinds": dict(kinds), "kernels": round(kinds.get("Kernel", 0) / k, 1),
                "steps_per_replay": k}
    except Exception as e:  # noqa: BLE001 - counting must not fail the measurement
        return {"error": f"{type(e).__name__}: {e}"[:300]}


def profiled_kernels(backend: TorchBackend, sources: list[list[int]], decoding: Any) -> dict[str, Any]:
    """Kernels (and copies) the profiler sees over one search, per step, with the heaviest names."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            _, _, steps, _ = timed_search(backend, sources, decoding)
        events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
        top = sorted(events, key=lambda e: e.device_time_total, reverse=True)[:10]
        return {"per_step": round(sum(e.count for e in events) / steps, 1), "steps": steps,
                "top": [{"name": e.key[:90], "count": e.count, "device_us": round(e.device_time_total, 1)}
                        for e in top]}
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"[:300]}


def timed_search(backend: TorchBackend, sources: list[list[int]], decoding: Any
                 ) -> tuple[float, float, int, float | None]:
    """One batch searched as serving does: (seconds of the whole search, what the user waits for; seconds
    inside backend.step calls, 0 where the search runs on the device; replays or step calls; the device's
    seconds in graph replays, from CUDA events, or None)."""
    timers: Any = backend.device_search or backend.static
    graphs = backend.static is not None and backend.static.capture
    if graphs:
        timers.gpu_times = []
    replays = backend.device_search.replays if backend.device_search is not None else 0
    sync = torch.cuda.synchronize if backend.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with step_calls_timed(backend) as spent:
        search(backend, pad_batch(sources), decoding)
        sync()
    wall = time.perf_counter() - t0
    calls = spent[1] or (backend.device_search.replays - replays if backend.device_search is not None else 0)
    gpu = None
    if graphs:
        gpu = sum(timers.gpu_times) if len(timers.gpu_times) == calls else None  # None: one was captured
        timers.gpu_times = None
    return wall, spent[0], int(calls), gpu


def machine(device: torch.device, dtypes: list[str]) -> dict[str, Any]:
    if device.type != "cuda":
        return {"device": "cpu", "cpu": platform.processor() or platform.machine()}
    return {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
            "copy": roofline.measure_copy_bandwidth(str(device), 1 << 30),
            "matmul": {dt: roofline.measure_matmul_rate(str(device), dt, 8192) for dt in dtypes}}


class Run:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.deadline = time.monotonic() + args.budget
        self.out: dict[str, Any] = {"command": "python scripts/gpu_fused_step.py " + " ".join(sys.argv[1:]),
                                    "rows": [], "marian": [], "skipped": [], "compile": []}
        self.decoding = PAPER.replace(beam_size=4, max_len_a=0.0, max_len_b=args.tokens, min_len=args.tokens)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        if self.args.json:
            self.args.json.write_text(json.dumps(self.out, indent=1) + "\n")

    def skip(self, what: str, why: str) -> None:
        self.out["skipped"].append({"what": what, "why": why})
        print(f"SKIP {what}: {why}", file=sys.stderr, flush=True)
        self.save()

    def main(self) -> None:
        a = self.args
        dtypes = a.dtypes.split(",")
        self.out["machine"] = machine(self.device, sorted(set(dtypes)))
        self.save()
        for name in a.presets.split(","):
            for dtype in dtypes:
                if self.left() < a.reserve:
                    self.skip(f"{name} {dtype}", f"{self.left():.0f} s left of --budget {a.budget}")
                    continue
                self.shape(name, dtype)

    def shape(self, name: str, dtype: str) -> None:
        a = self.args
        variants = a.variants.split(",")
        torch.manual_seed(0)
        cfg = preset(name, a.vocab)
        backends = {}
        for v in variants:
            torch.manual_seed(0)  # the same weights for every variant
            backends[v] = make_backend(build_model(cfg), self.device, DTYPES[dtype], v)
        g = torch.Generator().manual_seed(1)
        batches = [int(b) for b in a.batches.split(",")]
        sources = [torch.randint(4, a.vocab, (SRC_TOKENS,), generator=g).tolist() + [EOS_ID]
                   for _ in range(max(batches))]
        shape = roofline.Shape.of(cfg)
        width = 2 if dtype in ("fp16", "bf16") else 4
        rate = self.out["machine"].get("matmul", {}).get(dtype)
        copy = self.out["machine"].get("copy")
        for bs in batches:
            if self.left() < a.reserve:
                self.skip(f"{name} {dtype} batch {bs}", f"{self.left():.0f} s left of --budget {a.budget}")
                continue
            src = sources[:bs]
            first, first_s, compile_s = {}, {}, {}
            for v in list(variants):  # the first search also captures and compiles
                runner = backends[v].static
                before = backends[v].compile_seconds
                t0 = time.perf_counter()
                try:
                    first[v] = [h[0].tokens for h in search(backends[v], pad_batch(src), self.decoding)]
                except Exception as e:  # noqa: BLE001 - one variant failing must not cost the others
                    self.skip(f"{name} {dtype} {v}", f"{type(e).__name__}: {e}"[:400])
                    variants.remove(v)
                    continue
                first_s[v] = time.perf_counter() - t0
                compile_s[v] = round(backends[v].compile_seconds - before, 2) if runner else None
            if any(compile_s.values()):
                self.out["compile"].append({"preset": name, "dtype": dtype, "batch": bs, "seconds": compile_s,
                                            "first_search_seconds": {v: round(t, 2) for v, t in first_s.items()}})
            best: dict[str, tuple[float, float, int, float | None]] = {}
            for r in range(a.rounds):
                for v in (variants if r % 2 == 0 else variants[::-1]):
                    t = timed_search(backends[v], src, self.decoding)
                    best[v] = min(best.get(v, t), t, key=lambda x: x[0])
            steps = a.tokens + 1  # the decoder steps each translation needs (the forced EOS included)
            for v in variants:
                seconds, in_steps, replays, gpu = best[v]
                row: dict[str, Any] = {
                    "preset": name, "dtype": dtype, "batch": bs, "beam": 4, "variant": v, "steps": steps,
                    "steps_per_replay": backends[v].steps_per_replay, "replays": replays,
                    "step_ms": round(1000 * seconds / steps, 4),
                    "step_call_ms": round(1000 * in_steps / steps, 4) if in_steps else None,
                    "gpu_ms": round(1000 * gpu / steps, 4) if gpu is not None else None,
                    "target_tok_per_s": round(bs * a.tokens / seconds, 1),
                    "identical_to_first": sum(x == y for x, y in zip(first[v], first[variants[0]])),
                    "sentences": bs, "compile_seconds": compile_s[v]}
                runner = backends[v].static
                if runner is not None:
                    row["captured"] = runner.capture
                row["graph"] = graph_kernels(backends[v])
                if bs == batches[0] or not (row["graph"] and row["graph"].get("kernels")):
                    row["profiled"] = profiled_kernels(backends[v], src, self.decoding)
                if copy and rate:
                    cost = roofline.decode_cost(shape, bs, 4, steps, SRC_TOKENS + 1, weight_bytes=width)
                    row["roofline_pct_host"] = round(roofline.achieved(cost, seconds, copy["bytes_per_s"],
                                                                       rate["flops_per_s"])["roofline_pct"], 2)
                    if gpu:
                        row["roofline_pct_gpu"] = round(roofline.achieved(cost, gpu, copy["bytes_per_s"],
                                                                          rate["flops_per_s"])["roofline_pct"], 2)
                self.out["rows"].append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "profiled"}), file=sys.stderr, flush=True)
            self.save()
            if a.marian and self.left() > a.reserve:
                self.marian(backends[variants[0]].model, name, dtype, bs, src)
        del backends
        if self.cuda:
            torch.cuda.empty_cache()

    def marian(self, model: Any, name: str, dtype: str, bs: int, src: list[list[int]]) -> None:
        try:
            from pipeline.evaluation import marian_peer

            peer = marian_peer.to_marian(model).to(self.device)
            row = marian_peer.time_generate(peer, src * (4 if bs == 1 else 1), bs, 4, self.args.tokens)
            row.update(preset=name, dtype=dtype)
            self.out["marian"].append(row)
            print(f"marian {name} {dtype} batch {bs}: {row['target_tokens_per_s']:.0f} tok/s", file=sys.stderr,
                  flush=True)
            del peer
        except Exception as e:  # noqa: BLE001 - the peer is a comparison, not the measurement
            self.skip(f"marian {name} {dtype} batch {bs}", f"{type(e).__name__}: {e}"[:300])
        self.save()


def table(out: dict[str, Any]) -> str:
    marian = {(m["preset"], m["dtype"], m["batch_size"]): m["target_tokens_per_s"] for m in out["marian"]}
    lines = ["| shape | dtype | batch x beam | step | host ms/step | step call ms | GPU ms/step | kernels/step | "
             "tok/s | roofline % (GPU) | roofline % (host) | same tokens | compile s | generate tok/s |",
             "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in out["rows"]:
        graph, prof = r.get("graph") or {}, r.get("profiled") or {}
        kernels = graph.get("kernels") or prof.get("per_step")
        lines.append(f"| {r['preset']} | {r['dtype']} | {r['batch']} x 4 | {r['variant']} | {r['step_ms']} | "
                     f"{r.get('step_call_ms')} | {r['gpu_ms']} | {kernels} | {r['target_tok_per_s']} | "
                     f"{r.get('roofline_pct_gpu')} | "
                     f"{r.get('roofline_pct_host')} | {r['identical_to_first']}/{r['sentences']} | "
                     f"{r['compile_seconds']} | {marian.get((r['preset'], r['dtype'], r['batch']))} |")
    for s in out["skipped"]:
        lines.append(f"\nSkipped {s['what']}: {s['why']}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--presets", default="base,big")
    ap.add_argument("--dtypes", default="fp16,fp32")
    ap.add_argument("--batches", default="32,1,128")
    ap.add_argument("--variants", default="eager,graph,compiled")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tokens", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget", type=float, default=420, help="seconds; rows that no longer fit are skipped")
    ap.add_argument("--reserve", type=float, default=40, help="seconds a row needs at least")
    ap.add_argument("--marian", action="store_true", help="time MarianMTModel.generate on the same weights")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--md", type=Path)
    args = ap.parse_args()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(os.environ.get("TMPDIR", "/tmp")) / "inductor"))
    run = Run(args)
    run.main()
    text = table(run.out)
    if args.md:
        args.md.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
