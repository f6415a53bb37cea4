"""Every option of `pipeline train`, its defaults (from the preset table in model/config.py),
the checks of impossible numbers, and the part of them that makes a save dir one experiment."""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model.config import MAX_VOCAB, MIN_VOCAB, PRESETS, ConfigError, ModelConfig, preset
from model.errors import UserError
from model.manifest import MANIFEST
from pipeline.cli_options import opt
from pipeline.training.step import SCHEDULES
from runtime.decoding import PAPER
from runtime.fields import Checked, at_least, declared_types
from runtime.machine import thread_problem

# The built-in synthetic corpus (no --train-src): preset demo, tuned to reach a high
# validation BLEU in a few CPU minutes.
BUILTIN_DEFAULTS: dict[str, Any] = dict(preset="demo", batch_tokens=3000, warmup=300, max_steps=1200,
                                        vocab_size=600, valid_every=400, save_every=400,
                                        builtin_pairs=30000)


@dataclass
class TrainOptions:
    """Every option of `pipeline train` (None = the preset's / built-in corpus' default).

    Each field's default and help text are the command line's (pipeline/cli_options.options_from)."""

    save_dir: Path = opt(help="Checkpoints, tokenizer, config, metrics; rerunning the same command resumes "
                              "from here.", path="dir")
    train_src: Path | None = opt(None, "Training source text (plain or .gz), one sentence per line. "
                                 "Without --train-src/--train-tgt: the built-in synthetic language pair.")
    train_tgt: Path | None = opt(None, "Training target text, line-aligned with --train-src.")
    valid_src: Path | None = opt(None, "Validation source text (for loss and BLEU).")
    valid_tgt: Path | None = opt(None, "Validation references, line-aligned with --valid-src.")
    preset: str | None = opt(None, "Model size (default: demo for the built-in corpus, else base).",
                             choices=tuple(PRESETS))
    d_model: int | None = opt(None, "Override the preset's d_model.")
    n_heads: int | None = opt(None, "Override the preset's number of attention heads.")
    d_ff: int | None = opt(None, "Override the preset's feed-forward width.")
    layers: int | None = opt(None, "Override the number of encoder and of decoder layers.")
    decoder_layers: int | None = opt(None, "Override the number of decoder layers only (a deep-encoder, "
                                           "shallow-decoder model; default: --layers, or the preset's).")
    dropout: float | None = opt(None, "Dropout (default: the preset's; the paper: 0.1 base, 0.3 big).")
    vocab_size: int | None = opt(None, "Joint SentencePiece vocabulary size (a soft limit).")
    max_len: int = opt(256, "Drop training pairs with a side longer than this many tokens, and validation pairs "
                            "from the validation loss (BLEU translates every validation line; a validation set "
                            "with no pair within it is refused); counts are logged.")
    batch_tokens: int | None = opt(None, "Token budget of one micro-batch per process (padded max(source, "
                                   "target) tokens; the paper used ~25000).")
    update_freq: int = opt(1, "Gradient accumulation: micro-batches per process per update.")
    max_steps: int | None = opt(None, "Stop after this many updates.")
    lr_scale: float = opt(1.0, "Multiplies the paper's d_model^-0.5 * min(step^-0.5, step * warmup^-1.5).")
    warmup: int | None = opt(None, "Warmup steps of the learning-rate schedule (paper: 4000).")
    lr_schedule: str = opt("rsqrt", "rsqrt: the paper's inverse square root. linear: the same warmup, then a "
                           "straight line from the peak down to zero at the end of the run (--max-steps, or "
                           "the step --max-time is estimated to end at, from the speed measured after warmup).",
                           choices=SCHEDULES)
    decay_time: str | None = opt(None, "With --lr-schedule linear: the budget to decay over (default "
                                 "--max-time). Set it to the full budget when stopping earlier on purpose and "
                                 "resuming, so the schedule is that of the full run.", metavar="DURATION")
    label_smoothing: float | None = opt(None, "Label smoothing (default: the preset's; the paper: 0.1).")
    clip_norm: float = opt(0.0, "Clip the gradient norm to this value (0 = off, as in the paper).")
    seed: int = opt(1, "Seed of initialisation, data order, dropout (and of the built-in corpus).")
    save_every: int | None = opt(None, "Write a checkpoint every N updates (and at the end).")
    keep_last: int = opt(5, "Keep the last K step checkpoints, and with validation the K ending at the best BLEU "
                            "(what `average --best K` averages): up to 2K.")
    valid_every: int | None = opt(None, "Validate every N updates (default: --save-every).")
    valid_beam: int = opt(1, "Beam size of validation BLEU decoding (1 = greedy, fast; "
                          f"{PAPER.beam_size} = the paper's); length penalty and limit are the paper's.")
    valid_max_sentences: int = opt(0, "Decode at most this many validation sentences for BLEU (0 = all).")
    log_every: int = opt(50, "Write a train event to metrics.jsonl and refresh loss/lr/tokens/s every N updates.")
    device: str = opt("auto", "auto, cpu, cuda or cuda:N (one process: that GPU). auto and cuda take this "
                      "process's LOCAL_RANK GPU (under torchrun, one per rank) when CUDA is available; auto falls "
                      "back to the CPU.", metavar="DEV")
    precision: str = opt("auto", "auto = bf16 on CUDA (fp16 with loss scaling without bf16), fp32 on CPU.",
                         choices=("auto", "fp32", "bf16", "fp16"))
    threads: int | None = opt(None, "CPU threads per process (torch.set_num_threads).")
    max_nonfinite: int = opt(5, "Fail after this many consecutive updates with a non-finite loss (each is "
                             "skipped).")
    builtin_pairs: int | None = opt(None, "Training pairs of the built-in synthetic corpus (default "
                                    f"{BUILTIN_DEFAULTS['builtin_pairs']}).")
    progress: bool = opt(True, "Show a progress bar on stderr (only on a terminal).")
    log_seconds: float = opt(30.0, "Where stderr is not a terminal (a log file, a pipe): a progress line every N "
                             "seconds (step, loss, tokens/s, elapsed, time left to --max-steps or --max-time), "
                             "since no bar is drawn there; 0 for none.", min=0)
    allow_changed_data: bool = opt(False, "Resume even though a corpus file's contents changed since the save "
                                   "dir's checkpoints (refused without it): keep the run's tokenizer and data "
                                   "position, record the new files' fingerprints.")
    max_time: str | None = opt(None, "Wall-clock budget of the whole run, e.g. 90s, 60m, 1h30m: counted from "
                               "process start (data preparation included) and over resumes; at the budget a "
                               "checkpoint is written and training stops with status 0. A run that validated "
                               "on its --valid-every schedule keeps back the time of one validation and "
                               "validates its last update too.", metavar="DURATION")
    spm_alpha: float = opt(0.0, "SentencePiece subword regularisation during training: sampling smoothing "
                           "alpha (0 = off; 0.1-0.2 typical for small data). Never used for validation, "
                           "export or serving.")
    # Not SentencePiece's -1 (all segmentations, from the lattice): its draws differ between processes
    # (pipeline/corpus/sampling.py).
    spm_nbest: int = opt(64, "Subword sampling among the n best segmentations (at least 1). "
                         "Batches are formed on the deterministic lengths, so sampled batches exceed "
                         "--batch-tokens by as much.")
    tensorboard: bool = opt(True, "Write TensorBoard events under SAVE_DIR/tensorboard (needs the "
                            "`tensorboard` package).")


# Options whose change makes a save dir a different experiment (checked on resume).
# Everything else (how long, how often, where, how fast) may change between runs.
MAX_LEN = 16_384  # --max-len: tokens of a training pair's side (the model's positions: max(1024, this + 1))
MAX_COUNT = 10 ** 12  # steps, tokens and intervals past any run: a bound that keeps them integers a float holds
MAX_LR_SCALE = 1e6  # a learning rate a million times the paper's (1e39 trains to a non-finite loss, refused there)
MAX_SPM_NBEST = 512  # SentencePiece's largest n-best size
MAX_VALID_BEAM = 64  # --valid-beam (the validation search asks the model for 2 x beam candidates a step)
RESUME_KEYS = ("train_src", "train_tgt", "valid_src", "valid_tgt", "vocab_size", "max_len",
               "batch_tokens", "lr_scale", "warmup", "label_smoothing", "clip_norm", "seed",
               "builtin_pairs")
CORPUS_PATHS = ("train_src", "train_tgt", "valid_src", "valid_tgt")
# Subword sampling and the linear schedule change the experiment too, but are recorded only when
# on, so that save dirs made before they existed still resume.
SAMPLING_KEYS = ("spm_alpha", "spm_nbest")
SCHEDULE_KEYS = ("lr_schedule",)


DEFAULT_AVERAGE_LAST = 5  # the paper's count for base


@dataclass(frozen=True)
class AverageOptions(Checked):
    """`pipeline average`'s options (its command line is generated from these fields): which step checkpoints of a
    save dir to average (averaging.average_checkpoints), and where to write the average."""

    error = UserError

    last: int | None = opt(None, f"Average the last K step checkpoints (the paper: 5 for base, 20 for big) "
                                 f"[default: {DEFAULT_AVERAGE_LAST}, unless --best].")
    best: int | None = opt(None, "Average instead the K step checkpoints ending at the best validation BLEU "
                                 "(checkpoint_best.pt's step); K up to the run's --keep-last survive pruning.")
    out: Path | None = opt(None, "Output checkpoint (default SAVE_DIR/averaged.pt).")
    force: bool = opt(False, "Replace --out if it exists (SAVE_DIR/averaged.pt is replaced without it).")

    def problems(self, name: Callable[[str], str] | None = None) -> list[str]:
        n = name or self.flag
        if self.best is not None and self.last is not None:
            return [f"{n('last')} and {n('best')} choose the checkpoints two ways: give one"]
        return at_least(self.best, 1, "best", n) if self.best is not None else at_least(self.count, 1, "last", n)

    @property
    def count(self) -> int:
        """How many checkpoints --last averages (its default when neither --last nor --best is given)."""
        return DEFAULT_AVERAGE_LAST if self.last is None else self.last


def resolve_options(opts: TrainOptions) -> TrainOptions:
    """Fill the defaults that depend on the preset and on whether data was given."""
    mistyped = declared_types(opts)  # from Python: max_steps="3" was a TypeError in the arithmetic below
    if mistyped:
        raise UserError("; ".join(mistyped))
    builtin = opts.train_src is None and opts.train_tgt is None
    if (opts.train_src is None) != (opts.train_tgt is None):
        raise UserError("give both --train-src and --train-tgt, or neither (built-in synthetic corpus)")
    if (opts.valid_src is None) != (opts.valid_tgt is None):
        raise UserError("give both --valid-src and --valid-tgt, or neither")
    if builtin and opts.valid_src is not None:
        raise UserError("--valid-src/--valid-tgt need --train-src/--train-tgt (the built-in corpus "
                        "brings its own validation set)")
    values = dataclasses.asdict(opts)
    name = opts.preset or (BUILTIN_DEFAULTS["preset"] if builtin else "base")
    if name not in PRESETS:
        raise UserError(f"--preset {name!r} is unknown; choose one of: {', '.join(PRESETS)}")
    values["preset"] = name
    defaults = PRESETS[name].training_defaults()
    if builtin:
        defaults.update({k: v for k, v in BUILTIN_DEFAULTS.items() if k != "preset"})
        if values.get("save_every") is not None:  # --valid-every's default is --save-every, the given one too
            defaults.pop("valid_every")
    elif opts.builtin_pairs is not None:  # it was dropped in silence
        raise UserError("--builtin-pairs sizes the built-in corpus; with --train-src/--train-tgt leave it out")
    for key, value in defaults.items():
        if values.get(key) is None:
            values[key] = value
    max_steps = values["max_steps"]
    # `is None`, not `or`: an explicit 0 is a mistake for check_numbers to name, not "the default"
    if values["save_every"] is None:
        values["save_every"] = max(1, min(1000, max_steps))
    if values["valid_every"] is None and values["save_every"] >= 1:  # else only --save-every is named
        values["valid_every"] = values["save_every"]
    resolved = TrainOptions(**values)
    check_numbers(resolved)
    return resolved


def check_numbers(o: TrainOptions) -> None:
    """Collect every impossible number, then fail once naming the options."""
    problems = []
    for name in ("max_len", "batch_tokens", "update_freq", "max_steps", "warmup", "save_every",
                 "keep_last", "valid_every", "valid_beam", "log_every", "max_nonfinite"):
        value = getattr(o, name)
        if value is not None and value < 1:
            problems.append(f"--{name.replace('_', '-')} must be at least 1 (got {value})")
        elif value is not None and value > MAX_COUNT:  # (a --warmup of 309 digits: an OverflowError traceback)
            problems.append(f"--{name.replace('_', '-')} must be at most {MAX_COUNT:.0e} (got {str(value)[:20]}...)")
    if o.max_len > MAX_LEN:  # the positional table has max_len rows: 10,000,000 took 8 GB and 2.5 GB of ONNX
        problems.append(f"--max-len must be at most {MAX_LEN} tokens (got {o.max_len}); a pair that long is no "
                        "sentence")
    if o.valid_beam > MAX_VALID_BEAM:
        problems.append(f"--valid-beam must be at most {MAX_VALID_BEAM} (got {o.valid_beam})")
    if o.vocab_size is not None and not MIN_VOCAB <= o.vocab_size <= MAX_VOCAB:  # before the corpus is read
        problems.append(f"--vocab-size must be in {MIN_VOCAB}..{MAX_VOCAB} (got {o.vocab_size})")
    if not problems:  # the model's shape too, before the corpus is read and SentencePiece trained on it (not
        try:  # with a --vocab-size out of range: its special ids' problems hid the one line that mattered)
            model_config(o, o.vocab_size or MIN_VOCAB)
        except ConfigError as e:
            problems.append(str(e))
    if not (math.isfinite(o.lr_scale) and 0 < o.lr_scale <= MAX_LR_SCALE):  # NaN passed `<= 0` (a non-finite
        problems.append(f"--lr-scale must be in (0, {MAX_LR_SCALE:.0e}] (got {o.lr_scale})")  # loss; 1e308 overflowed)
    if not 0 <= o.seed < 2 ** 32:  # numpy's and the data order's range
        problems.append(f"--seed must be in 0..{2 ** 32 - 1} (got {o.seed})")
    if (Path(o.save_dir) / MANIFEST).is_file():
        problems.append(f"--save-dir {o.save_dir} is an exported model dir (it holds {MANIFEST}); training there "
                        "would replace its files: choose another directory")
    if not 0 <= o.label_smoothing < 1:
        problems.append(f"--label-smoothing must be in [0, 1) (got {o.label_smoothing})")
    if o.clip_norm < 0:
        problems.append(f"--clip-norm must be >= 0, 0 = off (got {o.clip_norm})")
    if o.valid_max_sentences < 0:
        problems.append(f"--valid-max-sentences must be >= 0, 0 = all (got {o.valid_max_sentences})")
    if o.builtin_pairs is not None and o.builtin_pairs < 10:
        problems.append(f"--builtin-pairs must be at least 10 (got {o.builtin_pairs})")
    for name in ("max_time", "decay_time"):
        if getattr(o, name) is not None:
            try:
                parse_duration(getattr(o, name), "--" + name.replace("_", "-"))
            except ValueError as e:
                problems.append(str(e))
    if o.lr_schedule not in SCHEDULES:
        problems.append(f"--lr-schedule must be one of {', '.join(SCHEDULES)} (got {o.lr_schedule!r})")
    if o.decay_time is not None and o.max_time is not None and not problems and \
            parse_duration(o.decay_time) < parse_duration(o.max_time):  # the rest of the run at a learning rate of 0
        problems.append(f"--decay-time {o.decay_time} is shorter than --max-time {o.max_time}: the learning rate "
                        "would be zero for the rest of the run; leave --decay-time out (it decays over --max-time)")
    if o.decay_time is not None and o.lr_schedule != "linear":
        problems.append("--decay-time sets how long --lr-schedule linear decays; it needs --lr-schedule linear")
    if not 0 <= o.spm_alpha <= 1:
        problems.append(f"--spm-alpha must be in [0, 1], 0 = off (got {o.spm_alpha})")
    if o.spm_nbest > MAX_SPM_NBEST:  # SentencePiece's own bound: it failed after the corpus was prepared
        problems.append(f"--spm-nbest must be at most {MAX_SPM_NBEST} (got {o.spm_nbest})")
    if o.spm_nbest < 1:  # -1 (SentencePiece's lattice sampling) draws differently in each process
        problems.append(f"--spm-nbest must be at least 1 (got {o.spm_nbest}); sampling from all segmentations (-1) "
                        "cannot be repeated exactly, so resumed and multi-process runs would differ (a run started "
                        "with -1 cannot resume exactly either: start it again in a new --save-dir, with 64)")
    threads = thread_problem(o.threads, "--threads")
    if threads:
        problems.append(threads)
    if problems:
        raise UserError("; ".join(problems))


# the model config's fields the command line sets, as a refusal names them ("n_enc_layers must be ..." said a key)
CONFIG_OPTIONS = {"n_enc_layers": "--layers", "n_dec_layers": "--decoder-layers", "n_heads": "--n-heads",
                  "d_model": "--d-model", "d_ff": "--d-ff", "dropout": "--dropout"}


def model_config(opts: TrainOptions, vocab_size: int) -> ModelConfig:
    """The preset with the command-line overrides (ConfigError names every problem, by its option)."""
    try:
        return preset(opts.preset, vocab_size=vocab_size, d_model=opts.d_model, n_heads=opts.n_heads,
                      d_ff=opts.d_ff, n_enc_layers=opts.layers,
                      n_dec_layers=opts.decoder_layers if opts.decoder_layers is not None else opts.layers,
                      dropout=opts.dropout, max_positions=max(1024, opts.max_len + 1))
    except ConfigError as e:
        said = re.sub(r"\b(" + "|".join(CONFIG_OPTIONS) + r")\b", lambda m: CONFIG_OPTIONS[m[1]], str(e))
        raise ConfigError(said.replace("invalid model config: ", f"the model (--preset {opts.preset}): ")) from None


def comparable_config(opts: TrainOptions, cfg: ModelConfig) -> dict[str, Any]:
    """What config.json records and a resumed run must match."""
    training = {k: getattr(opts, k) for k in RESUME_KEYS}
    if opts.spm_alpha > 0:
        training.update({k: getattr(opts, k) for k in SAMPLING_KEYS})
    if opts.lr_schedule != "rsqrt":
        training.update({k: getattr(opts, k) for k in SCHEDULE_KEYS})
    for k in ("train_src", "train_tgt", "valid_src", "valid_tgt"):
        if training[k] is not None:
            training[k] = os.path.realpath(training[k])  # Path.resolve raises on a symlink loop; reading names it
    if opts.builtin_pairs is not None:  # the built-in corpus lives inside the save dir
        training.update(train_src="builtin", train_tgt="builtin", valid_src="builtin", valid_tgt="builtin")
    model = {k: v for k, v in cfg.to_dict().items() if k != "vocab_size"}
    return {"model": model, "training": training}


# what a key recorded only when on (SAMPLING_KEYS, SCHEDULE_KEYS) was when a config lacks it
UNRECORDED = {"spm_alpha": 0.0, "spm_nbest": 64, "lr_schedule": "rsqrt"}


def config_differences(old: dict[str, Any], new: dict[str, Any], fingerprinted: bool = False) -> list[str]:
    """`--option old -> new` for every entry of comparable_config that changed (a model field no option sets:
    `the model's key`). `fingerprinted`: the old run recorded its corpus files' contents (checkpointing.check_data
    compares those), so a corpus file at another path (a moved project, another machine's mount) is no
    difference; a file added or dropped still is."""
    diffs = []
    for section in ("model", "training"):
        a, b = old.get(section, {}), new.get(section, {})
        for key in sorted(set(a) | set(b)):
            values = tuple(side.get(key, UNRECORDED.get(key)) for side in (a, b))
            if fingerprinted and section == "training" and key in CORPUS_PATHS and None not in values \
                    and "builtin" not in values:
                continue
            if values[0] != values[1]:  # None is an option not given: "none"
                name = f"--{key.replace('_', '-')}" if section == "training" else \
                    CONFIG_OPTIONS.get(key, f"the model's {key}")
                shown = ("none" if v is None else v if isinstance(v, str) and v else repr(v) for v in values)
                diffs.append(f"{name} {' -> '.join(shown)}")
    return diffs


def jsonable(opts: TrainOptions) -> dict[str, Any]:
    """The options as JSON values (paths as strings), for config.json and checkpoints."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(opts).items()}


def describe_defaults() -> str:
    """The per-preset defaults, for --help and the README."""
    rows = [f"{name}: " + ", ".join(f"{k} {v}" for k, v in p.training_defaults().items())
            for name, p in PRESETS.items()]
    builtin = ", ".join(f"{k} {v}" for k, v in BUILTIN_DEFAULTS.items() if k != "preset")
    return "; ".join(rows) + (f". Without --train-src/--train-tgt (the built-in corpus), whatever the preset "
                              f"(default {BUILTIN_DEFAULTS['preset']}): {builtin}")


_DURATION = re.compile(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s)?")


def parse_duration(text: str, option: str = "--max-time") -> float:
    """Seconds in `90s`, `60m`, `1h30m`, `1.5h` or a plain number of seconds."""
    text = text.strip().lower()
    try:
        seconds = float(text)
    except ValueError:
        match = _DURATION.fullmatch(text)
        if not text or match is None:
            raise ValueError(f"{option} {text!r} is not a duration; write e.g. 90s, 60m or 1h30m") from None
        h, m, s = (float(g) if g else 0.0 for g in match.groups())
        seconds = 3600 * h + 60 * m + s
    if not math.isfinite(seconds) or seconds <= 0:  # nan and inf passed: the budget was ignored, or crashed the
        raise ValueError(f"{option} must be a positive, finite duration (got {text!r})")  # linear schedule
    return seconds
