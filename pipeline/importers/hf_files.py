"""Reading a model directory written by transformers' `save_pretrained`, for every importer
(pipeline/importers): typed reads of its JSON files, where its files may resolve, and its weights'
shapes from the file's header, so that a hostile directory is one line naming the file and field
before anything is allocated, and nothing outside the directory is read.

Every file an importer reads whole (the JSON files, the SentencePiece models) goes through one
`HFFiles` per import: the file must resolve inside the directory before it is opened, must be a
regular file (a FIFO or a device is refused, never waited on), and is read up to its size limit
(LIMITS) plus one byte, so a 4 GB config.json or /dev/zero costs nothing; each JSON file is parsed
once per import."""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch

from model.errors import UserError


class ImportRefused(UserError):
    """A directory an importer cannot map (names the file, and the field where there is one)."""


class Weights(NamedTuple):
    """Where an import's tensors are: `path` the weights file (or a sharded model's index, named by messages about
    the whole), `shards` the file of each tensor of a sharded model; `of(name)` names a tensor's own file."""

    path: Path
    shards: Mapping[str, Path] = {}

    def of(self, tensor: str) -> Path:
        return self.shards.get(tensor, self.path)

    @property
    def name(self) -> str:
        return self.path.name

    def __str__(self) -> str:
        return str(self.path)


class TensorInfo(NamedTuple):
    """What a weights file's header says of one tensor: enough to check it without reading it."""

    shape: tuple[int, ...]
    dtype: str
    floating: bool


# -- typed reads of config.json and generation_config.json: a wrong type is one line naming the field --


def show(value: Any) -> str:
    """A JSON value as the file spells it, cut short: an error stays one readable line."""
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def wrong_type(config: dict[str, Any], expected: str) -> str:
    """config.json's model_type, not the `expected` one, as a refusal says it."""
    if config.get("model_type") is None:
        return f'no "model_type" (this family\'s config.json says "model_type": "{expected}")'
    return f'model_type {show(config["model_type"])}, not "{expected}"'



def integer(data: dict[str, Any], key: str, where: Path, minimum: int = 1, why: str = "") -> int:
    value = data.get(key)
    if key not in data:
        raise ImportRefused(f"{where}: no {key!r}")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ImportRefused(f"{where}: {key} is {show(value)}; expected an integer")
    if value < minimum:
        raise ImportRefused(f"{where}: {key} {value} must be at least {minimum}{why}")
    return value


def optional_integer(data: dict[str, Any], key: str, where: Path, default: int, minimum: int,
                      why: str = "") -> int:
    return default if data.get(key) is None else integer(data, key, where, minimum, why)


def token_id(data: dict[str, Any], key: str, where: Path, vocab_size: int) -> int:
    value = integer(data, key, where, minimum=0)
    if value >= vocab_size:
        raise ImportRefused(f"{where}: {key} {value} is not an id of the vocabulary (0..{vocab_size - 1})")
    return value


def number(data: dict[str, Any], key: str, where: Path, default: float) -> float:
    value = data.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ImportRefused(f"{where}: {key} is {show(value)}; expected a finite number")
    return float(value)


def flag(data: dict[str, Any], key: str, where: Path, default: bool) -> bool:
    value = data.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ImportRefused(f"{where}: {key} is {show(value)}; expected true or false")
    return value


# -- bounded reads: every file read whole has a size limit (docs/import.md) --------------------------

MiB = 1 << 20
CONFIG_LIMIT = 4 * MiB  # config.json, generation_config.json, tokenizer_config.json, ...: a few KB each
VOCABULARY_LIMIT = 64 * MiB  # NLLB-200's tokenizer.json is 17 MB, M2M-100's vocab.json 4 MB
SENTENCEPIECE_LIMIT = 64 * MiB  # NLLB-200's sentencepiece.bpe.model is 5 MB, an OPUS-MT source.spm 1 MB
LIMITS = {"vocab.json": VOCABULARY_LIMIT, "tokenizer.json": VOCABULARY_LIMIT,
          "source.spm": SENTENCEPIECE_LIMIT, "target.spm": SENTENCEPIECE_LIMIT,
          "sentencepiece.bpe.model": SENTENCEPIECE_LIMIT}


def limit_of(name: str) -> int:
    """The size limit of a file read whole, by its name: the vocabularies' and SentencePiece models', else a
    config file's."""
    return LIMITS.get(name, CONFIG_LIMIT)


def size_text(n: int) -> str:
    return f"{n / MiB:g} MiB" if n >= MiB else f"{n} bytes"


def read_bounded(path: Path, limit: int | None = None) -> bytes:
    """The bytes of a regular file of at most `limit` bytes (by its name's limit when None), read as at most
    limit + 1 bytes: a larger file, a FIFO or a device is one line naming the file, never a hang or a
    multi-GB read."""
    limit = limit_of(path.name) if limit is None else limit
    try:  # O_NONBLOCK: opening a FIFO must not wait for a writer (no effect on a regular file)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise ImportRefused(f"{path}: unreadable ({e.strerror or e})") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ImportRefused(f"{path}: not a regular file; the import reads files only")
        too_large = f"{path}: larger than {size_text(limit)}, the limit for {path.name} (docs/import.md); " \
                    f"not a file save_pretrained writes: replace it with the model's own"
        if info.st_size > limit:
            raise ImportRefused(f"{too_large} ({info.st_size} bytes)")
        try:
            data = f.read(limit + 1)
        except OSError as e:
            raise ImportRefused(f"{path}: unreadable ({e.strerror or e})") from None
    if len(data) > limit:  # grew since fstat, or a file whose size stat does not tell
        raise ImportRefused(too_large)
    return data


def read_json(path: Path, limit: int | None = None) -> dict[str, Any]:
    """A JSON object file, read bounded (read_bounded); anything else is one line naming the file."""
    return parse_json(path, read_bounded(path, limit))


def parse_json(path: Path, data: bytes) -> dict[str, Any]:
    """`data` (read from `path`) as a JSON object; anything else is one line naming the file."""
    try:
        parsed = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise ImportRefused(f"{path}: unreadable ({one_line(e)})") from None
    if not isinstance(parsed, dict):
        raise ImportRefused(f"{path}: expected a JSON object")
    return parsed


# -- where the directory's files may resolve --------------------------------------------------------


def allowed_roots(hf_dir: Path) -> list[str]:
    """Where the directory's files may resolve: inside it, and for a snapshot of the Hugging Face hub
    cache (models--ORG--NAME/snapshots/REV, whose files link to ../../blobs) that repository's blobs."""
    real = Path(os.path.realpath(hf_dir))
    roots = [str(real)]
    repo = real.parent.parent
    if real.parent.name == "snapshots" and repo.name.startswith("models--") and (repo / "blobs").is_dir():
        roots.append(str(repo / "blobs"))
    return roots


def inside(path: Path, roots: list[str]) -> bool:
    real = os.path.realpath(path)
    return any(os.path.commonpath([real, root]) == root for root in roots)


class HFFiles:
    """One import's reads of a directory: a file is checked to resolve inside it before it is opened
    (a link out of it is refused, never followed), read bounded (read_bounded), and each JSON file
    parsed once per import (`json` hands every caller the same object: they must not change it).
    A file read whole is opened once: its SHA-256 (`digest_of`, for the provenance record) is that of the
    bytes read, hashed from memory."""

    def __init__(self, hf_dir: Path):
        self.dir = Path(hf_dir)
        self.roots = allowed_roots(self.dir)
        self._json: dict[str, dict[str, Any]] = {}
        self._digests: dict[Path, str] = {}

    def path(self, name: str) -> Path:
        """`name` in the directory, once it is known to resolve inside it (else one line naming it)."""
        path = self.dir / name
        if (path.exists() or path.is_symlink()) and not inside(path, self.roots):
            raise ImportRefused(f"{path}: links to {os.path.realpath(path)}, outside {self.dir}; the import "
                                "reads only files inside the directory it is given: copy the file in")
        return path

    def has(self, name: str) -> bool:
        """Whether `name` is a file of the directory (one resolving outside it is refused, not skipped, and so is
        one that is there but not a regular file: a directory, pipe or device is not taken for "missing")."""
        path = self.path(name)
        if path.exists() and not path.is_file():
            raise ImportRefused(f"{path}: not a regular file (a directory, pipe or device); the import reads it "
                                "as a file of the model")
        if path.is_symlink() and not path.exists():  # was "missing": a loop, or a cache's blob not downloaded
            raise ImportRefused(f"{path}: a symbolic link that leads nowhere, or back to itself (a download that "
                                "did not finish leaves one in the Hugging Face cache): download the model again, "
                                "or copy the file in")
        return path.is_file()

    def read_bytes(self, name: str) -> bytes:
        """The file's bytes, read bounded (read_bounded); their SHA-256 is kept for `digest_of`."""
        path = self.path(name)
        data = read_bounded(path)
        self._digests[path] = hashlib.sha256(data).hexdigest()
        return data

    def json(self, name: str) -> dict[str, Any]:
        if name not in self._json:
            self._json[name] = parse_json(self.dir / name, self.read_bytes(name))
        return self._json[name]

    def read_whole(self, path: Path) -> bool:
        """Whether this import read `path` whole (its digest is of those bytes)."""
        return path in self._digests

    def digest_of(self, path: Path) -> str:
        """The SHA-256 of a file of the directory: of the bytes this import read, for a file read whole (the
        whole file: read_bounded refuses one larger than it reads), else hashed from the file (digest)."""
        known = self._digests.get(path)
        return known if known is not None else digest(path)

    def optional_json(self, name: str) -> dict[str, Any]:
        """The file's JSON object; {} when the directory has no such file."""
        return self.json(name) if self.has(name) else {}


# -- the weights: shapes from the header; a pickle refused unless it is tensors only -----------------


def load_pickle(path: Path) -> dict[str, torch.Tensor]:
    """pytorch_model.bin as a plain dict of tensors, memory-mapped (nothing read until used); anything
    else a pickle might hold is refused, never executed."""
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:  # the legacy (pre-zip) format cannot be mapped: read it whole
            if "mmap" not in str(e):
                raise
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "global" not in str(e).lower():  # torch's words for a pickle of other objects (a blocked module's: GLOBAL
            # posix.system); else it is torn or not one
            raise ImportRefused(f"{path}: unreadable weights: damaged, or not a PyTorch file (its pickle stops at "
                                "data no pickle holds); download it again") from None
        raise ImportRefused(f"{path}: not a plain tensor state dict (it holds pickled objects that are not "
                                "tensors); refused for safety; re-save it with save_pretrained("
                                "safe_serialization=True)") from None
    except EOFError:
        raise ImportRefused(f"{path}: unreadable weights: the file ends early (empty or cut short); download it "
                            "again") from None
    except Exception as e:  # a torn or foreign file: name it
        if "central directory" in str(e) or "zip archive" in str(e):  # (torch's message: miniz's advice, 70 words)
            raise ImportRefused(f"{path}: unreadable weights: damaged or cut short (PyTorch's zip archive has no "
                                "end); download it again") from None
        raise ImportRefused(f"{path}: unreadable weights ({one_line(e)})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ImportRefused(f"{path}: not a state dict (a flat dict of tensor names to tensors)")
    named = [k for k in state if not isinstance(k, str)]
    if named:
        raise ImportRefused(f"{path}: key {named[0]!r:.60} is not a tensor name (a string): not a state dict "
                            "save_pretrained writes; re-save it with save_pretrained(safe_serialization=True)")
    return state


def one_line(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first}"


def weight_infos(path: Path) -> dict[str, TensorInfo]:
    """Each tensor's shape and dtype, from the header (safetensors) or the memory-mapped pickle, without
    reading any weight."""
    if path.suffix != ".safetensors":
        return {k: TensorInfo(tuple(v.shape), str(v.dtype), v.dtype.is_floating_point)
                for k, v in load_pickle(path).items()}
    from safetensors import safe_open

    try:  # safetensors reports a file it may not open as missing: the real reason first
        os.close(os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)))
    except OSError as e:
        raise ImportRefused(f"{path}: unreadable weights ({e.strerror or e})") from None
    try:
        with safe_open(str(path), framework="pt") as f:
            slices = {k: f.get_slice(k) for k in f.keys()}
            return {k: TensorInfo(tuple(s.get_shape()), s.get_dtype(), s.get_dtype().startswith(("F", "BF")))
                    for k, s in slices.items()}
    except Exception as e:  # a torn or foreign file (safetensors checks the header against the size)
        raise ImportRefused(f"{path}: unreadable weights ({one_line(e)})") from None


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The weights file's tensors (once its header, weight_infos, has been checked)."""
    if path.suffix != ".safetensors":
        return load_pickle(path)
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as e:  # changed since its header was read
        raise ImportRefused(f"{path}: unreadable weights ({one_line(e)})") from None


# -- SentencePiece models: a model, and the one the vocabulary was made from ------------------------


def check_sentencepiece(path: Path, data: bytes, vocab: dict[str, int], vocab_name: str) -> None:
    """`data` (read from `path`) is a SentencePiece model with pieces, most of whose text pieces are entries of
    `vocab` (the tokenizer looks them up there: a model of another vocabulary would make every piece UNK);
    else one line naming the file. Empty bytes load no model in SentencePiece, without an error."""
    import sentencepiece as spm

    if not data:
        raise ImportRefused(f"{path}: empty (0 bytes), not a SentencePiece model; replace it with the model's own")
    try:
        sp = spm.SentencePieceProcessor(model_proto=data)
        size = sp.get_piece_size()
    except (RuntimeError, TypeError, OSError) as e:  # its own parse error runs over many lines
        raise ImportRefused(f"{path}: not a SentencePiece model ({one_line(e)})") from None
    pieces = [str(sp.id_to_piece(i)) for i in range(size) if not (sp.is_control(i) or sp.is_unknown(i))]
    missing = [p for p in pieces if p not in vocab]
    if not pieces or 2 * len(missing) > len(pieces):
        example = f" (such as {missing[0]!r:.40})" if missing else ""
        raise ImportRefused(f"{path}: {len(missing)} of its {len(pieces)} pieces are not in {vocab_name}{example}: "
                            f"not the SentencePiece model {vocab_name} was made from")


def digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()
