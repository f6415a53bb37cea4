"""`train(TrainOptions)`: the training of "Attention Is All You Need" (section 5), put
together from its parts. Runs as one process or as one rank of
`torchrun --nproc-per-node N -m pipeline train ...`: the model never sees
torch.distributed; DistributedDataParallel is applied here, from outside.

A save dir is self-contained and resumable: checkpoint_<step:08d>.pt files (see
checkpointing.py), spm.model, config.json, metrics.jsonl and the encoded-corpus cache.
Rerunning the same command continues exactly where the last checkpoint left off, on the
same data: config.json and every checkpoint record the corpus files' size and SHA-256.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import random
import re
import shutil
import signal
import time
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

from model.atomic import check_writable_dir, remove_stale_temps
from model.checkpoint import step_checkpoints
from model.errors import UserError
from model.transformer import build_model
from pipeline.corpus import synthetic
from pipeline.corpus.data import CACHE_DIR, PreparedData, ShardedBatches, file_fingerprint, prepare_data
from pipeline.corpus.sampling import SubwordSampler
from pipeline.distributed import DistContext, init_distributed, rank0_first, shutdown
from pipeline.textio import atomic_output, within
from pipeline.training.allocator import keep_freed_memory
from pipeline.training.budget import TimeBudget
from pipeline.training.checkpointing import (
    CONFIG_FILE,
    LOCK_FILE,
    Checkpointer,
    Progress,
    check_data,
    check_resume,
    data_fingerprint,
)
from pipeline.training.loop import TrainLoop
from pipeline.training.metrics import METRICS_FILE, MetricsLog, TrainingInterrupted
from pipeline.training.options import (
    CORPUS_PATHS,
    TrainOptions,
    comparable_config,
    jsonable,
    model_config,
    parse_duration,
    resolve_options,
)
from pipeline.training.step import Stepper, resolve_precision
from pipeline.training.tensorboard import TENSORBOARD_DIR, TensorBoardLog
from runtime.languages import language_suffix

log = logging.getLogger(__name__)

DATA_DIR = "data"  # the built-in corpus' text files, inside the save dir


def train(opts: TrainOptions, started: float | None = None) -> Path:
    """Train (or resume) into opts.save_dir; returns the save dir. Works under torchrun.

    --max-time counts from `started` (epoch seconds; default: this call, so that a notebook kernel's or a
    script's earlier life spends none of it; `pipeline train` passes its process's start, its imports included).
    Raises TrainingInterrupted after writing a checkpoint when SIGINT/SIGTERM arrive.
    """
    started = time.time() if started is None else started
    opts = resolve_options(opts)
    model_config(opts, vocab_size=max(8, opts.vocab_size or 8))  # impossible shapes fail before any work
    _check_corpus_outside_run_files(opts)
    made = not os.path.lexists(opts.save_dir)
    top = Path(opts.save_dir)  # the outermost directory the run creates (runs/a/b/c: runs/a, where runs exists)
    while not os.path.lexists(top.parent) and top.parent != top:
        top = top.parent
    writer = os.environ.get("RANK", "0") == "0"  # torchrun's rank 0 makes the save dir and writes it; the others
    if writer:  # read what it left there (had they made it, rank 0 could find it made, and leave it when refused)
        _check_save_dir(Path(opts.save_dir))
    lock = _lock_save_dir(Path(opts.save_dir)) if writer else None
    if opts.threads:
        torch.set_num_threads(opts.threads)
    ctx: DistContext | None = None
    try:
        ctx = init_distributed(opts.device)
        if ctx.device.type == "cpu":
            keep_freed_memory()
        save_dir = _train(opts, ctx, started)
        if ctx.distributed:  # every rank past its last collective before the group goes: a rank destroying it
            torch.distributed.barrier()  # while another still used it ended a finished run in SIGABRT (rarely)
        return save_dir
    except UserError:
        if made and (ctx is None or ctx.is_main):
            _remove_refused(Path(opts.save_dir), top)
        raise
    finally:
        if ctx is not None:
            shutdown(ctx)
        if lock is not None:
            lock.close()


def _lock_save_dir(save_dir: Path) -> IO[str]:
    """An exclusive lock on the save dir for this run, or a UserError naming the process that holds it: two runs
    writing one save dir (the same command twice; torchrun killed with -9 while its workers went on) pruned and
    truncated each other's checkpoints and metrics. Released when the process ends, however it ends."""
    handle = open(save_dir / LOCK_FILE, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip()[:20] or "another process"
        handle.close()
        raise UserError(f"{save_dir}: another training run is writing it (pid {holder}); wait for it to end, or "
                        "choose another --save-dir (`pipeline demo`: another --out)") from None
    except OSError as e:  # a file system without locks (some network ones): the run goes on, unguarded
        log.warning("%s: cannot lock it (%s); two runs started on it would write over each other", save_dir,
                    e.strerror or e)
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return handle


def _remove_refused(save_dir: Path, top: Path) -> None:
    """A save dir this run made and then refused the run in (a corpus of unequal lines, a missing file, no
    pair left after --max-len, an unusable device): removed with what it wrote before the refusal (SentencePiece's
    model, the cache), so that a refused run leaves nothing behind; never once a checkpoint is in it. So are the
    directories above it that the run made, up to `top`, where empty (they were left)."""
    with contextlib.suppress(OSError):
        # a checkpoint is one of its own *.pt files (cache/ holds the encoded corpus, written before refusals)
        if save_dir.is_dir() and not save_dir.is_symlink() and not any(save_dir.glob("*.pt")):
            shutil.rmtree(save_dir)
            for parent in save_dir.parents if save_dir != top else ():
                parent.rmdir()  # an OSError (not empty: another run's) ends it
                if parent == top:
                    break


RUN_FILES = re.compile(r"config\.json|metrics\.jsonl|interrupted\.json|spm\.model|.*\.pt|\..*")  # in a save dir


def _check_corpus_outside_run_files(opts: TrainOptions) -> None:
    """A corpus file the run would write over (--train-src RUN/config.json), or one inside a folder the run
    writes (cache/, tensorboard/): refused before anything is read (it was replaced, exit 0)."""
    if opts.builtin_pairs is not None:
        return
    save_dir = Path(os.path.realpath(opts.save_dir))
    for name in CORPUS_PATHS:
        given = getattr(opts, name)
        if given is None:
            continue
        path = Path(os.path.realpath(given))
        if path.parent == save_dir and RUN_FILES.fullmatch(path.name) or any(  # (data/: the built-in corpus')
                within(path, save_dir / d) for d in (CACHE_DIR, TENSORBOARD_DIR)):
            raise UserError(f"{given} (--{name.replace('_', '-')}): the run writes its own files there, in "
                            f"--save-dir {opts.save_dir}; move the corpus out of it, or choose another --save-dir")


def _check_save_dir(save_dir: Path) -> None:
    """Fail fast: a save dir that cannot be written (read-only, full, not a dir) is found
    before SentencePiece trains, not at the first checkpoint."""
    try:
        check_writable_dir(save_dir, "--save-dir")
    except OSError as e:
        raise UserError(f"{save_dir}: cannot write to this --save-dir ({e.strerror or e}); choose a "
                        "writable one") from None


def _refuse_foreign_config(save_dir: Path) -> None:
    """A save dir without checkpoints whose config.json no run wrote (`--save-dir .` in a project): refused, not
    replaced (a user's config.json was overwritten without a word)."""
    config = save_dir / CONFIG_FILE
    if not config.is_file() or step_checkpoints(save_dir):  # a run's dir: check_resume judges it
        return
    try:
        ours = isinstance(found := json.loads(config.read_text(encoding="utf-8")), dict) and "resolved_options" in found
    except (OSError, ValueError):
        ours = False
    if not ours:
        raise UserError(f"{config}: a config.json that no `pipeline train` wrote; training would replace it: choose "
                        "a new or empty --save-dir")


def _warn_same_contents(files: dict[str, dict[str, Any]]) -> None:
    """Corpus files of the same bytes where a run wants them apart, said once: a source side given as its own
    target (the model learns to copy), or validation files that are the training files (its BLEU and the best
    checkpoint then say nothing of text the model has not seen)."""
    digest = {name: f["sha256"] for name, f in files.items()}
    same = [(a, b, why) for a, b, why in (
        ("train_src", "train_tgt", "the model learns to copy its input"),
        ("valid_src", "valid_tgt", "validation BLEU measures copying"),
        ("train_src", "valid_src", "validation BLEU and checkpoint_best.pt measure text trained on, not held out"),
    ) if a in digest and digest[a] == digest.get(b) and files[a].get("size")]  # (empty ones: refused as such)
    for a, b, why in same:
        log.warning("--%s and --%s have the same contents: %s", a.replace("_", "-"), b.replace("_", "-"), why)


def _train(opts: TrainOptions, ctx: DistContext, started: float) -> Path:
    save_dir = Path(opts.save_dir)
    if ctx.is_main:  # only rank 0 writes here; another node's live temps have pids we cannot see
        for d in (save_dir, save_dir / CACHE_DIR, save_dir / DATA_DIR):
            remove_stale_temps(d)
    precision = resolve_precision(opts.precision, ctx.device)
    wanted = comparable_config(opts, model_config(opts, vocab_size=max(8, opts.vocab_size or 8)))
    _refuse_foreign_config(save_dir)
    payload = check_resume(save_dir, wanted) if save_dir.is_dir() else None
    data_files = data_fingerprint(opts)
    if ctx.is_main and data_files:
        _warn_same_contents(data_files)
    changed = check_data(save_dir, payload["train_state"].get("data_files"), data_files,
                         opts.allow_changed_data) if payload else []
    data = _prepare(opts, ctx, payload["spm_model"] if payload else None)
    cfg = model_config(opts, data.tokenizer.vocab_size)
    if data.valid is None:
        log.info("no --valid-src/--valid-tgt: validation loss and BLEU are skipped")
    elif 2 * opts.valid_beam > cfg.vocab_size:  # the search asks 2 x beam candidates a step (it failed with a
        # traceback at the first validation, the updates before it lost)
        raise UserError(f"--valid-beam {opts.valid_beam} needs {2 * opts.valid_beam} candidates a step, more "
                        f"than the vocabulary's {cfg.vocab_size} pieces: give at most {cfg.vocab_size // 2}")

    torch.manual_seed(opts.seed)  # the same initial weights on every rank
    model = build_model(cfg).to(ctx.device)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.0, betas=(0.9, 0.98), eps=1e-9)
    scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None
    sampler = SubwordSampler(data.spm_bytes, data.train, data.train_lines, opts.spm_alpha, opts.spm_nbest,
                             opts.max_len) if data.train_lines is not None else None
    batches = ShardedBatches(data.train, opts.batch_tokens, opts.seed, ctx.world_size, ctx.rank,
                             opts.update_freq, sampler)
    torch.manual_seed(opts.seed + ctx.rank)  # dropout masks differ between ranks
    random.seed(opts.seed + ctx.rank)
    np.random.seed(opts.seed + ctx.rank)
    checkpointer = Checkpointer(save_dir, ctx, model, optimizer, scaler, batches, data.spm_bytes, wanted,
                                jsonable(opts), opts.keep_last, data_files)
    metrics = MetricsLog(save_dir / METRICS_FILE, ctx.is_main)
    progress = Progress()
    if payload:
        progress = checkpointer.restore(payload)
        metrics.truncate_after(progress.step)
        log.info("resuming %s from step %d", save_dir, progress.step)
        if changed:
            metrics.write("data_changed", step=progress.step, files=changed)
    elif ctx.is_main:
        metrics.truncate_after(0)
    if ctx.is_main:
        # the built-in corpus' validation split as written: export takes it as the held-out set unless it changed
        held_out = [save_dir / DATA_DIR / name for name in BUILTIN_VALID] if opts.builtin_pairs is not None else []
        builtin = dict(zip(BUILTIN_VALID, file_fingerprint(held_out))) if all(p.is_file() for p in held_out) else None
        with atomic_output(save_dir / CONFIG_FILE) as f:
            json.dump({**wanted, "model": cfg.to_dict(), "resolved_options": jsonable(opts),
                       "data_files": data_files} | ({"builtin_files": builtin} if builtin else {}), f, indent=2)
    budget = TimeBudget(parse_duration(opts.max_time) if opts.max_time else None, progress.elapsed_s, started)
    if progress.step >= opts.max_steps:
        log.info("%s is already at step %d >= --max-steps %d: nothing to do", save_dir, progress.step,
                 opts.max_steps)
        checkpointer.finish(progress)  # a stop signal's checkpoint of this step is the run's last now
        return save_dir

    net: torch.nn.Module = model
    if ctx.distributed:
        net = DistributedDataParallel(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    n_params = sum(p.numel() for p in model.parameters())
    log.info("model %s: %.2fM parameters, vocab %d; %d training pairs; %d process(es) x --update-freq %d, "
             "--batch-tokens %d; precision %s on %s", opts.preset, n_params / 1e6, cfg.vocab_size,
             len(data.train), ctx.world_size, opts.update_freq, opts.batch_tokens, precision, ctx.device)
    stepper = Stepper(net, model, optimizer, scaler, ctx, precision, opts.label_smoothing, opts.clip_norm)
    tensorboard = TensorBoardLog(save_dir, opts.tensorboard and ctx.is_main, progress.step if payload else None)
    try:
        TrainLoop(opts, stepper, batches, data, metrics, checkpointer, budget, tensorboard).run(progress)
    except KeyboardInterrupt:  # a second Ctrl-C; a checkpoint write it hit finished first
        if not ctx.is_main:
            raise
        latest = step_checkpoints(save_dir)
        raise TrainingInterrupted(signal.SIGINT, progress.step, latest[-1] if latest else None,
                                  aborted=True) from None
    finally:
        tensorboard.close()
    return save_dir


BUILTIN_VALID = ("valid.src", "valid.tgt")  # the built-in corpus' validation split, in the save dir's data/


def validation_files(checkpoint: Path, existing: bool = True) -> tuple[Path, Path] | None:
    """The held-out (validation) pair a checkpoint's save dir trained with: the built-in corpus' valid split, or
    --valid-src/--valid-tgt at the absolute paths config.json's fingerprints record (the options hold them as
    typed: relative to where training ran, not to where this runs); None when unknown or (`existing`) gone or
    changed since (its size or SHA-256 not the recorded one)."""
    checkpoint = Path(checkpoint)
    save_dir = checkpoint if checkpoint.is_dir() else checkpoint.parent
    try:
        config = json.loads((save_dir / CONFIG_FILE).read_text())
        options, recorded = config["resolved_options"], config.get("data_files") or {}
        if options.get("builtin_pairs") is not None:  # fingerprinted since training recorded builtin_files
            files = [{**((config.get("builtin_files") or {}).get(name) or {}), "path": str(save_dir / DATA_DIR / name)}
                     for name in BUILTIN_VALID]  # where the save dir is now
        elif options.get("valid_src") and options.get("valid_tgt"):
            files = [recorded.get(name) or {"path": str(Path(options[name]).resolve())}
                     for name in ("valid_src", "valid_tgt")]  # a config without fingerprints: as typed
        else:
            return None
        pair = (Path(files[0]["path"]), Path(files[1]["path"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if not existing:
        return pair
    if not all(p.is_file() for p in pair):
        return None
    found = file_fingerprint(list(pair))
    if any(f.get("sha256", now["sha256"]) != now["sha256"] for f, now in zip(files, found)):
        log.warning("%s: its run's validation set (%s, %s) changed since it trained: not used", checkpoint, *pair)
        return None
    return pair


def corpus_languages(checkpoint: Path) -> tuple[str, str] | None:
    """The language codes a checkpoint's save dir trained on, from its corpus files' suffixes (train.de and
    train.en, .gz or not; --train-src/--train-tgt as config.json records them); None when they are not two
    different language codes, or for the built-in made-up pair."""
    checkpoint = Path(checkpoint)
    save_dir = checkpoint if checkpoint.is_dir() else checkpoint.parent
    try:
        options = json.loads((save_dir / CONFIG_FILE).read_text())["resolved_options"]
        files = [Path(options["train_src"]), Path(options["train_tgt"])]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    codes = [next((s[1:] for s in reversed(f.suffixes) if s != ".gz"), "") for f in files]
    if all(language_suffix(c) for c in codes) and codes[0] != codes[1]:  # train.src / train.tgt name none
        return codes[0], codes[1]
    return None


def _prepare(opts: TrainOptions, ctx: DistContext, resume_spm: bytes | None) -> PreparedData:
    """Tokenizer and encoded corpora; rank 0 trains/caches them, the other ranks read the cache."""
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
            train_pair = (Path(opts.train_src), Path(opts.train_tgt))  # type: ignore[arg-type]
            valid_pair = (Path(opts.valid_src), Path(opts.valid_tgt)) if opts.valid_src else (None, None)
        return prepare_data(save_dir, *train_pair, *valid_pair, vocab_size=opts.vocab_size,
                            max_len=opts.max_len, spm_bytes=resume_spm, write=write,
                            keep_train_text=opts.spm_alpha > 0)

    return rank0_first(ctx, work)
