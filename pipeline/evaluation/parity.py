"""`pipeline parity`: does each deployed backend translate as the PyTorch model does?

Per backend: BLEU and chrF against the references, BLEU against the PyTorch output, the
share of sentences token-identical to PyTorch, and for the ones that differ the first
step where they diverge and the PyTorch model's log-prob gap there (how close the call
was: fp16 noise shows as tiny gaps on near-ties, a bug as large ones; pipeline/evaluation/divergence.py).

With `shortlist` every listed backend decodes over the model dir's vocabulary shortlist (runtime/shortlist.py),
torch included, while the reference stays the full-vocabulary fp32 PyTorch model: its precision reads
e.g. "fp32+shortlist", it is gated by BLEU like a precision (DEFAULT_GATES["shortlist"]), and
`shortlist_coverage` says how many of the reference's tokens were among their sentence's candidates.

Every backend translates SRC through serve-batch's own path (pipeline.serve_batch.files.translate_windows:
reading, blank and long line policy, encoding, batching, search, formatting), so the
numbers describe exactly what serve-batch writes; --save-hyps keeps those outputs.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sacrebleu

from model.errors import UserError
from model.manifest import CHECKPOINT_FILE, REFERENCES_FILE
from pipeline.evaluation.divergence import Divergence, ModelOnDemand, divergence_gaps
from pipeline.evaluation.parity_options import DEFAULT_GATES, REFERENCE, REFERENCES, SHORTLISTED, Gate, gate_for
from pipeline.invocation import command_line
from pipeline.serve_batch.files import translate_windows, warn_min_len
from pipeline.serve_batch.translation import ServeBatchOptions
from pipeline.textio import atomic_output, read_lines
from runtime.backend import Backend
from runtime.languages import own_languages
from runtime.model_dir import LoadOptions, ModelDir, check_load, load
from runtime.registry import installed
from runtime.tokenizer import AnyTokenizer

if TYPE_CHECKING:
    from runtime.torch_backend import TorchBackend

log = logging.getLogger(__name__)

@dataclass
class BackendResult:
    backend: str
    precision: str
    device: str
    seconds: float
    bleu: float
    chrf: float
    bleu_vs_torch: float
    identical: float            # share of sentences token-identical to PyTorch
    n_different: int
    bleu_delta: float           # bleu - torch's bleu
    max_log_prob_gap: float | None
    median_divergence_step: float | None
    divergences: list[Divergence] = field(default_factory=list)
    # decoding over the shortlist: the share of the reference's tokens (EOS counted) among their own sentence's
    # candidates, a lower bound (a batch decodes over the union of its sentences'); None: full vocabulary
    shortlist_coverage: float | None = None
    passed: bool = True
    failures: list[str] = field(default_factory=list)


@dataclass
class ParityReport:
    model_dir: str
    src: str
    ref: str
    sentences: int
    beam_size: int
    bleu_signature: str
    chrf_signature: str
    results: list[BackendResult]
    reference: str = REFERENCE  # what "identical" and "BLEU/torch" compare with (REFERENCES)
    shortlist: bool = False     # the backends decoded over the model dir's vocabulary shortlist
    lines: int | None = None    # every line of SRC, blank ones too: BLEU and chrF score all of them

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    def to_json(self) -> dict[str, Any]:
        return dict(asdict(self), passed=self.passed)


def check_gate(result: BackendResult, gate: Gate) -> None:
    if gate.min_identical is not None and result.identical < gate.min_identical:
        result.failures.append(
            f"identical {result.identical:.1%} < {gate.min_identical:.1%}")
    if gate.max_bleu_delta is not None and abs(result.bleu_delta) > gate.max_bleu_delta:
        result.failures.append(f"|dBLEU| {abs(result.bleu_delta):.2f} > {gate.max_bleu_delta}")
    result.passed = not result.failures


@dataclass
class Served:
    """One backend's translation of SRC, as serve-batch would have written it."""

    lines: list[str]            # the output lines
    sources: list[list[int]]    # source ids the backend saw ([] for blank lines)
    tokens: list[list[int]]     # best hypothesis per line ([] for blank lines)
    seconds: float
    truncated: int
    min_len_over: int = 0       # lines whose maximum output length is below --min-len


def translate_as_served(backend: Backend, tokenizer: AnyTokenizer, src: Path, opts: ServeBatchOptions) -> Served:
    """SRC through the serving path (one process), collected for comparison."""
    t0 = time.perf_counter()
    windows = list(translate_windows(backend, tokenizer, str(src), opts))
    seconds = time.perf_counter() - t0
    return Served([line for w in windows for line in w.lines], [s for w in windows for s in w.sources],
                  [t for w in windows for t in w.best], seconds, sum(w.truncated for w in windows),
                  sum(w.min_len_over for w in windows))


def count_lines(path: Path) -> int:
    """Lines as serve-batch splits them (on b'\\n'), checked to be UTF-8 with text on one of them: parity reads
    SRC once per backend, so it must be a file (stdin or a pipe would be empty the second time)."""
    if str(path) != "-" and not os.path.exists(path):
        raise UserError(f"{path}: no such file")
    if os.path.isdir(path):
        raise UserError(f"{path}: is a directory; give the source file")
    if str(path) == "-" or not os.path.isfile(path):
        raise UserError(f"{path}: parity translates --src once per backend and reads it again each time: give a "
                        "file, not stdin or a pipe")
    lines = read_lines(path)  # invalid UTF-8 named by file and line
    if not any(line.strip() for line in lines):
        raise UserError(f"{path}: no line with text to translate; parity would pass having compared nothing")
    return len(lines)


def _warn(served: Served, src: Path, opts: ServeBatchOptions) -> None:
    """What serve-batch would have warned of, translating SRC so."""
    if served.truncated:
        log.warning("%s: %d line(s) longer than the model's source limit were truncated, as serve-batch "
                    "does", src, served.truncated)
    warn_min_len(served.min_len_over, str(src), opts.decoding)


def save_hypotheses(served: Served, directory: Path, backend: str, precision: str) -> Path:
    path = directory / f"{backend}.{precision}.txt"
    with atomic_output(path) as f:
        f.write("".join(line + "\n" for line in served.lines))
    return path


def run_parity(model_dir: Path, src: Path | None, ref: Path | None, backends: list[str], *,
               opts: ServeBatchOptions | None = None, device: str | None = None,
               gates: dict[str, Gate] | None = None, threads: int | None = None,
               save_hyps: Path | None = None, reference_engine: str = REFERENCE,
               hf_dir: Path | None = None, shortlist: bool = False) -> ParityReport:
    """Parity of each backend against the fp32 PyTorch model, translated as serve-batch translates
    with `opts` [default: serve-batch's defaults]: on SRC against REF with the PyTorch model run
    live, or, with src and ref None, on the held-out lines recorded in the model dir at export
    (runtime/references.py; their own decoding options), which needs no PyTorch. save_hyps: a
    directory that receives each backend's output as <backend>.<precision>.txt.

    reference_engine "transformers": the reference is transformers' generate on the directory an
    imported model came from (hf_dir, by default the one its checkpoint records), with the model dir's
    decoding; every backend, torch included, is gated against it.

    shortlist: every backend (torch too) decodes over the model dir's vocabulary shortlist; the reference
    is still the full-vocabulary model (module docstring)."""
    gates = gates or DEFAULT_GATES
    if reference_engine not in REFERENCES:
        raise UserError(f"--reference {reference_engine!r}: choose one of {', '.join(REFERENCES)}")
    if not backends:
        raise UserError("parity needs at least one backend to compare (--backends)")
    if (src is None) != (ref is None):
        raise UserError("give both --src and --ref, or neither (to use the model dir's recorded references)")
    if src is None and reference_engine == REFERENCE:
        return _recorded_parity(model_dir, backends, device, gates, threads, save_hyps, shortlist)
    if src is None:
        raise UserError("--reference transformers translates --src (with --ref for BLEU)")
    assert ref is not None
    opts = (opts or ServeBatchOptions()).validate()
    if opts.decoding.nbest != 1:
        raise UserError(f"parity compares best translations; --nbest must be 1 (got {opts.decoding.nbest})")
    ref_lines = read_lines(ref)
    n_src = count_lines(src)
    if n_src != len(ref_lines):
        raise UserError(f"{src} has {n_src} lines but {ref} has {len(ref_lines)}; "
                        "source and reference must be line-aligned")
    if not installed("torch"):
        raise UserError("parity against the PyTorch model run live needs PyTorch (pip install -e \".[train]\"); "
                        "leave out --src/--ref to gate against the references recorded in the model dir")

    # The reference is the fp32 PyTorch model on the CPU, whatever the export precision (or transformers).
    opened = ModelDir.open(model_dir)  # the manifest read and verified once, for every backend
    _check_backends(opened, backends, device, threads, shortlist)
    loaded = load(opened, LoadOptions(backend=REFERENCE, device="cpu", threads=threads, precision="fp32"),
                  opts.decoding)  # with the model's own decoding defaults for what is not given
    reference, tokenizer = loaded.backend, loaded.tokenizer
    from runtime.torch_backend import TorchBackend  # the live reference is PyTorch's (torch is installed here)

    assert isinstance(reference, TorchBackend)
    manifest = opened.manifest  # a one-pair model's own --src-lang/--tgt-lang: as none
    source, target = own_languages(manifest.model_config, manifest.language_pair, opts.src_lang, opts.tgt_lang)
    opts = replace(opts, decoding=loaded.decoding, src_lang=source, tgt_lang=target)
    if source is not None and source == target:  # every backend copies the lines: nothing would be compared
        raise UserError(f"--src-lang and --tgt-lang are both {source}: serve-batch writes every line as it came, so "
                        "parity would compare copies (transformers would translate them); choose two languages")
    if reference_engine == "transformers":
        return _transformers_parity(opened, src, ref, ref_lines, backends, opts, device, gates, threads, save_hyps,
                                    hf_dir, reference, tokenizer, shortlist)
    ref_run = translate_as_served(reference, tokenizer, src, opts)
    _warn(ref_run, src, opts)
    runs = (_translate(name, opened, src, opts, device, threads, tokenizer, (reference, ref_run), shortlist)
            for name in backends)
    live = _live(read_lines(src))
    results, signatures = _compare(runs, ref_run, ref_lines, reference.model, gates, save_hyps, reference.cfg.eos_id,
                                   live)
    return ParityReport(str(model_dir), str(src), str(ref), live, opts.decoding.beam_size, *signatures, results,
                        shortlist=shortlist, lines=len(ref_run.lines))


def _transformers_parity(opened: ModelDir, src: Path, ref_path: Path, ref_lines: list[str], backends: list[str],
                         opts: ServeBatchOptions, device: str | None, gates: dict[str, Gate], threads: int | None,
                         save_hyps: Path | None, hf_dir: Path | None, torch_backend: TorchBackend,
                         tokenizer: AnyTokenizer, shortlist: bool = False) -> ParityReport:
    """Every backend against transformers' generate on the imported model's own directory."""
    from pipeline.evaluation import transformers_reference

    model_dir = opened.path
    hf_dir = transformers_reference.source_dir(opened.file(CHECKPOINT_FILE), hf_dir)
    if hf_dir is None:
        raise UserError(f"{model_dir}: not an imported model (trained here), so no Hugging Face model is its "
                        "reference; compare it with --reference torch")
    torch_run = translate_as_served(torch_backend, tokenizer, src, opts)
    _warn(torch_run, src, opts)
    sources = read_lines(src)
    lines, tokens, seconds = transformers_reference.translate(hf_dir, sources, opts.decoding, opts.src_lang,
                                                              opts.tgt_lang, torch_backend.max_src_len,
                                                              frozenset(dict(torch_backend.cfg.languages).values()),
                                                              torch_backend.max_tgt_len)
    ref_run = Served(lines, torch_run.sources, tokens, seconds, 0)
    runs = (_translate(name, opened, src, opts, device, threads, tokenizer, (torch_backend, torch_run), shortlist)
            for name in backends)
    live = _live(sources)
    results, signatures = _compare(runs, ref_run, ref_lines, torch_backend.model, gates, save_hyps,
                                   torch_backend.cfg.eos_id, live)
    return ParityReport(str(model_dir), str(src), str(ref_path), live, opts.decoding.beam_size,
                        *signatures, results, reference=f"transformers generate on {hf_dir}", shortlist=shortlist,
                        lines=len(sources))


def _recorded_parity(model_dir: Path, backends: list[str], device: str | None, gates: dict[str, Gate],
                     threads: int | None, save_hyps: Path | None, shortlist: bool = False) -> ParityReport:
    """Every backend against the fp32 PyTorch translations recorded at export."""
    opened = ModelDir.open(model_dir)  # the manifest read and verified once, for every backend
    _check_backends(opened, backends, device, threads, shortlist)
    manifest = opened.manifest
    refs = opened.references()
    opts = ServeBatchOptions(decoding=refs.decoding, src_lang=refs.source_lang, tgt_lang=refs.target_lang).validate()
    tokenizer = opened.tokenizer
    ref_run = Served(refs.lines, [], refs.hypotheses, 0.0, 0)
    model = ModelOnDemand(Path(model_dir) / CHECKPOINT_FILE
                          if installed("torch") and manifest.lists(CHECKPOINT_FILE) else None)
    with tempfile.TemporaryDirectory(prefix="parity-") as tmp:
        src = Path(tmp) / "references.src"
        src.write_text("".join(line + "\n" for line in refs.sources), encoding="utf-8")
        runs = (_translate(name, opened, src, opts, device, threads, tokenizer, None, shortlist)
                for name in backends)
        live = _live(refs.sources)
        results, signatures = _compare(runs, ref_run, refs.references, model, gates, save_hyps,
                                       manifest.model_config.eos_id, live)
    where = f"{Path(model_dir) / REFERENCES_FILE} (recorded at export)"
    return ParityReport(str(model_dir), where, where, live, opts.decoding.beam_size, *signatures,
                        results, shortlist=shortlist, lines=len(refs.sources))


def _translate(name: str, opened: ModelDir, src: Path, opts: ServeBatchOptions, device: str | None, threads: int | None,
               tokenizer: AnyTokenizer, live: tuple[Backend, Served] | None,
               shortlist: bool = False) -> tuple[str, Any, Served, str]:
    """(name, backend, its run, precision): the live reference's own run is reused for `torch` (unless it
    is to decode over the shortlist, which the reference does not)."""
    if name == REFERENCE and live is not None and not shortlist:
        return name, live[0], live[1], "fp32"
    loaded = load(opened, _load_options(name, device, threads, shortlist))
    backend = loaded.backend
    precision = backend.precision + (SHORTLISTED if shortlist else "")  # what it computes in (torch: its dtype's)
    return name, backend, translate_as_served(backend, tokenizer, src, opts), precision


def _load_options(name: str, device: str | None, threads: int | None, shortlist: bool) -> LoadOptions:
    return LoadOptions(backend=name, device=device, threads=threads, precision="fp32" if name == REFERENCE else None,
                       shortlist=shortlist)


def _check_backends(opened: ModelDir, backends: list[str], device: str | None, threads: int | None,
                    shortlist: bool) -> None:
    """What each backend would refuse (its device, engines, shortlist), before the long work: a --device cuda
    without CUDA was said once the reference had translated every line, and a missing engine threw away the
    backends compared before it."""
    for name in backends:
        check_load(opened, _load_options(name, device, threads, shortlist).validate())


def _live(sources: list[str]) -> int:
    """The source lines a model translates: not the blank ones, which never reach it (serve-batch counts so)."""
    return sum(1 for line in sources if line.strip())


def _compare(runs: Any, ref_run: Served, ref_lines: list[str], model: Any, gates: dict[str, Gate],
             save_hyps: Path | None, eos: int, live: int) -> tuple[list[BackendResult], tuple[str, str]]:
    """Each run against the reference run; also the BLEU and chrF signatures. The identical share is of the
    `live` lines, those the model translates: blank lines, equal in every run, padded it (500 of them turned a
    failed 99.9% gate into a pass)."""
    bleu_metric, chrf_metric = sacrebleu.BLEU(), sacrebleu.CHRF()
    bleu_ref = bleu_metric.corpus_score(ref_run.lines, [ref_lines]).score
    results = []
    for name, backend, run, precision in runs:
        if save_hyps is not None:
            log.info("%s: wrote %s", name, save_hypotheses(run, save_hyps, name, precision))
        bleu = bleu_metric.corpus_score(run.lines, [ref_lines]).score
        different = [i for i, (a, b) in enumerate(zip(ref_run.tokens, run.tokens)) if a != b]
        at_hand = model.get() if isinstance(model, ModelOnDemand) and different else model
        divs = divergence_gaps(None if isinstance(at_hand, ModelOnDemand) else at_hand, run.sources,
                               ref_run.tokens, run.tokens, different, eos)
        gaps = [abs(d.log_prob_gap) for d in divs if d.log_prob_gap is not None]
        result = BackendResult(
            backend=name, precision=precision, device=str(backend.device),
            seconds=round(run.seconds, 3), bleu=round(bleu, 2),
            chrf=round(chrf_metric.corpus_score(run.lines, [ref_lines]).score, 2),
            bleu_vs_torch=round(bleu_metric.corpus_score(run.lines, [ref_run.lines]).score, 2),
            identical=1 - len(different) / live if live else 1.0, n_different=len(different),
            bleu_delta=round(bleu - bleu_ref, 2),
            max_log_prob_gap=max(gaps, default=None),
            median_divergence_step=statistics.median(d.step for d in divs) if divs else None,
            divergences=divs[:20],
            shortlist_coverage=_coverage(backend.shortlist, run.sources, ref_run.tokens),
        )
        check_gate(result, gate_for(precision, gates))
        results.append(result)
        log.info("%s: BLEU %.2f, identical %.1f%%", name, result.bleu, 100 * result.identical)
    return results, (str(bleu_metric.get_signature()), str(chrf_metric.get_signature()))


def _coverage(table: Any, sources: list[list[int]], reference: list[list[int]]) -> float | None:
    """Shortlist.coverage of the reference's tokens as a share (None: no shortlist, or nothing decoded)."""
    if table is None:
        return None
    inside, total = table.coverage(sources, reference)
    return round(inside / total, 4) if total else None


def format_table(report: ParityReport) -> str:
    width = max([5] + [len(r.precision) for r in report.results])
    head = (f"{'backend':<12} {'prec':<{width}} {'BLEU':>6} {'chrF':>6} {'dBLEU':>6} {'BLEU/torch':>10} "
            f"{'identical':>9} {'max gap':>8} {'sec':>7}  gate")
    rows = [head, "-" * len(head)]
    for r in report.results:
        gap = "-" if r.max_log_prob_gap is None else f"{r.max_log_prob_gap:.4f}"
        gate = "PASS" if r.passed else "FAIL: " + "; ".join(r.failures)
        rows.append(f"{r.backend:<12} {r.precision:<{width}} {r.bleu:>6.2f} {r.chrf:>6.2f} {r.bleu_delta:>+6.2f} "
                    f"{r.bleu_vs_torch:>10.2f} {r.identical:>9.1%} {gap:>8} {r.seconds:>7.2f}  {gate}")
    lines = report.lines or report.sentences  # "39 sentences" read as if BLEU left the blank line out
    scored = f" of {lines} lines (blank ones: BLEU and chrF score all {lines})" if lines != report.sentences else ""
    rows.append(f"{report.sentences} sentences{scored}, beam {report.beam_size}; BLEU {report.bleu_signature}; "
                f"chrF {report.chrf_signature}")
    if report.reference != REFERENCE:
        rows.append(f"'identical' and 'BLEU/torch' compare with {report.reference}")
    for r in report.results:
        if r.shortlist_coverage is not None:
            rows.append(f"{r.backend} {r.precision}: shortlist coverage {r.shortlist_coverage:.1%} of the "
                        "reference's tokens (EOS included) among their sentence's candidates (a lower bound: a batch "
                        "decodes over their union)")
    return "\n".join(rows)


def write_json(report: ParityReport, path: Path) -> None:
    with atomic_output(path) as f:  # first the command that made it (pipeline/invocation.py)
        json.dump({"command": command_line(), **report.to_json()}, f, indent=2)
        f.write("\n")
