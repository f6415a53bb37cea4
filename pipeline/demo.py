"""`pipeline demo`: the whole product on the built-in language pair, in minutes on a CPU.

train (built-in synthetic corpus) -> average the last checkpoints -> export fp32, fp16 and int8
(ONNX graphs verified against PyTorch) -> serve-batch the held-out test file -> parity of
every backend against the PyTorch model, per precision. Each stage is the same function
the corresponding command runs; rerunning the demo resumes training (nothing to do once
finished) and re-exports.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sacrebleu

from export.api import export_model
from export.errors import ExportError
from pipeline.errors import UserError
from pipeline.parity import ParityReport, format_table, run_parity, write_json
from pipeline.serve import ServeOptions, serve_files
from pipeline.textio import read_lines
from pipeline.train import DATA_DIR, TrainOptions, average_checkpoints, train
from runtime.loader import load_backend

log = logging.getLogger(__name__)

PRECISIONS = ("fp32", "fp16", "int8")


@dataclass
class DemoOptions:
    out: Path
    preset: str | None = None  # None: the built-in default (train's BUILTIN_DEFAULTS)
    max_steps: int | None = None
    builtin_pairs: int | None = None
    average_last: int = 3
    backends: tuple[str, ...] = ("torch", "onnxruntime")
    beam_size: int = 4
    threads: int | None = None
    progress: bool = True


@dataclass
class DemoResult:
    save_dir: Path
    model_dirs: dict[str, Path]
    translation: Path
    bleu: float
    serve_summary: str
    seconds: dict[str, float] = field(default_factory=dict)
    parity: dict[str, ParityReport] = field(default_factory=dict)

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
    clock.stage("train", train, TrainOptions(
        save_dir=save_dir, preset=opts.preset, max_steps=opts.max_steps, builtin_pairs=opts.builtin_pairs,
        threads=opts.threads, progress=opts.progress))
    checkpoint = clock.stage("average", average_checkpoints, save_dir, last=opts.average_last)

    model_dirs = {p: out / f"model-{p}" for p in PRECISIONS}
    for precision, model_dir in model_dirs.items():
        try:
            clock.stage(f"export {precision}", export_model, checkpoint, model_dir, fp16=precision == "fp16",
                        int8=precision == "int8", tensorrt=None, force=True)
        except ExportError as e:
            raise UserError(str(e)) from None

    test_src, test_ref = (save_dir / DATA_DIR / "test.src"), (save_dir / DATA_DIR / "test.tgt")
    translation = out / "test.hyp"
    backend, tokenizer, _ = load_backend(model_dirs["fp32"], backend="auto", threads=opts.threads)
    stats = clock.stage("serve-batch", serve_files, backend, tokenizer, [str(test_src)], [str(translation)],
                        ServeOptions(beam_size=opts.beam_size), progress=opts.progress)
    bleu = sacrebleu.corpus_bleu(read_lines(translation), [read_lines(test_ref)]).score

    result = DemoResult(save_dir, model_dirs, translation, round(bleu, 2),
                        serve_summary=stats.summary(backend.name, str(backend.device)))
    for precision, model_dir in model_dirs.items():
        report = clock.stage(f"parity {precision}", run_parity, model_dir, test_src, test_ref,
                             list(opts.backends), beam_size=opts.beam_size, threads=opts.threads)
        write_json(report, out / f"parity-{precision}.json")
        result.parity[precision] = report
    result.seconds = clock.seconds
    return result


def format_result(result: DemoResult) -> str:
    lines = []
    for precision, report in result.parity.items():
        lines += [f"== parity, {precision} model ({result.model_dirs[precision]})", format_table(report), ""]
    lines.append(f"serve-batch: {result.serve_summary}")
    lines.append(f"test BLEU of serve-batch ({result.translation}): {result.bleu:.2f}")
    lines.append("seconds per stage: " + ", ".join(f"{k} {v:.1f}" for k, v in result.seconds.items()))
    lines.append("parity: " + ("passed" if result.passed else "FAILED"))
    return "\n".join(lines)
