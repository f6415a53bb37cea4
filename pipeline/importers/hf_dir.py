"""The input side of every import: a transformers `save_pretrained` directory, opened once (`HfDir.open`).

What it gives the import (pipeline/importers/convert.py) is read once and typed: each JSON file parsed once
(HFFiles), the weights' header (every tensor's shape and dtype, before anything of the model's size is
allocated), the weights themselves, and the record of what was imported (every file's SHA-256). Every file
it reads must resolve inside the directory, checked for all of a family's files before any of them is
opened; a link out of it is refused, never followed."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from pipeline.importers.hf_files import (
    HFFiles,
    ImportRefused,
    TensorInfo,
    Weights,
    allowed_roots,
    inside,
    read_weights,
    weight_infos,
)

log = logging.getLogger(__name__)

CONFIG = "config.json"
WEIGHTS = ("model.safetensors", "pytorch_model.bin")
UNREAD_HASHED = 64 << 20  # a file the import does not read is hashed up to this size, else its size is recorded
INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")  # sharded weights: their weight_map
# the weights as transformers looks for them (modeling_utils): safetensors whole, then sharded, then PyTorch's .bin
# whole, then sharded; an index with the format of its shards. A directory holding a .bin beside a sharded
# safetensors copy was imported from the .bin while transformers read the shards.
ORDER = ((WEIGHTS[0], None), (INDEXES[0], WEIGHTS[0]), (WEIGHTS[1], None), (INDEXES[1], WEIGHTS[1]))


class HfDir(HFFiles):
    """One import's view of a save_pretrained directory (see the module's docstring)."""

    def __init__(self, hf_dir: Path):
        super().__init__(hf_dir)
        self._weights: Path | None = None  # the weights file, or a sharded model's index naming its shards
        self._shards: list[Path] = []
        self._weight_map: dict[str, str] = {}
        self._header: dict[str, TensorInfo] | None = None

    @classmethod
    def open(cls, hf_dir: Path, what: str) -> HfDir:
        """The reads of `hf_dir`, once it is a directory whose config.json and weights resolve inside it (checked
        before any file is opened); else one line naming the file. `what` names the kind of directory expected."""
        hf_dir = Path(hf_dir)
        if not hf_dir.is_dir():
            raise ImportRefused(f"{hf_dir}: no such directory ({what})")
        opened = cls(hf_dir)
        opened.inside((CONFIG,))
        return opened

    def inside(self, names: tuple[str, ...]) -> None:
        """Every file of `names` and the weights that the directory holds resolve inside it (nothing is opened)."""
        for name in (*names, *WEIGHTS, *INDEXES):
            self.path(name)

    def require(self, what: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> Path:
        """The weights file, once every `required` file is there and every file the import may read lies inside
        the directory; else one line naming the file. `what` names the kind of directory expected."""
        self.inside((*required, *optional))
        for name in required:
            if not self.has(name):
                hint = (f" (a re-save by transformers 5 writes tokenizer.json alone: copy {name} from the snapshot "
                        "of the model it was fine-tuned from)") if name.endswith(".model") and self.has(
                    "tokenizer.json") else ""
                raise ImportRefused(f"{self.dir / name}: missing; {what} holds {', '.join(required)} and "
                                    f"{' or '.join(WEIGHTS)}{hint}")
        refused: ImportRefused | None = None
        for name, shards in ORDER:  # transformers' order: it reads the first there (parity compares with it)
            if not self.has(name):
                continue
            if shards is None:
                self._weights = self.dir / name
                self._shards = [self._weights]
                return self._weights
            try:  # an index whose shards are not all there: the next one (both indexes, one download of *.bin)
                self._weights, self._shards = self.dir / name, self._shard_files(name, shards)
                return self._weights
            except ImportRefused as e:
                refused = refused or e
        if refused is not None:
            raise refused
        raise ImportRefused(f"{self.dir / WEIGHTS[0]}: missing (nor is there a {WEIGHTS[1]}, nor a sharded model's "
                            f"{' or '.join(INDEXES)})")

    def _shard_files(self, index: str, weights: str) -> list[Path]:
        """The shard files a sharded model's index names (its weight_map's values), each a file of the directory
        like `weights` (model-00001-of-00002.safetensors), resolving inside it."""
        where = self.dir / index
        weight_map = self.json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map or not all(
                isinstance(v, str) for v in weight_map.values()):
            raise ImportRefused(f"{where}: no weight_map of tensor names to shard files")
        suffix = Path(weights).suffix
        names = sorted(set(weight_map.values()))
        for name in names:
            if Path(name).name != name or not name.endswith(suffix):
                raise ImportRefused(f"{where}: shard {name[:80]!r} is not a {suffix} file of the directory")
            if not self.has(name):
                raise ImportRefused(f"{self.dir / name}: missing; {index} names it as a shard of the weights")
        self._weight_map = weight_map
        return [self.dir / name for name in names]

    def config(self) -> dict[str, Any]:
        """config.json (read once, like every JSON file); one line when it is missing."""
        if not self.has(CONFIG):
            raise ImportRefused(f"{self.dir / CONFIG}: missing; a save_pretrained directory holds it (its "
                                "model_type names the model's family)")
        return self.json(CONFIG)

    @property
    def weights(self) -> Path:
        if self._weights is None:
            raise RuntimeError("HfDir.require names the weights file first")
        return self._weights

    @property
    def located(self) -> Weights:
        """The weights file, and for a sharded model the shard each tensor is in (what a refusal names)."""
        return Weights(self.weights, {name: self.dir / shard for name, shard in self._weight_map.items()})

    def header(self) -> dict[str, TensorInfo]:
        """Each tensor's shape and dtype, from the weights file's header, without reading any weight."""
        if self._header is None:
            self._header = self._merged({shard: weight_infos(shard) for shard in self._shards})
        return self._header

    def tensors(self) -> dict[str, torch.Tensor]:
        """The weights (once the header has been checked against config.json), of every shard."""
        return self._merged({shard: read_weights(shard) for shard in self._shards})

    def _merged(self, per_shard: dict[Path, dict[str, Any]]) -> dict[str, Any]:
        """The shards' tensors as one model's: each tensor in the shard the index names, and in no other."""
        if len(per_shard) == 1 and self._weights in per_shard:
            return per_shard[self._weights]
        merged: dict[str, Any] = {}
        for shard, tensors in per_shard.items():
            for name, value in tensors.items():
                if self._weight_map.get(name) != shard.name:
                    placed = repr(self._weight_map[name]) if name in self._weight_map else "no shard"
                    raise ImportRefused(f"{shard}: holds {name[:80]!r}, which {self.weights.name} places in "
                                        f"{placed}")
                merged[name] = value
        missing = sorted(set(self._weight_map) - set(merged))
        if missing:
            raise ImportRefused(f"{self.dir / self._weight_map[missing[0]]}: lacks {missing[0][:80]!r}, which "
                                f"{self.weights.name} places there ({len(missing)} tensor(s) missing)")
        return merged

    def provenance(self, family: str) -> dict[str, Any]:
        """Every file of the directory with its SHA-256 (of the bytes read, for a file the import read whole:
        HFFiles.digest_of); a file linking outside it is neither read nor hashed, nor is one the import does not
        need and cannot read (a README it may not open fails nothing), but each is named (a counted warning, and
        `skipped` in the record)."""
        roots = allowed_roots(self.dir)
        files = sorted(p for p in self.dir.iterdir() if p.is_file())
        outside = [p.name for p in files if not inside(p, roots)]
        if outside:
            log.warning("%s: skipped %d file%s linking outside the directory (not read, not hashed): %s", self.dir,
                        len(outside), "" if len(outside) == 1 else "s", ", ".join(outside))
        digests: dict[str, str] = {}
        unreadable: list[str] = []
        unhashed: dict[str, int] = {}  # large files the import never reads: their sizes
        for p in files:
            if p.name in outside:
                continue
            try:
                if p not in self._shards and not self.read_whole(p) and (size := p.stat().st_size) > UNREAD_HASHED:
                    unhashed[p.name] = size  # another framework's weights (tf_model.h5): 17 s a 4 GiB for nothing
                    continue
                digests[p.name] = self.digest_of(p)
            except (ImportRefused, OSError):  # the files the import needs were read already: not one of them
                unreadable.append(p.name)
        if unreadable:
            log.warning("%s: skipped %d file%s the import does not read and cannot open (not hashed): %s", self.dir,
                        len(unreadable), "" if len(unreadable) == 1 else "s", ", ".join(unreadable))
        if unhashed:
            log.info("%s: not hashed, as the import does not read them (their sizes are recorded): %s", self.dir,
                     ", ".join(unhashed))
        return {"format": family, "directory": str(self.dir.resolve()), "files": digests,
                "skipped": sorted(outside + unreadable)} | ({"unhashed": unhashed} if unhashed else {})
