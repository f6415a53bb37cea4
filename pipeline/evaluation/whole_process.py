"""`pipeline bench DIR [DIR...] --whole-process FILE [--compare ctranslate2]`: what a user waits for.

Each engine translates FILE in a fresh process, start to exit: interpreter start, imports, model
dir verification and loading, reading, translating and writing. Ours is `pipeline serve-batch
--backend onnxruntime` exactly as a user runs it; CTranslate2's is the short script a user would
write (SentencePiece + `Translator.translate_iterable`) on the same weights (converted from the
model dir's fp32 checkpoint, its greedy output checked token-identical to ours first). Engines
alternate within each round, so drift on a shared machine hits all of them alike; rows report
the median wall time and the largest peak RSS (the process's VmHWM) over rounds. Before the rounds,
each engine runs once untimed, and Python's bytecode is kept between runs (user_env): the state of
a user who has run the tool before, not of the very first run.
With `fixed_length`, every sentence gets exactly that many target tokens in every engine, so
all do the same work whatever the weights.

Each row also says how long FILE's sources are (source pieces per line, by the model dir's tokenizer,
as serve-batch encodes them) and where the wall time went: start and load (process start to the
model loaded), encoder, decoder and the rest (reading, tokenizing, search, writing, exit). The timed
processes learn where to record this from PIPELINE_TIMINGS (a JSON file path): ours runs serve-batch's
own command line under TIMED_SERVE_BATCH, which times the backend's `encode` and `step` calls
(time.perf_counter around each, about a microsecond a call); CTranslate2's script records when its
translator was loaded (its encoder and decoder are one call, so its split is load and the rest).
"""

from __future__ import annotations

import json
import logging
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from model.errors import UserError
from model.manifest import SPM_FILE
from pipeline.evaluation import ctranslate2_compare
from pipeline.evaluation.bench import check_fixed_length, host_facts, host_line, model_column, vocabulary
from pipeline.evaluation.process_split import (
    TIMED_SERVE_BATCH,
    pieces_summary,
    run_split,
    source_pieces,
    split,
    split_line,
)
from pipeline.textio import read_served_lines
from runtime.decoding import PAPER
from runtime.languages import ONE_PAIR, Direction, direction
from runtime.model_dir import LoadOptions, ModelDir
from runtime.tokenizer import VocabTokenizer

log = logging.getLogger(__name__)

# The CTranslate2 user's script: arguments ct2_dir spm input output threads beam compute_type fixed_length alpha
# max_len, a multilingual model's source and target language tokens ("" for a one-pair model): the source
# starts with the first, the second is the target prefix (forced first), left out of the output text; the
# batches translated at once (inter_threads, each on threads / inter_threads intra-op threads); and the model
# dir's source limit, a longer source cut to it as serve-batch cuts one (its first max_src - 1 tokens + EOS).
CT2_SCRIPT = """
import os, sys, time
import ctranslate2, sentencepiece
(ct2_dir, src_spm, tgt_spm, src, out, threads, beam, compute_type, fixed, alpha, max_len, src_tok,
 tgt_tok, inter, max_src) = sys.argv[1:16]
sp = sentencepiece.SentencePieceProcessor(model_file=src_spm)
sp_out = sentencepiece.SentencePieceProcessor(model_file=tgt_spm)
translator = ctranslate2.Translator(ct2_dir, device="cpu", compute_type=compute_type,
                                    intra_threads=int(threads) // int(inter), inter_threads=int(inter))
loaded_at = time.monotonic()
with open(src, encoding="utf-8") as f:
    lines = [line.rstrip("\\n") for line in f]
live = [i for i, line in enumerate(lines) if line.strip()]
opts = dict(beam_size=int(beam), length_penalty=float(alpha), max_decoding_length=int(max_len))
if int(fixed):
    opts.update(max_decoding_length=int(fixed), min_decoding_length=int(fixed))
head = [src_tok] if src_tok else []
tokens = [(head + sp.encode(lines[i], out_type=str))[:int(max_src) - 1] + ["</s>"] for i in live]
prefix = ([tgt_tok] for _ in live) if tgt_tok else None
results = translator.translate_iterable(tokens, prefix, **opts)
outputs = [""] * len(lines)
for i, r in zip(live, results):
    outputs[i] = sp_out.decode(r.hypotheses[0][1:] if tgt_tok else r.hypotheses[0])
with open(out, "w", encoding="utf-8") as f:
    f.write("".join(o + "\\n" for o in outputs))
if os.environ.get("PIPELINE_TIMINGS"):
    with open(os.environ["PIPELINE_TIMINGS"], "w") as f:
        f.write('{"loaded_at": %r, "source_tokens": %d}' % (loaded_at, sum(map(len, tokens))))
"""

# Ours, timed: `python -m pipeline ARGS` (pipeline/__main__.py) with, where PIPELINE_TIMINGS names a file,
# runtime.model_dir.load wrapped so that the backend it returns has its encode and step calls timed
# (perf_counter deltas summed), and the process's clock (CLOCK_MONOTONIC, the parent's too) read once
# the model is loaded; all written to that file as JSON at exit, an error's exit included.
def _shown(command: list[str]) -> str:
    """A timed command as a user would write it (a `python -c` script by what it runs, not its source)."""
    if command[1:2] == ["-c"]:
        return f"pipeline {command[3]}" if command[2] == TIMED_SERVE_BATCH else "the CTranslate2 script"
    return " ".join(command[:4])


def user_env(tmp: Path) -> dict[str, str]:
    """The environment of the timed processes: as a user's who has run the tool before, Python's
    compiled bytecode is kept between runs (an installed package has it from pip; this machine may set
    PYTHONDONTWRITEBYTECODE, which would make every run compile our modules again). It goes to a cache
    under `tmp`, never into the source tree. PIPELINE_TIMINGS is set only for the timed runs."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PIPELINE_TIMINGS")}
    env["PYTHONPYCACHEPREFIX"] = str(tmp / "pycache")
    return env


# serve-batch's own timings, from its log (runtime/model_dir.py, pipeline/serve_batch/files.py)
_LOADED = re.compile(r"\bloaded in (\d+(?:\.\d+)?) s\b")
_TRANSLATED = re.compile(r"\btranslated \d+ sentences .*? in (\d+(?:\.\d+)?) s:")


def phases(stderr: str) -> dict[str, float]:
    """Where a serve-batch process's time went, as it logged it: `load_s` (the model dir opened and its
    sessions created) and `translate_s` (reading, translating and writing the files). The rest of the
    wall time is the interpreter's start, the imports and the exit."""
    out = {}
    if m := _LOADED.search(stderr):
        out["load_s"] = float(m.group(1))
    if spans := _TRANSLATED.findall(stderr):
        out["translate_s"] = sum(float(x) for x in spans)
    return out


def run_timed(command: list[str], poll_s: float = 0.01, env: dict[str, str] | None = None
              ) -> tuple[float, float | None, str]:
    """(wall seconds, peak RSS MiB, standard error) of a command run to completion in a fresh process.

    Peak RSS is the process's VmHWM, sampled until it exits: the kernel's ru_maxrss would carry
    the forking parent's own peak over fork and exec, so it cannot be used. The last ~10 ms of the
    run are not sampled (teardown, not a peak). None where /proc is not available."""
    with tempfile.TemporaryFile() as log:  # a file, not a pipe: a process that logs more than a pipe holds
        started = time.perf_counter()  # would wait on it for ever
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, env=env)
        peak: float | None = None
        status = Path(f"/proc/{proc.pid}/status")
        try:
            while proc.poll() is None:
                try:
                    m = re.search(r"^VmHWM:\s+(\d+) kB", status.read_text(), re.M)
                except OSError:
                    m = None
                if m:
                    peak = max(peak or 0.0, int(m.group(1)) / 1024)
                time.sleep(poll_s)
        finally:  # Ctrl-C or SIGTERM to bench: the timed process goes too (it ran on for minutes)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        wall = time.perf_counter() - started
        log.seek(0)
        err = log.read()
    if proc.returncode != 0:
        tail = "".join(err.decode(errors="replace").strip().splitlines()[-1:]).removeprefix("error: ")
        raise UserError(f"{_shown(command)} ... failed with status {proc.returncode}: {tail}")
    return wall, peak, err.decode(errors="replace")


def ours_command(model_dir: Path, src: Path, out: Path, threads: int, beam_size: int,
                 fixed_length: int | None, shortlist: bool = False, way: Direction = ONE_PAIR,
                 parallel_batches: int = 1, rules: str | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "pipeline", "serve-batch", str(model_dir), str(src), "-o", str(out),
           "--backend", "onnxruntime", "--threads", str(threads), "--beam-size", str(beam_size), "--no-progress"]
    cmd += ["--parallel-batches", str(parallel_batches)]  # always: serve-batch's own default may differ
    if rules:
        cmd += ["--rules", rules]
    if shortlist:
        cmd.append("--shortlist")
    if way.source:
        cmd += ["--src-lang", way.source, "--tgt-lang", str(way.target)]
    if fixed_length:
        cmd += ["--max-len-a", "0", "--max-len-b", str(fixed_length), "--min-len", str(fixed_length)]
    return cmd


def sentencepiece_files(model_dir: ModelDir, tmp: Path) -> tuple[str, str]:
    """(source, target) SentencePiece model files of a model dir, for the CTranslate2 script: the joint
    model twice, or an imported model's two models written out of its tokenizer bundle."""
    tokenizer = model_dir.tokenizer
    if not isinstance(tokenizer, VocabTokenizer):
        return str(model_dir.file(SPM_FILE)), str(model_dir.file(SPM_FILE))
    (tmp / "source.spm").write_bytes(tokenizer.source_spm)
    (tmp / "target.spm").write_bytes(tokenizer.target_spm)
    return str(tmp / "source.spm"), str(tmp / "target.spm")


def run_whole_process(model_dirs: list[Path], files: list[Path], *, compare: list[str], threads: int,
                      beam_size: int, fixed_length: int | None, rounds: int,
                      shortlist: bool = False, src_lang: str | None = None, tgt_lang: str | None = None,
                      min_agreement: float = 1.0, parallel_batches: int = 1,
                      rules: str | None = None) -> dict[str, Any]:
    """One row per (engine, precision, file): median wall seconds and peak RSS over rounds. `shortlist`:
    ours runs serve-batch --shortlist (CTranslate2 is unchanged). `parallel_batches`: ours runs serve-batch
    --parallel-batches, CTranslate2 as many inter_threads, each engine's batches on threads / that many.
    src_lang/tgt_lang: a multilingual model's direction (serve-batch --src-lang/--tgt-lang; CTranslate2's
    script puts the source language token first and gives the target's as target_prefix)."""
    if not files:
        raise UserError("--whole-process needs at least one FILE")
    for f in files:  # a file of blank lines was timed as a translation of nothing
        if not any(line.strip() for line in read_served_lines(f)):
            raise UserError(f"{f}: has no non-blank line to translate; give a file with sentences")
    # what each dir records (the timed processes load and verify them)
    opened = [ModelDir.open(d, verify=False) for d in model_dirs]
    for o in opened:  # serve-batch stops at the limit while CTranslate2 goes on: the report claimed equal work
        check_fixed_length(fixed_length, o.manifest.limits.max_tgt_len)
    way = direction(opened[0].manifest.model_config, src_lang, tgt_lang, pair=opened[0].manifest.language_pair)
    engines: list[dict[str, Any]] = []
    for d, manifest in zip(model_dirs, (o.manifest for o in opened)):
        engines.append({"engine": "onnxruntime", "precision": manifest.precision,
                        "quantization": manifest.quantization, "model_dir": str(d), "shortlist": shortlist})
    LoadOptions(threads=threads, parallel_batches=parallel_batches).validate()
    report: dict[str, Any] = {"model_dirs": [str(d) for d in model_dirs], "threads": threads,
                              "parallel_batches": parallel_batches,
                              "beam_size": beam_size, "fixed_length": fixed_length, "rounds": rounds,
                              "rules": rules or PAPER.for_model(opened[0].manifest.decoding).rules,
                              "shortlist": shortlist, "src_lang": src_lang, "tgt_lang": tgt_lang,
                              "files": {str(f): len(read_served_lines(f)) for f in files},
                              "measures": "wall: process start to exit (median), after one untimed run of each "
                                          "engine (bytecode compiled and kept, files in the page cache); "
                                          "peak RSS: VmHWM sampled every 10 ms (max)"}
    with tempfile.TemporaryDirectory(prefix="pipeline-whole-") as tmp:
        if "ctranslate2" in compare:
            ct2_dir, model, tokenizer, report["ctranslate2_converter"] = ctranslate2_compare.for_model_dir(
                model_dirs[0], Path(tmp) / "ct2")
            names = ctranslate2_compare.id_pieces(ct2_dir, tokenizer, by_id=way.first is not None)
            check = [[*way.prefix, *tokenizer.encode_source([f"{i} {i + 1}"])[0]] for i in range(8)]
            translator = ctranslate2_compare.open_translator(ct2_dir, threads)
            agree = ctranslate2_compare.greedy_agreement(model, tokenizer, translator, check, first=way.first,
                                                         pieces=names)
            if agree < min_agreement * len(check):
                raise UserError(f"CTranslate2's greedy output differs from ours on {len(check) - agree} of "
                                f"{len(check)} sentences: not the same model")
            report["ctranslate2_greedy_agreement"] = f"{agree}/{len(check)}"
            del translator, model
            for precision, compute_type in ctranslate2_compare.COMPUTE_TYPES.items():
                engines.append({"engine": "ctranslate2", "precision": precision,
                                "quantization": "ctranslate2" if precision == "int8" else None,  # as in-process
                                "model_dir": str(model_dirs[0]), "ct2_dir": str(ct2_dir),
                                "compute_type": compute_type, "shortlist": False})
        spms = sentencepiece_files(opened[0], Path(tmp))
        # CTranslate2 decodes with the model's length penalty, within our length limit and positions
        manifest = opened[0].manifest
        decoding = PAPER.for_model(manifest.decoding)
        max_len = min(decoding.max_len_b if decoding.max_len_a == 0 else 256, manifest.limits.max_tgt_len - 1)
        out = Path(tmp) / "out.txt"
        tokenizer = opened[0].tokenizer
        tokens = [tokenizer.piece(way.prefix[0]) if way.prefix else "",
                  tokenizer.piece(way.first) if way.first is not None else ""]

        def command(e: dict[str, Any], f: Path) -> list[str]:
            if e["engine"] == "ctranslate2":
                return [sys.executable, "-c", CT2_SCRIPT, e["ct2_dir"], *spms, str(f), str(out), str(threads),
                        str(beam_size), e["compute_type"], str(fixed_length or 0), str(decoding.alpha), str(max_len),
                        *tokens, str(parallel_batches), str(manifest.limits.max_src_len)]
            ours = ours_command(Path(e["model_dir"]), f, out, threads, beam_size, fixed_length, e["shortlist"], way,
                                parallel_batches, rules)
            return [sys.executable, "-c", TIMED_SERVE_BATCH, *ours[3:]]  # `python -m pipeline ...`, timed

        env = user_env(Path(tmp))
        timings = Path(tmp) / "timings.json"
        pieces = {(d, str(f)): pieces_summary(source_pieces(Path(d), f, way))
                  for d in {e["model_dir"] for e in engines} for f in files}
        shortest = min(files, key=lambda f: report["files"][str(f)])
        for e in engines:  # untimed: what a user who has run the tool before has (bytecode, page cache)
            run_timed(command(e, shortest), env=env)
        samples: dict[tuple[int, str], list[tuple[float, float | None]]] = {}
        logged: dict[tuple[int, str], list[dict[str, float]]] = {}
        spans: dict[tuple[int, str], list[dict[str, float]]] = {}
        for r in range(rounds):
            order = engines[r % len(engines):] + engines[:r % len(engines)]  # a different engine first
            for f in files:
                for e in order:
                    timings.unlink(missing_ok=True)
                    started = time.monotonic()
                    wall, rss, err = run_timed(command(e, f), env={**env, "PIPELINE_TIMINGS": str(timings)})
                    recorded = json.loads(timings.read_text()) if timings.exists() else {}
                    spans.setdefault((engines.index(e), str(f)), []).append(
                        run_split(started, wall, recorded, batches=parallel_batches))
                    samples.setdefault((engines.index(e), str(f)), []).append((wall, rss))
                    logged.setdefault((engines.index(e), str(f)), []).append(phases(err))
                    log.info("round %d %s %s (%s) %s: %.2f s, %.0f MiB", r + 1, e["engine"], e["precision"],
                             Path(e["model_dir"]).name, f.name, wall, rss or 0)
    report["results"] = [
        {**{k: v for k, v in engines[i].items() if k in ("engine", "precision", "quantization", "shortlist",
                                                          "model_dir")},
         "file": f,
         "lines": report["files"][f], "wall_s": round(statistics.median(w for w, _ in runs), 3),
         "wall_s_all": [round(w, 3) for w, _ in runs],
         "peak_rss_mb": max((round(m, 1) for _, m in runs if m is not None), default=None),
         **_median_phases(logged[i, f]),
         **pieces[engines[i]["model_dir"], f],
         "split": split(statistics.median(w for w, _ in runs), spans[i, f])}
        for (i, f), runs in samples.items()]
    for r in report["results"]:  # the table's x ct2 columns, in the JSON too
        r["x_ct2"] = {p: round(ratio, 3) for p, ratio in _versus_ct2(report["results"], r).items()}
    report["source_pieces"] = ("SentencePiece pieces + EOS per non-blank line of the file (after a multilingual "
                               "model's source language token), by the model dir's tokenizer as serve-batch encodes "
                               "them; CTranslate2's script encodes the same")
    report["split_measures"] = ("load: process start to the model loaded; encoder, decoder: ours' backend encode and "
                                "step calls summed (not with parallel batches); rest: the wall time left (reading, "
                                "tokenizing, search, writing, exit); medians over rounds, adding up to wall_s")
    report["host"] = host_facts(threads)
    return report


def _median_phases(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each phase's median over the runs that logged it (ours; CTranslate2's script logs none)."""
    names = sorted({name for run in runs for name in run})
    return {name: round(statistics.median(run[name] for run in runs if name in run), 3) for name in names}


def _versus_ct2(results: list[dict[str, Any]], row: dict[str, Any]) -> dict[str, float]:
    """CTranslate2's wall time on the row's file over the row's, per CTranslate2 precision run (above 1: the row's
    engine finished first)."""
    return {r["precision"]: r["wall_s"] / row["wall_s"] for r in results
            if r["engine"] == "ctranslate2" and r["file"] == row["file"] and r["wall_s"] and row["wall_s"]}


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_whole_process(report: dict[str, Any]) -> str:
    model = model_column(report)
    against = [p for p in ("fp32", "int8") if any(r["engine"] == "ctranslate2" and r["precision"] == p
                                                   for r in report["results"])]
    head = (f"{model({})}{'engine':<12} {'prec':<5} {'quant':<11} {'vocab':<9} {'file':<28} {'lines':>6} {'wall s':>8} "
            f"{'peak MiB':>8} {'load s':>7} {'decode s':>8}" + "".join(f" {'x ct2 ' + p:>10}" for p in against))
    rows = [head, "-" * len(head)]
    for r in sorted(report["results"], key=lambda r: (r["file"], r["engine"] != "onnxruntime", r["precision"])):
        versus = _versus_ct2(report["results"], r)
        ratios = "".join(f" {versus[p]:>10.2f}" if p in versus else f" {'-':>10}" for p in against)
        rows.append(f"{model(r)}{r['engine']:<12} {r['precision']:<5} {r['quantization'] or '-':<11} "
                    f"{vocabulary(r):<9} {Path(r['file']).name[:28]:<28} {r['lines']:>6} {r['wall_s']:>8.2f} "
                    f"{r['peak_rss_mb'] or 0:>8.0f} {_seconds(r.get('load_s')):>7} {_seconds(r.get('translate_s')):>8}"
                    + ratios)
    rows.append(f"whole process, start to exit; median of {report['rounds']} alternating rounds, "
                f"{report['threads']} thread{'s' if report['threads'] != 1 else ''}, beam {report['beam_size']}"
                + (f", {report['parallel_batches']} batches at once in every engine"
                   if report.get("parallel_batches", 1) > 1 else "")
                + (f", exactly {report['fixed_length']} target tokens per sentence" if report["fixed_length"] else "")
                + (f", {report['src_lang']} -> {report['tgt_lang']}" if report.get("src_lang") else "")
                + ("; x ct2: CTranslate2's wall time on the file over the row's (above 1: the row's engine finished "
                   "first)" if against else ""))
    if any("split" in r for r in report["results"]):
        several_dirs, several_files = len(report["model_dirs"]) > 1, len({r["file"] for r in report["results"]}) > 1
        rows += [split_line(r, several_dirs, several_files) for r in sorted(
            report["results"], key=lambda r: (r["file"], r["engine"] != "onnxruntime", r["model_dir"], r["precision"]))]
        rows.append("source pieces: SentencePiece pieces + EOS per non-blank line; load: process start to the model "
                    "loaded; encoder, decoder: the backend's calls; the rest: reading, tokenizing, search, writing, "
                    "exit")
    if report.get("host"):
        rows.append(host_line(report["host"]))
    if any("load_s" in r for r in report["results"]):
        rows.append("load s, decode s: serve-batch's own log (the model dir opened and its sessions created; reading, "
                    "translating, writing); the rest of the wall time is the interpreter's start, imports and exit")
    if "ctranslate2_converter" in report:
        rows.append(f"CTranslate2 converted by {report['ctranslate2_converter']}; greedy output token-identical to "
                    f"PyTorch on {report['ctranslate2_greedy_agreement']} sentences")
        if not report["fixed_length"]:
            rules = report.get("rules", "fairseq")
            rows.append(f"search rules: ours {rules}, CTranslate2 top-beam (its early exit, the only rule its Python "
                        "API runs)" + ("" if rules == "top-beam" else "; --rules top-beam compares like for like"))
    return "\n".join(rows)
