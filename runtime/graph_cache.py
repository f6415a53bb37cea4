"""ONNX Runtime's optimised graphs, remembered per machine, so that a process loading a model dir
that was loaded before skips graph optimisation (the start-up a one-line file waits for).

ONNX Runtime optimises a graph (fusions, constant folding, its own contrib ops) every time a session
is created: for `small` rowwise int8 that is 35-70 ms of the encoder's and decoder's 50-110 ms
session creation on an AVX2 EPYC. The first session of a graph on a machine saves the optimised graph
(`SessionOptions.optimized_model_filepath`, its weights in a file beside it); later ones load that with
optimisation off, which ONNX Runtime documents as its "offline" mode. Its caveat, that a graph optimised
at the highest level may hold operators specific to the hardware and build, is why an entry is keyed by
everything the result depends on: the SHA-256 of the graph and of the model dir's weight files (of the
files as they are, not as a manifest says), the onnxruntime version, the execution providers, the
session config entries (with the graph optimizers left out), and this CPU's instruction-set flags.
Nothing is shared between machines.

Entries are directories under $PIPELINE_ORT_CACHE, else $XDG_CACHE_HOME/pipeline/ort-graphs
(~/.cache/...); `PIPELINE_ORT_CACHE=off` turns the cache off. An entry is built in a temporary directory
and renamed into place whole, so a reader sees a complete entry or none; it records the digests of its
two files, checked on every load (with model/manifest.py's remembered digests, so at the cost of a
stat), so a damaged entry is rebuilt, never run. Each entry holds a copy of the graph's weights (as
large as the model dir's): delete the directory at any time to reclaim the space. Where the cache
cannot be written (a read-only home), sessions are created as before.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from model.atomic import atomic_write_text
from model.digests import file_digest, user_cache_dir
from runtime.cpu_int8 import cpu_flags

log = logging.getLogger(__name__)

CACHE_ENV = "PIPELINE_ORT_CACHE"  # a directory for optimised graphs, or "off"
ENTRY_FORMAT = 1  # bumped when an entry's layout or what its key covers changes
GRAPH, WEIGHTS, META = "graph.onnx", "graph.data", "entry.json"
BUILDING = ".building-"  # an entry being built (renamed into place when complete)
STALE_S = 3600  # a build directory this old was left by a process killed while building


def cache_root() -> Path | None:
    """$PIPELINE_ORT_CACHE, else $XDG_CACHE_HOME/pipeline/ort-graphs; None when PIPELINE_ORT_CACHE=off."""
    return user_cache_dir(CACHE_ENV, "ort-graphs")


def entry_key(graph_sha256: str, weights_sha256: dict[str, str], ort_version: str, providers: list[str],
              config: dict[str, str]) -> str:
    """The entry's name: a digest of everything the optimised graph depends on (not the thread count,
    which graph optimisation does not read)."""
    what = {"format": ENTRY_FORMAT, "graph": graph_sha256, "weights": weights_sha256, "onnxruntime": ort_version,
            "providers": list(providers), "config": config, "cpu": sorted(cpu_flags())}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:40]


def _intact(entry: Path) -> bool:
    """Whether `entry` holds both files with the digests it recorded when it was built."""
    try:
        meta = json.loads((entry / META).read_text())
        return all(file_digest(entry / name) == meta["files"][name] for name in (GRAPH, WEIGHTS))
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _sweep(root: Path) -> None:
    """Remove what builds killed midway left (temporary directories older than STALE_S)."""
    now = time.time()
    for stale in root.glob(BUILDING + "*"):
        try:
            if now - stale.stat().st_mtime > STALE_S:
                shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            pass


def cached_session(path: Path, key: str, create: Callable[[str, Any], Any], options: Callable[[], Any],
                   ort: Any) -> Any:
    """A session of the graph at `path`: from the optimised graph remembered under `key` when there is an
    intact entry, else created from `path` as usual while the optimised graph is saved for next time.

    `options()` returns fresh SessionOptions as the caller wants them; `create(model_path, options)`
    creates the session (the caller's providers and provider options). Errors from `path` itself
    propagate as they would without the cache."""
    root = cache_root()
    if root is None:
        return create(str(path), options())
    entry = root / key
    if entry.is_dir():
        if _intact(entry):
            opts = options()
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # done when it was saved
            try:
                session = create(str(entry / GRAPH), opts)
                log.debug("%s: optimised graph loaded from %s", path.name, entry)
                return session
            except Exception as e:  # noqa: BLE001 - any failure of a cached copy means: rebuild it from the model dir
                log.warning("%s: the optimised graph remembered for %s does not load (%s); optimising it again",
                            entry, path.name, str(e).splitlines()[0] if str(e) else type(e).__name__)
        else:
            log.warning("%s: damaged entry of the optimised-graph cache, for %s; optimising it again", entry, path.name)
        shutil.rmtree(entry, ignore_errors=True)
    try:
        root.mkdir(parents=True, exist_ok=True)
        _sweep(root)
        building = Path(tempfile.mkdtemp(prefix=BUILDING, dir=root))
    except OSError:  # a read-only home or cache: sessions work as without the cache
        return create(str(path), options())
    try:
        opts = options()
        opts.optimized_model_filepath = str(building / GRAPH)
        opts.add_session_config_entry("session.optimized_model_external_initializers_file_name", WEIGHTS)
        # shape-like constants stay in the graph: ONNX Runtime's shape inference cannot read them from the file
        opts.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
        session = create(str(path), opts)
        if (building / GRAPH).is_file() and (building / WEIGHTS).is_file():
            files = {name: file_digest(building / name) for name in (GRAPH, WEIGHTS)}
            atomic_write_text(building / META, json.dumps({"source": str(path.resolve()), "files": files}) + "\n")
            try:
                os.rename(building, entry)
                log.debug("%s: optimised graph saved to %s", path.name, entry)
            except OSError:  # another process built the same entry first: theirs stays
                pass
        return session
    finally:
        shutil.rmtree(building, ignore_errors=True)
