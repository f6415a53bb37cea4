"""The model presented as the two exported graphs: an encoder and one decoder step.

Both wrappers only rearrange arguments around the model's own inference functions
(`encode` + `cross_kv`, `decode_step` + `select_candidates`), so the graphs compute
exactly what the PyTorch backend computes and parity tests one algorithm on two engines.

The decoder step takes the self-attention cache as model/cache.py lays it out: per-layer
buffers with one row per sentence that search never reorders, and a per-hypothesis index
of its ancestors' keys, which the step gathers; it returns only the step's own keys and
values, which the caller writes into the buffers. So the graph never returns a grown
cache, has no control flow, and no dynamic dim is ever 0 (step 0 gathers one masked
position). Cross K/V and
src_bias hold one row per sentence (batch), shared by the sentence's hyps / batch
hypotheses (a fixed number per live sentence; search selects sentences when they
finish), so they are never copied per beam nor reordered.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.export import Dim

from model import io_names
from model.transformer import Transformer, select_candidates


class EncoderGraph(nn.Module):
    """src_ids (batch, src_len) -> src_bias and every decoder layer's cross K/V, once."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model

    def forward(self, src_ids: Tensor) -> tuple[Tensor, ...]:
        memory, src_bias = self.model.encode(src_ids)
        ks, vs = self.model.cross_kv(memory)
        out: list[Tensor] = [src_bias]
        for k, v in zip(ks, vs):
            out += [k, v]
        return tuple(out)  # order of io_names.encoder_outputs(n_layers)


class DecoderStepGraph(nn.Module):
    """One decoder step over flat, named tensors -> top-k candidates and the step's K/V.

    Log-softmax and top-k run inside the graph so only (hyps, K) candidates leave it;
    K is a constant so TopK has the build-time K that TensorRT's parser requires.
    """

    def __init__(self, model: Transformer, topk: int, shortlist: bool = False):
        super().__init__()
        self.model = model
        self.topk = topk
        self.n_layers = model.cfg.n_dec_layers
        self.shortlist = shortlist  # one more input, last: the candidate target ids (io_names.CANDIDATES)

    def forward(self, tokens: Tensor, step: Tensor, self_index: Tensor, self_bias: Tensor,
                *rest: Tensor) -> tuple[Tensor, ...]:
        n = self.n_layers
        self_k, self_v = list(rest[0:n]), list(rest[n:2 * n])
        cross_k, cross_v = list(rest[2 * n:3 * n]), list(rest[3 * n:4 * n])
        src_bias = rest[4 * n]
        candidates = rest[4 * n + 1] if self.shortlist else None
        log_probs, new_k, new_v = self.model.decode_step(
            tokens, step, self_index, self_bias, self_k, self_v, cross_k, cross_v, src_bias, candidates)
        top_lp, top_ids, eos_lp = select_candidates(log_probs, self.topk, self.model.cfg.eos_id, candidates)
        return (top_lp, top_ids, eos_lp, *new_k, *new_v)  # io_names.decoder_outputs order


# Example sizes for tracing: every dynamic dim >= 2 and pairwise distinct, so
# torch.export neither specialises a dim to 0/1 nor infers a false equality.
# hyps is a multiple of batch (rows per sentence), as search always feeds.
EXAMPLE_BATCH = 3
EXAMPLE_SRC_LEN = 7
EXAMPLE_HYPS = 6  # 2 rows per sentence
EXAMPLE_CAPACITY = 5  # steps the example buffers hold: 10 cache rows per sentence
EXAMPLE_PAST = 4  # earlier steps


def example_candidates(topk: int, vocab_size: int) -> int:
    """How many candidates the shortlisted step is traced with: at least top-k (TopK's K is a
    constant), at most the vocabulary, and unlike every other example size."""
    taken = {EXAMPLE_BATCH, EXAMPLE_SRC_LEN, EXAMPLE_HYPS, EXAMPLE_CAPACITY, EXAMPLE_PAST,
             EXAMPLE_CAPACITY * (EXAMPLE_HYPS // EXAMPLE_BATCH)}
    size = max(topk, 2) + 1
    while size in taken:
        size += 1
    return min(size, vocab_size)


def _dtype_of(model: Transformer) -> torch.dtype:
    return model.embed.weight.dtype


def encoder_example(model: Transformer) -> tuple[Tensor]:
    cfg = model.cfg
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, cfg.vocab_size, (EXAMPLE_BATCH, EXAMPLE_SRC_LEN), generator=g)
    ids[0, -2:] = cfg.pad_id
    return (ids,)


def decoder_example(model: Transformer) -> tuple[Tensor, ...]:
    """Inputs in io_names.decoder_inputs order, with the example sizes above."""
    cfg = model.cfg
    dtype = _dtype_of(model)
    g = torch.Generator().manual_seed(0)
    n, h, dh = cfg.n_dec_layers, cfg.n_heads, cfg.d_head
    tokens = torch.randint(4, cfg.vocab_size, (EXAMPLE_HYPS,), generator=g)
    step = torch.tensor([EXAMPLE_PAST], dtype=torch.int64)
    cache_rows = EXAMPLE_CAPACITY * (EXAMPLE_HYPS // EXAMPLE_BATCH)
    self_index = torch.randint(0, EXAMPLE_BATCH * h * cache_rows, (EXAMPLE_HYPS, h, EXAMPLE_PAST), generator=g)
    self_bias = torch.zeros(EXAMPLE_HYPS, EXAMPLE_PAST)
    self_shape = (EXAMPLE_BATCH, h, cache_rows, dh)
    cross_shape = (EXAMPLE_BATCH, h, EXAMPLE_SRC_LEN, dh)
    self_kv = [torch.randn(self_shape, generator=g).to(dtype) for _ in range(2 * n)]
    cross_kv = [torch.randn(cross_shape, generator=g).to(dtype) for _ in range(2 * n)]
    src_bias = torch.zeros(EXAMPLE_BATCH, EXAMPLE_SRC_LEN)
    return (tokens, step, self_index, self_bias, *self_kv, *cross_kv, src_bias)


def decoder_shortlist_example(model: Transformer, topk: int) -> tuple[Tensor, ...]:
    """decoder_example's inputs and the candidates (EOS first, then ascending ids)."""
    cfg = model.cfg
    g = torch.Generator().manual_seed(1)
    others = torch.tensor([i for i in range(cfg.vocab_size) if i != cfg.eos_id])
    n = example_candidates(topk, cfg.vocab_size) - 1
    chosen = others[torch.randperm(others.numel(), generator=g)[:n]].sort().values
    return (*decoder_example(model), torch.cat([torch.tensor([cfg.eos_id]), chosen]))


def encoder_dynamic_shapes() -> dict[str, Any]:
    batch = Dim(io_names.BATCH, min=1)
    src_len = Dim(io_names.SRC_LEN, min=1)
    return {"src_ids": {0: batch, 1: src_len}}


def decoder_dynamic_shapes(n_layers: int) -> dict[str, Any]:
    """One Dim object per axis name, shared by every input that carries that axis."""
    batch = Dim(io_names.BATCH, min=1)
    hyps = Dim(io_names.HYPS, min=1)
    past = Dim(io_names.PAST, min=1)
    cache_rows = Dim(io_names.CACHE_ROWS, min=1)
    src_len = Dim(io_names.SRC_LEN, min=1)
    cache = {0: batch, 2: cache_rows}
    cross = {0: batch, 2: src_len}
    rest = [cache] * (2 * n_layers) + [cross] * (2 * n_layers) + [{0: batch, 1: src_len}]
    return {"tokens": {0: hyps}, "step": None, "self_index": {0: hyps, 2: past}, "self_bias": {0: hyps, 1: past},
            "rest": tuple(rest)}


def decoder_shortlist_dynamic_shapes(n_layers: int) -> dict[str, Any]:
    shapes = decoder_dynamic_shapes(n_layers)
    shapes["rest"] = (*shapes["rest"], {0: Dim(io_names.N_CANDIDATES, min=2)})
    return shapes


def encoder_axes(n_layers: int) -> dict[str, list[str | int | None]]:
    """Per graph input/output name: the symbolic name (or None = static) of each axis."""
    cross = [io_names.BATCH, None, io_names.SRC_LEN, None]
    axes: dict[str, list[str | int | None]] = {
        io_names.SRC_IDS: [io_names.BATCH, io_names.SRC_LEN],
        io_names.SRC_BIAS: [io_names.BATCH, io_names.SRC_LEN],
    }
    for i in range(n_layers):
        axes[io_names.cross_k(i)] = list(cross)
        axes[io_names.cross_v(i)] = list(cross)
    return axes


def decoder_axes(n_layers: int) -> dict[str, list[str | int | None]]:
    cache = [io_names.BATCH, None, io_names.CACHE_ROWS, None]
    cross = [io_names.BATCH, None, io_names.SRC_LEN, None]
    axes: dict[str, list[str | int | None]] = {
        io_names.TOKENS: [io_names.HYPS],
        io_names.STEP: [None],
        io_names.SELF_INDEX: [io_names.HYPS, None, io_names.PAST],
        io_names.SELF_BIAS: [io_names.HYPS, io_names.PAST],
        io_names.SRC_BIAS: [io_names.BATCH, io_names.SRC_LEN],
        io_names.TOPK_LOG_PROBS: [io_names.HYPS, None],
        io_names.TOPK_IDS: [io_names.HYPS, None],
        io_names.EOS_LOG_PROBS: [io_names.HYPS],
    }
    for i in range(n_layers):
        for name in (io_names.self_k(i), io_names.self_v(i)):
            axes[name] = list(cache)
        for name in (io_names.step_k(i), io_names.step_v(i)):
            axes[name] = [io_names.HYPS, None]
        for name in (io_names.cross_k(i), io_names.cross_v(i)):
            axes[name] = list(cross)
    return axes


def decoder_shortlist_axes(n_layers: int) -> dict[str, list[str | int | None]]:
    return {**decoder_axes(n_layers), io_names.CANDIDATES: [io_names.N_CANDIDATES]}
