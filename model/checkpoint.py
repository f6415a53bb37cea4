"""Checkpoint files: one self-contained `.pt` holding config, weights, tokenizer, state.

A checkpoint file carries the model config and the SentencePiece model bytes, so a
single file is enough to export or translate. Writes are atomic (temp file + rename):
a crash never leaves a file that a later run would mistake for a valid checkpoint.

Every file written here carries its own SHA-256, verified on every load: torch.load
checks no CRC, so a few flipped bits in the weights would otherwise load silently. The
file stays a plain torch.save zip archive (any tool can still torch.load it); the digest
of all bytes before it is the archive's zip comment, `pipeline-sha256:<64 hex>`.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, cast

import torch

from model.atomic import atomic_write
from model.config import ModelConfig
from model.errors import UserError
from model.signals import signals_deferred
from model.transformer import Transformer

log = logging.getLogger(__name__)

FORMAT = "pipeline-checkpoint-v1"


class CheckpointError(UserError, ValueError):
    """A path that is not a usable checkpoint."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (full disk, read-only dir...); nothing was replaced."""

    def __init__(self, path: Path, reason: str, errno_: int | None = None):
        self.path, self.reason, self.errno = path, reason, errno_
        super().__init__(f"{path}: cannot write: {reason}; nothing was replaced, the files already there "
                         "are intact")


# The zip end-of-central-directory record torch.save ends with (22 bytes, no comment), and
# the comment we give it.
_EOCD, _EOCD_LEN = b"PK\x05\x06", 22
_TAG = b"pipeline-sha256:"
_TRAILER_LEN = len(_TAG) + 64


class _DigestWriter:
    """What torch.save writes to: passes bytes through to `f` while hashing them, holding
    back the last 22 (the zip end record) so that its comment length can be set before
    they are hashed; `finish` then appends the digest as the comment."""

    def __init__(self, f: IO[bytes]):
        self.f, self.hash, self.tail = f, hashlib.sha256(), b""

    def _out(self, data: bytes | memoryview) -> None:
        self.f.write(data)
        self.hash.update(data)

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if len(view) >= _EOCD_LEN:  # the common case: no copy of a large tensor's bytes
            if self.tail:
                self._out(self.tail)
            self._out(view[:-_EOCD_LEN])
            self.tail = bytes(view[-_EOCD_LEN:])
        else:
            buf = self.tail + bytes(view)
            self._out(buf[:-_EOCD_LEN])
            self.tail = buf[-_EOCD_LEN:]
        return len(view)

    def flush(self) -> None:
        self.f.flush()

    def finish(self) -> str:
        tail = self.tail
        if len(tail) != _EOCD_LEN or not tail.startswith(_EOCD) or tail[20:] != b"\0\0":
            raise RuntimeError("torch.save did not end with a zip end record; cannot attach a checksum")
        self._out(tail[:20] + _TRAILER_LEN.to_bytes(2, "little"))
        digest = self.hash.hexdigest()
        self.f.write(_TAG + digest.encode("ascii"))
        return digest


def _chain(e: BaseException) -> Iterator[BaseException]:
    """`e` and the exceptions it was raised from or while handling."""
    seen: BaseException | None = e
    while seen is not None:
        yield seen
        seen = seen.__cause__ or seen.__context__


def _write_failure(e: BaseException) -> tuple[str, int | None] | None:
    """(reason, errno) when `e` is a failed write: an OSError, or the RuntimeError that
    torch's zip writer raises over one ('unexpected pos ...'); None for anything else."""
    for cause in _chain(e):
        if isinstance(cause, OSError) and cause.errno is not None:
            reason = os.strerror(cause.errno)
            return reason[:1].lower() + reason[1:], cause.errno
    if isinstance(e, RuntimeError) and ("unexpected pos" in str(e) or "failed writing" in str(e)):
        return "the write failed (is the disk full?)", None
    return None


def atomic_torch_save(obj: Any, path: Path, replace: bool = True) -> str:
    """torch.save that replaces `path` only once the whole file is on disk (model.atomic),
    with its SHA-256 attached; returns that digest.

    SIGINT/SIGTERM arriving meanwhile are delivered once the file is complete, so a
    second Ctrl-C cannot tear a checkpoint. A full disk, a read-only dir or any other
    failed write is a CheckpointWriteError naming the path, and leaves no temp file."""
    path = Path(path)
    try:
        with signals_deferred(), atomic_write(path, "wb", replace=replace) as f:
            writer = _DigestWriter(f)
            torch.save(obj, cast(IO[bytes], writer))  # it writes only, in order
            return writer.finish()
    except FileExistsError:  # replace=False, and something is there now
        raise
    except (OSError, RuntimeError) as e:
        # Ctrl-C outside the main thread, where signals cannot be deferred: still Ctrl-C.
        if any(isinstance(c, KeyboardInterrupt) for c in _chain(e)):
            raise KeyboardInterrupt from e
        failure = _write_failure(e)
        if failure is None:
            raise
        raise CheckpointWriteError(path, *failure) from e


def _verify(f: IO[bytes], path: Path, chunk: int = 1 << 22) -> None:
    """Check the digest at the end of an open checkpoint file; a file written before
    checkpoints carried one (a plain torch.save archive) loads with a warning."""
    size = f.seek(0, os.SEEK_END)
    if size >= _TRAILER_LEN + _EOCD_LEN:
        f.seek(size - _TRAILER_LEN)
        trailer = f.read(_TRAILER_LEN)
        if trailer.startswith(_TAG):
            h, left = hashlib.sha256(), size - _TRAILER_LEN
            f.seek(0)
            while left > 0:
                block = f.read(min(chunk, left))
                if not block:
                    break
                h.update(block)
                left -= len(block)
            if h.hexdigest().encode("ascii") != trailer[len(_TAG):]:
                raise CheckpointError(f"{path}: checksum mismatch: the file is damaged (its SHA-256 differs "
                                      f"from the one written with it){_MOVE_ASIDE}")
            return
    if size >= _EOCD_LEN:
        f.seek(size - _EOCD_LEN)
        tail = f.read(_EOCD_LEN)
        # Why load rather than refuse: checkpoints of earlier versions hold days of
        # training and were written atomically; they are only unverifiable, not suspect.
        if tail.startswith(_EOCD) and tail[20:] == b"\0\0":
            log.warning("%s: written before checkpoints carried a checksum, so it cannot be verified; "
                        "loading it anyway (checkpoints written from now on carry one)", path)
            return
    raise CheckpointError(f"{path}: not a pipeline checkpoint, or a damaged one (no checksum at its end)"
                          f"{_MOVE_ASIDE if checkpoint_step(path) is not None else ''}")


_MOVE_ASIDE = ("; move it out of its save dir (training resumes, and export reads, the newest one left), or "
               "retrain")


def torch_load_verified(path: Path) -> Any:
    """torch.load of a file written by atomic_torch_save, after checking its digest; the
    same open file is hashed and loaded, so what loads is what was checked."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    try:
        with open(path, "rb") as f:
            _verify(f, path)
            f.seek(0)
            return torch.load(f, map_location="cpu", weights_only=False)
    except CheckpointError:
        raise
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror or e}") from None
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same user error
        raise CheckpointError(f"{path}: not a pipeline checkpoint ({type(e).__name__}: {e})") from None


def save_checkpoint(path: Path, model: Transformer, spm_model: bytes,
                    train_state: dict[str, Any] | None = None,
                    extra: dict[str, Any] | None = None, replace: bool = True) -> str:
    """Write a checkpoint atomically; returns the SHA-256 it carries (see atomic_torch_save). `replace=False`:
    a FileExistsError, and nothing replaced, when `path` exists by the time the file is complete."""
    payload = {
        "format": FORMAT,
        "model_config": model.cfg.to_dict(),
        "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "spm_model": spm_model,
        "train_state": train_state,
        "extra": extra or {},
    }
    return atomic_torch_save(payload, path, replace)


def read_checkpoint(path: Path) -> dict[str, Any]:
    """Load a checkpoint file's payload, checksum verified, with a clear error for anything else."""
    path = Path(path)
    payload = torch_load_verified(path)
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a pipeline checkpoint (expected format {FORMAT})")
    return payload


def load_model(path: Path, device: str | torch.device = "cpu") -> tuple[Transformer, bytes, dict[str, Any]]:
    """(model in eval mode, SentencePiece model bytes, full payload) from a checkpoint file."""
    payload = read_checkpoint(path)
    cfg = ModelConfig.from_dict(payload["model_config"])
    model = Transformer(cfg)
    model.load_state_dict(payload["model"])
    model.to(device).eval()
    return model, payload["spm_model"], payload


# A save dir's step checkpoints: written by training, found here; the name is defined once.
STEP_PREFIX, STEP_SUFFIX = "checkpoint_", ".pt"


def average_mark(newest: Path) -> dict[str, Any]:
    """What an average records of its run's newest step checkpoint (AVERAGED_AT): its step, and the SHA-256 its
    file carries at its end (read, not computed)."""
    try:
        with open(newest, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - _TRAILER_LEN))
            trailer = f.read(_TRAILER_LEN)
    except OSError:
        trailer = b""
    digest = trailer[len(_TAG):].decode("ascii", "replace") if trailer.startswith(_TAG) else None
    return {"step": checkpoint_step(newest), "sha256": digest}


def _averaged_at(averaged: Path) -> dict[str, Any] | None:
    """The mark of the run's newest step checkpoint when this average was made (extra[AVERAGED_AT]), read without
    loading its weights (the chosen checkpoint is verified when it is loaded); None when it records none or
    cannot be read so."""
    try:
        payload = torch.load(averaged, map_location="cpu", weights_only=False, mmap=True)
    except Exception:  # noqa: BLE001 - unreadable here: judged by its time; loading it names the problem
        return None
    made = (payload.get("extra") or {}).get(AVERAGED_AT) if isinstance(payload, dict) else None
    return made if isinstance(made, dict) else None


def step_checkpoint_path(save_dir: Path, step: int) -> Path:
    """save_dir/checkpoint_<step:08d>.pt (zero-padded so names sort like steps)."""
    return Path(save_dir) / f"{STEP_PREFIX}{step:08d}{STEP_SUFFIX}"


def checkpoint_step(path: Path) -> int | None:
    """The step in a `checkpoint_<step>.pt` name, or None for any other file name."""
    name = Path(path).name
    if not (name.startswith(STEP_PREFIX) and name.endswith(STEP_SUFFIX)):
        return None
    digits = name[len(STEP_PREFIX):-len(STEP_SUFFIX)]
    return int(digits) if digits.isdigit() else None


def step_checkpoints(save_dir: Path) -> list[Path]:
    """The save dir's `checkpoint_<step>.pt` files, oldest step first."""
    found = []
    for p in Path(save_dir).glob(f"{STEP_PREFIX}*{STEP_SUFFIX}"):
        step = checkpoint_step(p)
        if step is not None:
            found.append((step, p))
    return [p for _, p in sorted(found)]


AVERAGED = "averaged.pt"
BEST = "checkpoint_best.pt"  # the best validation BLEU so far; not a step checkpoint, never pruned
# an average's extra: the newest step checkpoint of its run when it was made, {"step", "sha256"} (average_mark)
AVERAGED_AT = "averaged_at"


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint file, or from a save dir: `averaged.pt` while the run's newest step checkpoint is the one
    there was when it was made (it records its step and SHA-256, AVERAGED_AT: a copy that touched the files'
    times changes nothing, and a step retrained after a rollback is another file), else the latest step
    checkpoint. An averaged.pt that records none is judged by its time, as older ones were."""
    path = Path(path)
    if path.is_file():
        return path
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint file or save directory")
    steps = step_checkpoints(path)
    averaged = path / AVERAGED
    if averaged.is_file() and steps:
        made = _averaged_at(averaged)
        if made is not None and made == average_mark(steps[-1]):
            return averaged
        if made is None and averaged.stat().st_mtime >= steps[-1].stat().st_mtime:
            return averaged
    elif averaged.is_file():
        return averaged
    if not steps and (path / "manifest.json").is_file() and (path / "model.pt").is_file():  # export's output
        raise CheckpointError(f"{path}: an exported model dir, not a save dir; its checkpoint is {path / 'model.pt'}")
    if not steps:
        raise CheckpointError(f"{path}: no checkpoint_<step>.pt or {AVERAGED} in this directory; "
                              "is it a `pipeline train --save-dir`?")
    if checkpoint_step(steps[-1]) == 0:  # train said so ("a resume point only"); export wrote a model dir of noise
        raise CheckpointError(f"{path}: its one checkpoint is step 0, written before any update (untrained weights: "
                              "the run stopped at once); rerun the train command to train, or name "
                              f"{steps[-1]} itself to use it anyway")
    return steps[-1]
