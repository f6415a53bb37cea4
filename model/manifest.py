"""The model directory's manifest: what `pipeline export` wrote and every backend checks.

`manifest.json` records the model config, precision, opset, shape limits, versions and
the SHA-256 of every file. Backends refuse a directory whose files do not match it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
FORMAT = "pipeline-model-dir-v1"
CHECKPOINT_FILE = "model.pt"
SPM_FILE = "spm.model"


class ModelDirError(ValueError):
    """A model directory that is missing, incomplete, tampered with, or built elsewhere."""


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_manifest(model_dir: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Hash every file of model_dir (but the manifest) into manifest['files'] and write it."""
    model_dir = Path(model_dir)
    files = sorted(p for p in model_dir.iterdir() if p.is_file() and p.name != MANIFEST)
    manifest = dict(manifest, format=FORMAT, files={p.name: sha256_file(p) for p in files})
    (model_dir / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def read_manifest(model_dir: Path, verify: bool = True, need: tuple[str, ...] = ()) -> dict[str, Any]:
    """Load and (by default) verify model_dir/manifest.json against the files on disk.

    `need` names files that the caller's backend requires (e.g. the ONNX graphs).
    """
    model_dir = Path(model_dir)
    redo = "re-run `pipeline export CHECKPOINT --out DIR --force`"
    if not model_dir.is_dir():
        raise ModelDirError(f"{model_dir}: no such model directory (create one with `pipeline export`)")
    path = model_dir / MANIFEST
    if not path.is_file():
        raise ModelDirError(f"{model_dir}: no {MANIFEST}; not a model directory ({redo})")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelDirError(f"{path}: unreadable manifest ({e}); {redo}") from None
    if manifest.get("format") != FORMAT:
        raise ModelDirError(f"{path}: unknown manifest format {manifest.get('format')!r}; {redo}")
    files = manifest.get("files", {})
    for name in need:
        if name not in files:
            raise ModelDirError(f"{model_dir}: the manifest lists no {name}; {redo}")
    if verify:
        for name, digest in files.items():
            f = model_dir / name
            if not f.is_file():
                raise ModelDirError(f"{f}: listed in the manifest but missing; {redo}")
            if sha256_file(f) != digest:
                raise ModelDirError(f"{f}: SHA-256 does not match the manifest (file changed); {redo}")
    return manifest
