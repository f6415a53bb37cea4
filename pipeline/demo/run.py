"""`pipeline demo`: the whole product on the built-in language pair, in minutes on a CPU.

train (built-in synthetic corpus) -> average the last checkpoints -> export fp32, fp16 and int8
(ONNX graphs verified against PyTorch) -> serve-batch the held-out test file -> parity of
every backend against the PyTorch model, per precision. Each stage is the same function
the corresponding command runs; rerunning the demo resumes training (nothing to do once
finished) and re-exports.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sacrebleu

from export.api import export_model
from export.options import DEFAULT_MAX_BEAM
from export.out_dir import not_a_model_dir
from model.checkpoint import checkpoint_step, step_checkpoints
from model.config import PRESETS
from model.errors import UserError
from model.manifest import MANIFEST, PRECISIONS
from pipeline.cli_options import parse_backends
from pipeline.commands.export import held_out_calibration, reference_set
from pipeline.demo.plan import DemoPlan, format_plan, plan_demo
from pipeline.environment import gather_facts
from pipeline.evaluation.parity import ParityReport, format_table, run_parity, write_json
from pipeline.serve_batch.files import ServeBatchOptions, serve_files
from pipeline.textio import check_output_file, read_lines
from pipeline.training import DATA_DIR, TrainOptions, average_checkpoints, train
from pipeline.training.options import BUILTIN_DEFAULTS
from runtime.decoding import PAPER, DecodingOptions
from runtime.fields import Checked, at_least, opt
from runtime.model_dir import LoadOptions, load
from runtime.references import DEFAULT_LINES as DEFAULT_REFERENCE_LINES
from runtime.registry import backend_names

log = logging.getLogger(__name__)



DEMO_MAX_TIME = "10m"  # the README's "a few minutes": a busy machine stops training early rather than late


def _backend_list(value: str) -> tuple[str, ...]:
    return tuple(parse_backends(value))


@dataclass
class DemoOptions(Checked):
    """What the demo runs with; the fields with a help text are `pipeline demo`'s options (generated from them;
    the beam and the threads are DecodingOptions' and LoadOptions')."""

    error = UserError

    out: Path = opt(Path("runs/demo"), "Working directory: train/ (save dir), model-fp32/, model-fp16/, model-int8/, "
                                       "test.hyp, parity-*.json.", path="dir")
    # None: the built-in default (train's BUILTIN_DEFAULTS)
    preset: str | None = opt(None, "Model size [default: the built-in default, demo].", choices=tuple(PRESETS))
    max_steps: int | None = opt(None, "Training updates [default: the built-in default, 1200].", min=1)
    max_time: str | None = opt(DEMO_MAX_TIME, "Training's wall-clock budget (90s, 10m, 1h): it stops at this or "
                                              "--max-steps, whichever comes first, and the result says which.",
                               metavar="DURATION")
    builtin_pairs: int | None = opt(None, "Training pairs of the built-in corpus [default: 30000].", min=10)
    average_last: int = opt(3, "Average this many last checkpoints before export.", min=1)
    # None: every backend this machine can run (demo/plan.py); the command line gives them comma-separated
    backends: tuple[str, ...] | None = opt(None, "Backends whose parity with PyTorch is checked ("
                                                 + ",".join(backend_names()) + ") [default: every one this machine "
                                                 "can run; see `pipeline doctor`].", convert=_backend_list)
    decoding: DecodingOptions = PAPER
    threads: int | None = None
    progress: bool = opt(True, "Show progress bars.")
    plan: DemoPlan | None = None  # None: planned from this machine's facts (pipeline doctor)

    def problems(self, name: Callable[[str], str] | None = None) -> list[str]:
        n = name or self.flag
        out = [] if self.preset in (None, *PRESETS) else [f"{n('preset')} {self.preset!r}: choose one of "
                                                          f"{', '.join(PRESETS)}"]
        unknown = [b for b in self.backends or () if b not in backend_names()]
        if unknown:
            out.append(f"{n('backends')}: unknown backend(s) {unknown}; choose from {', '.join(backend_names())}")
        return (out + at_least(self.max_steps, 1, "max_steps", n) + at_least(self.builtin_pairs, 10, "builtin_pairs", n)
                + at_least(self.average_last, 1, "average_last", n))


@dataclass
class DemoResult:
    save_dir: Path
    model_dirs: dict[str, Path]
    translation: Path
    bleu: float
    serve_summary: str
    seconds: dict[str, float] = field(default_factory=dict)
    parity: dict[str, ParityReport] = field(default_factory=dict)
    plan: DemoPlan | None = None
    gpu_peak_gib: float | None = None
    training: str = ""  # how training ended: every step, or stopped by the time budget at step N

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.parity.values())


class _Clock:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def stage(self, name: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        log.info("demo: %s", name)
        t0 = time.perf_counter()
        result = fn(*args, **kwargs)
        self.seconds[name] = round(time.perf_counter() - t0, 1)
        return result


def run_demo(opts: DemoOptions) -> DemoResult:
    out = Path(opts.out)
    save_dir = out / "train"
    clock = _Clock()
    plan = opts.plan or plan_demo(gather_facts(), wanted=opts.backends)
    _check_before_training(opts, plan, out)
    before = _reached(save_dir)  # a rerun on the same --out resumes, or finds nothing left to train
    clock.stage("train", train, TrainOptions(
        save_dir=save_dir, preset=opts.preset, max_steps=opts.max_steps, builtin_pairs=opts.builtin_pairs,
        max_time=opts.max_time, threads=opts.threads, progress=opts.progress, device=plan.device,
        precision=plan.train_precision))
    training = _how_training_ended(save_dir, opts, before)
    log.info("demo: %s", training)
    checkpoint = clock.stage("average", average_checkpoints, save_dir, last=opts.average_last)

    model_dirs = {p: out / f"model-{p}" for p in PRECISIONS}
    # as `pipeline export` does: rowwise int8's static scales and the recorded held-out translations (so that
    # `pipeline parity MODEL_DIR` gates each dir alone), both from the save dir's validation set
    calibration = held_out_calibration(checkpoint)
    held_out = reference_set(checkpoint, None, None, DEFAULT_REFERENCE_LINES)
    for precision, model_dir in model_dirs.items():
        clock.stage(f"export {precision}", export_model, checkpoint, model_dir, fp16=precision == "fp16",
                    int8=precision == "int8", tensorrt=plan.export_tensorrt, force=True, calibration=calibration,
                    references=held_out)

    test_src, test_ref = (save_dir / DATA_DIR / "test.src"), (save_dir / DATA_DIR / "test.tgt")
    translation = out / "test.hyp"
    serving = ServeBatchOptions(decoding=opts.decoding)
    # as `pipeline serve-batch` loads: a file of many batches (two side by side on a CPU of 2 or more threads)
    loaded = load(model_dirs["fp32"], LoadOptions(threads=opts.threads, many_batches=True), opts.decoding)
    backend, tokenizer = loaded.backend, loaded.tokenizer
    stats = clock.stage("serve-batch", serve_files, backend, tokenizer, [str(test_src)], [str(translation)],
                        serving, progress=opts.progress)
    bleu = sacrebleu.corpus_bleu(read_lines(translation), [read_lines(test_ref)]).score

    result = DemoResult(save_dir, model_dirs, translation, round(bleu, 2),
                        serve_summary=stats.summary(backend.name, str(backend.device)), plan=plan, training=training)
    for precision, model_dir in model_dirs.items():
        report = clock.stage(f"parity {precision}", run_parity, model_dir, test_src, test_ref,
                             plan.backends(precision), opts=serving, threads=opts.threads,
                             device=plan.device)
        write_json(report, out / f"parity-{precision}.json")
        result.parity[precision] = report
    result.seconds = clock.seconds
    if plan.device == "cuda":
        import torch

        result.gpu_peak_gib = round(torch.cuda.max_memory_allocated() / (1 << 30), 2)
    return result


def _check_before_training(opts: DemoOptions, plan: DemoPlan, out: Path) -> None:
    """What would fail after minutes of training and exports, refused now: a search the model dirs cannot serve,
    a precision with no backend to check, and outputs that cannot be written (a non-model dir in model-int8/)."""
    opts.decoding.validate()
    limit = DEFAULT_MAX_BEAM  # the model dirs are exported with export's defaults
    if opts.decoding.beam_size > limit:
        raise UserError(f"--beam-size {opts.decoding.beam_size}: the demo's model dirs serve beams up to {limit} "
                        "(export's --max-beam); choose a smaller beam")
    missing = [p for p in PRECISIONS if not plan.backends(p)]
    if missing:
        skipped = "; ".join(f"{b}: {reason}" for b, reason in plan.skipped) or "none of them runs here"
        raise UserError(f"--backends {','.join(opts.backends or ())}: no backend to check the {missing[0]} model "
                        f"dir with ({skipped}); add torch or onnxruntime")
    if (out / MANIFEST).is_file():  # its files would be mixed into a model dir, which no export could replace
        raise UserError(f"{out}: is an exported model dir; the demo's --out is its working directory (train/, "
                        "model-*/): choose a new one")
    for precision in PRECISIONS:
        model_dir = out / f"model-{precision}"
        if model_dir.exists() and not model_dir.is_dir():
            raise UserError(f"{model_dir}: exists and is not a directory; the demo writes a model dir there: move "
                            "it, or choose another --out")
        if model_dir.is_dir() and any(model_dir.iterdir()) and (why := not_a_model_dir(model_dir) or _foreign(
                model_dir, out / "train")):
            raise UserError(f"{model_dir}: {why}; the demo replaces only a model dir it exported: move it, or "
                            "choose another --out")
    for name in ("test.hyp", *(f"parity-{p}.json" for p in PRECISIONS)):
        check_output_file(out / name, "--out")


def _foreign(model_dir: Path, save_dir: Path) -> str | None:
    """Why a model dir an export wrote is not this demo's: exported from a checkpoint neither in its save dir nor,
    for a demo dir moved or copied since (the path recorded is where it was), of a name its save dir holds."""
    source = json.loads((model_dir / MANIFEST).read_bytes()).get("source_checkpoint") or {}
    path = Path(str(source.get("path") or save_dir / "unrecorded.pt"))
    ours = path.parent.resolve() == save_dir.resolve() or (
        path.parent.name == save_dir.name and (save_dir / path.name).is_file())
    return None if ours else f"was exported from {path}, not from this demo's {save_dir}"


def _reached(save_dir: Path) -> int:
    """The step of the save dir's latest checkpoint (0 without one)."""
    last = step_checkpoints(save_dir) if save_dir.is_dir() else []
    return (checkpoint_step(last[-1]) or 0) if last else 0


def _how_training_ended(save_dir: Path, opts: DemoOptions, before: int = 0) -> str:
    """Which limit stopped training: every one of --max-steps, or the time budget first; or that an earlier run
    in the same --out had trained them all already."""
    steps = opts.max_steps or BUILTIN_DEFAULTS["max_steps"]
    reached = _reached(save_dir)
    if before >= steps:
        return f"training: {save_dir} was at step {before} already, nothing to train (--max-steps {steps})"
    if reached >= steps:
        return f"training ran all {steps} steps (--max-steps)"
    return f"training stopped at step {reached} of {steps} by its time budget (--max-time {opts.max_time})"


def format_result(result: DemoResult) -> str:
    lines = [result.training] if result.training else []
    for precision, report in result.parity.items():
        lines += [f"== parity, {precision} model ({result.model_dirs[precision]})", format_table(report), ""]
    lines.append(f"serve-batch: {result.serve_summary}")
    lines.append(f"test BLEU of serve-batch ({result.translation}): {result.bleu:.2f}")
    lines.append("seconds per stage: " + ", ".join(f"{k} {v:.1f}" for k, v in result.seconds.items()))
    if result.plan is not None:
        lines += format_plan(result.plan)
    if result.gpu_peak_gib is not None:
        lines.append(f"GPU memory: peak {result.gpu_peak_gib:.2f} GiB allocated by PyTorch")
    lines.append("parity: " + ("passed" if result.passed else "FAILED"))
    return "\n".join(lines)
