"""A transformers `save_pretrained` directory as every importer checks it: the files it needs are there and
inside it (a link out of it is refused, never followed), and what was imported is recorded with each file's
SHA-256."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pipeline.importers.hf_files import HFFiles, ImportRefused, allowed_roots, digest, inside

log = logging.getLogger(__name__)

WEIGHTS = ("model.safetensors", "pytorch_model.bin")


def directory(hf_dir: Path, what: str, names: tuple[str, ...]) -> HFFiles:
    """The reads of `hf_dir`, once it is a directory and every file of `names` and the weights that it holds
    resolves inside it (checked before any file is opened); else one line naming the file. `what` names the
    kind of directory expected."""
    if not hf_dir.is_dir():
        raise ImportRefused(f"{hf_dir}: no such directory ({what})")
    files = HFFiles(hf_dir)
    for name in (*names, *WEIGHTS):
        files.path(name)
    return files


def checked_files(files: HFFiles, what: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> Path:
    """The weights file, once every `required` file is there and every file the import may read lies inside
    the directory; else one line naming the file. `what` names the kind of directory expected."""
    hf_dir = files.dir
    for name in (*required, *optional, *WEIGHTS):
        files.path(name)
    for name in required:
        if not (hf_dir / name).is_file():
            raise ImportRefused(f"{hf_dir / name}: missing; {what} holds {', '.join(required)} and "
                                f"{' or '.join(WEIGHTS)}")
    for name in WEIGHTS:
        if (hf_dir / name).is_file():
            return hf_dir / name
    raise ImportRefused(f"{hf_dir / WEIGHTS[0]}: missing (nor is there a {WEIGHTS[1]})")


def provenance(hf_dir: Path, family: str) -> dict[str, Any]:
    """Every file of the directory with its SHA-256; a file linking outside it is neither read nor
    hashed, but named (a counted warning, and `skipped` in the record)."""
    roots = allowed_roots(hf_dir)
    files = sorted(p for p in hf_dir.iterdir() if p.is_file())
    skipped = [p.name for p in files if not inside(p, roots)]
    if skipped:
        log.warning("%s: skipped %d file%s linking outside the directory (not read, not hashed): %s", hf_dir,
                    len(skipped), "" if len(skipped) == 1 else "s", ", ".join(skipped))
    return {"format": family, "directory": str(hf_dir.resolve()),
            "files": {p.name: digest(p) for p in files if p.name not in skipped}, "skipped": skipped}
