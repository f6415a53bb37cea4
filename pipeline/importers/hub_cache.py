"""A Hugging Face hub id (`Helsinki-NLP/opus-mt-de-en`) or a cache repository dir (`models--ORG--NAME`) as the
local directory `import` reads: the snapshot that the cache's `refs/main` names, as transformers and CTranslate2's
converter resolve ids offline. Nothing is ever downloaded; where it looked is said in one line either way.

The cache is HF_HUB_CACHE, else HUGGINGFACE_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub, ~ and
$VARS expanded (huggingface_hub's order)."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from pipeline.importers.hf_files import ImportRefused, read_bounded
from pipeline.importers.registry import COMMANDS

log = logging.getLogger(__name__)

HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?")
REVISION = re.compile(r"[0-9a-f]{40}")


def hub_cache() -> Path:
    """huggingface_hub's cache dir: HF_HUB_CACHE, else the older HUGGINGFACE_HUB_CACHE, else HF_HOME/hub (HF_HOME:
    XDG_CACHE_HOME/huggingface, ~/.cache/huggingface), with ~ and $VARS expanded, as huggingface_hub.constants."""
    def expanded(path: str) -> str:
        return os.path.expanduser(os.path.expandvars(path))

    home = expanded(os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache",
                                                              "huggingface"))
    return Path(expanded(os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
                         or os.path.join(home, "hub")))


# the owners of the hub's models by the start of their names (nllb-200-..., m2m100_418M, opus-mt-de-en)
_OWNERS = (("nllb", "facebook"), ("m2m100", "facebook"), ("opus-mt", "Helsinki-NLP"))


def _owner(name: str) -> str:
    return next((owner for start, owner in _OWNERS if name.lower().startswith(start)), "ORG")


def resolve_model_dir(typed: str | Path) -> Path:
    """The directory to import: `typed` itself when it is a model directory, a cache repository's snapshot when it
    is `models--ORG--NAME` or a hub id found in the cache; else ImportRefused naming where it looked. A path as
    typed (`./nope`; a Path drops the `./`) is never taken for a hub id."""
    given, text = Path(typed), str(typed)
    url = re.match(r"https?:/+(?:www\.)?huggingface\.co/([^/]+/[^/?#]+)", text)
    if url or re.match(r"https?:/", text):  # (a Path spells https:// as https:/)
        hint = f" (here {url[1]})" if url else ""
        raise ImportRefused(f"{text}: a web address; give a hub id, ORG/NAME{hint}, of a model in the Hugging Face "
                            "cache, or a directory (nothing is downloaded)")
    if given.is_dir():
        if given.name.startswith("models--") and (given / "snapshots").is_dir():
            return _snapshot(given, str(given))
        return given
    if given.exists() or not HUB_ID.fullmatch(text) or text.startswith("."):
        return given  # not an id: the importer says what is wrong with the path
    repo = hub_cache() / ("models--" + text.replace("/", "--"))
    if not repo.is_dir() and text.lower() in COMMANDS:  # `pipeline import Marian DIR`: a family, not a directory
        raise ImportRefused(f"{text}: no such directory; {text} is a model family: `pipeline import "
                            f"{text.lower()} DIR --out X` (or `pipeline import DIR --out X`, which reads the family "
                            "from DIR)")
    if not repo.is_dir():
        fetch = (f"download it once with `hf download {text}` (`huggingface-cli download` before huggingface_hub "
                 "0.34; or save_pretrained)" if "/" in text else  # `hf download opus-mt-de-en` is no hub id
                 f"a hub id names its owner ({_owner(text)}/{text})")
        raise ImportRefused(f"{text}: no such directory, nor a model in the Hugging Face cache (looked for {repo}); "
                            f"{fetch}, or give its directory")
    return _snapshot(repo, text)


def _snapshot(repo: Path, name: str) -> Path:
    """The snapshot refs/main names (else the only one there is)."""
    ref = repo / "refs" / "main"
    snapshots = repo / "snapshots"
    if ref.is_file():
        revision = read_bounded(ref, 4096).decode("utf-8", errors="replace").strip()[:64]  # a 3 GB ref: refused
        if not REVISION.fullmatch(revision) or not (snapshots / revision).is_dir():
            raise ImportRefused(f"{ref}: names revision {revision[:40]!r}, which is not a snapshot in {snapshots}; "
                                f"download {name} again")
        found = snapshots / revision
    else:
        every = sorted(p for p in snapshots.iterdir() if p.is_dir()) if snapshots.is_dir() else []
        if len(every) != 1:
            raise ImportRefused(f"{repo}: no refs/main and {len(every)} snapshots; give the snapshot directory "
                                f"({snapshots}/REVISION)")
        found = every[0]
    log.info("%s: the Hugging Face cache's snapshot %s (%s)", name, found,
             "refs/main" if ref.is_file() else "the only snapshot")
    return found
