"""The model presented as the two exported graphs: an encoder and one decoder step.

Both wrappers only rearrange arguments around the model's own inference functions
(`encode` + `cross_kv`, `decode_step` + `select_candidates`), so the graphs compute
exactly what the PyTorch backend computes and parity tests one algorithm on two engines.

First-step design ("masked dummy slot", see model/transformer.py): every self-attention
cache starts with one masked slot, so the first step feeds cache_len = 1, never 0.
TensorRT optimisation profiles and torch.export reject size-0 dynamic dims, and the
alternative (an `If` that merges a no-cache first step into the decoder) cannot be built
by TensorRT. One graph therefore serves every step with no control flow at all.

Beam search never copies caches through the host: the step takes a `reorder` index and
gathers the surviving beams' cache rows itself. Cross K/V and src_bias hold one row per
sentence (batch), shared by the sentence's hyps / batch hypotheses (a fixed number per
live sentence; search selects sentences when they finish), so they are never copied
per beam nor reordered.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.export import Dim

from model import io_names
from model.cache import cache_shape
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
    """One decoder step over flat, named tensors -> top-k candidates and grown caches.

    Log-softmax and top-k run inside the graph so only (hyps, K) candidates leave it;
    K is a constant so TopK has the build-time K that TensorRT's parser requires.
    """

    def __init__(self, model: Transformer, topk: int):
        super().__init__()
        self.model = model
        self.topk = topk
        self.n_layers = model.cfg.n_dec_layers

    def forward(self, tokens: Tensor, step: Tensor, reorder: Tensor, *rest: Tensor) -> tuple[Tensor, ...]:
        n = self.n_layers
        self_k, self_v = list(rest[0:n]), list(rest[n:2 * n])
        cross_k, cross_v = list(rest[2 * n:3 * n]), list(rest[3 * n:4 * n])
        src_bias = rest[4 * n]
        log_probs, new_k, new_v = self.model.decode_step(
            tokens, step, reorder, self_k, self_v, cross_k, cross_v, src_bias)
        top_lp, top_ids, eos_lp = select_candidates(log_probs, self.topk, self.model.cfg.eos_id)
        return (top_lp, top_ids, eos_lp, *new_k, *new_v)  # io_names.decoder_outputs order


# Example sizes for tracing: every dynamic dim >= 2 and pairwise distinct, so
# torch.export neither specialises a dim to 0/1 nor infers a false equality.
# hyps is a multiple of batch (rows per sentence), as search always feeds.
EXAMPLE_BATCH = 3
EXAMPLE_SRC_LEN = 7
EXAMPLE_HYPS = 6
EXAMPLE_PREV_HYPS = 4
EXAMPLE_CACHE_LEN = 5


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
    step = torch.tensor([EXAMPLE_CACHE_LEN - 1], dtype=torch.int64)
    reorder = torch.randint(0, EXAMPLE_PREV_HYPS, (EXAMPLE_HYPS,), generator=g)
    self_shape = cache_shape(cfg, EXAMPLE_PREV_HYPS, EXAMPLE_CACHE_LEN)
    cross_shape = (EXAMPLE_BATCH, h, EXAMPLE_SRC_LEN, dh)
    self_kv = [torch.randn(self_shape, generator=g).to(dtype) for _ in range(2 * n)]
    cross_kv = [torch.randn(cross_shape, generator=g).to(dtype) for _ in range(2 * n)]
    src_bias = torch.zeros(EXAMPLE_BATCH, EXAMPLE_SRC_LEN)
    return (tokens, step, reorder, *self_kv, *cross_kv, src_bias)


def encoder_dynamic_shapes() -> dict[str, Any]:
    batch = Dim(io_names.BATCH, min=1)
    src_len = Dim(io_names.SRC_LEN, min=1)
    return {"src_ids": {0: batch, 1: src_len}}


def decoder_dynamic_shapes(n_layers: int) -> dict[str, Any]:
    """One Dim object per axis name, shared by every input that carries that axis."""
    batch = Dim(io_names.BATCH, min=1)
    hyps = Dim(io_names.HYPS, min=1)
    prev_hyps = Dim(io_names.PREV_HYPS, min=1)
    cache_len = Dim(io_names.CACHE_LEN, min=1)
    src_len = Dim(io_names.SRC_LEN, min=1)
    cache = {0: prev_hyps, 2: cache_len}
    cross = {0: batch, 2: src_len}
    rest = [cache] * (2 * n_layers) + [cross] * (2 * n_layers) + [{0: batch, 1: src_len}]
    return {"tokens": {0: hyps}, "step": None, "reorder": {0: hyps}, "rest": tuple(rest)}


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
    cache = [io_names.PREV_HYPS, None, io_names.CACHE_LEN, None]
    new_cache = [io_names.HYPS, None, io_names.NEW_CACHE_LEN, None]
    cross = [io_names.BATCH, None, io_names.SRC_LEN, None]
    axes: dict[str, list[str | int | None]] = {
        io_names.TOKENS: [io_names.HYPS],
        io_names.STEP: [None],
        io_names.REORDER: [io_names.HYPS],
        io_names.SRC_BIAS: [io_names.BATCH, io_names.SRC_LEN],
        io_names.TOPK_LOG_PROBS: [io_names.HYPS, None],
        io_names.TOPK_IDS: [io_names.HYPS, None],
        io_names.EOS_LOG_PROBS: [io_names.HYPS],
    }
    for i in range(n_layers):
        for name in (io_names.self_k(i), io_names.self_v(i)):
            axes[name] = list(cache)
        for name in (io_names.new_self_k(i), io_names.new_self_v(i)):
            axes[name] = list(new_cache)
        for name in (io_names.cross_k(i), io_names.cross_v(i)):
            axes[name] = list(cross)
    return axes
