"""The training loop of "Attention Is All You Need" (section 5), single process or DDP.

`train(TrainOptions)` runs the same code as one process or as one rank of
`torchrun --nproc-per-node N -m pipeline train ...`: the model never sees
torch.distributed; DistributedDataParallel is applied here, from outside.

The loss of an update is the sum of label-smoothed token losses over every micro-batch
of every rank, divided by the target-token count of that whole global batch (all-reduced
before backward) and multiplied by the world size (DDP averages gradients). One process
with the global batch and N processes with its shards therefore make the same update.

A save dir is self-contained and resumable: checkpoint_<step:08d>.pt files (model config,
SentencePiece model, weights, optimizer, schedule step, RNG states of every rank, data
position, options), spm.model, config.json, metrics.jsonl and the encoded-corpus cache.
Rerunning the same command continues exactly where the last checkpoint left off.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import math
import os
import random
import signal
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from model.checkpoint import AVERAGED, read_checkpoint, save_checkpoint, step_checkpoints
from model.config import PAD_ID, PRESETS, ConfigError, ModelConfig, preset
from model.transformer import Transformer, build_model
from pipeline import synthetic
from pipeline.data import Batch, PreparedData, ShardedBatches, iter_eval_batches, prepare_data
from pipeline.errors import UserError
from pipeline.textio import atomic_output

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
DATA_DIR = "data"

# Per-preset defaults for options left unset. base/big are the paper's (25k-token batches,
# 4000 warmup steps, 100k / 300k steps). Small models learn faster and are unstable at
# the paper's long warmup with tiny batches, so they get short warmups and small budgets.
PRESET_DEFAULTS: dict[str, dict[str, Any]] = {
    "tiny": dict(batch_tokens=1024, warmup=200, max_steps=2000, vocab_size=1000),
    "demo": dict(batch_tokens=4096, warmup=800, max_steps=20000, vocab_size=4000),
    "small": dict(batch_tokens=8192, warmup=2000, max_steps=50000, vocab_size=8000),
    "base": dict(batch_tokens=25000, warmup=4000, max_steps=100000, vocab_size=32000),
    "big": dict(batch_tokens=25000, warmup=4000, max_steps=300000, vocab_size=32000),
}
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
    label_smoothing: float = 0.1
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


# Options whose change makes a save dir a different experiment (checked on resume).
# Everything else (how long, how often, where, how fast) may change between runs.
RESUME_KEYS = ("train_src", "train_tgt", "valid_src", "valid_tgt", "vocab_size", "max_len",
               "batch_tokens", "lr_scale", "warmup", "label_smoothing", "clip_norm", "seed",
               "builtin_pairs")


class TrainingInterrupted(Exception):
    """SIGINT/SIGTERM stopped training after writing a checkpoint (exit 128 + signum)."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        super().__init__(f"stopped by {signal.Signals(signum).name} at step {step}; checkpoint "
                         f"{checkpoint}; rerun the same command to resume")


# -- options ---------------------------------------------------------------------------

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
    defaults = dict(PRESET_DEFAULTS[name])
    if builtin:
        defaults.update({k: v for k, v in BUILTIN_DEFAULTS.items() if k != "preset"})
    else:
        values["builtin_pairs"] = None
    for key, value in defaults.items():
        if values.get(key) is None:
            values[key] = value
    max_steps = values["max_steps"]
    values["save_every"] = values["save_every"] or max(1, min(1000, max_steps))
    values["valid_every"] = values["valid_every"] or values["save_every"]
    resolved = TrainOptions(**values)
    _check_numbers(resolved)
    return resolved


def _check_numbers(o: TrainOptions) -> None:
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
    for k in ("train_src", "train_tgt", "valid_src", "valid_tgt"):
        if training[k] is not None:
            training[k] = str(Path(training[k]).resolve())
    if opts.builtin_pairs is not None:  # the built-in corpus lives inside the save dir
        training.update(train_src="builtin", train_tgt="builtin", valid_src="builtin", valid_tgt="builtin")
    model = {k: v for k, v in cfg.to_dict().items() if k != "vocab_size"}
    return {"model": model, "training": training}


def _config_differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    diffs = []
    for section in ("model", "training"):
        a, b = old.get(section, {}), new.get(section, {})
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                diffs.append(f"{key} {a.get(key)!r} -> {b.get(key)!r}")
    return diffs


# -- learning rate, loss ---------------------------------------------------------------

def learning_rate(step: int, d_model: int, warmup: int, scale: float = 1.0) -> float:
    """Section 5.3: lr = scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), step >= 1."""
    step = max(step, 1)
    return scale * d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)


def token_losses(logits: torch.Tensor, target: torch.Tensor, label_smoothing: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(label-smoothed loss sum, NLL sum) over non-pad target tokens (section 5.4)."""
    flat_logits, flat_target = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
    loss = F.cross_entropy(flat_logits, flat_target, ignore_index=PAD_ID,
                           label_smoothing=label_smoothing, reduction="sum")
    with torch.no_grad():
        nll = F.cross_entropy(flat_logits.detach(), flat_target, ignore_index=PAD_ID, reduction="sum")
    return loss, nll


# -- distributed context -----------------------------------------------------------------

@dataclass
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    owns_group: bool  # we called init_process_group, so we destroy it

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def all_reduce(self, values: list[float]) -> list[float]:
        """Sum a few numbers over ranks (float64 on the training device)."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.distributed:
            dist.all_reduce(t)
        return t.tolist()


def _pick_device(name: str, local_rank: int) -> torch.device:
    if name not in ("auto", "cpu", "cuda"):
        raise UserError(f"--device {name!r}: choose auto, cpu or cuda")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is available; use --device cpu")
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(device_name: str) -> DistContext:
    """From torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*): gloo on CPU,
    NCCL on CUDA. Without it (or with WORLD_SIZE 1) a plain single process."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = _pick_device(device_name, local_rank)
    owns = False
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo",
                                timeout=datetime.timedelta(minutes=60))
        owns = True
    if world > 1:
        rank, world = dist.get_rank(), dist.get_world_size()
    return DistContext(rank, world, local_rank, device, owns)


def _rank0_first(ctx: DistContext, fn: Any) -> Any:
    """Run fn on rank 0 (which writes caches), then on the others (which read them); an
    error on rank 0 is raised on every rank instead of leaving them waiting."""
    if not ctx.distributed:
        return fn(True)
    result, error = None, None
    if ctx.is_main:
        try:
            result = fn(True)
        except (UserError, ConfigError) as e:
            error = str(e)
    box = [error]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise UserError(box[0])
    return result if ctx.is_main else fn(False)


# -- checkpoints, RNG, metrics -----------------------------------------------------------

def _rng_state(device: torch.device) -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _gather_rng(ctx: DistContext) -> list[dict[str, Any]]:
    mine = _rng_state(ctx.device)
    if not ctx.distributed:
        return [mine]
    everyone: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    return everyone


def checkpoint_path(save_dir: Path, step: int) -> Path:
    return Path(save_dir) / f"checkpoint_{step:08d}.pt"


def _prune(save_dir: Path, keep_last: int) -> None:
    for old in step_checkpoints(save_dir)[:-keep_last]:
        old.unlink(missing_ok=True)


class MetricsLog:
    """metrics.jsonl: one JSON object per event, appended by rank 0."""

    def __init__(self, path: Path, enabled: bool):
        self.path, self.enabled = path, enabled

    def truncate_after(self, step: int) -> None:
        """On resume, forget events logged after the checkpoint we resume from."""
        if not self.enabled or not self.path.is_file():
            return
        keep = [line for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= step]
        with atomic_output(self.path) as f:
            f.write("".join(line + "\n" for line in keep))

    def write(self, event: str, **fields: Any) -> None:
        if self.enabled:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"event": event, "time": round(time.time(), 3), **fields}) + "\n")


# -- signals -----------------------------------------------------------------------------

class StopFlag:
    """SIGINT/SIGTERM ask to stop after the current update; a second SIGINT aborts at once."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum
        log.warning("%s received: finishing this update, writing a checkpoint, then exiting "
                    "(Ctrl-C again to abort without a checkpoint)", signal.Signals(signum).name)

    def __enter__(self) -> StopFlag:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


# -- the loop ----------------------------------------------------------------------------

def _precision(name: str, device: torch.device) -> str:
    if name == "auto":
        if device.type == "cuda":
            return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        return "fp32"
    if name not in ("fp32", "bf16", "fp16"):
        raise UserError(f"--precision {name!r}: choose auto, fp32, bf16 or fp16")
    if name == "fp16" and device.type != "cuda":
        raise UserError("--precision fp16 needs a CUDA device; use fp32 or bf16 on CPU")
    return name


def _autocast(precision: str, device: torch.device) -> Any:
    if precision == "fp32":
        return nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


@dataclass
class UpdateStats:
    loss: float  # label-smoothed loss per target token (global batch)
    nll: float
    tgt_tokens: int
    src_tokens: int
    finite: bool
    stop: bool


def _update(net: torch.nn.Module, model: Transformer, optimizer: torch.optim.Optimizer,
            scaler: torch.amp.GradScaler | None, group: list[Batch], ctx: DistContext,
            opts: TrainOptions, precision: str, lr: float, stop_requested: bool) -> UpdateStats:
    """One optimizer update over this rank's micro-batches of the global batch."""
    local_tgt = sum(b.n_tgt_tokens for b in group)
    local_src = sum(b.n_src_tokens for b in group)
    tgt_total, src_total, stop = ctx.all_reduce([local_tgt, local_src, float(stop_requested)])
    if stop:
        return UpdateStats(0.0, 0.0, 0, 0, True, True)
    loss_sum = nll_sum = 0.0
    for i, batch in enumerate(group):
        batch = batch.to(ctx.device)
        last = i == len(group) - 1
        sync = nullcontext() if (last or not isinstance(net, DistributedDataParallel)) else net.no_sync()
        with sync:
            with _autocast(precision, ctx.device):
                logits = net(batch.src, batch.tgt_in)
            loss, nll = token_losses(logits, batch.tgt_out, opts.label_smoothing)
            scaled = loss * (ctx.world_size / tgt_total)
            (scaler.scale(scaled) if scaler else scaled).backward()
        loss_sum += loss.item()
        nll_sum += nll.item()
    loss_sum, nll_sum = ctx.all_reduce([loss_sum, nll_sum])
    finite = math.isfinite(loss_sum)
    if finite:
        if scaler:
            scaler.unscale_(optimizer)
        max_norm = opts.clip_norm if opts.clip_norm > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        finite = scaler is not None or bool(torch.isfinite(grad_norm))
    if finite:
        for g in optimizer.param_groups:
            g["lr"] = lr
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return UpdateStats(loss_sum / tgt_total, nll_sum / tgt_total, int(tgt_total), int(src_total),
                       finite, False)


@torch.no_grad()
def validate(model: Transformer, data: PreparedData, opts: TrainOptions, device: torch.device,
             precision: str) -> dict[str, Any]:
    """Validation loss (teacher forcing) and detokenized sacrebleu BLEU of greedy/beam output."""
    import sacrebleu

    from runtime.torch_backend import TorchBackend
    from runtime.translate import translate_lines

    model.eval()
    try:
        loss_sum = nll_sum = tokens = 0.0
        for batch in iter_eval_batches(data.valid, opts.batch_tokens):
            batch = batch.to(device)
            with _autocast(precision, device):
                logits = model(batch.src, batch.tgt_in)
            loss, nll = token_losses(logits, batch.tgt_out, opts.label_smoothing)
            loss_sum, nll_sum, tokens = loss_sum + loss.item(), nll_sum + nll.item(), tokens + batch.n_tgt_tokens
        n = opts.valid_max_sentences or len(data.valid_src_lines)
        sources, refs = data.valid_src_lines[:n], data.valid_ref_lines[:n]
        backend = TorchBackend(model, device=device, max_src_len=opts.max_len)
        hyps = translate_lines(backend, data.tokenizer, sources, beam_size=opts.valid_beam)
        bleu = sacrebleu.metrics.BLEU()
        score = bleu.corpus_score(hyps, [refs])
        return {"loss": loss_sum / tokens, "nll": nll_sum / tokens, "ppl": math.exp(min(nll_sum / tokens, 50)),
                "bleu": round(score.score, 2), "bleu_signature": str(bleu.get_signature()),
                "sentences": len(sources), "beam": opts.valid_beam}
    finally:
        model.train()


def _prepare(opts: TrainOptions, ctx: DistContext, resume_spm: bytes | None) -> PreparedData:
    save_dir = Path(opts.save_dir)

    def work(write: bool) -> PreparedData:
        if opts.builtin_pairs is not None:
            n_valid = max(5, min(500, opts.builtin_pairs // 20))
            paths = synthetic.write_corpus(save_dir / DATA_DIR, n_train=opts.builtin_pairs,
                                           n_valid=n_valid, n_test=n_valid, seed=opts.seed) if write else \
                {s: (save_dir / DATA_DIR / f"{s}.src", save_dir / DATA_DIR / f"{s}.tgt")
                 for s in synthetic.SPLITS}
            train_pair, valid_pair = paths["train"], paths["valid"]
        else:
            train_pair = (Path(opts.train_src), Path(opts.train_tgt))
            valid_pair = (Path(opts.valid_src), Path(opts.valid_tgt)) if opts.valid_src else (None, None)
        return prepare_data(save_dir, *train_pair, *valid_pair, vocab_size=opts.vocab_size,
                            max_len=opts.max_len, spm_bytes=resume_spm, write=write)

    return _rank0_first(ctx, work)


def _check_resume(save_dir: Path, wanted: dict[str, Any]) -> dict[str, Any] | None:
    """The latest checkpoint's payload when resuming (after checking its config), else None."""
    steps = step_checkpoints(save_dir)
    if not steps:
        return None
    payload = read_checkpoint(steps[-1])
    state = payload.get("train_state") or {}
    old = state.get("config")
    if old is None:
        raise UserError(f"{steps[-1]}: has no training state to resume from; use a new --save-dir")
    diffs = _config_differences(old, wanted)
    if diffs:
        raise UserError(f"{save_dir} holds a run with a different config ({'; '.join(diffs)}); rerun with "
                        "the original options or choose a new --save-dir")
    return payload


def train(opts: TrainOptions) -> Path:
    """Train (or resume) into opts.save_dir; returns the save dir. Works under torchrun.

    Raises TrainingInterrupted after writing a checkpoint when SIGINT/SIGTERM arrive.
    """
    opts = resolve_options(opts)
    model_config(opts, vocab_size=max(8, opts.vocab_size))  # impossible shapes fail before any work
    if opts.threads:
        torch.set_num_threads(opts.threads)
    ctx = init_distributed(opts.device)
    try:
        return _train(opts, ctx)
    finally:
        if ctx.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def _train(opts: TrainOptions, ctx: DistContext) -> Path:
    save_dir = Path(opts.save_dir)
    precision = _precision(opts.precision, ctx.device)
    wanted = comparable_config(opts, model_config(opts, vocab_size=max(8, opts.vocab_size)))
    payload = _check_resume(save_dir, wanted) if save_dir.is_dir() else None
    data = _prepare(opts, ctx, payload["spm_model"] if payload else None)
    cfg = model_config(opts, data.tokenizer.vocab_size)
    if data.valid is None:
        log.info("no --valid-src/--valid-tgt: validation loss and BLEU are skipped")

    torch.manual_seed(opts.seed)
    model = build_model(cfg).to(ctx.device)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.0, betas=(0.9, 0.98), eps=1e-9)
    scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None
    batches = ShardedBatches(data.train, opts.batch_tokens, opts.seed, ctx.world_size, ctx.rank,
                             opts.update_freq)
    torch.manual_seed(opts.seed + ctx.rank)  # dropout masks differ between ranks
    random.seed(opts.seed + ctx.rank)
    np.random.seed(opts.seed + ctx.rank)
    step, tokens_seen, best_bleu = 0, 0, None
    metrics = MetricsLog(save_dir / METRICS_FILE, ctx.is_main)
    if payload:
        step, tokens_seen, best_bleu = _restore(payload, model, optimizer, scaler, batches, ctx)
        metrics.truncate_after(step)
        log.info("resuming %s from step %d", save_dir, step)
    elif ctx.is_main:
        metrics.truncate_after(0)
    if ctx.is_main:
        with atomic_output(save_dir / CONFIG_FILE) as f:
            json.dump({**wanted, "model": cfg.to_dict(), "resolved_options": _jsonable(opts)}, f, indent=2)
    if step >= opts.max_steps:
        log.info("%s is already at step %d >= --max-steps %d: nothing to do", save_dir, step, opts.max_steps)
        return save_dir
    net: torch.nn.Module = model
    if ctx.distributed:
        net = DistributedDataParallel(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    n_params = sum(p.numel() for p in model.parameters())
    log.info("model %s: %.2fM parameters, vocab %d; %d training pairs; %d process(es) x --update-freq %d, "
             "--batch-tokens %d; precision %s on %s", opts.preset, n_params / 1e6, cfg.vocab_size,
             len(data.train), ctx.world_size, opts.update_freq, opts.batch_tokens, precision, ctx.device)
    loop = _Loop(opts, ctx, model, net, optimizer, scaler, batches, data, metrics, precision, wanted)
    return loop.run(step, tokens_seen, best_bleu)


def _jsonable(opts: TrainOptions) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(opts).items()}


def _restore(payload: dict[str, Any], model: Transformer, optimizer: torch.optim.Optimizer,
             scaler: torch.amp.GradScaler | None, batches: ShardedBatches, ctx: DistContext
             ) -> tuple[int, int, float | None]:
    state = payload["train_state"]
    saved_cfg = ModelConfig.from_dict(payload["model_config"])
    if saved_cfg != model.cfg:
        raise UserError(f"the checkpoint's model config differs from this run's: {saved_cfg} vs {model.cfg}")
    model.load_state_dict(payload["model"])
    optimizer.load_state_dict(state["optimizer"])
    if scaler is not None and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    batches.load_state_dict(state["data"])
    rngs = state["rng"]
    if len(rngs) == ctx.world_size:
        _set_rng_state(rngs[ctx.rank], ctx.device)
    else:
        log.warning("the checkpoint holds RNG states of %d process(es), this run has %d: dropout "
                    "masks will not replay exactly", len(rngs), ctx.world_size)
    return state["step"], state.get("tokens", 0), state.get("best_bleu")


class _Loop:
    """The training loop's state, so each piece (update, validate, save) stays small."""

    def __init__(self, opts: TrainOptions, ctx: DistContext, model: Transformer, net: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None,
                 batches: ShardedBatches, data: PreparedData, metrics: MetricsLog, precision: str,
                 config: dict[str, Any]):
        self.opts, self.ctx, self.model, self.net = opts, ctx, model, net
        self.optimizer, self.scaler, self.batches, self.data = optimizer, scaler, batches, data
        self.metrics, self.precision, self.config = metrics, precision, config
        self.save_dir = Path(opts.save_dir)
        self.best_bleu: float | None = None
        self.last_valid: dict[str, Any] = {}

    def run(self, step: int, tokens_seen: int, best_bleu: float | None) -> Path:
        opts, ctx = self.opts, self.ctx
        self.best_bleu = best_bleu
        start_step, start_time, run_tokens = step, time.time(), 0
        window_time, window_tokens = time.time(), 0
        nonfinite = 0
        bar = tqdm(total=opts.max_steps, initial=step, unit="step", dynamic_ncols=True,
                   disable=not (ctx.is_main and opts.progress))
        self.model.train()
        with StopFlag() as stop, bar:
            while step < opts.max_steps:
                position = self.batches.state_dict()
                group = self.batches.next_group()
                lr = learning_rate(step + 1, self.model.cfg.d_model, opts.warmup, opts.lr_scale)
                stats = _update(self.net, self.model, self.optimizer, self.scaler, group, ctx, opts,
                                self.precision, lr, stop.signum is not None)
                if stats.stop:
                    self.batches.load_state_dict(position)  # this group was not trained on
                    path = self._save(step, tokens_seen)
                    signum = stop.signum if stop.signum is not None else signal.SIGTERM
                    raise TrainingInterrupted(signum, step, path)
                if not stats.finite:
                    nonfinite += 1
                    log.warning("step %d: non-finite loss or gradient (%d in a row); update skipped",
                                step + 1, nonfinite)
                    if nonfinite >= opts.max_nonfinite:
                        raise UserError(f"the loss was not finite for {nonfinite} updates in a row at step "
                                        f"{step + 1}; nothing was saved from them. Lower --lr-scale, raise "
                                        "--warmup, set --clip-norm, or use --precision fp32")
                    continue
                nonfinite = 0
                step += 1
                n_tok = stats.tgt_tokens + stats.src_tokens
                tokens_seen, run_tokens, window_tokens = tokens_seen + n_tok, run_tokens + n_tok, window_tokens + n_tok
                bar.update(1)
                if step % opts.log_every == 0 or step == opts.max_steps:
                    now = time.time()
                    tps = window_tokens / max(now - window_time, 1e-9)
                    bar.set_postfix(loss=f"{stats.loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tps:.0f}")
                    self.metrics.write("train", step=step, loss=stats.loss, nll=stats.nll, lr=lr,
                                       tokens=tokens_seen, tokens_per_s=round(tps, 1),
                                       epoch=self.batches.epoch)
                    window_time, window_tokens = now, 0
                if self.data.valid is not None and (step % opts.valid_every == 0 or step == opts.max_steps):
                    self._validate(step, bar)
                if step % opts.save_every == 0 or step == opts.max_steps:
                    self._save(step, tokens_seen)
        seconds = time.time() - start_time
        summary = dict(steps=step - start_step, step=step, tokens=run_tokens, seconds=round(seconds, 1),
                       tokens_per_s=round(run_tokens / max(seconds, 1e-9), 1), best_bleu=self.best_bleu)
        self.metrics.write("summary", **summary)
        if ctx.is_main:
            log.info("trained %d steps (to step %d): %d tokens in %.1f s, %.0f tokens/s (source + target, "
                     "all processes); best valid BLEU %s", summary["steps"], step, run_tokens, seconds,
                     summary["tokens_per_s"], self.best_bleu if self.best_bleu is not None else "n/a")
        return self.save_dir

    def _validate(self, step: int, bar: tqdm) -> None:
        if self.ctx.is_main:
            result = validate(self.model, self.data, self.opts, self.ctx.device, self.precision)
            if self.best_bleu is None or result["bleu"] > self.best_bleu:
                self.best_bleu = result["bleu"]
            self.last_valid = result
            self.metrics.write("valid", step=step, **result)
            bar.write(f"step {step}: valid loss {result['loss']:.3f} ppl {result['ppl']:.2f} "
                      f"BLEU {result['bleu']:.2f} ({result['bleu_signature']})")
        best = [self.best_bleu]
        if self.ctx.distributed:
            dist.broadcast_object_list(best, src=0)
        self.best_bleu = best[0]

    def _save(self, step: int, tokens_seen: int) -> Path | None:
        """Every rank calls this (RNG states are gathered); rank 0 writes."""
        rng = _gather_rng(self.ctx)
        if not self.ctx.is_main:
            return None
        path = checkpoint_path(self.save_dir, step)
        state = {"step": step, "optimizer": self.optimizer.state_dict(),
                 "scaler": self.scaler.state_dict() if self.scaler else None,
                 "data": self.batches.state_dict(), "rng": rng, "world_size": self.ctx.world_size,
                 "tokens": tokens_seen, "best_bleu": self.best_bleu, "config": self.config,
                 "options": _jsonable(self.opts)}
        save_checkpoint(path, self.model, self.data.spm_bytes, train_state=state,
                        extra={"step": step, "valid": self.last_valid})
        _prune(self.save_dir, self.opts.keep_last)
        log.debug("wrote %s", path)
        return path


# -- averaging ---------------------------------------------------------------------------

def average_checkpoints(save_dir: Path, last: int = 5, out: Path | None = None) -> Path:
    """Average the weights of the last `last` step checkpoints (section 6.1: the last 5
    for base, 20 for big) into `out` (default save_dir/averaged.pt), atomically."""
    save_dir = Path(save_dir)
    if last < 1:
        raise UserError(f"--last must be at least 1 (got {last})")
    if not save_dir.is_dir():
        raise UserError(f"{save_dir}: no such save directory")
    paths = step_checkpoints(save_dir)[-last:]
    if not paths:
        raise UserError(f"{save_dir}: no checkpoint_<step>.pt files to average; is it a `pipeline train` "
                        "--save-dir?")
    if len(paths) < last:
        log.warning("only %d checkpoint(s) in %s, averaging those (asked for %d)", len(paths), save_dir, last)
    first = read_checkpoint(paths[0])
    last_payload = first
    total = {k: v.double() if v.is_floating_point() else v for k, v in first["model"].items()}
    for path in paths[1:]:
        payload = last_payload = read_checkpoint(path)
        if payload["model_config"] != first["model_config"]:
            raise UserError(f"{path}: its model config differs from {paths[0]}'s; cannot average them")
        for k, v in payload["model"].items():
            if v.is_floating_point():
                total[k] += v.double()
    model = Transformer(ModelConfig.from_dict(first["model_config"]))
    state = {k: (v / len(paths)).to(first["model"][k].dtype) if v.is_floating_point() else v
             for k, v in total.items()}
    model.load_state_dict(state)
    out = Path(out) if out is not None else save_dir / AVERAGED
    save_checkpoint(out, model, first["spm_model"],
                    extra={"averaged": [p.name for p in paths],
                           "step": last_payload["extra"].get("step")})
    log.info("averaged %d checkpoints (%s .. %s) into %s", len(paths), paths[0].name, paths[-1].name, out)
    return out


def describe_defaults() -> str:
    """The per-preset defaults, for --help and the README."""
    rows = [f"{name}: " + ", ".join(f"{k} {v}" for k, v in d.items()) for name, d in PRESET_DEFAULTS.items()]
    return "; ".join(rows)

