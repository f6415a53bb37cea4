"""Every option of `pipeline train`, its defaults (from the preset table in model/config.py),
the checks of impossible numbers, and the part of them that makes a save dir one experiment."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model.config import PRESETS, ModelConfig, preset
from model.errors import UserError
from pipeline.training.step import SCHEDULES

# The built-in synthetic corpus (no --train-src): preset demo, tuned to reach a high
# validation BLEU in a few CPU minutes.
BUILTIN_DEFAULTS: dict[str, Any] = dict(preset="demo", batch_tokens=3000, warmup=300, max_steps=1200,
                                        vocab_size=600, valid_every=400, save_every=400,
                                        builtin_pairs=30000)


@dataclass
class TrainOptions:
    """Every option of `pipeline train` (None = the preset's / built-in corpus' default)."""

    save_dir: Path
    train_src: Path | None = None
    train_tgt: Path | None = None
    valid_src: Path | None = None
    valid_tgt: Path | None = None
    preset: str | None = None
    d_model: int | None = None
    n_heads: int | None = None
    d_ff: int | None = None
    layers: int | None = None
    dropout: float | None = None
    vocab_size: int | None = None
    max_len: int = 256
    batch_tokens: int | None = None
    update_freq: int = 1
    max_steps: int | None = None
    lr_scale: float = 1.0
    warmup: int | None = None
    label_smoothing: float | None = None
    clip_norm: float = 0.0
    seed: int = 1
    save_every: int | None = None
    keep_last: int = 5
    valid_every: int | None = None
    valid_beam: int = 1
    valid_max_sentences: int = 0
    log_every: int = 50
    device: str = "auto"
    precision: str = "auto"
    threads: int | None = None
    max_nonfinite: int = 5
    builtin_pairs: int | None = None
    progress: bool = True
    allow_changed_data: bool = False
    max_time: str | None = None  # a duration (90s, 60m, 1h30m): the whole run, resumes included
    lr_schedule: str = "rsqrt"  # rsqrt (the paper's) or linear (warmup, then straight down to zero)
    decay_time: str | None = None  # linear: the budget it decays over (default --max-time)
    spm_alpha: float = 0.0  # SentencePiece sampling smoothing during training (0 = off)
    # Sample among the n best segmentations (-1 = all, from the lattice). 64: at alpha 0.1, sampling
    # from all of them made Multi30k sentences 2.03x as many pieces (64 best: 1.10x), which halves
    # the sentences trained per minute and doubles the padded batch beyond --batch-tokens.
    spm_nbest: int = 64
    tensorboard: bool = True  # write TensorBoard events when the package is installed


# Options whose change makes a save dir a different experiment (checked on resume).
# Everything else (how long, how often, where, how fast) may change between runs.
RESUME_KEYS = ("train_src", "train_tgt", "valid_src", "valid_tgt", "vocab_size", "max_len",
               "batch_tokens", "lr_scale", "warmup", "label_smoothing", "clip_norm", "seed",
               "builtin_pairs")
# Subword sampling and the linear schedule change the experiment too, but are recorded only when
# on, so that save dirs made before they existed still resume.
SAMPLING_KEYS = ("spm_alpha", "spm_nbest")
SCHEDULE_KEYS = ("lr_schedule",)


def resolve_options(opts: TrainOptions) -> TrainOptions:
    """Fill the defaults that depend on the preset and on whether data was given."""
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
    else:
        values["builtin_pairs"] = None
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
                 "keep_last", "valid_every", "valid_beam", "log_every", "max_nonfinite", "vocab_size"):
        value = getattr(o, name)
        if value is not None and value < 1:
            problems.append(f"--{name.replace('_', '-')} must be at least 1 (got {value})")
    if o.lr_scale <= 0:
        problems.append(f"--lr-scale must be positive (got {o.lr_scale})")
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
    if o.decay_time is not None and o.lr_schedule != "linear":
        problems.append("--decay-time sets how long --lr-schedule linear decays; it needs --lr-schedule linear")
    if not 0 <= o.spm_alpha <= 1:
        problems.append(f"--spm-alpha must be in [0, 1], 0 = off (got {o.spm_alpha})")
    if o.spm_nbest == 0 or o.spm_nbest < -1:
        problems.append(f"--spm-nbest must be -1 (all segmentations) or at least 1 (got {o.spm_nbest})")
    if o.threads is not None and o.threads < 1:
        problems.append(f"--threads must be at least 1 (got {o.threads})")
    if problems:
        raise UserError("; ".join(problems))


def model_config(opts: TrainOptions, vocab_size: int) -> ModelConfig:
    """The preset with the command-line overrides (ConfigError names every problem)."""
    return preset(opts.preset, vocab_size=vocab_size, d_model=opts.d_model, n_heads=opts.n_heads,
                  d_ff=opts.d_ff, n_enc_layers=opts.layers, n_dec_layers=opts.layers,
                  dropout=opts.dropout, max_positions=max(1024, opts.max_len + 1))


def comparable_config(opts: TrainOptions, cfg: ModelConfig) -> dict[str, Any]:
    """What config.json records and a resumed run must match."""
    training = {k: getattr(opts, k) for k in RESUME_KEYS}
    if opts.spm_alpha > 0:
        training.update({k: getattr(opts, k) for k in SAMPLING_KEYS})
    if opts.lr_schedule != "rsqrt":
        training.update({k: getattr(opts, k) for k in SCHEDULE_KEYS})
    for k in ("train_src", "train_tgt", "valid_src", "valid_tgt"):
        if training[k] is not None:
            training[k] = str(Path(training[k]).resolve())
    if opts.builtin_pairs is not None:  # the built-in corpus lives inside the save dir
        training.update(train_src="builtin", train_tgt="builtin", valid_src="builtin", valid_tgt="builtin")
    model = {k: v for k, v in cfg.to_dict().items() if k != "vocab_size"}
    return {"model": model, "training": training}


def config_differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """`key old -> new` for every entry of comparable_config that changed."""
    diffs = []
    for section in ("model", "training"):
        a, b = old.get(section, {}), new.get(section, {})
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                diffs.append(f"{key} {a.get(key)!r} -> {b.get(key)!r}")
    return diffs


def jsonable(opts: TrainOptions) -> dict[str, Any]:
    """The options as JSON values (paths as strings), for config.json and checkpoints."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(opts).items()}


def describe_defaults() -> str:
    """The per-preset defaults, for --help and the README."""
    rows = [f"{name}: " + ", ".join(f"{k} {v}" for k, v in p.training_defaults().items())
            for name, p in PRESETS.items()]
    return "; ".join(rows)


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
    if seconds <= 0:
        raise ValueError(f"{option} must be positive (got {text!r})")
    return seconds
