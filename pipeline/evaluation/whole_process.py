"""`pipeline bench DIR [DIR...] --whole-process FILE [--compare ctranslate2]`: what a user waits for.

Each engine translates FILE in a fresh process, start to exit: interpreter start, imports, model
dir verification and loading, reading, translating and writing. Ours is `pipeline serve-batch
--backend onnxruntime` exactly as a user runs it; CTranslate2's is the short script a user would
write (SentencePiece + `Translator.translate_iterable`) on the same weights (converted from the
model dir's fp32 checkpoint, its greedy output checked token-identical to ours first). Engines
alternate within each round, so drift on a shared machine hits all of them alike; rows report
the median wall time and the largest peak RSS (the process's VmHWM) over rounds.
With `fixed_length`, every sentence gets exactly that many target tokens in every engine, so
all do the same work whatever the weights.
"""

from __future__ import annotations

import logging
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from model.errors import UserError
from model.manifest import CHECKPOINT_FILE, SPM_FILE, read_manifest
from pipeline.evaluation import ctranslate2_compare
from pipeline.textio import read_lines
from runtime.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# The CTranslate2 user's script: arguments ct2_dir spm input output threads beam compute_type fixed_length.
CT2_SCRIPT = """
import sys
import ctranslate2, sentencepiece
ct2_dir, spm, src, out, threads, beam, compute_type, fixed = sys.argv[1:9]
sp = sentencepiece.SentencePieceProcessor(model_file=spm)
translator = ctranslate2.Translator(ct2_dir, device="cpu", compute_type=compute_type,
                                    intra_threads=int(threads), inter_threads=1)
with open(src, encoding="utf-8") as f:
    lines = [line.rstrip("\\n") for line in f]
live = [i for i, line in enumerate(lines) if line.strip()]
opts = dict(beam_size=int(beam), length_penalty=0.6)
if int(fixed):
    opts.update(max_decoding_length=int(fixed), min_decoding_length=int(fixed))
tokens = (sp.encode(lines[i], out_type=str) + ["</s>"] for i in live)
results = translator.translate_iterable(tokens, **opts)
outputs = [""] * len(lines)
for i, r in zip(live, results):
    outputs[i] = sp.decode(r.hypotheses[0])
with open(out, "w", encoding="utf-8") as f:
    f.write("".join(o + "\\n" for o in outputs))
"""


def run_timed(command: list[str], poll_s: float = 0.01) -> tuple[float, float | None]:
    """(wall seconds, peak RSS MB) of a command run to completion in a fresh process.

    Peak RSS is the process's VmHWM, sampled until it exits: the kernel's ru_maxrss would carry
    the forking parent's own peak over fork and exec, so it cannot be used. The last ~10 ms of the
    run are not sampled (teardown, not a peak). None where /proc is not available."""
    started = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak: float | None = None
    status = Path(f"/proc/{proc.pid}/status")
    while proc.poll() is None:
        try:
            m = re.search(r"^VmHWM:\s+(\d+) kB", status.read_text(), re.M)
        except OSError:
            m = None
        if m:
            peak = max(peak or 0.0, int(m.group(1)) / 1024)
        time.sleep(poll_s)
    wall = time.perf_counter() - started
    assert proc.stderr is not None
    err = proc.stderr.read()
    if proc.returncode != 0:
        tail = err.decode(errors="replace").strip().splitlines()[-1:]
        raise UserError(f"{' '.join(command[:4])} ... failed with status {proc.returncode}: {tail}")
    return wall, peak


def ours_command(model_dir: Path, src: Path, out: Path, threads: int, beam_size: int,
                 fixed_length: int | None) -> list[str]:
    cmd = [sys.executable, "-m", "pipeline", "serve-batch", str(model_dir), str(src), "-o", str(out),
           "--backend", "onnxruntime", "--threads", str(threads), "--beam-size", str(beam_size), "--no-progress"]
    if fixed_length:
        cmd += ["--max-len-a", "0", "--max-len-b", str(fixed_length), "--min-len", str(fixed_length)]
    return cmd


def run_whole_process(model_dirs: list[Path], files: list[Path], *, compare: list[str], threads: int,
                      beam_size: int, fixed_length: int | None, rounds: int) -> dict[str, Any]:
    """One row per (engine, precision, file): median wall seconds and peak RSS over rounds."""
    if not files:
        raise UserError("--whole-process needs at least one FILE")
    engines: list[dict[str, Any]] = []
    for d in model_dirs:
        manifest = read_manifest(d, verify=False)
        engines.append({"engine": "onnxruntime", "precision": manifest.precision,
                        "quantization": manifest.quantization, "model_dir": str(d)})
    report: dict[str, Any] = {"model_dirs": [str(d) for d in model_dirs], "threads": threads,
                              "beam_size": beam_size, "fixed_length": fixed_length, "rounds": rounds,
                              "files": {str(f): len(read_lines(f)) for f in files},
                              "measures": "wall: process start to exit (median); "
                                          "peak RSS: VmHWM sampled every 10 ms (max)"}
    with tempfile.TemporaryDirectory(prefix="pipeline-whole-") as tmp:
        if "ctranslate2" in compare:
            from model.checkpoint import load_model  # the weights: the fp32 checkpoint every export carries
            from pipeline.evaluation.transformers_reference import imported_from

            if imported_from(model_dirs[0] / CHECKPOINT_FILE) is not None:
                raise UserError("--whole-process --compare ctranslate2 runs CTranslate2 with a joint SentencePiece "
                                "model, which an imported model does not have; compare imported models with "
                                "`pipeline bench MODEL_DIR --compare ctranslate2`")
            tokenizer = Tokenizer.from_file(model_dirs[0] / SPM_FILE)  # ours: one joint SentencePiece model
            model, _, _ = load_model(model_dirs[0] / CHECKPOINT_FILE)
            ct2_dir = ctranslate2_compare.convert(model, tokenizer, Path(tmp) / "ct2")
            check = [tokenizer.encode_source([f"{i} {i + 1}"])[0] for i in range(8)]
            translator = ctranslate2_compare.open_translator(ct2_dir, threads)
            agree = ctranslate2_compare.greedy_agreement(model, tokenizer, translator, check)
            if agree != len(check):
                raise UserError(f"CTranslate2's greedy output differs from ours on {len(check) - agree} of "
                                f"{len(check)} sentences: not the same model")
            report["ctranslate2_greedy_agreement"] = f"{agree}/{len(check)}"
            del translator, model
            for precision, compute_type in ctranslate2_compare.COMPUTE_TYPES.items():
                engines.append({"engine": "ctranslate2", "precision": precision, "quantization": None,
                                "ct2_dir": str(ct2_dir), "compute_type": compute_type})
        spm = str(model_dirs[0] / SPM_FILE)
        samples: dict[tuple[int, str], list[tuple[float, float | None]]] = {}
        for r in range(rounds):
            order = engines[r % len(engines):] + engines[:r % len(engines)]  # a different engine first
            for f in files:
                for e in order:
                    out = Path(tmp) / "out.txt"
                    if e["engine"] == "ctranslate2":
                        cmd = [sys.executable, "-c", CT2_SCRIPT, e["ct2_dir"], spm, str(f), str(out), str(threads),
                               str(beam_size), e["compute_type"], str(fixed_length or 0)]
                    else:
                        cmd = ours_command(Path(e["model_dir"]), f, out, threads, beam_size, fixed_length)
                    wall, rss = run_timed(cmd)
                    samples.setdefault((engines.index(e), str(f)), []).append((wall, rss))
                    log.info("round %d %s %s %s: %.2f s, %.0f MB", r + 1, e["engine"], e["precision"], f.name,
                             wall, rss or 0)
    report["results"] = [
        {**{k: v for k, v in engines[i].items() if k in ("engine", "precision", "quantization")}, "file": f,
         "lines": report["files"][f], "wall_s": round(statistics.median(w for w, _ in runs), 3),
         "wall_s_all": [round(w, 3) for w, _ in runs],
         "peak_rss_mb": max((round(m, 1) for _, m in runs if m is not None), default=None)}
        for (i, f), runs in samples.items()]
    return report


def format_whole_process(report: dict[str, Any]) -> str:
    head = f"{'engine':<12} {'prec':<5} {'quant':<8} {'file':<28} {'lines':>6} {'wall s':>8} {'peak MB':>8}"
    rows = [head, "-" * len(head)]
    for r in sorted(report["results"], key=lambda r: (r["file"], r["engine"] != "onnxruntime", r["precision"])):
        rows.append(f"{r['engine']:<12} {r['precision']:<5} {r['quantization'] or '-':<8} "
                    f"{Path(r['file']).name[:28]:<28} {r['lines']:>6} {r['wall_s']:>8.2f} "
                    f"{r['peak_rss_mb'] or 0:>8.0f}")
    rows.append(f"whole process, start to exit; median of {report['rounds']} alternating rounds, "
                f"{report['threads']} threads, beam {report['beam_size']}"
                + (f", exactly {report['fixed_length']} target tokens per sentence" if report["fixed_length"] else ""))
    return "\n".join(rows)
