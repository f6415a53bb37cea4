"""`pipeline bench MODEL_DIR --serve INPUT`: load on `pipeline serve`, on loopback only, bounded
in requests and time.

Translates INPUT once with serve-batch (the offline bar), then starts `pipeline serve`
on a free 127.0.0.1 port with the same backend and options and, at each concurrency
level, sends requests of --lines-per-request lines from that many concurrent clients.
Reports per level: sentences/s and target tokens/s against serve-batch's, p50/p99
request latency, answers that differ from serve-batch's (should be 0), and the
server's peak RSS. With --paragraph N, every N lines of INPUT are one document, sent with
"split": "sentences" and set against serve-batch --split sentences on the same documents
(rates then count documents). With --api libretranslate (or both) the clients speak LibreTranslate's
API to the model served as --pair (each text a document, set against serve-batch --split sentences).
Writes JSON."""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model.errors import UserError
from pipeline.cli_options import opt
from pipeline.evaluation.bench import host_facts, host_line
from pipeline.textio import read_served_lines

log = logging.getLogger(__name__)
READY_TIMEOUT_S = 300


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def run_serve_batch(model_dir: str, lines: list[str], common: list[str], tmp: Path) -> tuple[list[str], dict]:
    """serve-batch's output for the lines and its own summary (model loading excluded); rates count lines, target
    tokens are counted as `pipeline bench` counts them (EOS left out)."""
    inp, out = tmp / "input.txt", tmp / "output.txt"
    inp.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    proc = subprocess.run([sys.executable, "-m", "pipeline", "serve-batch", model_dir, str(inp), "-o", str(out),
                           "--no-progress", *common], capture_output=True, text=True)
    if proc.returncode != 0:
        raise UserError(f"serve-batch failed: {''.join(proc.stderr.strip().splitlines()[-1:]).removeprefix('error: ')}")
    m = re.search(r"translated (\d+) sentences .*?, (\d+) target tokens\) in ([\d.]+) s", proc.stderr)
    if not m:
        raise UserError("serve-batch printed no summary line")
    # target tokens as bench and CTranslate2 count them, without EOS: serve-batch's (and /metrics') count one EOS
    # per sentence it sent to the model, the summary's first number
    n, tgt, seconds = len(lines), int(m.group(2)) - int(m.group(1)), float(m.group(3))
    served = re.search(r"; backend (\S+), device (\S+)", proc.stderr)  # what --backend auto resolved to
    summary = {"sentences": n, "target_tokens": tgt, "seconds": seconds,
               **({"backend": served.group(1), "device": served.group(2)} if served else {}),
               "sentences_per_s": n / seconds if seconds else None,
               "target_tokens_per_s": tgt / seconds if seconds else None}
    return out.read_text(encoding="utf-8").split("\n")[:-1], summary


def start_server(model_dir: str, common: list[str], extra: list[str], log_path: Path, name: str | None = None
                 ) -> tuple[subprocess.Popen, str]:
    """`pipeline serve MODEL_DIR` (or `--model NAME=MODEL_DIR`) on a free loopback port, once /health says it
    is ready."""
    import httpx

    logf = open(log_path, "w")
    served = ["--model", f"{name}={model_dir}"] if name else [model_dir]
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "serve", *served, "--host", "127.0.0.1",
                             "--port", "0", *common, *extra], stdout=logf, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        m = re.search(r"at (http://127\.0\.0\.1:\d+)", log_path.read_text())
        if m:
            try:
                if httpx.get(f"{m.group(1)}/health", timeout=5).status_code == 200:
                    return proc, m.group(1)
            except httpx.TransportError:
                pass
        time.sleep(0.2)
    code = proc.poll()
    stop_server(proc)
    said = log_path.read_text(errors="replace").strip().splitlines()  # quoted: its temporary dir goes with bench
    why = next((line for line in reversed(said) if line.startswith("error:")), said[-1] if said else "nothing")
    raise UserError((f"the server did not become ready in {READY_TIMEOUT_S:g} s" if code is None else
                     f"the server exited with status {code} before it was ready") + f"; it said: {why}")


def stop_server(proc: subprocess.Popen) -> int | None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


def peak_rss_mib(pid: int) -> float | None:
    """VmHWM of a live process (Linux); None elsewhere."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    m = re.search(r"^VmHWM:\s+(\d+) kB", text, re.M)
    return int(m.group(1)) / 1024 if m else None


def _native(texts: list[str], extra: dict[str, Any]) -> tuple[dict[str, Any], str]:
    return {"text": texts, **extra}, "translations"


def _libretranslate(pair: str) -> Any:
    """LibreTranslate's request for the texts: "q" a string for one text, a list for several."""
    source, _, target = pair.partition("-")

    def body(texts: list[str], extra: dict[str, Any]) -> tuple[dict[str, Any], str]:
        return {"q": texts[0] if len(texts) == 1 else texts, "source": source, "target": target}, "translatedText"
    return body


async def run_level(url: str, requests: list[list[int]], lines: list[str], expected: list[str],
                    concurrency: int, max_seconds: float, extra: dict[str, Any] | None = None,
                    api: str = "native", pair: str = "") -> dict[str, Any]:
    """`concurrency` clients send the requests (indices into lines, plus `extra` fields) until done or out
    of time, in the native API's form or LibreTranslate's (api "libretranslate", the model's `pair`)."""
    import httpx

    make = _native if api == "native" else _libretranslate(pair)

    latencies: list[float] = []  # of the requests answered 200
    counts = {"requests": 0, "sentences": 0, "mismatched_lines": 0, "errors": 0}
    refusals: dict[int, str] = {}  # status -> the first answer of that status
    todo = iter(requests)
    started = time.perf_counter()

    async def client(http: httpx.AsyncClient) -> None:
        for idx in todo:
            if time.perf_counter() - started > max_seconds:
                return
            t0 = time.perf_counter()
            body, key = make([lines[i] for i in idx], extra or {})
            try:
                r = await http.post(f"{url}/translate", json=body)
            except httpx.TransportError as e:  # the server died or hung up: said in one line, not a traceback
                raise UserError(f"the server stopped answering at {concurrency} clients "
                                f"({type(e).__name__}: {e or 'no reason given'})") from None
            if r.status_code != 200:  # refused (a full queue's 503...): counted, and not in the latencies of
                counts["errors"] += 1  # translations, which a quick refusal made look fast
                refusals.setdefault(r.status_code, r.text[:200])
                continue
            latencies.append(time.perf_counter() - t0)
            counts["requests"] += 1
            counts["sentences"] += len(idx)
            got = r.json()[key]
            got = [got] if isinstance(got, str) else got
            counts["mismatched_lines"] += sum(g != expected[i] for g, i in zip(got, idx))

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=max(60.0, max_seconds), limits=limits) as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    seconds = time.perf_counter() - started
    if counts["errors"] and not counts["requests"]:
        status, text = next(iter(refusals.items()))
        raise UserError(f"every request at {concurrency} clients was refused ({counts['errors']}; the first "
                        f"{status}: {text.strip()})")
    return {"api": api, "concurrency": concurrency, **counts, "seconds": seconds,
            "sentences_per_s": counts["sentences"] / seconds if seconds else None,
            "latency_p50_s": _percentile(latencies, 0.50), "latency_p99_s": _percentile(latencies, 0.99)}


@dataclass(frozen=True)
class ServeBenchOptions:
    """How `pipeline bench --serve` loads the server; each field is a `pipeline bench` option."""

    concurrency: str = opt("1,8,64", "With --serve: comma-separated numbers of concurrent clients, one "
                           "measurement each.")
    max_lines: int = opt(2000, "With --serve: use at most this many lines of INPUT.", min=1)
    lines_per_request: int = opt(4, "With --serve: lines per request.", min=1)
    requests: int = opt(500, "With --serve: requests per concurrency level at most.", min=1)
    max_seconds: float = opt(120.0, "With --serve: seconds per concurrency level at most.", min=1)
    server_arg: tuple[str, ...] = opt((), "With --serve: an extra `pipeline serve` option, repeatable "
                                      "(e.g. --server-arg=--max-wait-ms=10).", multiple=True)
    paragraph: int = opt(0, "With --serve: join every N lines of INPUT into one document and send documents with "
                         '"split": "sentences" (serve-batch: --split sentences); 0 sends lines.', min=0)
    lang: str = opt("en", "With --serve --paragraph: the documents' language, for the sentence rules.")
    api: str = opt("native", "With --serve: the API the clients speak: native ({\"text\": [...]}), libretranslate "
                   "({\"q\", \"source\", \"target\"}; each text a document, set against serve-batch --split "
                   "sentences) or both (each level measured with one, then the other).",
                   choices=("native", "libretranslate", "both"))
    pair: str = opt("de-en", "With --serve --api libretranslate or both: the model's languages SRC-TGT; it is served "
                    "under that name.")

    def levels(self) -> list[int]:
        try:
            levels = [int(c) for c in self.concurrency.split(",") if c.strip()]
        except ValueError:
            levels = []
        if not levels or min(levels) < 1:
            raise UserError(f"--concurrency {self.concurrency!r}: give positive client counts, e.g. 1,8,64")
        return levels


def run_serve_bench(model_dir: str, input_path: str, backend: str, threads: int | None, beam_size: int,
                    opts: ServeBenchOptions) -> dict[str, Any]:
    """Throughput and latency of `pipeline serve` against serve-batch on the same lines."""
    levels = opts.levels()  # a bad --concurrency fails before minutes of serve-batch
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the report
    lines = read_served_lines(input_path)[:opts.max_lines]  # plain or .gz, strict UTF-8, as serve-batch reads it
    lines = [line for line in lines if line.strip()]
    if not lines:  # it timed a request of "." against nothing
        raise UserError(f"{input_path}: has no non-blank line to translate; give a file with sentences")
    split: dict[str, Any] = {}
    offline_args: list[str] = []
    if opts.paragraph:
        lines = [" ".join(lines[i:i + opts.paragraph]) for i in range(0, len(lines), opts.paragraph)]
        split = {"split": "sentences", "lang": opts.lang}
        offline_args = ["--split", "sentences", "--lang", opts.lang]
    apis = ["native", "libretranslate"] if opts.api == "both" else [opts.api]
    if "libretranslate" in apis and not re.fullmatch(r"[a-z]{2,3}-[a-z]{2,3}", opts.pair):
        raise UserError(f"--pair {opts.pair!r}: give the model's languages as SRC-TGT, e.g. de-en")
    common = ["--backend", backend, "--beam-size", str(beam_size)] + (["--threads", str(threads)] if threads else [])
    with tempfile.TemporaryDirectory(prefix="serve-bench-") as tmp:
        log.info("serve-batch on %d lines", len(lines))
        expected, offline = run_serve_batch(model_dir, lines, common + offline_args, Path(tmp))
        documents = expected
        if "libretranslate" in apis and not opts.paragraph:  # LibreTranslate's texts are documents
            documents, _ = run_serve_batch(model_dir, lines, common + ["--split", "sentences", "--lang",
                                                                       opts.pair.split("-")[0]], Path(tmp))
        name = opts.pair if "libretranslate" in apis else None
        proc, url = start_server(model_dir, common, list(opts.server_arg), Path(tmp) / "serve.log", name)
        try:
            spans = [list(range(i, min(i + opts.lines_per_request, len(lines))))
                     for i in range(0, len(lines), opts.lines_per_request)]
            requests = [spans[k % len(spans)] for k in range(opts.requests)]
            results = []
            for c in levels:
                for api in apis:
                    log.info("concurrency %d, %s API", c, api)
                    level = asyncio.run(run_level(url, requests, lines, expected if api == "native" else documents,
                                                  c, opts.max_seconds, split, api, opts.pair))
                    if offline["sentences_per_s"] and level["sentences_per_s"]:
                        level["vs_serve_batch"] = level["sentences_per_s"] / offline["sentences_per_s"]
                    results.append(level)
            rss = peak_rss_mib(proc.pid)
        finally:
            code = stop_server(proc)
    return {"model_dir": model_dir, "backend": offline.get("backend", backend), "threads": threads,
            "beam_size": beam_size,
            "lines": len(lines), "paragraph": opts.paragraph,
            "lines_per_request": opts.lines_per_request, "api": opts.api, "pair": opts.pair if opts.api != "native"
            else None, "serve_batch": offline, "levels": results,
            "server_peak_rss_mib": rss, "server_exit_code": code, "server_args": list(opts.server_arg),
            "host": host_facts(threads)}


def format_serve_bench(report: dict[str, Any]) -> str:
    """The report as a table: one row per concurrency level, serve-batch's rate as the bar."""
    def ms(s: float | None) -> str:
        return "-" if s is None else f"{1000 * s:.1f}"

    offline = report["serve_batch"]
    unit = f"documents of {report['paragraph']} lines" if report.get("paragraph") else "lines"
    rate = offline["sentences_per_s"]  # None: serve-batch's summary said 0 s (nothing a model had to translate)
    rows = [f"serve-batch: {'-' if rate is None else f'{rate:.1f}'} {unit}/s on {report['lines']} {unit} "
            f"(backend {report['backend']}); server peak RSS {report['server_peak_rss_mib'] or 0:.0f} MiB",
            f"{'api':>14} {'clients':>8} {'texts/s':>8} {'x batch':>8} {'p50 ms':>8} {'p99 ms':>8} {'errors':>7} "
            f"{'differ':>7}"]
    for lv in report["levels"]:
        ratio = lv.get("vs_serve_batch")
        rows.append(f"{lv.get('api', 'native'):>14} {lv['concurrency']:>8} {lv['sentences_per_s'] or 0:>8.1f} "
                    f"{'-' if ratio is None else f'{ratio:.2f}':>8} {ms(lv['latency_p50_s']):>8} "
                    f"{ms(lv['latency_p99_s']):>8} {lv['errors']:>7} {lv['mismatched_lines']:>7}")
    if report.get("host"):
        rows.append(host_line(report["host"]))
    return "\n".join(rows)
