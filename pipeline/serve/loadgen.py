"""Load generator for `pipeline serve`, on loopback only, bounded in requests and time.

    python -m pipeline.serve.loadgen MODEL_DIR INPUT --out serve_bench.json

Translates INPUT once with serve-batch (the offline bar), then starts `pipeline serve`
on a free 127.0.0.1 port with the same backend and options and, at each concurrency
level, sends requests of --lines-per-request lines from that many concurrent clients.
Reports per level: sentences/s and target tokens/s against serve-batch's, p50/p99
request latency, answers that differ from serve-batch's (should be 0), and the
server's peak RSS. Writes JSON."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click

from pipeline.textio import atomic_output, read_lines

log = logging.getLogger("pipeline.serve.loadgen")
READY_TIMEOUT_S = 300


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def run_serve_batch(model_dir: str, lines: list[str], common: list[str], tmp: Path) -> tuple[list[str], dict]:
    """serve-batch's output for the lines and its own summary (model loading excluded)."""
    inp, out = tmp / "input.txt", tmp / "output.txt"
    inp.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    proc = subprocess.run([sys.executable, "-m", "pipeline", "serve-batch", model_dir, str(inp), "-o", str(out),
                           "--no-progress", *common], capture_output=True, text=True)
    if proc.returncode != 0:
        raise click.ClickException(f"serve-batch failed: {proc.stderr.strip().splitlines()[-1:]}")
    m = re.search(r"translated (\d+) sentences .*?, (\d+) target tokens\) in ([\d.]+) s", proc.stderr)
    if not m:
        raise click.ClickException("serve-batch printed no summary line")
    n, tgt, seconds = int(m.group(1)), int(m.group(2)), float(m.group(3))
    summary = {"sentences": n, "target_tokens": tgt, "seconds": seconds,
               "sentences_per_s": n / seconds if seconds else None,
               "target_tokens_per_s": tgt / seconds if seconds else None}
    return out.read_text(encoding="utf-8").split("\n")[:-1], summary


def start_server(model_dir: str, common: list[str], extra: list[str], log_path: Path
                 ) -> tuple[subprocess.Popen, str]:
    import httpx

    logf = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "serve", model_dir, "--host", "127.0.0.1",
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
    stop_server(proc)
    raise click.ClickException(f"the server did not become ready; see {log_path}")


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


async def run_level(url: str, requests: list[list[int]], lines: list[str], expected: list[str],
                    concurrency: int, max_seconds: float) -> dict[str, Any]:
    """`concurrency` clients send the requests (indices into lines) until done or out of time."""
    import httpx

    latencies: list[float] = []
    counts = {"requests": 0, "sentences": 0, "mismatched_lines": 0, "errors": 0}
    todo = iter(requests)
    started = time.perf_counter()

    async def client(http: httpx.AsyncClient) -> None:
        for idx in todo:
            if time.perf_counter() - started > max_seconds:
                return
            t0 = time.perf_counter()
            r = await http.post(f"{url}/translate", json={"text": [lines[i] for i in idx]})
            latencies.append(time.perf_counter() - t0)
            if r.status_code != 200:
                counts["errors"] += 1
                continue
            counts["requests"] += 1
            counts["sentences"] += len(idx)
            got = r.json()["translations"]
            counts["mismatched_lines"] += sum(g != expected[i] for g, i in zip(got, idx))

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=max(60.0, max_seconds), limits=limits) as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    seconds = time.perf_counter() - started
    return {"concurrency": concurrency, **counts, "seconds": seconds,
            "sentences_per_s": counts["sentences"] / seconds if seconds else None,
            "latency_p50_s": _percentile(latencies, 0.50), "latency_p99_s": _percentile(latencies, 0.99)}


@click.command()
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False))
@click.argument("input_path", metavar="INPUT", type=click.Path(exists=True, dir_okay=False))
@click.option("--out", "out_path", required=True, metavar="FILE", help="Where the JSON report goes.")
@click.option("--backend", default="auto", show_default=True, help="As `pipeline serve --backend`.")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="Backend threads (both runs).")
@click.option("--concurrency", default="1,8,64", show_default=True, help="Comma-separated client counts.")
@click.option("--max-lines", type=click.IntRange(min=1), default=2000, show_default=True,
              help="Use at most this many lines of INPUT.")
@click.option("--lines-per-request", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--requests", "n_requests", type=click.IntRange(min=1), default=500, show_default=True,
              help="Requests per concurrency level at most.")
@click.option("--max-seconds", type=click.FloatRange(min=1), default=120, show_default=True,
              help="Time per concurrency level at most.")
@click.option("--server-arg", "server_args", multiple=True,
              help="Extra `pipeline serve` option, repeatable (e.g. --server-arg=--max-wait-ms=10).")
def main(model_dir: str, input_path: str, out_path: str, backend: str, threads: int | None, concurrency: str,
         max_lines: int, lines_per_request: int, n_requests: int, max_seconds: float,
         server_args: tuple[str, ...]) -> None:
    """Throughput and latency of `pipeline serve` against serve-batch on the same lines."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the report
    levels = [int(c) for c in concurrency.split(",") if c.strip()]
    lines = read_lines(input_path)[:max_lines]  # plain or .gz, strict UTF-8, as serve-batch reads it
    lines = [line for line in lines if line.strip()] or ["."]
    common = ["--backend", backend] + (["--threads", str(threads)] if threads else [])
    with tempfile.TemporaryDirectory(prefix="serve-bench-") as tmp:
        log.info("serve-batch on %d lines", len(lines))
        expected, offline = run_serve_batch(model_dir, lines, common, Path(tmp))
        proc, url = start_server(model_dir, common, list(server_args), Path(tmp) / "serve.log")
        try:
            spans = [list(range(i, min(i + lines_per_request, len(lines))))
                     for i in range(0, len(lines), lines_per_request)]
            requests = [spans[k % len(spans)] for k in range(n_requests)]
            results = []
            for c in levels:
                log.info("concurrency %d", c)
                level = asyncio.run(run_level(url, requests, lines, expected, c, max_seconds))
                if offline["sentences_per_s"] and level["sentences_per_s"]:
                    level["vs_serve_batch"] = level["sentences_per_s"] / offline["sentences_per_s"]
                results.append(level)
            rss = peak_rss_mib(proc.pid)
        finally:
            code = stop_server(proc)
    report = {"model_dir": model_dir, "backend": backend, "threads": threads, "lines": len(lines),
              "lines_per_request": lines_per_request, "serve_batch": offline, "levels": results,
              "server_peak_rss_mib": rss, "server_exit_code": code, "server_args": list(server_args)}
    with atomic_output(out_path, "w") as f:
        json.dump(report, f, indent=2)
    click.echo(json.dumps({"levels": [{k: lv[k] for k in ("concurrency", "sentences_per_s", "latency_p50_s",
                                                          "latency_p99_s", "mismatched_lines")} for lv in results],
                           "serve_batch_sentences_per_s": offline["sentences_per_s"], "out": out_path}))


if __name__ == "__main__":
    main()
