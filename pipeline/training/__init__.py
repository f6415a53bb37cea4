"""Training of "Attention Is All You Need" as components (torchtitan style):

    options.py        TrainOptions, defaults from the preset table, checks, the resume config;
                      AverageOptions (`pipeline average`)
    step.py           one optimizer update: schedule, label-smoothed loss, precision, clipping
    loop.py           the loop: update, then log / validate / save on their schedules
    validation.py     validation loss and BLEU
    checkpointing.py  step checkpoints: save, prune, exact resume (RNG of every rank), the best
                      checkpoint, averaging the last or the best window
    metrics.py        metrics.jsonl, and the signals that stop a run with a checkpoint
    tensorboard.py    TensorBoard scalars beside metrics.jsonl (optional package)
    budget.py         --max-time: the run's wall clock, added up over resumes
    trainer.py        train(): puts the parts together, one process or one torchrun rank

The process group, device and "rank 0 first" helpers are in pipeline/distributed.py
(shared with serve-batch).
"""

from pipeline.training.averaging import average_checkpoints
from pipeline.training.metrics import TrainingInterrupted
from pipeline.training.options import RESUME_KEYS, AverageOptions, TrainOptions, describe_defaults, resolve_options
from pipeline.training.step import learning_rate, token_losses
from pipeline.training.trainer import CONFIG_FILE, DATA_DIR, train

__all__ = [
    "CONFIG_FILE", "DATA_DIR", "RESUME_KEYS", "AverageOptions", "TrainOptions", "TrainingInterrupted",
    "average_checkpoints", "describe_defaults", "learning_rate", "resolve_options", "token_losses", "train",
]
