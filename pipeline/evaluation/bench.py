"""`pipeline bench`: target tokens/s, sentences/s, batch latency and peak memory per backend.

Each (backend, batch size) run translates the same sentences in fixed-size batches after
one warm-up batch. `fixed_length` forces exactly N output tokens per hypothesis (EOS
banned before N, forced at N), so untrained or differently trained models compare fairly.
Peak memory is the process's peak resident set (VmHWM), reset before each backend.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from model.errors import UserError
from pipeline.evaluation.cpu_peak import peak_line, percent
from pipeline.invocation import command_line
from pipeline.textio import atomic_output, read_lines
from runtime.backend import Backend
from runtime.decoding import PAPER, DecodingOptions
from runtime.fields import Checked, at_least, opt
from runtime.languages import direction
from runtime.model_dir import LoadOptions, ModelDir, check_load, load
from runtime.registry import backend_names, entry
from runtime.search import Hypothesis, search
from runtime.tokenizer import AnyTokenizer
from runtime.translate import decode_batches, encode_sources, pad_batch

log = logging.getLogger(__name__)


MAX_SENTENCES = 1_000_000  # per measurement: the sources are built in memory first (10**9 was a MemoryError)


@dataclass(frozen=True)
class BenchOptions(Checked):
    """What `pipeline bench` measures and how, besides loading and decoding (LoadOptions, DecodingOptions), the
    languages (ServeBatchOptions) and --serve's load (ServeBenchOptions); its command line is generated from
    these fields."""

    error = UserError

    backends: str = opt("torch,onnxruntime", "Comma-separated backends to measure (" + ",".join(backend_names())
                        + ").")
    batch_sizes: tuple[int, ...] = opt((32,), "Sentences per batch (at least 1); several: comma-separated (1,32) or "
                                              "the option repeated.",
                                       flag="--batch-size", multiple=True, min=1, show_default=True)
    fixed_length: int | None = opt(None, "Force exactly N output tokens per sentence, for fair comparisons across "
                                         "models.", min=1)
    src: Path | None = opt(None, "Source sentences to translate (cycled); default: random pieces of --src-len tokens.",
                           exists=True)  # before the model loads
    sentences: int = opt(256, "Sentences per measurement.", min=1, max=MAX_SENTENCES)
    src_len: int = opt(20, "Length of generated source sentences (tokens, EOS included) when --src is not given.",
                       min=2)
    compare: tuple[str, ...] = opt((), "Also map the first MODEL_DIR's weights into this engine (after checking its "
                                       "greedy output is token-identical to ours) and time it in float32 and int8, "
                                       "with ratio columns. Needs the bench extra: pip install -e .[bench].",
                                   multiple=True, choices=("ctranslate2",))
    min_agreement: float = opt(1.0, "With --compare ctranslate2: least share of check sentences whose greedy output "
                                    "must be token-identical in both engines before anything is timed (the share is "
                                    "reported either way). Lower it only for random weights, whose near-ties the two "
                                    "engines' arithmetic may break apart.", min=0.0, max=1.0)
    rounds: int = opt(3, "With several MODEL_DIRs or --compare: alternating rounds, each measurement in a fresh "
                         "subprocess (honest peak RSS per engine); rows report medians.", min=1)
    serve_input: Path | None = opt(None, "Instead: load `pipeline serve` (started on a free 127.0.0.1 port with the "
                                         "first MODEL_DIR and backend) with INPUT's lines from --concurrency clients, "
                                         "and compare sentences/s and p50/p99 latency with serve-batch on the same "
                                         "lines. Bounded in requests and seconds.",
                                   flag="--serve", metavar="INPUT", exists=True)
    whole_process: tuple[Path, ...] = opt((), "Instead: time what a user waits for, translating FILE (repeatable) "
                                              "start to exit in a fresh process per run: `pipeline serve-batch "
                                              "--backend onnxruntime` for each MODEL_DIR and, with --compare "
                                              "ctranslate2, a CTranslate2 script on the same weights; wall time and "
                                              "peak RSS, --rounds alternating rounds, --threads threads (default 2).",
                                          multiple=True, metavar="FILE", exists=True)
    json_out: Path | None = opt(None, "Write results as JSON ('-': standard output, the table then on standard "
                                      "error).", flag="--json")

    def problems(self, name: Callable[[str], str] | None = None) -> list[str]:
        n = name or self.flag
        out = [f"{n('batch_sizes')} must be at least 1 (got {b})" for b in self.batch_sizes if b < 1]
        out += at_least(self.fixed_length, 1, "fixed_length", n) + at_least(self.sentences, 1, "sentences", n)
        out += at_least(self.src_len, 2, "src_len", n) + at_least(self.rounds, 1, "rounds", n)
        if not 0 <= self.min_agreement <= 1:
            out.append(f"{n('min_agreement')} is a share of sentences, between 0 and 1 (got {self.min_agreement})")
        return out


@dataclass
class BenchResult:
    backend: str
    engine: str                  # "onnxruntime" | "torch" | "tensorrt" (| "ctranslate2" in comparisons)
    precision: str               # what the engine computes: torch runs model.pt in fp32
    device: str
    batch_size: int
    beam_size: int
    sentences: int
    target_tokens: int
    seconds: float
    target_tokens_per_s: float
    sentences_per_s: float
    latency_ms_mean: float
    latency_ms_p50: float
    latency_ms_p90: float
    latency_ms_per_sentence: float
    peak_rss_mb: float | None
    shortlist: bool = False      # decoded over the model dir's vocabulary shortlist (bench --shortlist)
    # the torch backend on CUDA: PyTorch's peak allocation on the device during the row, weights included
    peak_gpu_mb: float | None = None
    step: str | None = None      # the torch backend's decoder step (eager, graph, compiled; --step)
    steps_per_replay: int | None = None  # its beam search steps per CUDA graph replay, as given (--steps-per-replay)
    compile_seconds: float | None = None  # step "compiled": torch.compile's time, in the warm-up, not in `seconds`
    parallel_batches: int = 1    # batches decoded at once (--parallel-batches); latencies are then each batch's own
    # on the CPU, against the machine (pipeline/evaluation/cpu_peak.py)
    macs_per_target_token: int | None = None
    pct_of_measured_peak: float | None = None
    pct_of_theoretical_peak: float | None = None


def torch_cuda(backend: Backend) -> Any:
    """torch, where `backend` is the torch backend on a CUDA device (its allocator sees all the memory it
    uses); else None. Never imports torch."""
    torch = sys.modules.get("torch")
    on_cuda = str(backend.device).startswith("cuda")
    ours = backend.name in backend_names() and entry(backend.name).torch_memory
    return torch if torch is not None and on_cuda and ours else None


def reset_peak_rss() -> None:
    """Reset the kernel's peak-RSS counter (Linux); harmless elsewhere."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def package_version(name: str) -> str | None:
    """An installed distribution's version (None when it is not installed); nothing is imported."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def host_facts(threads: int | None) -> dict[str, Any]:
    """What a figure holds only on: the CPU's model and the instruction sets the int8 and fp32 paths switch on
    (AVX2, AVX-512, VNNI, AMX), the cores and threads, and the engines' versions (every bench report's `host`)."""
    from pipeline.environment import cpu_facts

    cpu = cpu_facts()
    return {"cpu": cpu.model, "cpu_flags": [name for name, present in cpu.features.items() if present],
            "cores": cpu.cores, "threads": threads or cpu.cores, "machine": platform.machine(),
            "python": platform.python_version(),
            **{name: package_version(name) for name in ("pipeline", "torch", "onnxruntime", "ctranslate2")}}


def host_line(host: dict[str, Any]) -> str:
    """The host in one line under a table: the CPU, its flags, the threads and the engines' versions."""
    engines = ", ".join(f"{name} {host[name]}" for name in ("onnxruntime", "ctranslate2", "torch") if host.get(name))
    return (f"host: {host['cpu']} ({', '.join(host['cpu_flags']) or 'no AVX2'}), {host['threads']} threads of "
            f"{host['cores']} cores; {engines}")


def peak_rss_mb() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def make_sources(tokenizer: AnyTokenizer, src: Path | None, n: int, src_len: int, max_len: int,
                 seed: int = 0, prefix: tuple[int, ...] = ()) -> list[list[int]]:
    """Sources from a file (cycled to n lines) or random pieces of length src_len; `prefix` starts each (a
    multilingual model's source language token, counted in src_len)."""
    if src is not None:
        lines = [x for x in read_lines(src) if x.strip()]
        if not lines:
            raise UserError(f"{src}: has no non-blank line to translate; give a file with sentences, "
                            "or leave out --src for random ones")
        lines = (lines * (n // max(len(lines), 1) + 1))[:n]
        encoded = encode_sources(tokenizer, lines, max_len, origin=str(src), prefix=prefix)
        if encoded.truncated:  # as serve-batch says it (the figures are of the cut sentences)
            log.warning("%s: %d of the %d sentences measured were cut to the model's source limit of %d tokens",
                        src, encoded.truncated, len(lines), max_len)
        return encoded.ids
    if src_len > max_len:  # before n x src_len random pieces are drawn (10^12 ran for ever)
        raise UserError(f"--src-len {src_len} is longer than the model's source limit of {max_len} tokens; give at "
                        f"most {max_len}")
    rng = random.Random(seed)
    pieces = tokenizer.piece_ids
    return [[*prefix, *(rng.choice(pieces) for _ in range(max(0, src_len - 1 - len(prefix)))), tokenizer.eos_id]
            for _ in range(n)]


def check_fixed_length(fixed_length: int | None, max_tgt_len: int) -> None:
    """--fixed-length within the model's output limit (the search stops there: the report would claim more)."""
    if fixed_length is not None and fixed_length > max_tgt_len - 1:
        raise UserError(f"--fixed-length {fixed_length} is longer than the model dir's output limit of "
                        f"{max_tgt_len - 1} tokens (export's --max-tgt-len); give at most {max_tgt_len - 1}")


def bench_backend(backend: Backend, sources: list[list[int]], batch_size: int, decoding: DecodingOptions,
                  fixed_length: int | None, precision: str = "fp32", first: int | None = None) -> BenchResult:
    """`first`: the token forced first in every translation (a multilingual model's target language)."""
    if fixed_length is not None:
        check_fixed_length(fixed_length, backend.max_tgt_len)
        decoding = decoding.replace(max_len_a=0.0, max_len_b=fixed_length, min_len=fixed_length)
    decoding.validate()

    def run(batch: list[list[int]]) -> list[list[Hypothesis]]:
        return search(backend, pad_batch(batch, backend.cfg.pad_id), decoding,
                      None if first is None else [first] * len(batch))

    def timed(batch: list[list[int]]) -> tuple[list[list[Hypothesis]], float]:
        t = time.perf_counter()
        return run(batch), time.perf_counter() - t

    run(sources[:batch_size])  # warm-up: allocators, ORT kernels, caches
    latencies, tokens = [], 0
    t0 = time.perf_counter()
    batches = (sources[i: i + batch_size] for i in range(0, len(sources), batch_size))
    for _, (hyps, latency) in decode_batches(backend, batches, timed):  # several at once: parallel_batches
        latencies.append(latency)
        tokens += sum(len(h[0].tokens) for h in hyps)
    seconds = time.perf_counter() - t0
    ms = sorted(x * 1000 for x in latencies)
    return BenchResult(
        backend=backend.name, engine=backend.name, precision=precision, device=str(backend.device),
        batch_size=min(batch_size, len(sources)), beam_size=decoding.beam_size,  # the batches it ran
        sentences=len(sources), target_tokens=tokens, seconds=round(seconds, 3),
        target_tokens_per_s=round(tokens / seconds, 1), sentences_per_s=round(len(sources) / seconds, 2),
        latency_ms_mean=round(statistics.fmean(ms), 2), latency_ms_p50=round(statistics.median(ms), 2),
        latency_ms_p90=round(ms[min(len(ms) - 1, int(len(ms) * 0.9))], 2),
        latency_ms_per_sentence=round(seconds * 1000 / len(sources), 2), peak_rss_mb=None,
        shortlist=backend.shortlist is not None, step=backend.step_mode, parallel_batches=backend.parallel_batches,
    )


def run_bench(model_dir: Path, backends: list[str], batch_sizes: list[int], *, decoding: DecodingOptions = PAPER,
              fixed_length: int | None = None, src: Path | None = None, sentences: int = 256,
              src_len: int = 20, device: str | None = None, threads: int | None = None,
              shortlist: bool = False, src_lang: str | None = None, tgt_lang: str | None = None,
              step: str | None = None, steps_per_replay: int | None = None, parallel_batches: int = 1) -> dict:
    """Each backend in this process, one after the other; `shortlist`: each decodes over the model dir's
    vocabulary shortlist; src_lang/tgt_lang: a multilingual model's direction (runtime/languages.py);
    `step`: the torch backend's decoder step (the others have none). The warm-up batch before each row
    pays a compiled step's compilation, which is reported apart (`compile_seconds`)."""
    decoding.validate()  # before any backend is loaded
    opened = ModelDir.open(model_dir)
    direction(opened.manifest.model_config, src_lang, tgt_lang, pair=opened.manifest.language_pair)
    chosen = [(name, LoadOptions(device=device, threads=threads, shortlist=shortlist, step=step,
                                 steps_per_replay=steps_per_replay, parallel_batches=parallel_batches
                                 ).for_backend(name))  # --step: torch's only, ...
              for name in backends]
    for _, options in chosen:  # what each would refuse, before the first is measured (a refused tensorrt threw
        check_load(opened, options)  # away the onnxruntime rows measured before it)
    results, rows_sources = [], []
    for name, options in chosen:
        reset_peak_rss()
        # with an imported model's own decoding defaults for what is not set
        loaded = load(opened, options, decoding)
        backend, tokenizer, manifest = loaded.backend, loaded.tokenizer, loaded.manifest
        run_with = loaded.decoding  # this backend's (not the next one's given options: a CPU row after a CUDA one
        # ran with its batch_sentences 0)
        way = direction(manifest.model_config, src_lang, tgt_lang, pair=manifest.language_pair)
        sources = make_sources(tokenizer, src, sentences, src_len, backend.max_src_len, prefix=way.prefix)
        for bs in batch_sizes:
            reset_peak_rss()  # each row's own peak (the loaded model resident), not the larger batch's before it
            precision = backend.precision  # (torch: its dtype's, fp16 on a GPU for an fp16 dir; it said fp32)
            cuda = torch_cuda(backend)
            if cuda is not None:
                cuda.cuda.reset_peak_memory_stats(backend.device)
            compiled = backend.compile_seconds
            r = bench_backend(backend, sources, bs, run_with, fixed_length, precision, way.first)
            r.steps_per_replay = loaded.options.steps_per_replay  # as given (None: the backend's default)
            if loaded.options.step == "compiled":
                r.compile_seconds = round(backend.compile_seconds - compiled, 2)
            r.peak_rss_mb = peak_rss_mb()
            if cuda is not None:
                r.peak_gpu_mb = round(cuda.cuda.max_memory_allocated(backend.device) / 2 ** 20, 1)
            log.info("%s batch %d: %.1f target tokens/s", name, bs, r.target_tokens_per_s)
            results.append(r)
            rows_sources.append((sources, loaded.model_dir.shortlist if r.shortlist else None))
        del backend
    rows = [asdict(r) for r in results]
    peak = None
    if any(str(r.device).startswith("cpu") for r in results):
        from pipeline.evaluation import cpu_peak

        peak = cpu_peak.measure(threads).to_dict()
        for row, (srcs, table) in zip(rows, rows_sources):
            cpu_peak.annotate(row, manifest.model_config, srcs, peak, table)
    return {
        "model_dir": str(model_dir),
        "model_config": manifest.model_config.to_dict(),
        "precision": manifest.precision,
        "fixed_length": fixed_length,
        "shortlist": shortlist,
        "parallel_batches": parallel_batches,
        "src_lang": src_lang, "tgt_lang": tgt_lang,
        "host": host_facts(threads),
        "cpu_peak": peak,
        "results": rows,
    }


def vocabulary(row: dict) -> str:
    """A results row's target vocabulary, as the tables show it: the full one or the shortlist."""
    return "shortlist" if row.get("shortlist") else "full"


def model_column(report: dict) -> Callable[[dict], str]:
    """A comparison table's first cell per row: the row's model dir name, padded, where the report
    covers several model dirs (two exports of one precision give rows alike otherwise); else ""."""
    names = [Path(d).name for d in report["model_dirs"]]
    if len(names) < 2:
        return lambda row: ""
    width = max(map(len, names + ["model"]))
    return lambda row: f"{Path(row['model_dir']).name if row else 'model':<{width}} "


def format_table(report: dict) -> str:
    head = (f"{'backend':<14} {'prec':<5} {'vocab':<9} {'device':<6} {'batch':>5} {'beam':>4} {'tgt tok/s':>10} "
            f"{'sent/s':>8} {'lat ms':>8} {'p90 ms':>8} {'peak MiB':>8} {'GPU MiB':>8} {'% peak':>6}")
    rows = [head, "-" * len(head)]
    for r in report["results"]:
        peak = "-" if r["peak_rss_mb"] is None else f"{r['peak_rss_mb']:.0f}"
        gpu = "-" if r.get("peak_gpu_mb") is None else f"{r['peak_gpu_mb']:.0f}"
        name = r["backend"] + (f"/{r['step']}" if r.get("step") not in (None, "eager") else "")
        name += f" x{r['parallel_batches']}" if r.get("parallel_batches", 1) > 1 else ""  # batches at once
        rows.append(f"{name:<14} {r['precision']:<5} {vocabulary(r):<9} {r['device']:<6} {r['batch_size']:>5} "
                    f"{r['beam_size']:>4} "
                    f"{r['target_tokens_per_s']:>10.1f} {r['sentences_per_s']:>8.2f} "
                    f"{r['latency_ms_mean']:>8.1f} {r['latency_ms_p90']:>8.1f} {peak:>8} {gpu:>8} "
                    f"{percent(r):>6}")
    if len({r["backend"] for r in report["results"]}) > 1:  # one process measured them in turn
        rows.append("peak MiB: this process's resident peak in the row, so a backend measured after another counts "
                    "what that one left loaded (torch's libraries, its model); each engine's own: --compare")
    if report.get("cpu_peak"):
        rows.append(peak_line(report["cpu_peak"]))
    if report.get("host", {}).get("cpu"):
        rows.append(host_line(report["host"]))
    return "\n".join(rows)


def write_json(report: dict, path: Path) -> None:
    """The report, first the command that made it (pipeline/invocation.py)."""
    with atomic_output(path) as f:
        json.dump({"command": command_line(), **report}, f, indent=2)
        f.write("\n")
