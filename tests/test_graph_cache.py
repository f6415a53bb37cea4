"""ONNX Runtime's optimised graphs remembered per machine (runtime/graph_cache.py): a second load of a
model dir takes the saved graphs and translates exactly as a load without the cache; a damaged entry is
rebuilt, never run; a changed graph gets its own entry; the cache off or unwritable changes nothing."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from helpers import make_parallel, to_old_decoder_interface

from runtime import graph_cache
from runtime.graph_cache import CACHE_ENV, GRAPH, META, WEIGHTS, entry_key
from runtime.model_dir import LoadOptions, load
from runtime.translate import translate_ids

pytest.importorskip("onnxruntime")


def _decode(model_dir, n=12):
    loaded = load(model_dir, LoadOptions(backend="onnxruntime", threads=1))
    backend, tok = loaded.backend, loaded.tokenizer
    src, _ = make_parallel(n, seed=11)
    ids = [tok.encode_source([s])[0] for s in src]
    return [[(h.tokens, h.score, h.log_prob) for h in hyps] for hyps in translate_ids(backend, ids, beam_size=4,
                                                                                         nbest=2)]


def _entries(root):
    return sorted(p for p in root.iterdir() if not p.name.startswith(".")) if root.is_dir() else []


@pytest.mark.parametrize("fixture", ["trained_model_dir", "rowwise_dir"])
def test_second_load_takes_the_saved_graphs_and_decodes_identically(fixture, request, tmp_path, monkeypatch, caplog):
    model_dir = request.getfixturevalue(fixture)
    monkeypatch.setenv(CACHE_ENV, "off")
    uncached = _decode(model_dir)
    assert not _entries(tmp_path / "cache")

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    with caplog.at_level(logging.DEBUG, logger="runtime.graph_cache"):
        first = _decode(model_dir)
    entries = _entries(tmp_path / "cache")
    assert len(entries) == 2  # the encoder's and the decoder's
    for entry in entries:
        assert sorted(p.name for p in entry.iterdir()) == sorted([GRAPH, WEIGHTS, META])
    assert sum("saved to" in r.getMessage() for r in caplog.records) == 2
    stamp = {e: (e / GRAPH).stat().st_mtime_ns for e in entries}

    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="runtime.graph_cache"):
        second = _decode(model_dir)
    assert sum("loaded from" in r.getMessage() for r in caplog.records) == 2
    assert {e: (e / GRAPH).stat().st_mtime_ns for e in _entries(tmp_path / "cache")} == stamp  # read, not rebuilt
    assert first == uncached and second == uncached  # tokens, scores and log-probs, exactly


def test_a_damaged_entry_is_rebuilt_not_run(trained_model_dir, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    want = _decode(trained_model_dir)
    for entry in _entries(tmp_path / "cache"):  # same size, other bytes: only the digests can tell
        weights = entry / WEIGHTS
        data = bytearray(weights.read_bytes())
        data[len(data) // 2] ^= 0xFF
        weights.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="runtime.graph_cache"):
        assert _decode(trained_model_dir) == want
    assert sum("damaged entry" in r.getMessage() for r in caplog.records) == 2
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="runtime.graph_cache"):
        assert _decode(trained_model_dir) == want
    assert sum("loaded from" in r.getMessage() for r in caplog.records) == 2  # rebuilt intact


def test_an_entry_that_does_not_load_is_rebuilt(trained_model_dir, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    want = _decode(trained_model_dir)
    for entry in _entries(tmp_path / "cache"):  # garbage, with digests that match it
        (entry / GRAPH).write_bytes(b"not a graph")
        meta = json.loads((entry / META).read_text())
        meta["files"][GRAPH] = graph_cache.file_digest(entry / GRAPH)
        (entry / META).write_text(json.dumps(meta))
    with caplog.at_level(logging.WARNING, logger="runtime.graph_cache"):
        assert _decode(trained_model_dir) == want
    assert sum("does not load" in r.getMessage() for r in caplog.records) == 2


def test_a_changed_graph_gets_its_own_entry(trained_model_dir, tmp_path, monkeypatch):
    """The key is the files' content, not the manifest's word for it: a model dir loaded without
    verification after its graph changed never gets the old graph's optimised copy."""
    from model.manifest import read_manifest
    from runtime.errors import RuntimeUserError
    from runtime.ort_backend import OrtBackend

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    copy = tmp_path / "copy"
    shutil.copytree(trained_model_dir, copy)
    _decode(copy)
    to_old_decoder_interface(copy)  # as test_backends' older-interface test, after an entry was made
    with pytest.raises(RuntimeUserError, match="older decoder interface"):
        OrtBackend(copy, read_manifest(copy, verify=False), device="cpu")


def test_the_key_covers_what_the_optimised_graph_depends_on(monkeypatch):
    base = dict(graph_sha256="g", weights_sha256={"decoder.data": "w"}, ort_version="1.0",
                providers=["CPUExecutionProvider"], config={})
    key = entry_key(**base)
    assert entry_key(**base) == key
    for change in (dict(graph_sha256="g2"), dict(weights_sha256={"decoder.data": "w2"}), dict(ort_version="1.1"),
                   dict(providers=["CUDAExecutionProvider", "CPUExecutionProvider"]), dict(config={"k": "v"})):
        assert entry_key(**{**base, **change}) != key, change
    monkeypatch.setattr(graph_cache, "cpu_flags", lambda: {"avx2", "avx512_vnni"})
    assert entry_key(**base) != key  # another CPU's instruction set


def test_a_build_killed_midway_is_swept_later(trained_model_dir, tmp_path, monkeypatch):
    import os

    from runtime.graph_cache import BUILDING, STALE_S

    root = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV, str(root))
    old, recent = root / (BUILDING + "old"), root / (BUILDING + "recent")
    for left in (old, recent):
        left.mkdir(parents=True)
        (left / GRAPH).write_bytes(b"half")
    os.utime(old, (0, os.stat(old).st_mtime - STALE_S - 60))
    _decode(trained_model_dir)
    assert not old.exists() and recent.exists()  # a build still running elsewhere is left alone
    assert len(_entries(root)) == 2


def test_cache_off_or_unwritable_changes_nothing(trained_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, "off")
    want = _decode(trained_model_dir)
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(blocked / "cache"))  # cannot be created: a file is in the way
    assert _decode(trained_model_dir) == want
    assert blocked.read_text() == ""


def test_the_cpu_sessions_run_without_skip_layer_norm_fusion(rowwise_dir, tmp_path, monkeypatch):
    """ONNX Runtime fuses a residual Add + LayerNormalization of the int8 decoder into SkipLayerNormalization,
    whose CPU kernel was slower than the two nodes (runtime/ort_setup.py CPU_DISABLED_OPTIMIZERS): the sessions
    the backend creates leave it out, as the optimised graph it saves shows, where a session with every
    optimizer has it."""
    import onnx
    import onnxruntime as ort

    from runtime.ort_setup import CPU_DISABLED_OPTIMIZERS

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.optimized_model_filepath = str(tmp_path / "all.onnx")
    ort.InferenceSession(str(rowwise_dir / "decoder.onnx"), opts, providers=["CPUExecutionProvider"])
    ops = lambda path: {n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node}  # noqa: E731
    assert "SkipLayerNormalization" in ops(tmp_path / "all.onnx")  # what the fusion makes of this graph

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    load(rowwise_dir, LoadOptions(backend="onnxruntime", threads=1))
    saved = [entry / GRAPH for entry in _entries(tmp_path / "cache")]
    assert len(saved) == 2 and not any("SkipLayerNormalization" in ops(g) for g in saved)
    assert "SkipLayerNormFusion" in CPU_DISABLED_OPTIMIZERS


@pytest.mark.parametrize("value", ["off", "OFF", "Off", "0", "false", "no", " none "])
def test_a_cache_variable_turned_off_in_any_spelling_makes_no_folder(value, monkeypatch, tmp_path):
    """PIPELINE_HASH_CACHE=OFF (or false) was taken as a relative folder: caches were written to ./OFF in the
    working directory (/app in the image) without a word."""
    from model.digests import user_cache_dir

    monkeypatch.setenv("PIPELINE_HASH_CACHE", value)
    assert user_cache_dir("PIPELINE_HASH_CACHE", "hashes") is None
    monkeypatch.setenv("PIPELINE_HASH_CACHE", "~/hashes")  # the home, not a folder named ~
    assert user_cache_dir("PIPELINE_HASH_CACHE", "hashes") == Path.home() / "hashes"
