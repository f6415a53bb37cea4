"""The --out directory of an export: refused before any work when the export must not replace it
(`prepare_out`), and the finished model dir put there at the end (`commit_out`): the minutes between the two
are checked again, so a directory that appeared at --out meanwhile, or changed into one no export wrote, is
never replaced."""

from __future__ import annotations

import json
import os
from pathlib import Path

from export.errors import ExportError
from model.atomic import check_can_create_in, place_new, remove_stale_temps, replace_dir
from model.manifest import FORMAT, MANIFEST, OLD_FORMATS


def prepare_out(out: Path, force: bool, checkpoint: Path) -> None:
    """Refuse outputs we must not replace, before any work is done. What a killed export
    left beside --out goes first (a model dir it was replacing is put back)."""
    remove_stale_temps(out.parent)
    if out.is_symlink():  # replacing it would put a directory in the link's place, the linked dir untouched
        raise ExportError(f"{out}: is a symbolic link (to {os.readlink(out)}); give the directory it leads to, or "
                          "another --out")
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out}: exists and is not a directory; choose another --out")
    if out.is_dir():
        if not force:
            raise ExportError(f"{out}: already exists; pass --force to replace it or choose another --out")
        if any(out.iterdir()) and (why := not_a_model_dir(out)):
            raise ExportError(f"{out}: {why}; --force only replaces a model directory an export wrote (all of "
                              "it goes); choose another --out")
        if out.resolve() in checkpoint.resolve().parents:
            raise ExportError(f"{out}: holds the checkpoint being exported; choose another --out")
        if out.resolve() == Path.cwd().resolve() or out.resolve() in Path.cwd().resolve().parents:
            raise ExportError(f"{out}: is the current directory or holds it, which cannot be replaced (the export "
                              "ran to its end, then failed); give the model dir's path from outside it")
    try:
        check_can_create_in(out.parent, "--out")
    except OSError as e:  # (it said "/ro: permission denied; fix its permissions", naming no option)
        why = e.strerror if isinstance(e, NotADirectoryError) else f"cannot write --out here ({e.strerror})"
        raise ExportError(f"{e.filename}: {why}") from None
    out.parent.mkdir(parents=True, exist_ok=True)


def commit_out(tmp: Path, out: Path, force: bool) -> None:
    """The finished model dir put at --out. The plan checked --out minutes ago: with --force a model dir an export
    wrote is replaced (checked again now), else --out must still be free: what appeared there while this export ran
    (a directory a user made, another export's) is never replaced."""
    if force and out.is_dir() and not out.is_symlink():
        why = not_a_model_dir(out) if any(out.iterdir()) else None
        if why:
            raise ExportError(f"{out}: {why} (it changed while this export ran); --force only replaces a model "
                              "directory an export wrote; nothing was replaced, choose another --out")
        replace_dir(tmp, out)
        return
    try:
        place_new(tmp, out)
    except FileExistsError:
        raise ExportError(f"{out}: appeared while this export ran (another export's, or made there); nothing was "
                          "replaced: pass --force to replace a model dir, or choose another --out") from None


def not_a_model_dir(out: Path) -> str | None:
    """Why `out` is not a directory an export wrote, which --force would delete with whatever else it holds (a web
    extension has a manifest.json too); None for one: our manifest, and nothing in it but the files it lists."""
    manifest = out / MANIFEST
    if not manifest.is_file():
        return f"exists and is not a model directory (no {MANIFEST})"
    try:
        data = json.loads(manifest.read_bytes()[:1 << 22])
    except (OSError, ValueError):
        data = None
    if not isinstance(data, dict) or data.get("format") not in (FORMAT, *OLD_FORMATS) or not isinstance(
            data.get("files"), dict):  # never parsed as our Manifest: one of an old format is replaced too
        return f"its {MANIFEST} is not a model directory's (no \"format\": \"{FORMAT}\" and files)"
    other = sorted(p.name for p in out.iterdir() if p.name != MANIFEST and p.name not in data["files"])
    more = f" and {len(other) - 1} more" if len(other) > 1 else ""
    return f"holds {other[0]!r}{more}, which its {MANIFEST} does not list (no export wrote it)" if other else None
