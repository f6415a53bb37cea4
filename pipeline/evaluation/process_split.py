"""Where a whole-process run's time goes, and what its input is like (`pipeline bench --whole-process`): the
source pieces per line of a file as serve-batch encodes them, and the split of each run's wall time into
load, encoder, decoder and the rest. Ours runs under TIMED_SERVE_BATCH, which wraps the loaded backend's
`encode` and `step` and writes their times to the file PIPELINE_TIMINGS names (docs/performance.md)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from pipeline.textio import read_served_lines
from runtime.languages import ONE_PAIR, Direction
from runtime.model_dir import ModelDir
from runtime.translate import encode_sources

TIMED_SERVE_BATCH = """
import os, time
path = os.environ.get("PIPELINE_TIMINGS")
if path:
    import runtime.model_dir
    spent = {"encoder_s": 0.0, "decoder_s": 0.0, "encoder_calls": 0, "decoder_steps": 0}
    clock, load = time.perf_counter, runtime.model_dir.load

    def timed(method, seconds, calls):
        def call(*args, **kwargs):
            started = clock()
            try:
                return method(*args, **kwargs)
            finally:
                spent[seconds] += clock() - started
                spent[calls] += 1
        return call

    def timed_load(*args, **kwargs):
        loaded = load(*args, **kwargs)
        spent["loaded_at"] = time.monotonic()
        backend = loaded.backend
        backend.encode = timed(backend.encode, "encoder_s", "encoder_calls")
        backend.step = timed(backend.step, "decoder_s", "decoder_steps")
        on_device = backend.search_on_device

        def device_search(*args, **kwargs):  # the whole search on the device: its time less the encoder's
            started, encoder = clock(), spent["encoder_s"]
            try:
                return on_device(*args, **kwargs)
            finally:
                spent["decoder_s"] += clock() - started - (spent["encoder_s"] - encoder)
        backend.search_on_device = device_search
        return loaded

    runtime.model_dir.load = timed_load
from pipeline.cli import main
try:
    main()
finally:
    if path:
        import json
        with open(path, "w") as f:
            json.dump(spent, f)
"""


def source_pieces(model_dir: Path, path: Path, way: Direction = ONE_PAIR) -> list[int]:
    """Source tokens of each non-blank line of `path` as serve-batch encodes them with `model_dir`'s
    tokenizer: its SentencePiece pieces + EOS (after a multilingual model's source language token), a
    line over the model's source limit cut to it. Blank lines are left out (never translated)."""
    opened = ModelDir.open(model_dir, verify=False)  # what the dir records; serve-batch verifies what it loads
    sources = encode_sources(opened.tokenizer, read_served_lines(path), opened.manifest.limits.max_src_len,
                             prefix=way.prefix)
    return [len(ids) for ids in sources.ids if ids]


def pieces_summary(counts: list[int]) -> dict[str, float | None]:
    """Mean, median and 95th percentile (nearest rank) of source pieces per line; None for a file of
    blank lines."""
    if not counts:
        return {"source_pieces_per_line": None, "source_pieces_p50": None, "source_pieces_p95": None}
    ranked = sorted(counts)
    return {"source_pieces_per_line": round(statistics.fmean(counts), 2),
            "source_pieces_p50": float(statistics.median(counts)),
            "source_pieces_p95": float(ranked[max(0, math.ceil(0.95 * len(ranked)) - 1)])}


def run_split(started: float, wall: float, timings: dict[str, Any], batches: int = 1) -> dict[str, float]:
    """One run's seconds by phase from what the process recorded (PIPELINE_TIMINGS) and the parent's
    clock when it started the process: `load_s` from that start to the model loaded, and ours' summed
    `encoder_s` and `decoder_s` with the counts of calls. With `batches` decoded at once (serve-batch's CPU
    default), the sums are over that many batch threads: each is divided by it, a batch thread's mean
    (`batches_at_once` says so). Empty when the process recorded nothing or its clock is not the parent's."""
    if "loaded_at" not in timings or not 0 <= timings["loaded_at"] - started <= wall:
        return {}
    out = {"load_s": timings["loaded_at"] - started}
    if "encoder_s" in timings:
        out.update({k: float(timings[k]) / batches for k in ("encoder_s", "decoder_s")})
        out.update({k: float(timings[k]) for k in ("encoder_calls", "decoder_steps")})
        if batches > 1:
            out["batches_at_once"] = float(batches)
    return out


def split(wall_s: float, runs: list[dict[str, float]]) -> dict[str, float | None] | None:
    """Where the row's wall time went: each measured phase's median over the runs, and `rest_s` the wall time
    left (reading, tokenizing, search outside the backend's calls, writing, the interpreter's exit; for
    CTranslate2 also the encoder and decoder), so the phases add up to `wall_s`;
    each also as a percentage of it."""
    measured = [run for run in runs if run]
    if not measured:
        return None
    out: dict[str, float | None] = {}
    for name in ("load_s", "encoder_s", "decoder_s", "encoder_calls", "decoder_steps"):
        values = [run[name] for run in measured if name in run]
        out[name] = statistics.median(values) if values else None
    at_once = max(int(run.get("batches_at_once", 1)) for run in measured)
    out["rest_s"] = wall_s - sum(out[k] or 0.0 for k in ("load_s", "encoder_s", "decoder_s"))
    for name in ("load", "encoder", "decoder", "rest"):
        seconds = out[f"{name}_s"]
        out[f"{name}_pct"] = None if seconds is None or wall_s <= 0 else round(100 * seconds / wall_s, 1)
        out[f"{name}_s"] = None if seconds is None else round(seconds, 3)
    for name in ("encoder_calls", "decoder_steps"):
        out[name] = None if out[name] is None else round(out[name])  # type: ignore[arg-type]
    if at_once > 1:
        out["batches_at_once"] = at_once
    return out


def _phase(name: str, split: dict[str, Any], key: str) -> str:
    return f"{name} {split[key + '_s']:.2f} s ({split[key + '_pct']:.0f}%)"


def split_line(r: dict[str, Any], several_dirs: bool, several_files: bool) -> str:
    """One row's source pieces per line and split of its wall time, in a line:
    `ours fp32: 15.2 source pieces/line (p50 15, p95 27); load 0.41 s (8%), encoder 0.62 s (12%), decoder
    3.50 s (69%), I/O and the rest 0.55 s (11%)`."""
    name = ("ours" if r["engine"] == "onnxruntime" else r["engine"]) + " " + r["precision"]
    name += f" {Path(r['model_dir']).name}" if several_dirs and r["engine"] == "onnxruntime" else ""
    name += f" {Path(r['file']).name}" if several_files else ""
    mean = r.get("source_pieces_per_line")
    line = f"{name}: " + ("no source pieces (blank lines only)" if mean is None else
                          f"{mean:.1f} source pieces/line (p50 {r['source_pieces_p50']:.0f}, "
                          f"p95 {r['source_pieces_p95']:.0f})")
    s = r.get("split")
    if not s:
        return line + "; split not recorded"
    if s.get("encoder_s") is None:
        return line + f"; {_phase('load', s, 'load')}, {_phase('translating, I/O and the rest', s, 'rest')}"
    at_once = s.get("batches_at_once", 1)
    return line + (f"; {_phase('load', s, 'load')}, {_phase('encoder', s, 'encoder')}, "
                   f"{_phase('decoder', s, 'decoder')}, {_phase('I/O and the rest', s, 'rest')}"
                   + (f" (encoder, decoder: a batch thread's mean, {at_once} batches at once)" if at_once > 1 else ""))
