#!/usr/bin/env python
"""Glossaries (constrained beam search) measured on the terminology set of scripts/terminology_set.py.

    python scripts/terminology_set.py --data /work/shared/corpora/multi30k --out runs/terms
    python scripts/glossary_bench.py MODEL_DIR runs/terms --backends torch,onnxruntime --threads 2 \\
        --json runs/terms/bench.json

Every translation is `pipeline serve-batch MODEL INPUT --output X [--glossary G] --backend B --threads N`
in a subprocess, as a user runs it. For each backend:
  test.de    without and with glossary.tsv: term use and BLEU against test.en (sacreBLEU corpus BLEU)
  forced.de  without and with forced.tsv (targets the model would not choose): term use; BLEU, which the
             forced terms are expected to lower
  all.de     without and with glossary.tsv: the lines holding no term must come out identical (100%)
  speed.de   without and with speed.tsv, alternately, --rounds rounds each: the process's wall time and
             the translation time serve-batch reports; medians and their ratio
and across the first two backends: the share of identical lines (and of whitespace tokens at equal
positions) of their translations of test.de and forced.de with the glossary.

Term use is WMT 2021's terminology measure: over every (line, entry) whose source term occurs in the
source (whole word, case-insensitive), the share whose output holds the target term as a whole word:
case-sensitive as the glossary writes it, and case-insensitive. A serve-batch failure (e.g. a
serve-batch without --glossary) stops the bench with serve-batch's own error message.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from terminology_set import has_term, read_glossary, term_use  # noqa: E402

SUMMARY = re.compile(r"translated (\d+) sentences .* in ([0-9.]+) s")
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8")


class BenchError(SystemExit):
    pass


def cpu_description(cpuinfo: str | None = None) -> dict[str, Any]:
    """The CPU's model name, logical CPUs and which of CPU_FLAGS it has (Linux /proc/cpuinfo)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            cpuinfo = ""
    model, flags = "", set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and not model:
            model = value.strip()
        elif key.strip() in ("flags", "Features") and not flags:
            flags = set(value.split())
    model = model or platform.processor() or platform.machine()
    return {"model": model, "logical_cpus": os.cpu_count(), "flags": {f: f in flags for f in CPU_FLAGS}}


def pipeline_command(given: str | None = None) -> list[str]:
    """`given` (split on whitespace), else the `pipeline` beside this Python, else on PATH, else `python -m
    pipeline`."""
    if given:
        return given.split()
    beside = Path(sys.executable).with_name("pipeline")
    exe = str(beside) if beside.is_file() and os.access(beside, os.X_OK) else shutil.which("pipeline")
    return [exe] if exe else [sys.executable, "-m", "pipeline"]


def serve_batch(model: Path, src: Path, out: Path, backend: str, threads: int | None,
                glossary: Path | None = None, extra: list[str] | None = None,
                pipeline: list[str] | None = None) -> dict[str, Any]:
    """One serve-batch run: its output lines, wall seconds and the translation seconds it reports."""
    cmd = [*(pipeline or pipeline_command()), "serve-batch", str(model), str(src), "--output", str(out),
           "--backend", backend, "--no-progress"]
    if threads is not None:
        cmd += ["--threads", str(threads)]
    if glossary is not None:
        cmd += ["--glossary", str(glossary)]
    cmd += extra or []
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        message = proc.stderr.strip() or proc.stdout.strip() or "(no output)"
        raise BenchError(f"serve-batch failed (exit {proc.returncode}): {' '.join(cmd)}\n{message}")
    found = SUMMARY.findall(proc.stderr)
    return {"lines": out.read_text(encoding="utf-8").split("\n")[:-1], "wall_s": wall,
            "translate_s": float(found[-1][1]) if found else None}


def read_lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").split("\n")[:-1] if path.stat().st_size else []


def bleu(hyps: list[str], refs: list[str]) -> float:
    import sacrebleu

    return round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2)


def rates(entries: list[tuple[str, str]], sources: list[str], outputs: list[str]) -> dict[str, Any]:
    used, total = term_use(entries, sources, outputs, case_sensitive=True)
    used_ci, _ = term_use(entries, sources, outputs, case_sensitive=False)
    return {"occurrences": total, "used": used, "term_use": round(used / total, 4) if total else None,
            "used_ci": used_ci, "term_use_ci": round(used_ci / total, 4) if total else None}


def agreement(a: list[str], b: list[str]) -> dict[str, float]:
    """Identical lines, and whitespace tokens equal at equal positions over the longer line's length."""
    same = sum(x == y for x, y in zip(a, b))
    equal = total = 0
    for x, y in zip(a, b):
        xt, yt = x.split(), y.split()
        equal += sum(p == q for p, q in zip(xt, yt))
        total += max(len(xt), len(yt))
    return {"identical_lines": round(same / max(1, len(a)), 4), "token_agreement": round(equal / max(1, total), 4)}


def untouched(entries: list[tuple[str, str]], sources: list[str], plain: list[str], glossed: list[str]) -> dict:
    """Of the lines holding no glossary source term: how many translate identically with the glossary."""
    rows = [i for i, src in enumerate(sources) if not any(has_term(src, s) for s, _ in entries)]
    same = sum(plain[i] == glossed[i] for i in rows)
    return {"lines_without_terms": len(rows), "identical": same,
            "identical_share": round(same / len(rows), 4) if rows else None}


def bench_backend(model: Path, sets: Path, work: Path, backend: str, threads: int | None, rounds: int,
                  extra: list[str], pipeline: list[str]) -> dict[str, Any]:
    def run(name: str, glossary: str | None, tag: str = "") -> dict[str, Any]:
        out = work / f"{backend}.{name}.{'glossary' if glossary else 'plain'}{tag}.en"
        return serve_batch(model, sets / f"{name}.de", out, backend, threads,
                           sets / glossary if glossary else None, extra, pipeline)

    glossary, forced, speed = (read_glossary(sets / f) for f in ("glossary.tsv", "forced.tsv", "speed.tsv"))
    result: dict[str, Any] = {}
    outputs: dict[str, list[str]] = {}
    for name, entries, gfile in (("test", glossary, "glossary.tsv"), ("forced", forced, "forced.tsv"),
                                 ("all", glossary, "glossary.tsv")):
        src, ref = read_lines(sets / f"{name}.de"), read_lines(sets / f"{name}.en")
        glossed, plain = run(name, gfile), run(name, None)  # glossary first: a serve-batch without it fails fast
        outputs[name] = glossed["lines"]
        result[name] = {
            "lines": len(src),
            "plain": {"bleu": bleu(plain["lines"], ref), **rates(entries, src, plain["lines"])},
            "glossary": {"bleu": bleu(glossed["lines"], ref), **rates(entries, src, glossed["lines"])},
            "without_terms": untouched(entries, src, plain["lines"], glossed["lines"]),
        }
    walls: dict[str, list[float]] = {"plain": [], "glossary": []}
    inner: dict[str, list[float]] = {"plain": [], "glossary": []}
    speed_src = read_lines(sets / "speed.de")
    last: dict[str, list[str]] = {}
    for r in range(rounds):
        for kind in (("plain", "glossary") if r % 2 == 0 else ("glossary", "plain")):
            got = run("speed", "speed.tsv" if kind == "glossary" else None, f".{r}")
            walls[kind].append(got["wall_s"])
            if got["translate_s"] is not None:
                inner[kind].append(got["translate_s"])
            last[kind] = got["lines"]
    med = {k: statistics.median(v) for k, v in walls.items()}
    med_inner = {k: statistics.median(v) for k, v in inner.items() if v}
    result["speed"] = {
        "lines": len(speed_src),
        "lines_with_terms": sum(any(has_term(s, t) for t, _ in speed) for s in speed_src),
        "rounds": rounds, "wall_s": walls, "translate_s": inner,
        "median_wall_s": {k: round(v, 3) for k, v in med.items()},
        "wall_ratio": round(med["glossary"] / med["plain"], 3),
        "median_translate_s": {k: round(v, 3) for k, v in med_inner.items()},
        "translate_ratio": round(med_inner["glossary"] / med_inner["plain"], 3) if len(med_inner) == 2 else None,
        "without_terms": untouched(speed, speed_src, last["plain"], last["glossary"]),
    }
    result["_outputs"] = outputs
    return result


def markdown(report: dict[str, Any]) -> str:
    cpu = report["cpu"]
    flags = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in cpu["flags"].items())
    out = [f"CPU: {cpu['model']} ({cpu['logical_cpus']} logical CPUs; {flags}); --threads {report['threads']}",
           f"model: {report['model']}; sets: {report['sets']}", "",
           "| backend | set | lines | BLEU plain | BLEU glossary | term use plain | term use glossary "
           "| (case-insens.) | no-term lines identical |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}%"

    for backend, r in report["backends"].items():
        for name in ("test", "forced", "all"):
            s = r[name]
            p, g, w = s["plain"], s["glossary"], s["without_terms"]
            out.append(f"| {backend} | {name} | {s['lines']} | {p['bleu']:.2f} | {g['bleu']:.2f} "
                       f"| {pct(p['term_use'])} | {pct(g['term_use'])} ({g['used']}/{g['occurrences']}) "
                       f"| {pct(g['term_use_ci'])} | {pct(w['identical_share'])} of {w['lines_without_terms']} |")
    out += ["", "| backend | speed.de lines (with terms) | median wall plain | median wall glossary | ratio "
                "| median translate plain | median translate glossary | ratio | no-term lines identical |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for backend, r in report["backends"].items():
        s = r["speed"]
        mt = s["median_translate_s"]
        w = s["without_terms"]
        out.append(f"| {backend} | {s['lines']} ({s['lines_with_terms']}) | {s['median_wall_s']['plain']:.2f} s "
                   f"| {s['median_wall_s']['glossary']:.2f} s | {s['wall_ratio']:.2f}x "
                   f"| {mt.get('plain', float('nan')):.2f} s | {mt.get('glossary', float('nan')):.2f} s "
                   f"| {s['translate_ratio'] or float('nan'):.2f}x "
                   f"| {100 * (w['identical_share'] or 0):.1f}% of {w['lines_without_terms']} |")
    for pair, agree in report.get("agreement", {}).items():
        out += ["", f"{pair} with the glossary: " + "; ".join(
            f"{name}: {100 * a['identical_lines']:.1f}% identical lines, {100 * a['token_agreement']:.1f}% tokens"
            for name, a in agree.items())]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path, help="an exported model dir")
    ap.add_argument("sets", type=Path, help="scripts/terminology_set.py's --out dir")
    ap.add_argument("--backends", default="torch,onnxruntime", help="comma-separated [%(default)s]")
    ap.add_argument("--threads", type=int, default=None, help="serve-batch --threads, the same for every run")
    ap.add_argument("--rounds", type=int, default=3, help="speed rounds of each kind, alternating [%(default)s]")
    ap.add_argument("--json", type=Path, help="write the report here")
    ap.add_argument("--work", type=Path, help="keep the translations here [default: a temp dir, removed]")
    ap.add_argument("--pipeline", metavar="CMD",
                    help="the pipeline command [default: the one beside this Python, else on PATH, else "
                         "python -m pipeline]")
    ap.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                    help="one more serve-batch argument for every run (repeatable), e.g. --serve-arg=--beam-size=4")
    args = ap.parse_args()
    needed = ["test.de", "test.en", "glossary.tsv", "forced.de", "forced.en", "forced.tsv", "all.de", "all.en",
              "speed.de", "speed.tsv"]
    missing = [n for n in needed if not (args.sets / n).is_file()]
    if missing:
        raise SystemExit(f"{args.sets}: missing {', '.join(missing)}; run scripts/terminology_set.py --out "
                         f"{args.sets} first")
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not backends or args.rounds < 1:
        raise SystemExit("need at least one backend and one round")
    pipeline = pipeline_command(args.pipeline)
    with tempfile.TemporaryDirectory(prefix="glossary-bench-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        report: dict[str, Any] = {"cpu": cpu_description(), "threads": args.threads, "model": str(args.model),
                                  "sets": str(args.sets), "serve_args": args.serve_arg,
                                  "pipeline": " ".join(pipeline), "backends": {}}
        for backend in backends:
            print(f"{backend}: translating ...", file=sys.stderr, flush=True)
            report["backends"][backend] = bench_backend(args.model, args.sets, work, backend, args.threads,
                                                        args.rounds, args.serve_arg, pipeline)
        if len(backends) >= 2:
            a, b = (report["backends"][x].pop("_outputs") for x in backends[:2])
            report["agreement"] = {f"{backends[0]} vs {backends[1]}": {n: agreement(a[n], b[n])
                                                                        for n in ("test", "forced")}}
        for r in report["backends"].values():
            r.pop("_outputs", None)
    print(markdown(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
