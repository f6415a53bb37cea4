"""Finished sentences leave a batch with the fewest rows moved (model.cache.tail_filled): the caches, the encoder
state and the search follow that order, and no translation depends on it."""

from __future__ import annotations

import numpy as np
import pytest

from model.cache import BeamCache, CacheError, keep_rows_in_place, moves_in_place, tail_filled
from model.config import preset
from runtime import search
from runtime.backend import EncoderState, select_rows
from runtime.indirect_cache import IndirectCache
from runtime.model_dir import LoadOptions, load


def test_holes_take_rows_from_the_end():
    alive = np.array([True, False, True, False, True, True, True])
    order = tail_filled(alive)
    assert order.tolist() == [0, 5, 2, 6, 4]  # rows 0, 2, 4 stay; the holes 1 and 3 take rows 5 and 6
    rng = np.random.default_rng(0)
    for _ in range(200):
        alive = rng.random(int(rng.integers(1, 40))) < rng.random()
        order = tail_filled(alive)
        n = int(alive.sum())
        assert sorted(order.tolist()) == np.flatnonzero(alive).tolist()  # every live row once, no other
        assert int((order != np.arange(n)).sum()) == int((~alive[:n]).sum())  # one move per hole, no more
        assert moves_in_place(order, alive.size) and moves_in_place(np.flatnonzero(alive), alive.size)


def test_rows_move_in_place_as_take_would_copy_them():
    rng = np.random.default_rng(1)
    for _ in range(100):
        rows = int(rng.integers(1, 30))
        alive = rng.random(rows) < 0.6
        for kept in (tail_filled(alive), np.flatnonzero(alive)):
            block = rng.standard_normal((3, rows, 2, 5)).astype(np.float32)
            want = [np.take(a, kept, axis=0) for a in block]
            moved = keep_rows_in_place([block[0], block[1], block[2]], kept)
            assert all(np.array_equal(m, w) for m, w in zip(moved, want))
    # a swap or a repeated row would read a row already written: refused, so callers copy
    assert not moves_in_place(np.array([1, 0]), 2) and not moves_in_place(np.array([2, 2]), 3)
    assert not moves_in_place(np.array([0, 3]), 3)


def test_the_encoder_state_follows_any_order():
    rng = np.random.default_rng(2)
    tensors = {"cross_k.0": rng.standard_normal((5, 2, 3, 4)).astype(np.float32),
               "src_bias": rng.standard_normal((5, 3)).astype(np.float32)}
    copies = {k: v.copy() for k, v in tensors.items()}
    for rows in (np.array([0, 4, 2]), np.array([3, 1])):  # the first in place, the second (a swap) copied
        state = select_rows(EncoderState({k: v.copy() for k, v in copies.items()}, 5), rows)
        assert state.n_rows == rows.size
        for name, v in state.tensors.items():
            assert np.array_equal(v, copies[name][rows])


@pytest.mark.parametrize("kind", ["beam", "indirect"])
def test_the_caches_follow_the_tail_filled_order(kind):
    """Three sentences of two rows, one step written with each sentence's own value; sentence 0 finishes, so
    sentence 2 takes its place: every kept hypothesis still reads its own sentence's history."""
    cfg = preset("tiny", 32)
    if kind == "beam":
        cache = BeamCache(cfg, 6, max_steps=8)
        cache.advance(np.arange(6), 3)
        rows = np.repeat(np.arange(3.0), 2)[:, None] * np.ones(cfg.d_model, np.float32)
        cache.append([rows.astype(np.float32)] * cfg.n_dec_layers, [rows.astype(np.float32)] * cfg.n_dec_layers)
    else:
        cache = IndirectCache(cfg, 6, max_steps=8)
        cache.advance(np.arange(6), 3)
        for layer in cache.kv:
            layer[:, :, 0] = np.repeat(np.arange(3.0), 2)[:, None, None]
        cache.wrote()
    kept = tail_filled(np.array([False, True, True]))
    assert kept.tolist() == [2, 1]
    reorder = (kept[:, None] * 2 + np.array([1, 0])).reshape(-1)  # each sentence's rows swapped, for good measure
    cache.advance(reorder, 2)
    if kind == "beam":
        assert [float(k[s, 0, 0, 0]) for k in cache.k for s in range(2)] == [2.0, 1.0] * cfg.n_dec_layers
    else:
        assert [float(a[2 * s + r, 0, 0, 0]) for a in cache.kv for s in range(2) for r in range(2)] == \
            [2.0, 2.0, 1.0, 1.0] * (2 * cfg.n_dec_layers)
    with pytest.raises(CacheError, match="its own sentence"):
        cache.advance(np.array([0, 1, 0, 1]), 2)  # both sentences continuing the same one


@pytest.mark.parametrize("fixture", ["memorised_int8_dir", "memorised_fp32_dir"])
def test_translations_do_not_depend_on_the_order(fixture, memorise_corpus, monkeypatch, request):
    """The same batch searched with finished sentences leaving in the old order (the rest moved up) and in
    tail_filled's: the same hypotheses and scores, on the cache per hypothesis (int8) and the beam cache (fp32)."""
    loaded = load(request.getfixturevalue(fixture), LoadOptions(backend="onnxruntime", threads=1))
    lines = memorise_corpus[0].read_text(encoding="utf-8").splitlines()[:24]
    ids = loaded.tokenizer.encode(lines)
    lengths = {len(x) for x in ids}
    assert len(lengths) > 3  # sentences of several lengths end at several steps
    filled = loaded.translate(ids)
    monkeypatch.setattr(search, "tail_filled", lambda alive: np.flatnonzero(alive))
    assert loaded.translate(ids) == filled


def test_one_copy_writes_a_step_as_the_per_layer_writes_do():
    """The ONNX Runtime CPU backend hands BeamCache.append the step's K/V stacked in one array; while the buffers are
    one block's (allocated, grown, rows dropped in place) one copy writes them all, after a drop that copies (a
    swap) the per-layer writes do. Either way the buffers hold what the per-layer writes give."""
    cfg = preset("tiny", vocab_size=32)
    rows, n_layers, d = 2, cfg.n_dec_layers, cfg.d_model
    rng = np.random.default_rng(3)
    one, each = (BeamCache(cfg, 3 * rows, max_steps=40, initial_capacity=2) for _ in range(2))
    sentences, stacked_steps = 3, 0
    for t in range(7):
        # step 3: sentence 1 finishes (tail-filled order, in place); step 5: the two left swap places (copied)
        kept = {3: np.array([0, 2]), 5: np.array([1, 0])}.get(t, np.arange(sentences))
        reorder = (kept[:, None] * rows + rng.integers(0, rows, (kept.size, rows))).reshape(-1) if t else \
            np.arange(sentences * rows)
        sentences = kept.size if t else sentences
        for cache in (one, each):
            cache.advance(reorder, sentences)
        kv = rng.standard_normal((2 * n_layers, sentences * rows, d)).astype(np.float32)
        stacked_steps += one._kv is not None
        one.append(list(kv[:n_layers]), list(kv[n_layers:]), kv)
        each.append(list(kv[:n_layers]), list(kv[n_layers:]))
        assert all(np.array_equal(a, b) for a, b in zip(one.k + one.v, each.k + each.v))
    assert one.capacity == 8 and stacked_steps == 5  # grown at steps 2 and 4; the swap leaves separate buffers
