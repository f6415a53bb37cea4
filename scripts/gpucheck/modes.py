"""What the GPU check runs (scripts/gpu_check.py): each mode's sizes, options and time limits, the stages
in order, and a stage's record in the report."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpucheck.util import PENDING

# -- what each mode runs ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Mode:
    name: str                      # "gpu" or "cpu"
    device: str
    precision: str                 # training autocast
    train: tuple[str, ...]         # pipeline train options (besides --save-dir, --device, --precision)
    max_steps: int
    signal_at: int                 # SIGTERM once metrics.jsonl logs this step
    fallback_train: tuple[str, ...]
    export: tuple[str, ...]
    serve_threads: tuple[str, ...]
    decode: tuple[str, ...]        # serve-batch and live parity decoding options (the same for both)
    test_lines: int                # serve-batch and live parity translate the test split's first lines
    bench_presets: tuple[str, ...]
    bench_vocab: int
    bench_batches: tuple[int, ...]
    bench_sentences: dict[int, int]
    bench_dtypes: tuple[str, ...]
    roofline_batches: tuple[int, ...]
    file_lines: int                # the file stage: serve-batch over this many lines of the training corpus
    file_cpu_lines: int            # ... onnxruntime on the host's CPU over its first lines
    file_generate_lines: int       # ... and generate() over its first lines, at each of file_generate_batches
    file_generate_batches: tuple[int, ...]
    step_modes: tuple[str, ...]  # the torch backend's decoder step (runtime/static_step.py), the first the reference
    cli_batches: tuple[int, ...]
    copy_bytes: int
    matmul_n: int
    matmul_dtypes: tuple[str, ...]
    threads: int | None
    budget_s: float
    timeouts: dict[str, float]


FP16_MODE_AGREEMENT = 0.9  # share of fp16 translations that must not change with the decoder step mode

CPU_TRAIN = ("--preset", "tiny", "--builtin-pairs", "1000", "--vocab-size", "200", "--max-steps", "60",
             "--warmup", "20", "--save-every", "30", "--valid-every", "60", "--valid-max-sentences", "20",
             "--log-every", "1", "--threads", "1", "--no-tensorboard", "--no-progress", "--seed", "1")

MODES = {
    "gpu": Mode(
        name="gpu", device="cuda", precision="bf16",
        # the built-in corpus' own defaults (preset demo, 3000-token batches, warmup 300, vocab 600, 30000
        # pairs: a high validation BLEU in 1200 steps), so that parity gates a model that has learnt
        train=("--max-steps", "1200", "--save-every", "400", "--valid-every", "1200", "--valid-max-sentences", "200",
               "--log-every", "10", "--no-progress", "--seed", "1"),
        max_steps=1200, signal_at=500, fallback_train=CPU_TRAIN, export=(),
        serve_threads=(), decode=(), test_lines=200,
        bench_presets=("base", "big"), bench_vocab=32000, bench_batches=(1, 32, 128),
        bench_sentences={1: 8, 32: 128, 128: 256}, bench_dtypes=("fp32", "fp16"), roofline_batches=(32, 128),
        file_lines=20000, file_cpu_lines=2000, file_generate_lines=4000, file_generate_batches=(64, 256),
        step_modes=("eager", "graph", "graph-k4"),
        cli_batches=(1, 32), copy_bytes=1 << 30, matmul_n=8192, matmul_dtypes=("fp32", "fp16", "bf16"),
        threads=None, budget_s=540.0,
        timeouts={"doctor": 60, "nvidia-smi": 30, "distributed": 120, "train": 180, "resume": 300,
                  "export-fp32": 200, "export-fp16": 200, "serve-fp32": 90, "serve-fp16": 90,
                  "parity-torch-recorded": 120, "parity-onnxruntime-fp32": 150, "parity-onnxruntime-fp16": 150,
                  "parity-serve": 60, "random-checkpoints": 200, "bench-cli": 90, "bench": 200, "file": 150,
                  "marian": 200, "roofline": 90, "onnxruntime-cuda": 240},
    ),
    "cpu": Mode(
        name="cpu", device="cpu", precision="fp32", train=CPU_TRAIN, max_steps=60, signal_at=25,
        fallback_train=CPU_TRAIN, export=("--reference-lines", "10"), serve_threads=("--threads", "2"),
        decode=("--max-len-a", "0", "--max-len-b", "12"),  # the untrained tiny model never ends by itself
        test_lines=50,
        bench_presets=("tiny", "demo"), bench_vocab=256, bench_batches=(1, 4), bench_sentences={1: 4, 4: 8},
        bench_dtypes=("fp32",), roofline_batches=(4,),
        file_lines=200, file_cpu_lines=50, file_generate_lines=50, file_generate_batches=(16,),
        step_modes=("eager", "static", "static-k4"),
        cli_batches=(1, 4), copy_bytes=64 << 20, matmul_n=512,
        matmul_dtypes=("fp32",), threads=2, budget_s=600.0,
        timeouts={"doctor": 60, "nvidia-smi": 30, "distributed": 90, "train": 120, "resume": 240,
                  "export-fp32": 180, "export-fp16": 180, "serve-fp32": 90, "serve-fp16": 90,
                  "parity-torch-recorded": 90, "parity-onnxruntime-fp32": 120, "parity-onnxruntime-fp16": 120,
                  "parity-serve": 60, "random-checkpoints": 120, "bench-cli": 90, "bench": 120, "file": 150,
                  "marian": 120, "roofline": 60, "onnxruntime-cuda": 60},
    ),
}

STAGES = [
    ("doctor", "pipeline doctor --json"),
    ("nvidia-smi", "nvidia-smi"),
    ("distributed", "1-rank process group under torchrun (all-reduce, broadcast, DDP step)"),
    ("train", "torchrun -m pipeline train (built-in corpus)"),
    ("resume", "SIGTERM mid-run, resume, compare with the uninterrupted run"),
    ("export-fp32", "pipeline export --no-tensorrt"),
    ("export-fp16", "pipeline export --fp16 --no-tensorrt"),
    ("serve-fp32", "pipeline serve-batch --backend torch --dtype fp32"),
    ("serve-fp16", "pipeline serve-batch --backend torch --dtype fp16"),
    ("parity-torch-recorded", "pipeline parity (torch on the device vs fp32 CPU references recorded at export)"),
    ("parity-onnxruntime-fp32", "pipeline parity --backends onnxruntime (CPU) vs torch (CPU, fp32), fp32 dir"),
    ("parity-onnxruntime-fp16", "pipeline parity --backends onnxruntime (CPU) vs torch (CPU, fp32), fp16 dir"),
    ("parity-serve", "serve-batch's torch output on the device (fp32, fp16) vs torch (CPU, fp32)"),
    ("random-checkpoints", "pipeline random-checkpoint (bench shapes)"),
    ("bench-cli", "pipeline bench --backends torch on the trained model dir"),
    ("bench", "torch backend on the device: bench shapes, batch sizes, peak memory"),
    ("file", "a file on the device: serve-batch's whole process (default, one step per replay), generate() at its "
             "best batch, onnxruntime on the CPU"),
    ("marian", "transformers MarianMTModel on the same weights: greedy agreement, generate() timing"),
    ("roofline", "bytes and FLOPs per decoder step vs measured copy bandwidth and matmul rate"),
    ("onnxruntime-cuda", "onnxruntime's CUDA provider (onnxruntime-gpu carried in parts): parity and bench"),
]


# -- bookkeeping -----------------------------------------------------------------------------------


@dataclass
class Stage:
    name: str
    title: str
    status: str = PENDING
    reason: str = ""
    seconds: float = 0.0
    commands: list[dict[str, Any]] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    stderr_tail: str = ""
