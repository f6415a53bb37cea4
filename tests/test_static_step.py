"""The torch backend's fixed-shape decoder step (runtime/static_step.py), the body of its CUDA graph.

A CUDA graph cannot run here; what it replays can: step_mode="static" runs the same body on the
CPU without capture. So these tests pin what the graph computes: the same translations and scores
as the eager step, with padded batches and sources, sentences finishing at different steps, the
cache growing past its first capacity, and storage reused across batches but never shared."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from model.checkpoint import load_model
from model.config import EOS_ID
from runtime import static_step
from runtime.search import beam_search, greedy_search
from runtime.shortlist import build as build_shortlist
from runtime.static_step import StaticBatch, StaticCache, size_bucket, source_bucket
from runtime.torch_backend import CUDA_GRAPHS_ENV, TorchBackend, default_step_mode
from runtime.translate import pad_batch, translate_ids


@pytest.fixture(scope="module")
def backends(random_checkpoint):
    model, _, _ = load_model(random_checkpoint)
    return TorchBackend(model), TorchBackend(model, step_mode="static")


def _sources(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(rng.randint(1, 13))] + [EOS_ID] for _ in range(n)]


def _same(a, b) -> None:
    assert [[h.tokens for h in x] for x in a] == [[h.tokens for h in x] for x in b]
    for x, y in zip(a, b):
        for h, g in zip(x, y):
            assert h.score == pytest.approx(g.score, abs=1e-4)
            assert h.step_log_probs == pytest.approx(g.step_log_probs, abs=1e-4)


def test_size_buckets_pad_by_at_most_half():
    assert [size_bucket(n) for n in (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 17, 25, 32, 33, 100)] == \
        [1, 2, 3, 4, 6, 6, 8, 8, 12, 16, 24, 32, 32, 48, 128]
    for n in range(1, 300):
        assert n <= size_bucket(n) <= max(2, 1.5 * n)
    assert [source_bucket(s) for s in (1, 8, 9, 20)] == [8, 8, 16, 24]
    with pytest.raises(ValueError):
        size_bucket(0)


def test_default_modes_and_refusals(random_checkpoint):
    model, _, _ = load_model(random_checkpoint)
    assert TorchBackend(model).step_mode == "eager"  # the CPU: no graphs to replay
    with pytest.raises(ValueError, match="CUDA"):
        TorchBackend(model, step_mode="graph")
    with pytest.raises(ValueError, match="step mode"):
        TorchBackend(model, step_mode="fast")
    vocab = model.cfg.vocab_size
    table, _ = build_shortlist([list(range(4, vocab))], [list(range(4, vocab))], vocab_size=vocab,
                               eos_id=model.cfg.eos_id, frequent=vocab)
    with pytest.raises(ValueError, match="shortlist"):
        TorchBackend(model, step_mode="static", shortlist=table)
    assert TorchBackend(model, shortlist=table).step_mode == "eager"


def test_cuda_graphs_by_default_on_cuda_unless_switched_off():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert default_step_mode(cuda, None, {}) == "graph"
    assert default_step_mode(cuda, object(), {}) == "eager"  # a shortlist: shapes change per batch
    assert default_step_mode(cpu, None, {}) == "eager"
    for off in ("0", "false", "Off", " no "):
        assert default_step_mode(cuda, None, {CUDA_GRAPHS_ENV: off}) == "eager"
    assert default_step_mode(cuda, None, {CUDA_GRAPHS_ENV: "1"}) == "graph"


@pytest.mark.parametrize("beam", [1, 4])
def test_static_step_translates_as_eager(backends, beam):
    """Mixed source lengths (13 sentences: padded to 16 slots, sources to a multiple of 8); lengths
    limited by the source, so sentences leave at different steps; up to 40 steps, past the first
    capacity of 16 and the second of 32."""
    eager, static = backends
    src = pad_batch(_sources(13, eager.cfg.vocab_size, seed=beam))
    opts = dict(max_len_a=1.5, max_len_b=20)
    if beam == 1:
        _same(greedy_search(eager, src, **opts), greedy_search(static, src, **opts))
    _same(beam_search(eager, src, beam_size=beam, nbest=beam, **opts),
          beam_search(static, src, beam_size=beam, nbest=beam, **opts))


def test_trained_model_translates_as_eager(trained_checkpoint):
    """A trained model ends its sentences itself (EOS), not at the length limit."""
    model, _, _ = load_model(trained_checkpoint)
    eager, static = TorchBackend(model), TorchBackend(model, step_mode="static")
    sources = _sources(40, model.cfg.vocab_size, seed=5)
    out_e = translate_ids(eager, sources, batch_tokens=200, beam_size=4)
    out_s = translate_ids(static, sources, batch_tokens=200, beam_size=4)
    assert [[h.tokens for h in x] for x in out_e] == [[h.tokens for h in x] for x in out_s]
    assert len(static.static.batches) <= static_step.MAX_BATCHES


def test_finished_sentences_keep_their_slots(backends):
    """After sentences leave, the state carries no tensors (the static batch holds them) and the
    cache maps the live sentences to their original slots."""
    _, static = backends
    src = pad_batch(_sources(5, static.cfg.vocab_size, seed=7))
    state = static.encode(src)
    cache = static.initial_cache(5 * 2)
    assert isinstance(cache, StaticCache)
    tokens = np.full(10, static.cfg.bos_id, dtype=np.int64)
    out, cache = static.step(state, tokens, 0, cache, np.arange(10))
    assert isinstance(state.bound, StaticBatch) and state.bound.n_sentences == 6
    assert out.topk_ids.shape == (10, static.topk)
    live = np.array([0, 2, 4])
    state = static.select(state, live)
    assert state.n_rows == 3 and state.tensors == {} and isinstance(state.bound, StaticBatch)
    reorder = (live[:, None] * 2 + np.array([1, 0])).reshape(-1)  # beams swapped within each sentence
    out, cache = static.step(state, out.topk_ids[reorder, 0], 1, cache, reorder)
    assert list(cache.live) == [0, 2, 4] and out.topk_ids.shape == (6, static.topk)
    assert list(cache.static_rows()) == [0, 1, 4, 5, 8, 9]


def test_storage_is_reused_across_batches_but_never_shared(backends):
    """A second search of the same shape reuses the first's storage once it is done; while a search
    holds it, another of that shape gets its own."""
    _, static = backends
    static.static.batches.clear()
    src = pad_batch(_sources(4, static.cfg.vocab_size, seed=9))

    def start():
        state = static.encode(src)
        cache = static.initial_cache(4)
        static.step(state, np.full(4, static.cfg.bos_id, dtype=np.int64), 0, cache, np.arange(4))
        return cache

    first = start()
    second = start()
    assert first.batch is not second.batch and first.batch.busy and second.batch.busy
    kept = first.batch
    del first, second
    third = start()
    assert third.batch is kept  # released when its search let go of the cache
    for n in (1, 2, 3, 6, 9, 13):  # more shapes than are kept
        beam_search(static, pad_batch(_sources(n, static.cfg.vocab_size, seed=n)), beam_size=2, max_len_b=5,
                    max_len_a=0.0)
    assert len(static.static.batches) <= static_step.MAX_BATCHES
    assert third.batch.busy


def test_padding_slots_do_not_change_a_sentence(backends):
    """A sentence translated alone (one slot) and among others (padded to a bucket) is the same."""
    eager, static = backends
    sources = _sources(5, static.cfg.vocab_size, seed=11)
    together = beam_search(static, pad_batch(sources), beam_size=3, max_len_b=10, max_len_a=0.0)
    for s, hyps in zip(sources, together):
        alone = beam_search(eager, pad_batch([s]), beam_size=3, max_len_b=10, max_len_a=0.0)[0]
        assert [h.tokens for h in hyps] == [h.tokens for h in alone]


def test_static_cache_bytes_follow_the_bucket(backends):
    _, static = backends
    batch = StaticBatch(static.cfg, 6, 4, 16, torch.float32, torch.device("cpu"))
    cap = batch.capacity(16)
    cfg = static.cfg
    assert cap.nbytes() == 2 * cfg.n_dec_layers * 6 * cfg.n_heads * 16 * 4 * cfg.d_head * 4
    assert batch.capacity(16) is cap and cap.pos.shape == (24, 16)


def _decode_all(backend, sources):
    found = beam_search(backend, pad_batch(sources), beam_size=4, nbest=4, max_len_a=0.0, max_len_b=12, min_len=12)
    return [[(h.tokens, h.score, h.step_log_probs) for h in x] for x in found]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_inference_preparation_keeps_every_bit(random_checkpoint, dtype):
    """prepare_for_inference (one GEMM for q, k and v; fp32 LayerNorm parameters in half precision)
    translates with bitwise the same hypotheses, scores and step log-probs as the model as loaded, in
    the eager and the graph's static step; a .to() that copies the parameters apart falls back to
    three projections instead of reading stale fused weights."""
    model, _, _ = load_model(random_checkpoint)
    plain, _, _ = load_model(random_checkpoint)
    sources = _sources(7, model.cfg.vocab_size, seed=5)
    for mode in ("eager", "static"):
        reference = _decode_all(TorchBackend(plain, dtype=dtype, step_mode=mode, fuse=False), sources)
        backend = TorchBackend(model, dtype=dtype, step_mode=mode)
        attn = [layer.self_attn for layer in backend.model.decoder]
        assert all(a._qkv_fused() for a in attn)
        assert attn[0].k_proj.weight.data_ptr() == attn[0].qkv[0][model.cfg.d_model].data_ptr()
        assert all(m.weight.dtype == torch.float32 for m in backend.model.modules()
                   if isinstance(m, torch.nn.LayerNorm))
        assert _decode_all(backend, sources) == reference
    assert model.state_dict().keys() == plain.state_dict().keys()
    assert all(torch.equal(a.float(), b.float()) for a, b in zip(model.state_dict().values(),
                                                                 plain.state_dict().values()))
    model.to(torch.float64 if dtype == torch.float32 else torch.float32)  # copied apart: not fused any more
    assert not any(layer.self_attn._qkv_fused() for layer in model.decoder)
    with torch.no_grad():  # a change that stale fused weights would not see
        model.decoder[0].self_attn.q_proj.weight.mul_(0.5)
        plain.decoder[0].self_attn.q_proj.weight.mul_(0.5)
    assert _decode_all(TorchBackend(model, dtype=dtype, fuse=False), sources) == \
        _decode_all(TorchBackend(plain, dtype=dtype, fuse=False), sources)


def test_validation_backend_leaves_the_training_parameters_alone(random_checkpoint):
    model, _, _ = load_model(random_checkpoint)
    model.train()
    before = [id(p) for p in model.parameters()]
    TorchBackend(model, fuse=False)
    assert [id(p) for p in model.parameters()] == before
    assert all(p.requires_grad for p in model.parameters())
    TorchBackend(model)  # an inference backend replaces q, k and v with views of one weight
    assert [id(p) for p in model.parameters()] != before
