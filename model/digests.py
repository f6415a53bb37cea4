"""The SHA-256 of a model dir's files, each large file hashed once per version of it (remembered in a cache
keyed by its identity), and the tool's user cache directories."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from model.atomic import atomic_write_text


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


HASH_CACHE_ENV = "PIPELINE_HASH_CACHE"  # a directory for remembered digests, or "off"
CACHED_MIN_BYTES = 1 << 20  # smaller files are hashed every time: it costs less than the lookup
RACY_NS = 2_000_000_000  # a digest taken this soon after the file's last change is taken again next time


OFF = ("off", "0", "false", "no", "none")  # a cache variable's values that turn it off


def user_cache_dir(env: str, name: str) -> Path | None:
    """A cache of this tool's: the directory $`env` names (~ expanded), else $XDG_CACHE_HOME/pipeline/`name`
    (~/.cache/...); None when $`env` is off, in any case, or 0, false, no, none (OFF and false made folders of
    those names in the working directory)."""
    value = os.environ.get(env, "").strip()
    if value.lower() in OFF:
        return None
    if value:
        return Path(value).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pipeline" / name


def hash_cache_dir() -> Path | None:
    """Where digests of large files are remembered: $PIPELINE_HASH_CACHE, else
    $XDG_CACHE_HOME/pipeline/hashes (~/.cache/...); None when PIPELINE_HASH_CACHE=off."""
    return user_cache_dir(HASH_CACHE_ENV, "hashes")


def file_digest(path: Path) -> str:
    """SHA-256 of `path`, hashed once per version of the file.

    A large file's digest is remembered with its identity: device, inode, size, mtime and ctime
    (nanoseconds). Any write, rename over it, or attribute change (utime included, which resets
    mtime but moves ctime) changes the identity, and the file is hashed again. A digest taken
    less than RACY_NS after the file's last change is not trusted (a change within the same
    clock tick would keep the identity; git calls such entries racily clean). What is not
    caught is a change below the file system (bit rot, raw disk writes):
    PIPELINE_HASH_CACHE=off hashes every file on every load."""
    path = Path(path)
    st = path.stat()
    cache = hash_cache_dir()
    if cache is None or st.st_size < CACHED_MIN_BYTES:
        return sha256_file(path)
    identity = [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
    entry = cache / (hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32] + ".json")
    try:
        known = json.loads(entry.read_text())
        if (known.get("identity") == identity and isinstance(known.get("sha256"), str)
                and int(known.get("hashed_at_ns", 0)) - st.st_ctime_ns > RACY_NS):
            return str(known["sha256"])
    except (OSError, ValueError, TypeError):
        pass
    hashed_at = time.time_ns()
    digest = sha256_file(path)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        atomic_write_text(entry, json.dumps({"path": str(path.resolve()), "identity": identity,
                                             "sha256": digest, "hashed_at_ns": hashed_at}))
    except OSError:  # a read-only home or cache: verification still works, it only costs more
        pass
    return digest
