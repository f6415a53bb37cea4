"""`pipeline bench DIR [DIR...] [--compare ctranslate2]`: one table over engines and precisions.

Every measurement (engine, precision, batch size) runs in a fresh spawned subprocess, so
its peak RSS (VmHWM) is that engine's alone: in one process the counter cannot separate
engines (freed memory is not returned, libraries stay mapped). The whole set is repeated
`rounds` times in a rotating order, so engines alternate on a shared machine and drift
hits all of them alike; each row reports the median over rounds (peak RSS: the largest).
Every subprocess gets the same source ids and the same thread count, and imports the same
modules (not torch: only the torch engine loads it, as only it needs it), so the RSS baseline
is common to all rows and the differences are the engines' own.

CTranslate2 gets the weights of the first model dir's model.pt (the fp32 checkpoint every
export carries), converted once; its greedy output must be token-identical to our
PyTorch model's before anything is timed. float32 and int8 (compute_type, quantized at
load with per-row scales) are both measured.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import tempfile
from pathlib import Path
from typing import Any

from model.errors import UserError
from model.manifest import SPM_FILE
from pipeline.evaluation import cpu_peak, ctranslate2_compare
from pipeline.evaluation.bench import (
    bench_backend,
    check_fixed_length,
    host_facts,
    host_line,
    make_sources,
    model_column,
    peak_rss_mb,
    vocabulary,
)
from pipeline.evaluation.cpu_peak import peak_line, percent
from runtime.decoding import PAPER
from runtime.languages import ONE_PAIR, Direction, direction
from runtime.machine import usable_cores
from runtime.model_dir import LoadOptions, ModelDir, load
from runtime.registry import entry
from runtime.tokenizer import AnyTokenizer

log = logging.getLogger(__name__)

AGREEMENT_SENTENCES = 16
LATENCY_SENTENCES = 16  # batch 1, beam 4: ms per sentence


def _measure(job: dict[str, Any]) -> dict[str, Any]:
    """One measurement in this (fresh) process; returns a results row."""
    sources = job["sources"]
    if job["engine"] == "ctranslate2":
        translator = ctranslate2_compare.open_translator(Path(job["ct2_dir"]), job["threads"] or 0,
                                                         ctranslate2_compare.COMPUTE_TYPES[job["precision"]],
                                                         inter_threads=job["parallel_batches"])
        row = ctranslate2_compare.bench_translator(translator, job["pieces"], job["batch_size"],
                                                   job["beam_size"], job["fixed_length"], job["alpha"],
                                                   use_vmap=job["shortlist"], prefix=job["target_prefix"],
                                                   parallel_batches=job["parallel_batches"])
        row["shortlist"] = job["shortlist"]
        device = "cpu"
    else:
        given = PAPER.replace(beam_size=job["beam_size"], explicit=frozenset({"beam_size"}))
        options = LoadOptions(device=job["device"], threads=job["threads"], shortlist=job["shortlist"],
                              parallel_batches=job["parallel_batches"]).for_backend(job["engine"])
        loaded = load(job["model_dir"], options, given)  # the model's defaults under it
        backend = loaded.backend
        r = bench_backend(backend, sources, job["batch_size"], loaded.decoding, job["fixed_length"], job["precision"],
                          job["first"])
        row = {"target_tokens": r.target_tokens, "seconds": r.seconds,
               "target_tokens_per_s": r.target_tokens_per_s, "sentences_per_s": r.sentences_per_s,
               "latency_ms_mean": r.latency_ms_mean, "latency_ms_per_sentence": r.latency_ms_per_sentence,
               "shortlist": r.shortlist}
        device = str(backend.device)
    return {**row, "peak_rss_mb": peak_rss_mb(), "device": device}


def _jobs(model_dirs: list[Path], engines: list[str], compare: list[str], ct2_dir: Path | None,
          common: dict[str, Any], shortlist: bool = False) -> list[dict[str, Any]]:
    """One measurement per (model dir, engine) and compared engine over the whole vocabulary; with
    `shortlist`, each also over the shortlist (CTranslate2: its vocabulary map made from the same lists)."""
    jobs: list[dict[str, Any]] = []
    vocabularies = (False, True) if shortlist else (False,)
    for model_dir in model_dirs:
        manifest = ModelDir.open(model_dir, verify=False).manifest
        for engine in engines:
            fp32 = entry(engine).checkpoint_weights  # torch runs model.pt (fp32) whatever the dir
            if fp32 and any(j["engine"] == engine for j in jobs):
                continue  # once is enough
            jobs += [{**common, "engine": engine, "model_dir": str(model_dir),
                      "precision": "fp32" if fp32 else manifest.precision,
                      "quantization": None if fp32 else manifest.quantization, "shortlist": listed}
                     for listed in vocabularies]
    if "ctranslate2" in compare:
        for precision in ctranslate2_compare.COMPUTE_TYPES:
            jobs += [{**common, "engine": "ctranslate2", "ct2_dir": str(ct2_dir),
                      "model_dir": str(model_dirs[0]), "precision": precision,
                      "quantization": "ctranslate2" if precision == "int8" else None, "shortlist": listed}
                     for listed in vocabularies]
    return jobs


def check_same_model(model: Any, tokenizer: AnyTokenizer, ct2_dir: Path, sources: list[list[int]],
                     threads: int | None, way: Direction = ONE_PAIR, pieces: list[str] | None = None,
                     min_agreement: float = 1.0) -> str:
    """"agreed/checked": sentences whose greedy output is token-identical in CTranslate2 and our PyTorch
    model, in the direction `way`; a UserError below `min_agreement` (a share). A trained model agrees on
    all; random weights may tie near-equal candidates differently in the two engines' arithmetic."""
    translator = ctranslate2_compare.open_translator(ct2_dir, threads or 0)
    check = sources[:AGREEMENT_SENTENCES]
    agree = ctranslate2_compare.greedy_agreement(model, tokenizer, translator, check, first=way.first, pieces=pieces)
    if agree < min_agreement * len(check):
        raise UserError(f"CTranslate2's greedy output differs from our PyTorch model on "
                        f"{len(check) - agree}/{len(check)} sentences: the weight mapping does not "
                        "reproduce this model, so the comparison would not be of the same model")
    return f"{agree}/{len(check)}"


def run_comparison(model_dirs: list[Path], engines: list[str], batch_sizes: list[int], *,
                   compare: tuple[str, ...] | list[str] = (), beam_size: int = 4, fixed_length: int | None = None,
                   src: Path | None = None, sentences: int = 256, src_len: int = 20,
                   device: str | None = None, threads: int | None = None, rounds: int = 3,
                   latency: bool = True, shortlist: bool = False, src_lang: str | None = None,
                   tgt_lang: str | None = None, min_agreement: float = 1.0,
                   parallel_batches: int = 1) -> dict[str, Any]:
    """Bench every (model dir, engine) and the compared engines; one row per engine and precision.
    `shortlist`: every engine is measured over the whole vocabulary and over the model dir's shortlist
    (CTranslate2 over its vocabulary map, written from the same lists). src_lang/tgt_lang: a multilingual
    model's direction: every source starts with the source language's token, and every engine forces the
    target language's token first (CTranslate2: target_prefix). `parallel_batches`: ours on onnxruntime decodes
    that many batches at once (--parallel-batches) and CTranslate2 runs as many inter_threads, each engine's
    batches on threads / that many (the latency rows stay one batch at a time: there is only one)."""
    model_dirs = [Path(d) for d in model_dirs]
    if parallel_batches > 1 and threads is None:  # both engines split the same cores (CTranslate2's 0 is its own)
        threads = usable_cores()
    first = ModelDir.open(model_dirs[0], verify=False)  # each measurement's process loads (and verifies) it
    manifest, tokenizer = first.manifest, first.tokenizer
    for other in model_dirs[1:]:  # the sources are the first's ids: another tokenizer would read them as noise
        if ModelDir.open(other, verify=False).manifest.files.get(SPM_FILE) != manifest.files.get(SPM_FILE):
            raise UserError(f"{other}: its {SPM_FILE} differs from {model_dirs[0]}'s; bench compares model dirs of "
                            "one tokenizer (precisions of one model, or a student and its teacher): bench it apart")
    cfg = manifest.model_config
    check_fixed_length(fixed_length, manifest.limits.max_tgt_len)  # before any measurement's process starts
    way = direction(cfg, src_lang, tgt_lang, pair=manifest.language_pair)
    # the model dir's source limit, as one dir's bench takes it (the model's positions let 300 tokens through, and
    # the backend refused them after the CTranslate2 conversion)
    sources = make_sources(tokenizer, src, sentences, src_len, manifest.limits.max_src_len, prefix=way.prefix)
    # an imported model decodes with its own defaults (rules, alpha); CTranslate2 gets the same alpha
    alpha = PAPER.for_model(manifest.decoding).alpha
    report: dict[str, Any] = {"model_dirs": [str(d) for d in model_dirs], "model_config": cfg.to_dict(),
                              "fixed_length": fixed_length, "threads": threads, "rounds": rounds,
                              "shortlist": shortlist, "parallel_batches": parallel_batches,
                              "peak_rss": "VmHWM of a fresh subprocess per measurement",
                              "decoding": manifest.decoding or "the paper's", "src_lang": src_lang,
                              "tgt_lang": tgt_lang}
    with tempfile.TemporaryDirectory(prefix="pipeline-ct2-") as tmp:
        ct2_dir, names = None, [tokenizer.piece(i) for i in range(tokenizer.vocab_size)]
        if "ctranslate2" in compare:
            ct2_dir, model, _, report["ctranslate2_converter"] = ctranslate2_compare.for_model_dir(
                model_dirs[0], Path(tmp) / "ct2")
            # a multilingual model: CTranslate2 gets exactly our ids
            names = ctranslate2_compare.id_pieces(ct2_dir, tokenizer, by_id=way.first is not None)
            report["ctranslate2_greedy_agreement"] = check_same_model(model, tokenizer, ct2_dir, sources, threads,
                                                                      way, names, min_agreement)
            del model
            if shortlist:  # CTranslate2 + vmap: the same lists, as its vocabulary map
                ctranslate2_compare.write_vmap(first.shortlist, ct2_dir, tokenizer)
        pieces = [[names[i] for i in s] for s in sources]
        prefix = ctranslate2_compare.target_prefix(names, way.first, len(sources))
        settings = [(bs, beam_size, sources, pieces) for bs in batch_sizes]
        if latency and 1 not in batch_sizes:  # else batch 1's own row says it (two rows looked the same)
            settings.append((1, beam_size, sources[:LATENCY_SENTENCES], pieces[:LATENCY_SENTENCES]))
        jobs: list[dict[str, Any]] = []
        for bs, beam, srcs, pcs in settings:
            common = {"batch_size": bs, "beam_size": beam, "fixed_length": fixed_length, "threads": threads,
                      "parallel_batches": parallel_batches if bs > 1 else 1,
                      "device": device, "sources": srcs, "pieces": pcs,
                      "alpha": alpha, "first": way.first, "target_prefix": prefix and prefix[:len(srcs)]}
            jobs += _jobs(model_dirs, engines, list(compare), ct2_dir, common, shortlist)
        measured: list[list[dict[str, Any]]] = [[] for _ in jobs]
        ctx = multiprocessing.get_context("spawn")
        for r in range(rounds):
            order = [(i + r) % len(jobs) for i in range(len(jobs))]  # rotate: engines alternate
            for i in order:
                measured[i].append(_in_fresh_process(ctx, jobs[i]))
                log.info("round %d: %s %s (%s) batch %d: %.1f target tokens/s", r + 1, jobs[i]["engine"],
                         jobs[i]["precision"], Path(jobs[i]["model_dir"]).name, jobs[i]["batch_size"],
                         measured[i][-1]["target_tokens_per_s"])
    report["results"] = [_row(job, runs) for job, runs in zip(jobs, measured)]
    if device in (None, "cpu"):  # against the machine: MACs per target token over its int8 / fp32 peak
        peak = cpu_peak.measure(threads).to_dict()
        report["cpu_peak"] = peak
        table = first.shortlist if shortlist else None
        for job, row in zip(jobs, report["results"]):
            cpu_peak.annotate(row, cfg, job["sources"], peak, table)
    report["host"] = host_facts(threads)
    return report


def _in_fresh_process(ctx: Any, job: dict[str, Any]) -> dict[str, Any]:
    """_measure(job) in a new process (spawned: nothing of this one's memory or threads), its exception raised
    here. Interrupted (Ctrl-C to this process alone, as `timeout -s INT` sends it), the child is stopped: a
    ProcessPoolExecutor's shutdown waited on its worker, which sometimes never ended."""
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_measured_into, args=(send, job), daemon=True)
    # Ctrl-C or SIGTERM while the child is started cut the job it reads at its start short: it printed a traceback
    # (UnpicklingError: pickle data was truncated). Held until it has all of it; the child inherits the mask.
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        try:
            child.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)  # an interrupt held is raised here (the child stopped)
            send.close()
        try:
            ok, value = receive.recv()
        except EOFError:  # it died without a word (killed, out of memory)
            child.join()
            raise UserError(f"the measurement of {job['engine']} ({Path(job['model_dir']).name}, batch "
                            f"{job['batch_size']}) ended without a result (exit code {child.exitcode})") from None
        child.join()
    except BaseException:
        if child.pid is not None:  # started
            child.terminate()
            child.join()
        raise
    finally:
        receive.close()
    if not ok:
        raise value
    return value


def _measured_into(send: Any, job: dict[str, Any]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the parent, which stops this
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})  # held while it started: a
    # SIGTERM the parent sent meanwhile (interrupted) ends it here, before any measurement
    try:
        result = (True, _measure(job))
    except Exception as e:  # raised again in the parent, as ProcessPoolExecutor raised a worker's
        result = (False, e)
    send.send(result)
    send.close()


def _row(job: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The job's row: every figure from one round, the (lower) median one by target tokens/s. Each figure's own
    median, over an even number of rounds, averaged two rounds that disagreed (4,667 tok/s beside 282 ms a
    sentence from rounds of 18 and 9,316 tok/s)."""
    mid = sorted(runs, key=lambda r: r["target_tokens_per_s"])[(len(runs) - 1) // 2]

    def med(key: str) -> float:
        return round(mid[key], 2)

    rss = [r["peak_rss_mb"] for r in runs if r["peak_rss_mb"] is not None]
    return {"engine": job["engine"], "precision": job["precision"], "quantization": job["quantization"],
            "shortlist": runs[0].get("shortlist", False), "model_dir": job["model_dir"],
            "device": runs[0]["device"], "batch_size": job["batch_size"], "beam_size": job["beam_size"],
            "sentences": len(job["sources"]), "target_tokens": runs[0]["target_tokens"],
            "target_tokens_per_s": med("target_tokens_per_s"), "sentences_per_s": med("sentences_per_s"),
            "latency_ms_mean": med("latency_ms_mean"), "latency_ms_per_sentence": med("latency_ms_per_sentence"),
            "peak_rss_mb": round(max(rss), 1) if rss else None,
            "rounds_target_tokens_per_s": [r["target_tokens_per_s"] for r in runs]}


def format_comparison(report: dict[str, Any]) -> str:
    """Rows per batch size; ratio columns against CTranslate2 fp32 and int8 of the same batch. With
    several model dirs, a first column names each row's (CTranslate2's: the first dir, converted)."""
    model = model_column(report)
    head = (f"{model({})}{'engine':<12} {'prec':<5} {'quant':<11} {'vocab':<9} {'batch':>5} {'beam':>4} "
            f"{'tgt tok/s':>10} {'ms/sent':>8} {'peak MiB':>8} {'x ct2 fp32':>10} {'x ct2 int8':>10} {'% peak':>6}")
    lines = [head, "-" * len(head)]
    results = report["results"]
    for r in results:
        ct2 = {x["precision"]: x["target_tokens_per_s"] for x in results  # CTranslate2 without its vmap
               if x["engine"] == "ctranslate2" and x["batch_size"] == r["batch_size"] and not x["shortlist"]
               and x.get("sentences") == r.get("sentences")}  # the same work: batch 1's latency rows are fewer
        ratios = [f"{r['target_tokens_per_s'] / ct2[p]:>10.2f}" if ct2.get(p) else f"{'-':>10}"
                  for p in ("fp32", "int8")]
        peak = "-" if r["peak_rss_mb"] is None else f"{r['peak_rss_mb']:.0f}"
        lines.append(f"{model(r)}{r['engine']:<12} {r['precision']:<5} {r['quantization'] or '-':<11} "
                     f"{vocabulary(r):<9} {r['batch_size']:>5} {r['beam_size']:>4} "
                     f"{r['target_tokens_per_s']:>10.1f} {r['latency_ms_per_sentence']:>8.1f} {peak:>8} "
                     + " ".join(ratios) + f" {percent(r):>6}")
    if "ctranslate2_greedy_agreement" in report:
        lines.append(f"CTranslate2 greedy output token-identical to PyTorch on "
                     f"{report['ctranslate2_greedy_agreement']} sentences; medians of {report['rounds']} "
                     "alternating rounds; peak RSS per fresh subprocess; ratios against CTranslate2 over the "
                     "whole vocabulary")
    if report.get("cpu_peak"):
        lines.append(peak_line(report["cpu_peak"]))
    if report.get("host", {}).get("cpu"):
        lines.append(host_line(report["host"]))
    if report.get("ctranslate2_converter"):
        lines.append(f"CTranslate2 converted by {report['ctranslate2_converter']}")
    if report.get("src_lang"):
        lines.append(f"direction {report['src_lang']} -> {report['tgt_lang']}: every source starts with its language "
                     "token, every engine forces the target language's token first (CTranslate2: target_prefix)")
    return "\n".join(lines)
