"""`pipeline train` and `pipeline average`: parse options, delegate to pipeline.training."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import click

from model.config import PRESETS
from pipeline.training import TrainingInterrupted, TrainOptions, average_checkpoints, describe_defaults
from pipeline.training import train as run_training
from pipeline.training.step import SCHEDULES
from runtime.decoding import PAPER

_FILE = click.Path(dir_okay=False, path_type=Path)
# Defaults of options that no preset sets: TrainOptions holds them, --help shows them.
_DEFAULT = {f.name: f.default for f in dataclasses.fields(TrainOptions)}


@click.command(epilog="Per-preset defaults for unset options: " + describe_defaults())
@click.option("--train-src", type=_FILE, help="Training source text (plain or .gz), one sentence per line. "
              "Without --train-src/--train-tgt: the built-in synthetic language pair.")
@click.option("--train-tgt", type=_FILE, help="Training target text, line-aligned with --train-src.")
@click.option("--valid-src", type=_FILE, help="Validation source text (for loss and BLEU).")
@click.option("--valid-tgt", type=_FILE, help="Validation references, line-aligned with --valid-src.")
@click.option("--save-dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Checkpoints, tokenizer, config, metrics; rerunning the same command resumes from here.")
@click.option("--preset", type=click.Choice(list(PRESETS)), default=None,
              help="Model size (default: demo for the built-in corpus, else base).")
@click.option("--d-model", type=int, help="Override the preset's d_model.")
@click.option("--n-heads", type=int, help="Override the preset's number of attention heads.")
@click.option("--d-ff", type=int, help="Override the preset's feed-forward width.")
@click.option("--layers", type=int, help="Override the number of encoder and of decoder layers.")
@click.option("--dropout", type=float, help="Dropout (default: the preset's; the paper: 0.1 base, 0.3 big; "
              "0.3 suits small data such as Multi30k).")
@click.option("--vocab-size", type=int, help="Joint SentencePiece vocabulary size (a soft limit).")
@click.option("--max-len", type=int, default=256, show_default=True,
              help="Drop training pairs with a side longer than this many tokens (counts are logged).")
@click.option("--batch-tokens", type=int, help="Token budget of one micro-batch per process (padded "
              "max(source, target) tokens; the paper used ~25000).")
@click.option("--update-freq", type=int, default=1, show_default=True,
              help="Gradient accumulation: micro-batches per process per update.")
@click.option("--max-steps", type=int, help="Stop after this many updates.")
@click.option("--lr-scale", type=float, default=1.0, show_default=True,
              help="Multiplies the paper's d_model^-0.5 * min(step^-0.5, step * warmup^-1.5).")
@click.option("--warmup", type=int, help="Warmup steps of the learning-rate schedule (paper: 4000).")
@click.option("--lr-schedule", type=click.Choice(SCHEDULES), default="rsqrt", show_default=True,
              help="rsqrt: the paper's inverse square root. linear: the same warmup, then a straight line "
              "from the peak down to zero at the end of the run (--max-steps, or the step --max-time is "
              "estimated to end at, from the speed measured after warmup). Measured on Multi30k: no better than rsqrt.")
@click.option("--decay-time", metavar="DURATION", help="With --lr-schedule linear: the budget to decay over "
              "(default --max-time). Set it to the full budget when stopping earlier on purpose and "
              "resuming, so the schedule is that of the full run.")
@click.option("--label-smoothing", type=float, help="Label smoothing (default: the preset's; the paper: 0.1).")
@click.option("--clip-norm", type=float, default=0.0, show_default=True,
              help="Clip the gradient norm to this value (0 = off, as in the paper).")
@click.option("--seed", type=int, default=1, show_default=True,
              help="Seed of initialisation, data order, dropout (and of the built-in corpus).")
@click.option("--save-every", type=int, help="Write a checkpoint every N updates (and at the end).")
@click.option("--keep-last", type=int, default=5, show_default=True, help="Keep the last K step checkpoints.")
@click.option("--valid-every", type=int, help="Validate every N updates (default: --save-every).")
@click.option("--valid-beam", type=int, default=1, show_default=True,
              help="Beam size of validation BLEU decoding (1 = greedy, fast; "
              f"{PAPER.beam_size} = the paper's); length penalty and limit are the paper's.")
@click.option("--valid-max-sentences", type=int, default=0, show_default=True,
              help="Decode at most this many validation sentences for BLEU (0 = all).")
@click.option("--log-every", type=int, default=50, show_default=True,
              help="Write a train event to metrics.jsonl and refresh loss/lr/tokens/s every N updates.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="auto = CUDA (this process's LOCAL_RANK GPU) when available, else CPU.")
@click.option("--precision", type=click.Choice(["auto", "fp32", "bf16", "fp16"]), default="auto",
              show_default=True, help="auto = bf16 on CUDA (fp16 with loss scaling without bf16), fp32 on CPU.")
@click.option("--threads", type=int, help="CPU threads per process (torch.set_num_threads).")
@click.option("--max-nonfinite", type=int, default=5, show_default=True,
              help="Fail after this many consecutive updates with a non-finite loss (each is skipped).")
@click.option("--builtin-pairs", type=int, help="Training pairs of the built-in synthetic corpus "
              "(default 30000).")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Show a progress bar.")
@click.option("--allow-changed-data", is_flag=True, help="Resume even though a corpus file's contents "
              "changed since the save dir's checkpoints (refused without it): keep the run's tokenizer "
              "and data position, record the new files' fingerprints.")
@click.option("--max-time", metavar="DURATION", help="Wall-clock budget of the whole run, e.g. 90s, 60m, 1h30m: "
              "counted from process start (data preparation included) and over resumes; at the budget a "
              "checkpoint is written and training stops with status 0. A run that validated on its "
              "--valid-every schedule keeps back the time of one validation and validates its last "
              "update too.")
@click.option("--spm-alpha", type=float, default=_DEFAULT["spm_alpha"], show_default=True,
              help="SentencePiece subword regularisation during training: sampling smoothing alpha "
              "(0 = off; 0.1-0.2 typical for small data). Never used for validation, export or serving.")
@click.option("--spm-nbest", type=int, default=_DEFAULT["spm_nbest"], show_default=True,
              help="Subword sampling among the n best segmentations (-1 = all, from the lattice; at "
              "alpha 0.1 that doubled the pieces per sentence on Multi30k, 64 added 10%). Batches are "
              "formed on the deterministic lengths, so sampled batches exceed --batch-tokens by as much.")
@click.option("--tensorboard/--no-tensorboard", default=True, show_default=True,
              help="Write TensorBoard events under SAVE_DIR/tensorboard (needs the `tensorboard` package).")
def train(**kwargs: object) -> None:
    """Train the Transformer on a parallel corpus (or the built-in one) into --save-dir.

    One process: `pipeline train ...`. Several (DDP, gloo on CPU, NCCL on GPU):
    `torchrun --standalone --nproc-per-node N -m pipeline train ...`. SIGINT/SIGTERM
    write a checkpoint and exit with status 130/143; rerun the same command to resume.
    Validation keeps the best-BLEU weights as SAVE_DIR/checkpoint_best.pt.
    """
    opts = TrainOptions(**kwargs)  # type: ignore[arg-type]
    try:
        save_dir = run_training(opts)
    except TrainingInterrupted as e:
        click.echo(str(e), err=True)
        sys.exit(128 + e.signum)
    click.echo(f"checkpoints in {save_dir}; average them with `pipeline average {save_dir}`")


@click.command()
@click.argument("save_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--last", type=int, default=5, show_default=True,
              help="Average the last K step checkpoints (the paper: 5 for base, 20 for big).")
@click.option("--best", type=int, help="Average instead the K step checkpoints ending at the best validation "
              "BLEU (checkpoint_best.pt's step); K up to the run's --keep-last survive pruning.")
@click.option("--out", type=_FILE, help="Output checkpoint (default SAVE_DIR/averaged.pt).")
def average(save_dir: Path, last: int, best: int | None, out: Path | None) -> None:
    """Average the weights of the last K checkpoints of a save dir (section 6.1)."""
    path = average_checkpoints(save_dir, last=last, out=out, best=best)
    click.echo(f"wrote {path}")
