"""Reading a model directory written by transformers' `save_pretrained`, for every importer
(pipeline/importers): typed reads of its JSON files, where its files may resolve, and its weights'
shapes from the file's header, so that a hostile directory is one line naming the file and field
before anything is allocated, and nothing outside the directory is read."""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
from pathlib import Path
from typing import Any, NamedTuple

import torch

from model.errors import UserError


class ImportRefused(UserError):
    """A directory an importer cannot map (names the file, and the field where there is one)."""


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


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise ImportRefused(f"{path}: unreadable ({e})") from None
    if not isinstance(data, dict):
        raise ImportRefused(f"{path}: expected a JSON object")
    return data


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
    except pickle.UnpicklingError:
        raise ImportRefused(f"{path}: not a plain tensor state dict (it holds pickled objects that are not "
                                "tensors); refused for safety; re-save it with save_pretrained("
                                "safe_serialization=True)") from None
    except Exception as e:  # a torn or foreign file: name it
        raise ImportRefused(f"{path}: unreadable weights ({one_line(e)})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ImportRefused(f"{path}: not a state dict (a flat dict of tensor names to tensors)")
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

    try:
        with safe_open(str(path), framework="pt") as f:
            slices = {k: f.get_slice(k) for k in f.keys()}
            return {k: TensorInfo(tuple(s.get_shape()), s.get_dtype(), s.get_dtype().startswith(("F", "BF")))
                    for k, s in slices.items()}
    except Exception as e:  # a torn or foreign file (safetensors checks the header against the size)
        raise ImportRefused(f"{path}: unreadable weights ({one_line(e)})") from None


def digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()
