"""The Transformer itself: positions, masks, padding, incremental decoding, config errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from model import ConfigError, ModelConfig, build_model, io_names, preset, select_candidates
from model.cache import BeamCache, CacheError
from model.transformer import MASK_VALUE, sinusoidal_positions

V = 40


@pytest.fixture()
def model():
    torch.manual_seed(0)
    return build_model(preset("tiny", vocab_size=V)).eval()


def batch(b=3, s=7, t=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, V, (b, s), generator=g)
    tgt = torch.randint(4, V, (b, t), generator=g)
    tgt[:, 0] = 2
    return src, tgt


def test_positional_encoding_matches_formula():
    d = 16
    pe = sinusoidal_positions(50, d)
    for pos in (0, 1, 7, 49):
        for i in range(d // 2):
            angle = pos / 10000 ** (2 * i / d)
            assert pe[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert pe[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def test_embeddings_scaled_and_tied(model):
    ids = torch.tensor([[5, 6]])
    x = model.embed_tokens(ids, torch.arange(2))
    expected = model.embed.weight[ids] * math.sqrt(model.cfg.d_model) + model.pe[:2]
    torch.testing.assert_close(x, expected)
    h = torch.randn(1, 2, model.cfg.d_model)
    torch.testing.assert_close(model.logits(h), h @ model.embed.weight.T)


def test_causal_mask_future_tokens_do_not_leak(model):
    src, tgt = batch()
    with torch.no_grad():
        out = model(src, tgt)
        for i in range(tgt.shape[1] - 1):
            changed = tgt.clone()
            changed[:, i + 1:] = torch.randint(4, V, changed[:, i + 1:].shape)
            out2 = model(src, changed)
            torch.testing.assert_close(out2[:, : i + 1], out[:, : i + 1], atol=1e-5, rtol=1e-5)
            assert not torch.allclose(out2[:, i + 1:], out[:, i + 1:])


def test_padding_does_not_change_a_sentence(model):
    src, tgt = batch(b=1, s=5, t=4)
    with torch.no_grad():
        alone = model(src, tgt)
        others_src, others_tgt = batch(b=3, s=9, t=7, seed=5)
        padded_src = others_src.clone()
        padded_src[1] = 0
        padded_src[1, :5] = src[0]
        padded_tgt = others_tgt.clone()
        padded_tgt[1] = 0
        padded_tgt[1, :4] = tgt[0]
        inside = model(padded_src, padded_tgt)
    torch.testing.assert_close(inside[1, :4], alone[0], atol=1e-5, rtol=1e-5)


def _step(model, cache, tokens, t, reorder, n_sent, ck, cv, src_bias):
    """One decode_step over `cache`, as the backends run it (numpy buffers shared with torch, no copy)."""
    feeds = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in
             cache.advance(reorder, n_sent).items()}
    k, v = ([torch.from_numpy(b) if isinstance(b, np.ndarray) else b for b in bufs] for bufs in (cache.k, cache.v))
    lp, step_k, step_v = model.decode_step(tokens, torch.tensor([t]), feeds[io_names.SELF_INDEX],
                                           feeds[io_names.SELF_BIAS], k, v, ck, cv, src_bias)
    cache.append(step_k, step_v)
    return lp


@pytest.mark.parametrize("train_mode", [False, True])
def test_incremental_decoding_equals_full_forward(model, train_mode):
    cfg = model.cfg
    if train_mode:  # the fused SDPA training path must agree with the exported path
        model = build_model(ModelConfig(**{**cfg.to_dict(), "dropout": 0.0})).train()
    src, tgt = batch()
    src[1, 4:] = 0
    with torch.no_grad():
        full = model(src, tgt).log_softmax(-1)
        model.eval()
        memory, src_bias = model.encode(src)
        ck, cv = model.cross_kv(memory)
        cache = BeamCache(cfg, src.shape[0], torch.float32, initial_capacity=2)
        reorder = torch.arange(src.shape[0])
        for t in range(tgt.shape[1]):
            lp = _step(model, cache, tgt[:, t], t, reorder, src.shape[0], ck, cv, src_bias)
            torch.testing.assert_close(lp, full[:, t], atol=1e-5, rtol=1e-5)
            assert cache.steps == t + 1 and cache.capacity >= t + 1
    assert cache.capacity == 8  # grew 2 -> 4 -> 8, keeping what was written


@pytest.mark.parametrize("dtype", [torch.float32, np.float32], ids=["torch", "numpy"])
def test_beam_cache_follows_each_hypothesis_history(model, dtype):
    """Sentences of `beam` rows sharing one row of cross K/V; every step each row continues a
    random row of its own sentence (rows repeat, others die), and sentences finish midway (numpy
    buffers move the survivors up in place, torch ones copy them). Each row's log-probs must equal
    teacher forcing of the history it actually has, with its own copy of its source: the ancestry
    index picks exactly the ancestors' keys."""
    beam, n_steps = 3, 7
    src, _ = batch(b=5, s=7)
    src[1, 3:] = 0  # padding: the shared src_bias must mask every row of sentence 1
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        memory, src_bias = model.encode(src)
        ck, cv = model.cross_kv(memory)
        sentences = torch.arange(src.shape[0])
        n = src.shape[0] * beam
        cache = BeamCache(model.cfg, n, dtype, initial_capacity=2)
        history = [[2] for _ in range(n)]
        reorder = torch.arange(n)
        for t in range(n_steps):
            n_sent = sentences.numel()
            tokens = torch.tensor([h[-1] for h in history])
            lp = _step(model, cache, tokens, t, reorder, n_sent, ck, cv, src_bias)
            ref = model(src[sentences].repeat_interleave(beam, 0), torch.tensor(history))[:, -1].log_softmax(-1)
            torch.testing.assert_close(lp, ref, atol=1e-5, rtol=1e-5)
            # Sentence rows really see their own sentence.
            assert not torch.allclose(lp[:beam], lp[beam:2 * beam], atol=1e-3)
            # sentence 2 finishes (rows 3 and 4 move up together), then the first of those left (all move)
            keep = {2: torch.tensor([0, 1, 3, 4]), 4: torch.tensor([1, 2, 3])}.get(t, torch.arange(n_sent))
            reorder = (keep[:, None] * beam + torch.randint(0, beam, (keep.numel(), beam), generator=g)).reshape(-1)
            history = [history[r] + [int(torch.randint(4, V, (), generator=g))] for r in reorder.tolist()]
            sentences, ck, cv, src_bias = sentences[keep], [k[keep] for k in ck], [v[keep] for v in cv], src_bias[keep]
    assert cache.k[0].shape[0] == 3 and cache.capacity == 8


def test_beam_cache_refuses_what_it_cannot_follow(model):
    cache = BeamCache(model.cfg, 4, max_steps=2)
    cache.advance(torch.arange(4), 2)
    cache.append(*([torch.zeros(4, model.cfg.d_model)] * model.cfg.n_dec_layers,) * 2)
    with pytest.raises(CacheError, match="its own sentence"):
        cache.advance(torch.tensor([0, 2, 2, 3]), 2)  # sentence 0's second row continuing sentence 1's
    with pytest.raises(CacheError, match="its own sentence"):
        cache.advance(torch.tensor([0, 1, 0, 1]), 2)  # both sentences continuing sentence 0
    with pytest.raises(CacheError, match="split into"):
        cache.advance(torch.arange(3), 2)
    cache.advance(torch.tensor([1, 1, 2, 3]), 2)
    cache.append(*([torch.zeros(4, model.cfg.d_model)] * model.cfg.n_dec_layers,) * 2)
    with pytest.raises(CacheError, match="past the 2 decoder positions"):
        cache.advance(torch.arange(4), 2)


def test_masks_stay_finite_in_fp16(model):
    assert MASK_VALUE > torch.finfo(torch.float16).min
    src, tgt = batch()
    src[0, 3:] = 0
    with torch.no_grad():
        out = model.half()(src, tgt)
    assert torch.isfinite(out).all()


def test_select_candidates(model):
    lp = torch.log_softmax(torch.randn(3, V), -1)
    top_lp, top_ids, eos = select_candidates(lp, 5, eos_id=3)
    assert top_lp.shape == (3, 5) and top_ids.shape == (3, 5)
    torch.testing.assert_close(top_lp, lp.gather(1, top_ids))
    assert (top_lp[:, :-1] >= top_lp[:, 1:]).all()
    torch.testing.assert_close(eos, lp[:, 3])


def test_presets_match_the_paper():
    base = preset("base", vocab_size=37000)
    assert (base.d_model, base.n_heads, base.d_ff, base.n_enc_layers, base.n_dec_layers, base.dropout) == (
        512, 8, 2048, 6, 6, 0.1)
    big = preset("big", vocab_size=37000)
    assert (big.d_model, big.n_heads, big.d_ff, big.dropout) == (1024, 16, 4096, 0.3)


def test_impossible_configs_are_rejected():
    with pytest.raises(ConfigError, match="divisible"):
        ModelConfig(vocab_size=100, d_model=30, n_heads=4)
    with pytest.raises(ConfigError, match="vocab_size"):
        ModelConfig(vocab_size=0)
    with pytest.raises(ConfigError, match="unknown preset"):
        preset("huge", vocab_size=10)


def test_cpu_dropout_drops_p_and_keeps_the_expectation():
    from model.transformer import Dropout
    drop = Dropout(0.1).train()
    x = torch.ones(1000, 1001)  # odd size: the random bits are drawn four elements per int64
    torch.manual_seed(3)
    y = drop(x)
    dropped = (y == 0).float().mean().item()
    assert abs(dropped - 0.1) < 0.003
    assert abs(y.mean().item() - 1.0) < 0.005  # survivors scaled by 1 / keep probability
    values = torch.unique(y).tolist()
    assert values[0] == 0.0 and values[1:] == [pytest.approx(65536 / (65536 - round(0.1 * 65536)))]
    torch.manual_seed(3)
    assert torch.equal(drop(x), y)  # the global generator decides: seeded runs repeat
    assert not torch.equal(drop(x), y)
    x.requires_grad_(True)
    torch.manual_seed(3)
    drop(x).sum().backward()
    assert torch.equal(x.grad, y)  # the gradient goes through the same mask and scale
    assert torch.equal(drop.eval()(x), x)


def test_forward_rows_projects_only_the_given_positions(model):
    src, tgt = batch()
    rows = torch.ones_like(tgt, dtype=torch.bool)
    rows[0, 3:] = False
    rows[2, 5:] = False
    with torch.no_grad():
        full = model(src, tgt)
        torch.testing.assert_close(model(src, tgt, rows), full[rows])
